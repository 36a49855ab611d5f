// SysCalls and Deadline — the seam under every socket operation of the daemon/client path.
//
// Contract:
//  * SysCalls is a table of the socket syscalls that carry protocol traffic (sendmsg,
//    recvmsg, accept4, poll). The base class IS the real implementation: each virtual calls
//    the libc function and returns its result with errno set exactly as the kernel left it.
//    Tests derive from it and override one function to inject EINTR, EAGAIN, short writes or
//    truncated control data, delegating to the base for everything else.
//  * SysCalls::Default() is a process-wide, stateless instance; it is thread-safe. A derived
//    fault injector is as thread-safe as its author makes it (the tests' ones are not).
//  * Deadline is a value type (a point on the steady clock, or "never").
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>

#include "weightcache/status.h"

namespace weightcache::os {

class SysCalls {
 public:
  virtual ~SysCalls() = default;

  virtual ssize_t SendMsg(int fd, const msghdr* msg, int flags);
  virtual ssize_t RecvMsg(int fd, msghdr* msg, int flags);
  virtual int Accept4(int fd, sockaddr* addr, socklen_t* addr_len, int flags);
  virtual int Poll(pollfd* fds, nfds_t count, int timeout_ms);

  // The real syscalls.
  static SysCalls& Default();
};

struct FdLimit {
  uint64_t soft = 0;
  uint64_t hard = 0;
  bool raised = false;  // the soft limit was below the hard one and now equals it
};

// Raises this process's soft RLIMIT_NOFILE to its hard limit (a daemon serves one fd per
// client; the default soft 1024 is a guess for select()-era programs). The limits after.
Result<FdLimit> RaiseFdLimitToHard();

// When a blocking-style operation must give up. Never() waits forever.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline Never() { return Deadline(std::nullopt); }
  static Deadline After(std::chrono::milliseconds timeout) {
    return Deadline(Clock::now() + timeout);
  }

  bool is_never() const { return !at_.has_value(); }
  bool Expired() const { return at_.has_value() && Clock::now() >= *at_; }
  // Milliseconds left, rounded up, for poll(2): -1 for never, 0 once expired.
  int PollTimeoutMs() const;

 private:
  explicit Deadline(std::optional<Clock::time_point> at) : at_(at) {}
  std::optional<Clock::time_point> at_;
};

}  // namespace weightcache::os
