// The launcher's view of real `weightcache serve` daemons: their command lines, their log
// files, and the three seams of launcher.h implemented against the protocol (Status request),
// OFD lock (IsLockHeld) and the lock file's recorded owner pid.
//
// Contract:
//  * BuildDaemonSpecs is pure. Each daemon runs `<exe> serve` with every identity flag of the
//    job (docs/design.md "Launcher": launch applies the identity flags of serve to every daemon),
//    its own ranks and `--device <UUID>` (never a local index: the UUID is the identity, and the
//    daemon re-resolves it against the same visible devices), plus the job's load flags. The
//    identity flags are written by ServeFlags::identity_args, never listed here.
//  * Log files: <log_dir>/<job>-tp<r>-pp<r>-<uuid tag>.log; the uuid tag keeps two jobs with
//    the same name and ranks on different GPUs apart.
//  * The probes are stateless and thread-safe; each opens and closes its own connection/fds.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "identity/paths.h"
#include "launcher/launcher.h"
#include "launcher/placement.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

// The `serve` flags a launch applies to every daemon (docs/design.md "Launcher").
struct ServeFlags {
  // The job's identity, as `weightcache launch` parsed it with the identity flags of `serve`
  // (tools/identity_flags.h, job scope), with model_dir, quantization_config and
  // device_inventory made absolute and runtime_dir resolved by the caller (every daemon uses
  // exactly that one). Each daemon gets a copy with its ranks and device (the UUID) from its
  // placement and no socket (the launcher finds sockets in the layout).
  IdentityOptions identity;
  // Writes one daemon's IdentityOptions as `serve` arguments: tools/identity_flags.h
  // ServeArgsFor, generated from the table that registers the flags, so that every identity
  // flag is forwarded and none is spelled here. Required.
  std::function<std::vector<std::string>(const IdentityOptions&)> identity_args;
  // Load flags of serve: "" / 0 = serve's default.
  std::string memory_budget;
  int threads = 0;
  // Budget flags of serve (docs/budget.md), forwarded as given: "" / false = not given.
  std::string gpu_budget;
  std::string host_budget;
  bool pin = false;
  std::string demote;  // serve's --demote ("host", "host-pinned"); "" = not given
  // serve's --adopt-verify (sample|full|behind, docs/keeper.md); "" = not given. With
  // --supervise, a daemon restarted after a crash re-adopts its keeper's memory this way.
  std::string adopt_verify;
  // serve's --seed-from ("auto": each daemon seeds from a peer cache of its own rank on another
  // GPU of this node, docs/seeding.md); "" = not given.
  std::string seed_from;
  // serve's --allow-uid / --allow-gid: the peers besides the owner that may attach (an engine
  // running as another user than the daemons', e.g. in another pod); forwarded as given.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  // serve's --metrics-addr, made per daemon by AddrForRank ("" = no metrics). The caller
  // checks it with AddrForRank for the job's largest rank first.
  std::string metrics_addr;
  // The fleet flags of serve (--registry and its kin, --fill-*: serve/fleet_options.h) of the
  // daemon of job rank `rank`, appended as given; null = none. The caller validated them for
  // every rank of the plan before any daemon starts.
  std::function<std::vector<std::string>(int rank)> fleet_args;
};

// The daemon's rank within its job, the one numbering of per-daemon resources:
// pp_rank * tp_size + tp_rank.
int JobRank(const DaemonPlacement& placement, int tp_size);

// The address of the daemon of job rank `rank` from the job's `addr` given to `flag`, the one
// rule for per-daemon listening addresses (docs/launcher.md): HOST:PORT gets the port PORT + rank
// (port 0 stays 0: each daemon picks a free one and logs it); with kHostPortOrUnixPath an
// absolute Unix socket path gets the suffix ".<rank>". "" stays "". kInvalidArgument, naming
// the flag, for anything else or a port that would pass 65535.
enum class RankedAddr { kHostPort, kHostPortOrUnixPath };
Result<std::string> AddrForRank(std::string_view flag, const std::string& addr, int rank,
                                RankedAddr kind);

struct JobFiles {
  std::string exe;      // absolute path of the weightcache binary
  std::string log_dir;  // where the daemons' logs go
  std::string job;      // log file name prefix
};

std::vector<DaemonSpec> BuildDaemonSpecs(const std::vector<DaemonPlacement>& plan,
                                         const ServeFlags& flags, const JobFiles& files);

// What a published cache's `awaiting` (its daemon waits for a publisher) counts as: ready
// (kReady) for `serve --detach` and for `launch` of a published source, which are done once
// the daemon can take its publisher; kLoading where the caller waits for the publish itself.
enum class AwaitingIs { kLoading, kReady };

// The daemon's state through a protocol Status request; connect and reply bounded by
// `timeout`. Errors as Connection reports them (kNotFound: no socket yet, …).
Result<ProbeReport> ProbeDaemonState(const std::string& socket_path,
                                     std::chrono::milliseconds timeout,
                                     AwaitingIs awaiting = AwaitingIs::kLoading);

// The socket under <runtime_dir>/<namespace_name>/*/ whose lock is held and records `pid` as
// its owner.
std::optional<PublishedPaths> LocatePublishedSocket(const std::string& runtime_dir,
                                                    const std::string& namespace_name, pid_t pid);

// The lock file of a socket: identity's rule, the one place path rules live.
using identity::LockPathFor;

// The --json summary: {"status": "ok"|<code name>, "message", "exit_code", "daemons": [{...}],
// "cleaned": [...]} with each daemon's ranks, device, socket, pid, state, bytes, seconds, log,
// restarts, exit; `cleaned` is the stale files removed before the start (daemon/stale_files.h's
// CleanedToJson; `launch` sweeps its namespace, `serve --detach` nothing).
std::string LaunchSummaryJson(const LaunchReport& report, int exit_code,
                              const nlohmann::json& cleaned = nlohmann::json::array());

}  // namespace weightcache::launcher
