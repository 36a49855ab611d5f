// The two ends of `serve`'s upgrade (docs/upgrade.md), as a serving process composes them:
// starting the successor of an Upgrade, and, in that successor, taking the cache over. The
// handover protocol itself is daemon/upgrade.h.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "daemon/daemon.h"
#include "daemon/upgrade.h"
#include "identity/resolve.h"
#include "weightcache/status.h"

namespace weightcache::serve {

// The successor of an Upgrade: `binary` run with our own `command_line` (argv, [0] is ours
// and replaced by `binary`), minus any --handover-fd and --metrics-fd of our own, plus the
// handover `channel` and, when we serve metrics (`metrics_listener` >= 0), our metrics
// listener (docs/metrics.md "Upgrade"); in our session, with our standard streams, so that its
// log lines go where ours went.
Result<std::unique_ptr<daemon::Successor>> StartSuccessor(std::span<const std::string> command_line,
                                                          const std::string& binary, int channel,
                                                          int metrics_listener);

// An upgrade's successor: receive and validate the handover on `handover_fd` (taken: closed
// on return), publish the socket over the old daemon's, confirm. Any failure goes back to the
// old daemon (which serves on) and is ours. `predecessor_pid`: the old daemon's pid, once
// taken over.
Result<std::unique_ptr<daemon::Daemon>> TakeOver(int handover_fd,
                                                 const identity::ResolvedIdentity& id,
                                                 const daemon::DaemonOptions& options,
                                                 int64_t* predecessor_pid);

}  // namespace weightcache::serve
