// `weightcache fleet ls`: the entries of the fleet registry (docs/fleet.md): which node holds
// which cache, its state, tier, bytes and transport endpoint. With --model (and the identity
// flags of serve) only the entries of that identity's fleet key; --fleet-key HEX does the same
// from the key itself. Entries are read from etcd as untrusted values: a malformed one is
// skipped with a warning (fleet::LookupEntries).
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli_common.h"
#include "common/terminal_text.h"
#include "daemon/byte_size.h"
#include "fleet/registry_entry.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "registry_flags.h"
#include "serve/fleet_registry.h"

namespace weightcache::cli {
namespace {

struct FleetLsArgs {
  serve::FleetOptions registry;
  IdentityOptions identity;
  CLI::Option* model = nullptr;  // set: filter by the identity's fleet key
  std::string fleet_key;
  bool json = false;
};

int RunLs(FleetLsArgs& args) {
  constexpr std::string_view kCmd = "fleet ls";
  std::optional<std::string> fleet_key;
  if (!args.fleet_key.empty()) fleet_key = args.fleet_key;
  if (args.model->count() > 0) {
    if (fleet_key) return Fail(kCmd, InvalidArgument("--fleet-key and --model exclude each other"));
    // The fleet key leaves the tier out: resolve as the host tier, which needs no GPU.
    args.identity.tier = Tier::kHost;
    auto id = identity::ResolveIdentity(args.identity);
    if (!id.ok()) return Fail(kCmd, id.status());
    // The same key serve registers: with the checkpoint's content anchor where it has one.
    auto anchor = serve::LookUpFleetAnchor(args.registry, args.identity.model_dir, id->config);
    if (!anchor.ok()) return Fail(kCmd, anchor.status());
    fleet_key = serve::FleetKey(id->config, *anchor);
  }
  if (fleet_key && (fleet_key->size() != 64 ||
                    fleet_key->find_first_not_of("0123456789abcdef") != std::string::npos)) {
    return Fail(kCmd, InvalidArgument("--fleet-key must be 64 lowercase hex characters"));
  }
  if (Status prefix = fleet::ValidatePrefix(args.registry.prefix); !prefix.ok()) {
    return Fail(kCmd, prefix);
  }
  auto client = serve::RegistryClient(args.registry);
  if (!client.ok()) return Fail(kCmd, client.status());
  auto entries = fleet::LookupEntries(*client, args.registry.prefix, fleet_key);
  if (!entries.ok()) return Fail(kCmd, entries.status());

  if (args.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const fleet::RegistryEntry& e : *entries) list.push_back(e.ToJson());
    nlohmann::json out{{"registry", args.registry.url},
                       {"prefix", args.registry.prefix},
                       {"fleet_key", fleet_key ? nlohmann::json(*fleet_key) : nlohmann::json()},
                       {"entries", list}};
    std::cout << out.dump(2) << std::endl;
    return kExitOk;
  }
  if (entries->empty()) {
    std::cout << "no entries under " << args.registry.prefix
              << (fleet_key ? " for fleet key " + fleet_key->substr(0, 16) : "") << std::endl;
    return kExitOk;
  }
  // Columns sized to their content (FormatTable): a long node name or rank set never runs into
  // the next column.
  std::vector<std::vector<std::string>> table = {
      {"FLEET KEY", "NODE", "STATE", "TIER", "BYTES", "RANKS", "ENDPOINT", "PID", "MODEL"}};
  for (const fleet::RegistryEntry& e : *entries) {
    const std::string ranks = "tp" + std::to_string(e.tp_rank) + "/" + std::to_string(e.tp_size) +
                              " pp" + std::to_string(e.pp_rank) + "/" + std::to_string(e.pp_size) +
                              " ep" + std::to_string(e.ep_rank) + "/" + std::to_string(e.ep_size);
    // Every cell comes from the registry, untrusted: escaped (common/terminal_text.h).
    table.push_back({EscapeForTerminal(e.fleet_key.substr(0, 16)), EscapeForTerminal(e.node),
                     std::string(fleet::EntryStateName(e.state)), std::string(TierName(e.tier)),
                     daemon::FormatBytes(e.bytes), ranks,
                     e.endpoint.empty() ? "-" : EscapeForTerminal(e.endpoint),
                     std::to_string(e.pid),
                     EscapeForTerminal(e.model_id + (e.revision.empty() ? "" : "@" + e.revision))});
  }
  std::cout << FormatTable(table) << std::flush;
  return kExitOk;
}

}  // namespace

void RegisterFleetCommand(CLI::App& root) {
  CLI::App* fleet = root.add_subcommand(
      "fleet", "The fleet registry: which node holds which cache (docs/fleet.md)");
  fleet->require_subcommand(1);
  auto args = std::make_shared<FleetLsArgs>();
  CLI::App* ls = fleet->add_subcommand(
      "ls",
      "List the registry's entries (node, state, tier, bytes, ranks, transport endpoint, pid, "
      "model); with --model and serve's identity flags, or --fleet-key, only that identity's");
  AddRegistryFlags(ls, &args->registry, RegistryFlagScope::kList);
  AddIdentityFlags(ls, &args->identity, IdentityScope::kOneCache);
  args->model = ls->get_option("--model");
  args->model->required(false);
  ls->add_option("--fleet-key", args->fleet_key,
                 "only the entries of this fleet key (64 hex: CacheConfig::FleetDigest, "
                 "docs/identity.md)");
  ls->add_flag("--json", args->json, "print the entries as JSON");
  SetAction(ls, [args] { return RunLs(*args); });
}

}  // namespace weightcache::cli
