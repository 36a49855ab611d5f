// The launcher's view of real `weightcache serve` daemons: their command lines, their log
// files, and the three seams of launcher.h implemented against the protocol (Status request),
// flock (IsLockHeld) and the lock file's recorded owner pid.
//
// Contract:
//  * BuildDaemonSpecs is pure. Each daemon runs `<exe> serve` with the job's identity flags,
//    its own ranks and `--device <UUID>` (never a local index: the UUID is the identity, and
//    the daemon re-resolves it against the same visible devices).
//  * Log files: <log_dir>/<job>-tp<r>-pp<r>-<uuid tag>.log; the uuid tag keeps two jobs with
//    the same name and ranks on different GPUs apart.
//  * The probes are stateless and thread-safe; each opens and closes its own connection/fds.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "launcher/launcher.h"
#include "launcher/placement.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

// The `serve` flags a launch applies to every daemon (SPEC §5). Empty strings are omitted.
struct ServeFlags {
  std::string model;  // --model DIR (made absolute by the caller)
  std::string tier = "host";
  std::string model_id;
  std::string revision;
  std::string namespace_name = "default";
  std::string runtime_dir;       // resolved, absolute: every daemon uses exactly this one
  std::string device_inventory;  // --device-inventory
  std::string memory_budget;
  int tp_size = 1;
  int pp_size = 1;
  int ep_size = 1;
  int dp_size = 1;
};

struct JobFiles {
  std::string exe;      // absolute path of the weightcache binary
  std::string log_dir;  // where the daemons' logs go
  std::string job;      // log file name prefix
};

std::vector<DaemonSpec> BuildDaemonSpecs(const std::vector<DaemonPlacement>& plan,
                                         const ServeFlags& flags, const JobFiles& files);

// The daemon's state through a protocol Status request; connect and reply bounded by
// `timeout`. Errors as Connection reports them (kNotFound: no socket yet, …).
Result<ProbeReport> ProbeDaemonState(const std::string& socket_path,
                                     std::chrono::milliseconds timeout);

// The socket under <runtime_dir>/<namespace_name>/*/ whose lock is held and records `pid` as
// its owner.
std::optional<PublishedPaths> LocatePublishedSocket(const std::string& runtime_dir,
                                                    const std::string& namespace_name, pid_t pid);

// The lock file of a layout socket: <stem>.sock → <stem>.lock.
std::string LockPathFor(const std::string& socket_path);

// Removes every socket under <namespace_dir>/*/ whose lock is not held (stale, SPEC §2); a
// socket with a held lock, and every lock file, stays. Returns the removed paths.
Result<std::vector<std::string>> SweepStaleSockets(const std::string& runtime_dir,
                                                   const std::string& namespace_name);

// The --json summary: {"status": "ok"|<code name>, "message", "exit_code", "daemons": [{...}]}
// with each daemon's ranks, device, socket, pid, state, bytes, seconds, log, restarts, exit.
std::string LaunchSummaryJson(const LaunchReport& report, int exit_code);

}  // namespace weightcache::launcher
