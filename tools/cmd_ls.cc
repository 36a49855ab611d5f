// `weightcache ls`: every cache on this host (docs/design.md "Command line"): identity, tier,
// device, state, bytes (a sharded cache's: the bytes of its rank's slices, marked "sliced" after
// its ranks and "sharded": true in --json), clients, pid. Walks
// <runtime>/<namespace>/<device key>/*.sock; a socket whose lock is not held is stale and listed
// as such (never queried); a live one is asked Hello (for its full CacheConfig: revision and
// ranks), Status and Metrics (hits, misses, last attach in --json). A daemon that does not answer
// is listed with the error instead of failing the whole listing. The scan is ListCaches
// (cache_listing.h), shared with `status`.
//
// Keepers (docs/keeper.md): a live cache's row carries its keeper ("keeper": pid, state, bytes;
// "adopted": true when the daemon re-adopted the kept memory instead of loading). A live keeper
// whose daemon is gone is an **orphan**: listed with state "orphan" and the bytes it holds
// (its cache socket's row, stale or absent, is replaced by it); `stop` frees it.
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cache_listing.h"
#include "cli_common.h"
#include "common/terminal_text.h"
#include "daemon/byte_size.h"
#include "identity/cache_config.h"

namespace weightcache::cli {
namespace {

using LsArgs = ListingArgs;  // the flags ls and status share (cache_listing.h)

std::string Ranks(const nlohmann::json& config) {
  if (!config.is_object()) return "-";
  auto get = [&](const char* key) -> std::string {
    auto it = config.find(key);
    return it != config.end() && it->is_number_unsigned() ? std::to_string(it->get<uint64_t>())
                                                          : "?";
  };
  const bool sharded = !config.value("shard_rules_digest", std::string()).empty();
  return "tp" + get("tp_rank") + "/" + get("tp_size") + " pp" + get("pp_rank") + "/" +
         get("pp_size") + " ep" + get("ep_rank") + "/" + get("ep_size") + " dp" + get("dp_size") +
         (sharded ? " sliced" : "");
}

int Run(const LsArgs& args) {
  constexpr std::string_view kCmd = "ls";
  auto listing = ListCaches(args.Options());
  if (!listing.ok()) return Fail(kCmd, listing.status());
  const nlohmann::json& rows = listing->rows;
  const std::string& ns = listing->namespace_name;
  if (args.json) {
    std::cout << nlohmann::json{{"runtime_dir", listing->runtime_dir}, {"caches", rows}}.dump(2)
              << std::endl;
    return kExitOk;
  }
  if (rows.empty()) {
    std::cout << "no caches under " << EscapeForTerminal(listing->runtime_dir)
              << (args.all_namespaces ? "" : " (namespace " + ns + ")") << std::endl;
    return kExitOk;
  }
  // Columns sized to their content (FormatTable): a long model id or device key never runs into
  // the next column. A row's notes follow it on lines of their own.
  std::vector<std::vector<std::string>> table = {{"NAMESPACE", "DEVICE", "MODEL", "RANKS", "TIER",
                                                  "STATE", "BYTES", "CLIENTS", "PID", "ORIGIN",
                                                  "DIGEST"}};
  std::vector<std::string> notes;
  for (const auto& r : rows) {
    auto str = [&](const char* key) {
      auto it = r.find(key);
      if (it == r.end()) return std::string("-");
      // Every cell comes from a daemon's reply: escaped (common/terminal_text.h).
      return EscapeForTerminal(it->is_string() ? it->get<std::string>() : it->dump());
    };
    std::string model = str("model_id");
    const auto config = r.value("config", nlohmann::json());
    if (config.is_object() && !config.value("revision", std::string()).empty()) {
      model += "@" + EscapeForTerminal(config.value("revision", std::string()));
    }
    std::string state = str("state");
    if (state == "loading" && r.value("bytes_total", uint64_t{0}) > 0) {
      state += " " +
               std::to_string(100 * r.value("bytes_done", uint64_t{0}) /
                              r.value("bytes_total", uint64_t{1})) +
               "%";
    }
    const std::string bytes = r.contains("bytes") ? daemon::FormatBytes(r["bytes"]) : "-";
    std::string digest = str("digest");
    if (digest.size() > 16) digest.resize(16);
    // "disk", "fleet", "published", "adopted", or "peer <device key>": the kind in the column,
    // the peer's device on a line of its own.
    const std::string origin = str("origin");
    const std::string origin_kind = origin.substr(0, origin.find(' '));
    table.push_back({str("namespace"), str("device"), model, Ranks(config), str("tier"), state,
                     bytes, str("clients"), str("pid"), origin_kind, digest});
    std::string note;
    if (origin_kind == "peer")
      note += "    seeded from the peer cache of " + origin.substr(5) + "\n";
    if (r.contains("failure_reason")) note += "    failed: " + str("failure_reason") + "\n";
    if (r.contains("error")) note += "    error: " + str("error") + "\n";
    if (state == "orphan") {
      note += "    orphan: keeper pid " + str("pid") +
              " holds the memory of a daemon that is gone; `weightcache stop --socket " +
              str("socket") + "` frees it\n";
    }
    notes.push_back(std::move(note));
  }
  std::ostringstream out;
  std::istringstream lines(FormatTable(table));
  std::string line;
  for (size_t i = 0; std::getline(lines, line); ++i) {
    out << line << "\n";
    if (i > 0) out << notes[i - 1];
  }
  // Each device's memory budget, as `status` prints it (a device with neither a ledger nor a
  // budget.conf has none and no line).
  std::set<std::pair<std::string, std::string>> devices;
  for (const auto& r : rows) {
    devices.insert({r.value("namespace", std::string()), r.value("device", std::string())});
  }
  for (const auto& [device_ns, device] : devices) {
    DeviceBudgetView budget =
        ReadDeviceBudget(std::filesystem::path(listing->runtime_dir) / device_ns / device);
    if (!budget) continue;
    out << "device " << EscapeForTerminal(device) << " (namespace " << EscapeForTerminal(device_ns)
        << "): " << FormatDeviceBudget(budget) << "\n";
  }
  std::cout << out.str() << std::flush;
  return kExitOk;
}

}  // namespace

void RegisterLsCommand(CLI::App& root) {
  auto args = std::make_shared<LsArgs>();
  CLI::App* sub = root.add_subcommand("ls", "List every cache on this host and its state");
  AddListingFlags(sub, args.get());
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
