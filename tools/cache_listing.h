// ListCaches — the one scan of a runtime dir's caches, shared by `ls` and `status`: every
// cache socket (of one namespace, or all) as a JSON row with its identity, tier, state, bytes,
// clients, pid, its attach counters (hits, misses, last attach: the Metrics request), and its
// keeper; orphaned keepers as rows of their own. A stale socket is listed as such and never
// queried; a daemon that does not answer is listed with the error; a daemon too old for the
// Metrics request has no counters in its row.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "weightcache/status.h"

namespace weightcache::cli {

struct ListOptions {
  std::string runtime_dir;     // as given (--runtime-dir), resolved by ListCaches
  std::string namespace_name;  // empty: the default namespace
  bool all_namespaces = false;
  std::chrono::milliseconds timeout{2000};  // per daemon
};

// The flags `ls` and `status` share, one home for both: --json, --namespace, --all-namespaces,
// --runtime-dir, --timeout. AddListingFlags registers them on a command; Options() turns them
// into the scan's options.
struct ListingArgs {
  bool json = false;
  std::string namespace_name;
  bool all_namespaces = false;
  std::string runtime_dir;
  double timeout_s = 2;
  ListOptions Options() const;
};
void AddListingFlags(CLI::App* command, ListingArgs* args);

struct CacheListing {
  std::string runtime_dir;  // resolved
  std::string namespace_name;
  nlohmann::json rows = nlohmann::json::array();
};

Result<CacheListing> ListCaches(const ListOptions& options);

// A device's memory budget (docs/budget.md): the bytes its ledger's caches hold on the
// device's tier, and the budget its budget.conf sets in bytes (a budget in % of the device's
// memory, or one given only by `serve --gpu-budget`, is not known here: null).
struct DeviceBudget {
  std::optional<uint64_t> budget_bytes;
  // Where budget_bytes comes from: "budget.conf", or "serve flag" (no budget.conf entry for
  // the tier: the smallest budget a live cache of the tier was admitted under, its
  // --gpu-budget or --host-budget); "" when unknown.
  std::string budget_source;
  uint64_t used_bytes = 0;
  std::optional<uint64_t> free_bytes;  // budget - used, when the budget is known
};
using DeviceBudgetView = std::optional<DeviceBudget>;

// The budget of the device whose dir (<runtime>/<namespace>/<device key>) is `device_dir`, from
// its budget ledger and budget.conf; std::nullopt when it has neither, or they cannot be read
// (a corrupt ledger is logged once, naming the file).
DeviceBudgetView ReadDeviceBudget(const std::filesystem::path& device_dir);

// "budget 40.00 GiB, used 16.00 GiB, free 24.00 GiB" ("-" for what is not known; "budget
// 40.00 GiB (serve flag), …" when it comes from the caches' flags): the budget line of a device
// in `status` and `ls`.
std::string FormatDeviceBudget(const DeviceBudgetView& view);

}  // namespace weightcache::cli
