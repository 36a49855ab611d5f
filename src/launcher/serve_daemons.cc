#include "launcher/serve_daemons.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "identity/paths.h"
#include "os/lock_file.h"
#include "protocol/connection.h"
#include "protocol/messages.h"

namespace weightcache::launcher {

int JobRank(const DaemonPlacement& placement, int tp_size) {
  return placement.pp_rank * tp_size + placement.tp_rank;
}

Result<std::string> AddrForRank(std::string_view flag, const std::string& addr, int rank,
                                RankedAddr kind) {
  if (addr.empty()) return addr;
  const bool unix_path = addr.front() == '/';
  if (unix_path && kind == RankedAddr::kHostPortOrUnixPath) {
    return addr + "." + std::to_string(rank);
  }
  const size_t colon = addr.rfind(':');
  const std::string port_text = colon == std::string::npos ? "" : addr.substr(colon + 1);
  if (unix_path || colon == 0 || port_text.empty() || port_text.size() > 5 ||
      port_text.find_first_not_of("0123456789") != std::string::npos) {
    return InvalidArgument(std::string(flag) + " " + addr +
                           (kind == RankedAddr::kHostPortOrUnixPath
                                ? ": not HOST:PORT nor an absolute Unix socket path"
                                : ": not HOST:PORT"));
  }
  const int port = std::stoi(port_text);
  if (port == 0) return addr;
  if (port + rank > 65535) {
    return InvalidArgument(std::string(flag) + " " + addr + ": the daemon of rank " +
                           std::to_string(rank) + " would get port " + std::to_string(port + rank) +
                           ", past 65535");
  }
  return addr.substr(0, colon + 1) + std::to_string(port + rank);
}

std::vector<DaemonSpec> BuildDaemonSpecs(const std::vector<DaemonPlacement>& plan,
                                         const ServeFlags& flags, const JobFiles& files) {
  std::vector<DaemonSpec> specs;
  for (const DaemonPlacement& p : plan) {
    DaemonSpec s;
    s.placement = p;
    s.name = "tp" + std::to_string(p.tp_rank) + "-pp" + std::to_string(p.pp_rank);
    IdentityOptions daemon = flags.identity;
    daemon.tp_rank = p.tp_rank;
    daemon.pp_rank = p.pp_rank;
    daemon.ep_rank = p.ep_rank;
    daemon.device = p.device_uuid;
    daemon.socket.clear();
    auto& argv = s.spawn.argv;
    argv = {files.exe, "serve"};
    const std::vector<std::string> identity_args = flags.identity_args(daemon);
    argv.insert(argv.end(), identity_args.begin(), identity_args.end());
    auto add = [&argv](const char* flag, const std::string& value) {
      if (value.empty()) return;
      argv.push_back(flag);
      argv.push_back(value);
    };
    add("--memory-budget", flags.memory_budget);
    if (flags.threads > 0) add("--threads", std::to_string(flags.threads));
    add("--gpu-budget", flags.gpu_budget);
    add("--host-budget", flags.host_budget);
    if (flags.pin) argv.push_back("--pin");
    add("--demote", flags.demote);
    add("--adopt-verify", flags.adopt_verify);
    add("--seed-from", flags.seed_from);
    for (uint32_t uid : flags.allow_uids) add("--allow-uid", std::to_string(uid));
    for (uint32_t gid : flags.allow_gids) add("--allow-gid", std::to_string(gid));
    const int rank = JobRank(p, flags.identity.tp_size);
    if (auto metrics = AddrForRank("--metrics-addr", flags.metrics_addr, rank,
                                   RankedAddr::kHostPortOrUnixPath);
        metrics.ok()) {
      add("--metrics-addr", *metrics);
    }
    if (flags.fleet_args) {
      const std::vector<std::string> fleet = flags.fleet_args(rank);
      argv.insert(argv.end(), fleet.begin(), fleet.end());
    }
    // "GPU-1a2b3c4d-…" → "1a2b3c4d": short, and unique among the GPUs of one host in practice.
    std::string tag = p.device_uuid.empty() ? "host" : p.device_uuid;
    if (auto dash = tag.find('-'); dash != std::string::npos) tag = tag.substr(dash + 1);
    tag = tag.substr(0, 8);
    s.spawn.log_path = files.log_dir + "/" + files.job + "-" + s.name + "-" + tag + ".log";
    specs.push_back(std::move(s));
  }
  return specs;
}

Result<ProbeReport> ProbeDaemonState(const std::string& socket_path,
                                     std::chrono::milliseconds timeout, AwaitingIs awaiting) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Connection conn,
                               protocol::Connection::Connect(socket_path, timeout));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::StatusReply reply,
                               conn.QueryStatus(os::Deadline::After(timeout)));
  ProbeReport r;
  r.bytes_done = reply.bytes_done;
  r.bytes_total = reply.bytes_total;
  r.reason = reply.failure_reason;
  switch (reply.state) {
    case protocol::CacheState::kLoading:
      r.state = ProbeReport::State::kLoading;
      break;
    case protocol::CacheState::kAwaiting:  // a published cache waiting for its publisher
      r.state = awaiting == AwaitingIs::kReady ? ProbeReport::State::kReady
                                               : ProbeReport::State::kLoading;
      break;
    case protocol::CacheState::kReady:
    case protocol::CacheState::kDemoted:  // serving from host RAM; an attach promotes it
      r.state = ProbeReport::State::kReady;
      break;
    case protocol::CacheState::kFailed:
      r.state = ProbeReport::State::kFailed;
      break;
    case protocol::CacheState::kDraining:
      r.state = ProbeReport::State::kDraining;
      break;
  }
  return r;
}

namespace {

Result<std::vector<std::string>> NamespaceSockets(const std::string& runtime_dir,
                                                  const std::string& namespace_name) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<identity::SocketEntry> all,
                               identity::ListAllCacheSockets(runtime_dir));
  std::vector<std::string> out;
  for (auto& e : all) {
    if (e.namespace_name == namespace_name) out.push_back(std::move(e.socket));
  }
  return out;
}

}  // namespace

std::optional<PublishedPaths> LocatePublishedSocket(const std::string& runtime_dir,
                                                    const std::string& namespace_name, pid_t pid) {
  auto sockets = NamespaceSockets(runtime_dir, namespace_name);
  if (!sockets.ok()) return std::nullopt;
  for (const std::string& socket : *sockets) {
    const std::string lock = LockPathFor(socket);
    // The recorded owner alone could be a previous holder's; the held OFD lock makes it current.
    if (os::ReadLockOwner(lock) == pid && os::IsLockHeld(lock)) {
      return PublishedPaths{socket, lock};
    }
  }
  return std::nullopt;
}

std::string LaunchSummaryJson(const LaunchReport& report, int exit_code,
                              const nlohmann::json& cleaned) {
  nlohmann::json j;
  j["status"] = report.status.ok() ? "ok" : std::string(StatusCodeName(report.status.code()));
  j["message"] = report.status.message();
  j["exit_code"] = exit_code;
  if (report.stop_signal != 0) j["stop_signal"] = report.stop_signal;
  nlohmann::json daemons = nlohmann::json::array();
  for (size_t i = 0; i < report.daemons.size(); ++i) {
    const DaemonSnapshot& d = report.daemons[i];
    nlohmann::json e = {{"name", d.name},
                        {"tp_rank", d.placement.tp_rank},
                        {"pp_rank", d.placement.pp_rank},
                        {"ep_rank", d.placement.ep_rank},
                        {"local_gpu_id", d.placement.local_gpu_id},
                        {"device_uuid", d.placement.device_uuid},
                        {"socket", d.socket_path},
                        {"log", d.log_path},
                        {"pid", d.pid},
                        {"state", std::string(DaemonStateName(d.state))},
                        {"bytes_done", d.bytes_done},
                        {"bytes_total", d.bytes_total},
                        {"seconds", d.seconds},
                        {"restarts", d.restarts}};
    if (d.exit) {
      e["exit"] = d.exit->exited() ? nlohmann::json{{"code", d.exit->exit_code}}
                                   : nlohmann::json{{"signal", d.exit->signal}};
    }
    if (!d.reason.empty() && d.state != DaemonState::kReady) e["reason"] = d.reason;
    if (static_cast<int>(i) == report.failed_index) e["failed"] = true;
    daemons.push_back(std::move(e));
  }
  j["daemons"] = std::move(daemons);
  j["cleaned"] = cleaned;
  return j.dump(2);
}

}  // namespace weightcache::launcher
