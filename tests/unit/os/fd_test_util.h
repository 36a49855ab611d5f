// Helpers shared by the os and protocol unit tests: fd counting and fault-injecting SysCalls.
#pragma once

#include <dirent.h>
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/unique_fd.h"
#include "os/memfd.h"
#include "os/syscalls.h"

namespace weightcache::testing {

// Open fds of this process, from /proc/self/fd (minus the directory's own fd).
inline int CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count - 1;
}

// A memfd holding `contents` (not sealed).
inline UniqueFd MemfdWith(const std::string& contents) {
  auto fd = os::CreateMemfd("test", contents.size());
  if (!fd.ok()) return UniqueFd();
  if (!contents.empty() && ::pwrite(fd->get(), contents.data(), contents.size(), 0) !=
                               static_cast<ssize_t>(contents.size())) {
    return UniqueFd();
  }
  return std::move(fd).value();
}

inline std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  off_t at = 0;
  while (true) {
    ssize_t n = ::pread(fd, buf, sizeof(buf), at);
    if (n <= 0) break;
    out.append(buf, n);
    at += n;
  }
  return out;
}

// Fault injection through the SysCalls seam: the first `eintr` calls of each kind fail with
// EINTR, the next `eagain` with EAGAIN; sends accept at most `max_send` bytes per call;
// receives offer the kernel at most `control_limit` bytes of control buffer.
class FaultySysCalls : public os::SysCalls {
 public:
  int send_eintr = 0;
  int send_eagain = 0;
  int recv_eintr = 0;
  int recv_eagain = 0;
  size_t max_send = SIZE_MAX;
  size_t max_recv = SIZE_MAX;
  size_t control_limit = SIZE_MAX;
  int send_calls = 0;
  int recv_calls = 0;

  ssize_t SendMsg(int fd, const msghdr* msg, int flags) override {
    ++send_calls;
    if (send_eintr > 0) return Fail(send_eintr, EINTR);
    if (send_eagain > 0) return Fail(send_eagain, EAGAIN);
    msghdr copy = *msg;
    iovec iov = msg->msg_iov[0];
    iov.iov_len = std::min(iov.iov_len, max_send);
    copy.msg_iov = &iov;
    return os::SysCalls::SendMsg(fd, &copy, flags);
  }
  ssize_t RecvMsg(int fd, msghdr* msg, int flags) override {
    ++recv_calls;
    if (recv_eintr > 0) return Fail(recv_eintr, EINTR);
    if (recv_eagain > 0) return Fail(recv_eagain, EAGAIN);
    iovec* original = msg->msg_iov;
    iovec iov = original[0];
    iov.iov_len = std::min(iov.iov_len, max_recv);
    msg->msg_iov = &iov;
    msg->msg_controllen = std::min<size_t>(msg->msg_controllen, control_limit);
    ssize_t n = os::SysCalls::RecvMsg(fd, msg, flags);
    msg->msg_iov = original;
    return n;
  }

 private:
  static ssize_t Fail(int& counter, int err) {
    --counter;
    errno = err;
    return -1;
  }
};

}  // namespace weightcache::testing
