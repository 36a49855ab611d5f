// `weightcache ls`: every cache on this host (SPEC §5): identity, tier, device, state, bytes
// (a sharded cache's: the bytes of its rank's slices, marked "sliced" after its ranks and
// "sharded": true in --json), clients, pid. Walks <runtime>/<namespace>/<device key>/*.sock; a
// socket whose lock is not held is stale and listed as such (never queried); a live one is asked
// Hello (for its full CacheConfig: revision and ranks) and Status. A daemon that does not answer is
// listed with the error instead of failing the whole listing.
//
// Keepers (docs/keeper.md): a live cache's row carries its keeper ("keeper": pid, state, bytes;
// "adopted": true when the daemon re-adopted the kept memory instead of loading). A live keeper
// whose daemon is gone is an **orphan**: listed with state "orphan" and the bytes it holds
// (its cache socket's row, stale or absent, is replaced by it); `stop` frees it.
#include <algorithm>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli_common.h"
#include "common/terminal_text.h"
#include "daemon/byte_size.h"
#include "identity/cache_config.h"
#include "identity/paths.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "protocol/connection.h"

namespace weightcache::cli {
namespace {

struct LsArgs {
  bool json = false;
  std::string namespace_name;
  bool all_namespaces = false;
  std::string runtime_dir;
  double timeout_s = 2;
};

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
  auto runtime = identity::ResolveRuntimeDir(args.runtime_dir, identity::ProcessEnv());
  if (!runtime.ok()) return Fail(kCmd, runtime.status());
  auto entries = identity::ListAllCacheSockets(runtime->path);
  if (!entries.ok()) return Fail(kCmd, entries.status());
  const std::string ns =
      args.namespace_name.empty() ? std::string(identity::kDefaultNamespace) : args.namespace_name;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));

  nlohmann::json rows = nlohmann::json::array();
  for (const auto& entry : *entries) {
    if (!args.all_namespaces && entry.namespace_name != ns) continue;
    rows.push_back(Describe(entry, timeout));
    AddKeeper(rows.back(), timeout);
  }
  // Orphans whose cache socket is gone too (a stale socket is listed above).
  auto keepers = identity::ListAllKeeperSockets(runtime->path);
  if (!keepers.ok()) return Fail(kCmd, keepers.status());
  for (const auto& k : *keepers) {
    if (!args.all_namespaces && k.namespace_name != ns) continue;
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

  if (args.json) {
    std::cout << nlohmann::json{{"runtime_dir", runtime->path}, {"caches", rows}}.dump(2)
              << std::endl;
    return kExitOk;
  }
  if (rows.empty()) {
    std::cout << "no caches under " << EscapeForTerminal(runtime->path)
              << (args.all_namespaces ? "" : " (namespace " + ns + ")") << std::endl;
    return kExitOk;
  }
  std::ostringstream out;
  out << std::left << std::setw(10) << "NAMESPACE" << std::setw(42) << "DEVICE" << std::setw(24)
      << "MODEL" << std::setw(35) << "RANKS" << std::setw(6) << "TIER" << std::setw(12) << "STATE"
      << std::setw(12) << "BYTES" << std::setw(8) << "CLIENTS" << std::setw(8) << "PID"
      << "DIGEST\n";
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
    out << std::left << std::setw(10) << str("namespace") << std::setw(42) << str("device")
        << std::setw(24) << model << std::setw(35) << Ranks(config) << std::setw(6) << str("tier")
        << std::setw(12) << state << std::setw(12) << bytes << std::setw(8) << str("clients")
        << std::setw(8) << str("pid") << digest << "\n";
    if (r.contains("failure_reason")) out << "    failed: " << str("failure_reason") << "\n";
    if (r.contains("error")) out << "    error: " << str("error") << "\n";
    if (state == "orphan") {
      out << "    orphan: keeper pid " << str("pid")
          << " holds the memory of a daemon that is gone; `weightcache stop --socket "
          << str("socket") << "` frees it\n";
    }
  }
  std::cout << out.str() << std::flush;
  return kExitOk;
}

}  // namespace

void RegisterLsCommand(CLI::App& root) {
  auto args = std::make_shared<LsArgs>();
  CLI::App* sub = root.add_subcommand("ls", "List every cache on this host and its state");
  sub->add_flag("--json", args->json, "print one JSON object");
  auto* ns = sub->add_option("--namespace", args->namespace_name,
                             "only this namespace (default: default)");
  sub->add_flag("--all-namespaces", args->all_namespaces, "every namespace")->excludes(ns);
  sub->add_option("--runtime-dir", args->runtime_dir, "runtime dir");
  sub->add_option("--timeout", args->timeout_s, "seconds to wait for each daemon's answer")
      ->check(CLI::PositiveNumber);
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
