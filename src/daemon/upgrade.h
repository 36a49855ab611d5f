// The upgrade handover (docs/upgrade.md): a ready daemon hands its cache — the arena fds, the
// manifest and the identity lock — to a successor process, which may be a new binary, over a
// socketpair; the successor validates everything, takes the socket path over and serves; the
// old daemon then exits without freeing a byte. The event-loop half (when to start, when to
// stop accepting) is the Daemon's (daemon.h); this file is both ends of the channel.
//
// Channel (handoff frames, versioned by kHandoffVersion so that two builds can hand over):
//   old → successor   Handover      the keeper Deposit's payload; fds: manifest memfd, one per
//                                   allocation, then the identity lock's open file description
//   successor → old   HandoverDone  empty: it validated and serves at the socket path
//                     or Error      why it refused (it then exits; the old daemon serves on)
//
// Rules (each lives here only):
//  * The successor validates before it serves, with the keeper's checks (keeper_link.h): the
//    fds' kinds, sizes and seals (protocol::DecodeHandoff), the lock (os::LockFile::Adopt:
//    the lock file's inode, and that the description holds the lock), the config digest, the
//    checkpoint as it is now (a loaded cache), and the manifest's checksums against the memory,
//    a sample or in full (`serve --adopt-verify`; the gpu tier with the checksum kernel).
//  * The lock travels as an fd, so the identity is owned without a gap: nobody else can take
//    it between the old daemon's exit and the successor's start.
//  * A successor that refuses or dies before HandoverDone leaves the old daemon serving.
//
// Thread-safety: plain functions on fds the caller owns.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "common/unique_fd.h"
#include "daemon/keeper_link.h"
#include "daemon/weight_store.h"
#include "identity/cache_config.h"
#include "identity/paths.h"
#include "os/lock_file.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// A started successor process. Destroying one that was not Release()d kills and reaps it.
class Successor {
 public:
  virtual ~Successor() = default;
  virtual pid_t pid() const = 0;
  // It serves now: it outlives us, and is never signalled or reaped by us.
  virtual void Release() = 0;
};

// Starts `binary` as the successor with `channel` as its fd 3 (DaemonOptions::start_successor;
// `serve` implements it with the project's spawner).
using StartSuccessor =
    std::function<Result<std::unique_ptr<Successor>>(const std::string& binary, int channel)>;

// The fd number the successor finds its end of the channel at (`serve --handover-fd`).
inline constexpr int kHandoverChannelFd = 3;
// The fd number the successor finds the old daemon's metrics listener at (`serve
// --metrics-fd`, docs/metrics.md): not part of the Handover frame, since the listener is the
// CLI's, not the cache's; it is inherited at the successor's start instead.
inline constexpr int kMetricsListenerFd = 4;

// Old side: the Handover frame for `store` and the lock, sent on `channel` by `deadline`.
Status SendHandover(int channel, const identity::CacheConfig& config, const WeightStore& store,
                    int lock_fd, std::chrono::milliseconds timeout);

// What a successor took over, validated.
struct TakenOver {
  os::LockFile lock;
  WeightStore store;
  int64_t predecessor_pid = 0;
  std::string verified;  // DescribeVerified's: "64 of 291 tensors verified"
};

// Successor side: reads the Handover on `channel` (by `timeout`) and validates it (the rules
// above). An error names the step; the caller sends it back (RefuseHandover) and exits.
// `model_path` is empty for a published cache (no checkpoint to re-check). `gpu` is required
// for a gpu-tier cache.
Result<TakenOver> ReceiveHandover(int channel, const identity::CachePaths& paths,
                                  const identity::CacheConfig& config,
                                  const std::string& model_path, const KeeperLinkOptions& verify,
                                  const GpuAdoptContext* gpu, std::chrono::milliseconds timeout);

// Successor side: HandoverDone once serving, or the refusal.
Status ConfirmHandover(int channel);
void RefuseHandover(int channel, const Status& why);

}  // namespace weightcache::daemon
