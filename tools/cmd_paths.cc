// `weightcache paths`: what one identity resolves to, without touching anything — the
// runtime dir (and which rule chose it), the namespace, the device key with the device it
// names, the config digest, the socket and lock paths, and the canonical CacheConfig.
//
// It takes exactly the identity flags of `serve` and `attach` (AddIdentityFlags) and
// resolves them with the same call (identity::ResolveIdentity), so what it prints is the
// socket those commands would use. Like `serve`, the gpu tier needs an explicit --device:
// this command answers "where would a daemon for GPU X live", never "for some GPU".
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_common.h"
#include "identity/device_inventory.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "weightcache/client.h"

namespace weightcache::cli {
namespace {

struct PathsArgs {
  IdentityOptions identity;
  bool json = false;
};

nlohmann::json DeviceJson(const identity::DeviceInfo& d) {
  return {{"index", d.index},
          {"uuid", d.uuid},
          {"name", d.name},
          {"memory_bytes", d.memory_bytes},
          {"pci_bus_id", d.pci_bus_id}};
}

int Run(PathsArgs& args) {
  constexpr std::string_view kCmd = "paths";
  if (args.identity.tier == Tier::kGpu && args.identity.device.empty()) {
    return Fail(kCmd, InvalidArgument("--tier gpu needs --device N|UUID (there is no implicit "
                                      "GPU 0); use --tier host for the host key"));
  }
  auto id = identity::ResolveIdentity(args.identity);
  if (!id.ok()) return Fail(kCmd, id.status());
  const identity::CachePaths& p = id->paths;

  if (args.json) {
    nlohmann::json out = {
        {"runtime_dir", p.runtime_dir},
        {"runtime_dir_origin", p.runtime_dir_origin},
        {"namespace", p.namespace_name},
        {"tier", std::string(TierName(id->config.tier))},
        {"device_key", p.device_key},
        {"device", id->device ? DeviceJson(*id->device) : nlohmann::json(nullptr)},
        {"digest", p.digest},
        {"short_digest", p.digest.substr(0, 16)},
        {"device_dir", p.device_dir},
        {"socket", p.socket},
        {"socket_origin", p.socket_origin},
        {"lock", p.lock},
        {"config", id->config.ToJson()},
        {"canonical_config", id->config.Canonical()},
    };
    std::cout << out.dump(2) << std::endl;
    return kExitOk;
  }
  std::cout << "runtime dir:  " << p.runtime_dir << "  (from " << p.runtime_dir_origin << ")\n"
            << "namespace:    " << p.namespace_name << "\n"
            << "device key:   " << p.device_key;
  if (id->device) {
    std::cout << "  (local index " << id->device->index;
    if (!id->device->name.empty()) std::cout << ", " << id->device->name;
    std::cout << ")";
  }
  std::cout << "\n"
            << "digest:       " << p.digest << "\n"
            << "socket:       " << p.socket << "  (from " << p.socket_origin << ")\n"
            << "lock:         " << p.lock << "\n"
            << "config:\n";
  for (std::string_view field : identity::CacheConfig::FieldNames()) {
    std::cout << "  " << field << std::string(28 - field.size(), ' ') << id->config.FieldText(field)
              << "\n";
  }
  std::cout << "canonical:    " << id->config.Canonical() << std::endl;
  return kExitOk;
}

}  // namespace

void RegisterPathsCommand(CLI::App& root) {
  auto args = std::make_shared<PathsArgs>();
  CLI::App* sub = root.add_subcommand(
      "paths", "Show what an identity resolves to: device key, config digest, socket and lock");
  AddIdentityFlags(sub, &args->identity, IdentityScope::kOneCache);
  sub->add_flag("--json", args->json, "print one JSON object");
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
