#include "cache_listing.h"

#include <unistd.h>

#include <algorithm>

#include "common/logging.h"
#include "daemon/budget.h"
#include "daemon/byte_size.h"
#include "flag_checks.h"
#include "identity/cache_config.h"
#include "identity/env.h"
#include "identity/paths.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "protocol/connection.h"

namespace weightcache::cli {
namespace {

using identity::LockPathFor;

// A Hello needs a well-formed config; this one matches nothing, so the daemon answers with its
// own config and the differences, which is all `ls` wants.
identity::CacheConfig ObserverConfig() {
  identity::CacheConfig c;
  c.model_id = "weightcache-ls";
  c.checkpoint_fingerprint = std::string(64, '0');
  c.checkpoint_files = std::string(64, '0');
  c.tier = Tier::kHost;  // any valid tier: this config is never meant to match
  return c;
}

nlohmann::json Describe(const identity::SocketEntry& entry, std::chrono::milliseconds timeout) {
  nlohmann::json row = {
      {"namespace", entry.namespace_name}, {"device", entry.device_key}, {"socket", entry.socket}};
  const std::string lock = LockPathFor(entry.socket);
  if (!os::IsLockHeld(lock)) {
    row["state"] = "stale";
    return row;
  }
  if (auto owner = os::ReadLockOwner(lock)) row["pid"] = *owner;
  auto query = [&]() -> Status {
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn, protocol::Connection::Connect(entry.socket, timeout));
    protocol::Hello hello;
    hello.config = ObserverConfig().ToJson();
    hello.client_pid = ::getpid();
    hello.client_name = "weightcache-ls";
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto hr, conn.SendHello(hello, os::Deadline::After(timeout)));
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto st, conn.QueryStatus(os::Deadline::After(timeout)));
    row["state"] = std::string(protocol::CacheStateName(st.state));
    row["pid"] = st.pid;
    row["tier"] = std::string(TierName(st.tier));
    row["device"] = st.device_uuid;
    row["model_id"] = st.model_id;
    row["digest"] = st.config_digest;
    if (!st.origin.empty()) row["origin"] = st.origin;
    row["tensors"] = st.tensor_count;
    row["bytes"] = st.bytes;
    row["bytes_done"] = st.bytes_done;
    row["bytes_total"] = st.bytes_total;
    row["clients"] = st.clients;
    if (!st.failure_reason.empty()) row["failure_reason"] = st.failure_reason;
    row["config"] = hr.daemon_config;
    // A sharded cache holds its rank's slices only: `bytes` are the held bytes.
    row["sharded"] = hr.daemon_config.is_object() &&
                     !hr.daemon_config.value("shard_rules_digest", std::string()).empty();
    // The attach counters; a daemon without the Metrics request (an older build) answers
    // Error and closes: its counters are unknown, the rest of its row stands.
    row["hits"] = nullptr;
    row["misses"] = nullptr;
    row["last_attach_unix_ms"] = nullptr;
    auto metrics = conn.QueryMetrics(os::Deadline::After(timeout));
    if (metrics.ok()) {
      row["hits"] = metrics->hits;
      row["misses"] = metrics->misses;
      if (metrics->last_attach_unix_ms > 0)
        row["last_attach_unix_ms"] = metrics->last_attach_unix_ms;
    }
    return Status::Ok();
  };
  Status status = query();
  if (!status.ok()) {
    row["state"] = "unreachable";
    row["error"] = status.ToString();
  }
  return row;
}

// What the keeper of `cache_socket` holds, as JSON; null when there is no live keeper.
nlohmann::json DescribeKeeper(const std::string& cache_socket, std::chrono::milliseconds timeout) {
  const std::string socket = identity::KeeperSocketFor(cache_socket);
  auto query = keeper::QueryKeeper({socket, LockPathFor(socket)}, timeout);
  if (query.ok() && !query->has_value()) return nullptr;
  nlohmann::json k = {{"socket", socket}};
  if (!query.ok()) {
    k["error"] = query.status().ToString();
    return k;
  }
  const protocol::KeeperQuery& q = **query;
  k["pid"] = q.keeper_pid;
  k["state"] = std::string(protocol::KeeperStateName(q.state));
  k["bytes"] = q.bytes;
  k["allocations"] = q.fd_count;
  k["depositor_pid"] = q.depositor_pid;
  k["age_ms"] = q.age_ms;
  k["digest"] = q.config_digest;
  return k;
}

// Adds the keeper to a cache's row; an orphan (live keeper, no live daemon) becomes its row.
void AddKeeper(nlohmann::json& row, std::chrono::milliseconds timeout) {
  const std::string socket = row.value("socket", std::string());
  nlohmann::json k = DescribeKeeper(socket, timeout);
  if (k.is_null()) return;
  const std::string state = row.value("state", std::string());
  if (state == "stale" || state == "absent") {
    row["state"] = "orphan";
    row["pid"] = k.value("pid", int64_t{0});
    if (k.contains("bytes")) row["bytes"] = k["bytes"];
    if (k.contains("digest")) row["digest"] = k["digest"];
  } else if (k.contains("depositor_pid") && row.contains("pid") &&
             k.value("state", std::string()) == "holding") {
    // The daemon deposits what it loads; a holding keeper deposited by another pid is what
    // this daemon adopted.
    row["adopted"] = k["depositor_pid"] != row["pid"];
  }
  row["keeper"] = std::move(k);
}

}  // namespace

Result<CacheListing> ListCaches(const ListOptions& options) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      auto runtime, identity::ResolveRuntimeDir(options.runtime_dir, identity::ProcessEnv()));
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto entries, identity::ListAllCacheSockets(runtime.path));
  CacheListing listing;
  listing.runtime_dir = runtime.path;
  listing.namespace_name = options.namespace_name.empty() ? std::string(identity::kDefaultNamespace)
                                                          : options.namespace_name;
  const std::string& ns = listing.namespace_name;
  const auto timeout = options.timeout;
  nlohmann::json& rows = listing.rows;
  for (const auto& entry : entries) {
    if (!options.all_namespaces && entry.namespace_name != ns) continue;
    rows.push_back(Describe(entry, timeout));
    AddKeeper(rows.back(), timeout);
  }
  // Orphans whose cache socket is gone too (a stale socket is listed above).
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto keepers, identity::ListAllKeeperSockets(runtime.path));
  for (const auto& k : keepers) {
    if (!options.all_namespaces && k.namespace_name != ns) continue;
    const std::string cache_socket = identity::CacheSocketForKeeper(k.socket);
    const bool listed = std::any_of(rows.begin(), rows.end(), [&](const nlohmann::json& r) {
      return r.value("socket", std::string()) == cache_socket;
    });
    if (listed || !os::IsLockHeld(LockPathFor(k.socket))) continue;
    nlohmann::json row = {{"namespace", k.namespace_name},
                          {"device", k.device_key},
                          {"socket", cache_socket},
                          {"state", "absent"}};
    AddKeeper(row, timeout);
    rows.push_back(std::move(row));
  }
  return listing;
}

ListOptions ListingArgs::Options() const {
  ListOptions options;
  options.runtime_dir = runtime_dir;
  options.namespace_name = namespace_name;
  options.all_namespaces = all_namespaces;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return options;
}

void AddListingFlags(CLI::App* command, ListingArgs* args) {
  command->add_flag("--json", args->json, "print one JSON object");
  auto* ns = command->add_option("--namespace", args->namespace_name,
                                 "only this namespace (default: default)");
  command->add_flag("--all-namespaces", args->all_namespaces, "every namespace")->excludes(ns);
  command->add_option("--runtime-dir", args->runtime_dir, "runtime dir");
  command->add_option("--timeout", args->timeout_s, "seconds to wait for each daemon's answer")
      ->check(Positive());
}

DeviceBudgetView ReadDeviceBudget(const std::filesystem::path& device_dir) {
  const std::string dir = device_dir.string();
  const bool host = device_dir.filename() == identity::kHostDeviceKey;
  const Tier tier = host ? Tier::kHost : Tier::kGpu;
  const bool has_ledger = std::filesystem::exists(identity::BudgetLedgerPath(dir));
  auto config = daemon::ReadBudgetConfig(identity::BudgetConfigPath(dir));
  if (!config.ok()) {
    LOG_WARN << config.status().ToString();
    return std::nullopt;
  }
  const std::string& spec = host ? config->host_budget : config->gpu_budget;
  if (!has_ledger && spec.empty()) return std::nullopt;
  DeviceBudget view;
  std::optional<uint64_t> flagged;  // the smallest budget a live cache of the tier was given
  if (has_ledger) {
    auto ledger = daemon::BudgetLedger(dir).ReadOnly();
    if (!ledger.ok()) {
      LOG_WARN << ledger.status().ToString();
      return std::nullopt;
    }
    view.used_bytes = ledger->BytesOn(tier);
    for (const daemon::LedgerEntry& e : ledger->entries) {
      if (e.tier != tier || e.budget == 0) continue;
      flagged = flagged ? std::min(*flagged, e.budget) : e.budget;
    }
  }
  if (auto bytes = daemon::ParseByteSize(spec); !spec.empty() && bytes.ok()) {
    view.budget_bytes = *bytes;
    view.budget_source = "budget.conf";
  } else if (spec.empty() && flagged) {
    view.budget_bytes = *flagged;
    view.budget_source = "serve flag";
  }
  if (view.budget_bytes) {
    view.free_bytes =
        *view.budget_bytes > view.used_bytes ? *view.budget_bytes - view.used_bytes : 0;
  }
  return view;
}

std::string FormatDeviceBudget(const DeviceBudgetView& view) {
  auto bytes = [](const std::optional<uint64_t>& v) {
    return v ? daemon::FormatBytes(*v) : std::string("-");
  };
  if (!view) return "budget -, used -, free -";
  const std::string source = view->budget_source == "serve flag" ? " (serve flag)" : "";
  return "budget " + bytes(view->budget_bytes) + source + ", used " +
         daemon::FormatBytes(view->used_bytes) + ", free " + bytes(view->free_bytes);
}

}  // namespace weightcache::cli
