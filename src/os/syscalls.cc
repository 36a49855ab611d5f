#include "os/syscalls.h"

#include <sys/resource.h>

#include <cerrno>
#include <climits>

namespace weightcache::os {

ssize_t SysCalls::SendMsg(int fd, const msghdr* msg, int flags) {
  return ::sendmsg(fd, msg, flags);
}

ssize_t SysCalls::RecvMsg(int fd, msghdr* msg, int flags) { return ::recvmsg(fd, msg, flags); }

int SysCalls::Accept4(int fd, sockaddr* addr, socklen_t* addr_len, int flags) {
  return ::accept4(fd, addr, addr_len, flags);
}

int SysCalls::Poll(pollfd* fds, nfds_t count, int timeout_ms) {
  return ::poll(fds, count, timeout_ms);
}

SysCalls& SysCalls::Default() {
  static SysCalls real;
  return real;
}

Result<FdLimit> RaiseFdLimitToHard() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return IoError("getrlimit(RLIMIT_NOFILE)", errno);
  FdLimit out{limit.rlim_cur, limit.rlim_max, false};
  if (limit.rlim_cur >= limit.rlim_max) return out;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return IoError("setrlimit(RLIMIT_NOFILE, soft " + std::to_string(limit.rlim_max) + ")", errno);
  }
  out.soft = limit.rlim_max;
  out.raised = true;
  return out;
}

int Deadline::PollTimeoutMs() const {
  if (!at_) return -1;
  auto left = *at_ - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  // Round up so that a 0.3 ms remainder polls for 1 ms instead of spinning at 0.
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

}  // namespace weightcache::os
