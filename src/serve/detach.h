// `serve --detach` as a library call (docs/daemon.md "Detached"): the serving command line, less
// --detach, runs as a daemon in a new session (stdin /dev/null, stdout and stderr to its log),
// spawned and polled by the launcher, the one home of both. Done when the daemon answers
// `ready`, or `awaiting` for a published source (it can take its publisher then); the daemon
// is left running. A daemon that exits first ends the detach with its own exit code (7 already
// served, 5 invalid checkpoint, ...); one that does not answer within the ready timeout is
// stopped (kTimeout). The CLI prints the result (tools/cmd_serve.cc).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "identity/resolve.h"
#include "launcher/launcher.h"
#include "weightcache/status.h"

namespace weightcache::serve {

struct DetachOptions {
  // The serving command line, executable first; every "--detach" is left out of the daemon's.
  std::vector<std::string> argv;
  // The daemon's log; "" = <runtime>/<namespace>/logs/serve-<digest16>.log (launch's log
  // dir), or <socket>.log beside an explicit socket.
  std::string log_file;
  std::chrono::milliseconds ready_timeout{600'000};
};

struct Detached {
  launcher::LaunchReport report;  // the one daemon: its socket, pid, log, state
  // The process's exit code: 0 serving; else the daemon's own exit code when it exited with
  // one (report.status then carries that code's status), or the code of report.status.
  int exit_code = 0;
};

// The daemon's log path for `options.log_file` and this identity (its dirs created private).
Result<std::string> DetachedLogPath(const std::string& log_file,
                                    const identity::ResolvedIdentity& identity);

// Starts the detached daemon of `identity` and waits for it as above; a stop signal on
// `signal_fd` stops it. Errors before the spawn (the log path, the executable) are returned.
Result<Detached> Detach(const DetachOptions& options, const identity::ResolvedIdentity& identity,
                        int signal_fd);

}  // namespace weightcache::serve
