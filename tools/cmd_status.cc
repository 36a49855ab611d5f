// `weightcache status`: per device, its memory budget (budget, used, free) and each of its
// caches: tier and state (gpu / host when ready; loading, awaiting, failed, draining, stale,
// orphan otherwise), bytes, clients, last attach, hits and misses; then the device's LRU order
// (least recently attached first: the order in which the budget ledger picks caches to make
// room). One scan with `ls` (ListCaches, cache_listing.h). The budget fields come from the
// device's budget ledger and budget.conf (ReadDeviceBudget); null / "-" where unknown.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cache_listing.h"
#include "cli_common.h"
#include "common/terminal_text.h"
#include "daemon/byte_size.h"

namespace weightcache::cli {
namespace {

using StatusArgs = ListingArgs;  // the flags ls and status share (cache_listing.h)

// "gpu" or "host" for a ready cache (where its bytes are), else its state.
std::string CacheState(const nlohmann::json& row) {
  std::string state = row.value("state", std::string("-"));
  if (state == "ready") return row.value("tier", state);
  return state;
}

// Least recently attached first; never attached before any attached; the socket breaks ties.
// Only caches that hold memory (ready) are in the order.
nlohmann::json LruOrder(const std::vector<nlohmann::json>& caches) {
  std::vector<const nlohmann::json*> ready;
  for (const auto& c : caches) {
    if (c.value("state", std::string()) == "ready") ready.push_back(&c);
  }
  auto last = [](const nlohmann::json* c) {
    auto it = c->find("last_attach_unix_ms");
    return it != c->end() && it->is_number_unsigned() ? it->get<uint64_t>() : uint64_t{0};
  };
  std::sort(ready.begin(), ready.end(), [&](const nlohmann::json* a, const nlohmann::json* b) {
    if (last(a) != last(b)) return last(a) < last(b);
    return a->value("socket", std::string()) < b->value("socket", std::string());
  });
  nlohmann::json order = nlohmann::json::array();
  for (const auto* c : ready)
    order.push_back(c->value("digest", c->value("socket", std::string())));
  return order;
}

std::string Ago(const nlohmann::json& row, uint64_t now_ms) {
  auto it = row.find("last_attach_unix_ms");
  if (it == row.end() || !it->is_number_unsigned()) return "-";
  const uint64_t at = it->get<uint64_t>();
  return std::to_string(now_ms > at ? (now_ms - at) / 1000 : 0) + "s ago";
}

int RunStatus(const StatusArgs& args) {
  constexpr std::string_view kCmd = "status";
  auto listing = ListCaches(args.Options());
  if (!listing.ok()) return Fail(kCmd, listing.status());

  std::map<std::pair<std::string, std::string>, std::vector<nlohmann::json>> by_device;
  for (const auto& row : listing->rows) {
    by_device[{row.value("namespace", std::string()), row.value("device", std::string())}]
        .push_back(row);
  }
  nlohmann::json devices = nlohmann::json::array();
  std::vector<std::string> budget_lines;  // one per device, in the order of `devices`
  for (auto& [key, caches] : by_device) {
    const auto& [ns, device] = key;
    DeviceBudgetView budget =
        ReadDeviceBudget(std::filesystem::path(listing->runtime_dir) / ns / device);
    nlohmann::json d = {{"namespace", ns}, {"device", device}};
    auto or_null = [](const std::optional<uint64_t>& v) {
      return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
    };
    d["budget_bytes"] = budget ? or_null(budget->budget_bytes) : nlohmann::json(nullptr);
    d["budget_source"] = budget && !budget->budget_source.empty()
                             ? nlohmann::json(budget->budget_source)
                             : nlohmann::json(nullptr);
    d["used_bytes"] = budget ? nlohmann::json(budget->used_bytes) : nlohmann::json(nullptr);
    d["free_bytes"] = budget ? or_null(budget->free_bytes) : nlohmann::json(nullptr);
    budget_lines.push_back(FormatDeviceBudget(budget));
    for (auto& c : caches) c["cache_state"] = CacheState(c);
    d["caches"] = caches;
    d["lru"] = LruOrder(caches);
    devices.push_back(std::move(d));
  }

  if (args.json) {
    std::cout << nlohmann::json{{"runtime_dir", listing->runtime_dir}, {"devices", devices}}.dump(2)
              << std::endl;
    return kExitOk;
  }
  if (devices.empty()) {
    std::cout << "no caches under " << EscapeForTerminal(listing->runtime_dir)
              << (args.all_namespaces ? "" : " (namespace " + listing->namespace_name + ")")
              << std::endl;
    return kExitOk;
  }
  const uint64_t now_ms =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  std::ostringstream out;
  size_t i = 0;
  for (const auto& d : devices) {
    out << "device " << EscapeForTerminal(d["device"].get<std::string>()) << " (namespace "
        << EscapeForTerminal(d["namespace"].get<std::string>()) << "): " << budget_lines[i++]
        << "\n";
    // Columns sized to their content (FormatTable); a row's error follows it on its own line.
    std::vector<std::vector<std::string>> table = {
        {"MODEL", "STATE", "BYTES", "CLIENTS", "LAST ATTACH", "HITS", "MISSES", "PID", "DIGEST"}};
    std::vector<std::string> notes;
    for (const auto& r : d["caches"]) {
      auto str = [&](const char* key) {
        auto it = r.find(key);
        if (it == r.end() || it->is_null()) return std::string("-");
        // Every cell comes from a daemon's reply: escaped (common/terminal_text.h).
        return EscapeForTerminal(it->is_string() ? it->get<std::string>() : it->dump());
      };
      std::string digest = str("digest");
      if (digest.size() > 16) digest.resize(16);
      table.push_back({str("model_id"), str("cache_state"),
                       r.contains("bytes") ? daemon::FormatBytes(r["bytes"].get<uint64_t>()) : "-",
                       str("clients"), Ago(r, now_ms), str("hits"), str("misses"), str("pid"),
                       digest});
      notes.push_back(r.contains("error") ? "    error: " + str("error") + "\n" : "");
    }
    std::istringstream lines(FormatTable(table));
    std::string line;
    for (size_t row = 0; std::getline(lines, line); ++row) {
      out << "  " << line << "\n";
      if (row > 0) out << notes[row - 1];
    }
    out << "  LRU (least recently attached first):";
    if (d["lru"].empty()) out << " -";
    for (const auto& digest : d["lru"]) {
      out << " " << EscapeForTerminal(digest.get<std::string>().substr(0, 16));
    }
    out << "\n";
  }
  std::cout << out.str() << std::flush;
  return kExitOk;
}

}  // namespace

void RegisterStatusCommand(CLI::App& root) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* sub = root.add_subcommand(
      "status", "Per device: the memory budget, each cache's state, hits and misses, LRU order");
  AddListingFlags(sub, args.get());
  SetAction(sub, [args] { return RunStatus(*args); });
}

}  // namespace weightcache::cli
