// ReadyNotice — a daemon's "look now" to the launcher that spawned it, sent the moment it
// serves or fails, so the launcher probes at once instead of at its next poll (issue 39: a
// probe every 100 ms into a long load added up to 100 ms to what `serve --detach`, `launch`
// and their supervisors saw).
//
// Wire: the launcher makes one AF_UNIX SOCK_DGRAM socketpair per spawn, keeps one end in its
// epoll set and passes the other as fd kReadyNoticeFd, named by the variable kReadyNoticeEnv
// ("WEIGHTCACHE_READY_NOTICE_FD=5") in the child's environment. The daemon sends one datagram
// ("r") at ready and one ("f") at failure. Their content is never trusted: a datagram only
// makes the launcher probe the daemon's socket now, and the probe's answer is what counts. A
// daemon that never sends one (an older binary, any program the launcher runs) is found by
// the probes as before.
//
// Contract:
//  * ReadyNotice::Take() runs before the process starts any thread (it edits the
//    environment): it removes the variable and marks the fd close-on-exec, so the daemon's
//    own children (its keeper, an upgrade's successor) get neither.
//  * Send() never blocks and never raises SIGPIPE; a launcher that has gone (or stopped
//    reading) is no error of the daemon's.
//  * DrainReadyNotices() reads the launcher's end empty without blocking: false only when
//    the socket failed (close it). A daemon that exits raises no event on a datagram pair;
//    its end is closed with the next spawn or the launcher.
#pragma once

#include <optional>
#include <string_view>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::launcher {

inline constexpr int kReadyNoticeFd = 5;  // after the upgrade's handover (3) and metrics (4)
inline constexpr char kReadyNoticeEnv[] = "WEIGHTCACHE_READY_NOTICE_FD";

// Both ends of a new notice channel, close-on-exec: the launcher's and the child's.
struct ReadyNoticeChannel {
  UniqueFd launcher_end;
  UniqueFd daemon_end;
};
Result<ReadyNoticeChannel> MakeReadyNoticeChannel();

// Reads every pending datagram off the launcher's end.
bool DrainReadyNotices(int launcher_end);

class ReadyNotice {
 public:
  // The end kReadyNoticeEnv names, taken; std::nullopt when the variable is unset or empty
  // (not spawned by a launcher). An error when it names no open datagram socket: the value
  // is not a number, or the fd is closed, a file, a pipe or a stream socket.
  static Result<std::optional<ReadyNotice>> Take();

  enum class What : char { kReady = 'r', kFailed = 'f' };
  void Send(What what) const;

  int fd() const { return fd_.get(); }

 private:
  explicit ReadyNotice(UniqueFd fd) : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

}  // namespace weightcache::launcher
