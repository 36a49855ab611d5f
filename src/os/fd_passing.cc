#include "os/fd_passing.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace weightcache::os {
namespace {

constexpr size_t kControlCapacity = CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage);

std::string SocketName(int fd) { return "socket fd " + std::to_string(fd); }

// A peer that went away (EPIPE on send; ECONNRESET when it closed with our data unread) is
// kUnavailable like a clean close: callers treat "daemon gone" alike however it left.
Status SocketError(const char* call, int fd, int err) {
  if (err == EPIPE || err == ECONNRESET) {
    Status s(StatusCode::kUnavailable, std::string(call) + " on " + SocketName(fd) +
                                           ": peer closed the connection (" + std::strerror(err) +
                                           ")");
    s.WithErrno(err);
    return s;
  }
  return IoError(std::string(call) + " on " + SocketName(fd), err);
}

}  // namespace

Result<SendProgress> SendSome(int fd, std::span<const uint8_t> bytes, std::span<const int> fds,
                              SysCalls& sys) {
  if (fds.size() > kMaxFdsPerMessage) {
    return InvalidArgument("cannot send " + std::to_string(fds.size()) + " fds in one message (" +
                           "the kernel allows " + std::to_string(kMaxFdsPerMessage) + ")");
  }
  if (!fds.empty() && bytes.empty()) {
    return InvalidArgument("fds must ride on at least one data byte");
  }
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) unsigned char control[kControlCapacity];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    ssize_t n = sys.SendMsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return SendProgress{static_cast<size_t>(n), false};
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return SendProgress{0, true};
    return SocketError("sendmsg", fd, err);
  }
}

Result<RecvChunk> RecvSome(int fd, std::span<uint8_t> buffer, size_t max_fds, SysCalls& sys) {
  if (max_fds > kMaxFdsPerMessage) max_fds = kMaxFdsPerMessage;
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for at least one fd even when none is expected: an unexpected fd is then received,
  // closed and reported by name instead of only showing up as a truncation.
  alignas(cmsghdr) unsigned char control[kControlCapacity];
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * (max_fds == 0 ? 1 : max_fds));

  ssize_t n;
  while (true) {
    n = sys.RecvMsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n >= 0) break;
    int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      RecvChunk chunk;
      chunk.would_block = true;
      return chunk;
    }
    return SocketError("recvmsg", fd, err);
  }

  // Wrap every received fd first; only then judge the message.
  RecvChunk chunk;
  chunk.bytes = static_cast<size_t>(n);
  const unsigned char* control_end = control + msg.msg_controllen;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const unsigned char* data = CMSG_DATA(cmsg);
    const unsigned char* end = reinterpret_cast<const unsigned char*>(cmsg) + cmsg->cmsg_len;
    if (end > control_end) end = control_end;
    for (; data + sizeof(int) <= end; data += sizeof(int)) {
      int received;
      std::memcpy(&received, data, sizeof(int));
      chunk.fds.emplace_back(received);
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    return ProtocolError("control data truncated on " + SocketName(fd) +
                         ": the peer sent more fds than the " + std::to_string(max_fds) +
                         " allowed here (" + std::to_string(chunk.fds.size()) +
                         " that arrived were closed)");
  }
  if (chunk.fds.size() > max_fds) {
    return ProtocolError(std::to_string(chunk.fds.size()) + " unexpected fds on " + SocketName(fd) +
                         " (at most " + std::to_string(max_fds) + " allowed here); closed them");
  }
  if (n == 0 && !buffer.empty()) chunk.eof = true;
  return chunk;
}

Status WaitFor(int fd, short events, Deadline deadline, SysCalls& sys) {
  while (true) {
    pollfd p{fd, events, 0};
    int timeout = deadline.PollTimeoutMs();
    int r = sys.Poll(&p, 1, timeout);
    if (r > 0) return Status::Ok();
    if (r == 0) {
      if (deadline.Expired()) {
        return Status(StatusCode::kTimeout, "deadline passed waiting on " + SocketName(fd));
      }
      continue;
    }
    int err = errno;
    if (err == EINTR) continue;
    return IoError("poll on " + SocketName(fd), err);
  }
}

Status SendMessage(int fd, std::span<const uint8_t> bytes, std::span<const int> fds,
                   Deadline deadline, SysCalls& sys) {
  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < bytes.size()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        SendProgress p,
        SendSome(fd, bytes.subspan(sent), fds_sent ? std::span<const int>() : fds, sys));
    if (p.would_block) {
      Status s = WaitFor(fd, POLLOUT, deadline, sys);
      if (!s.ok()) {
        return s.Context("sending " + std::to_string(bytes.size()) + "-byte message (" +
                         std::to_string(sent) + " sent)");
      }
      continue;
    }
    if (p.bytes > 0) fds_sent = true;
    sent += p.bytes;
  }
  return Status::Ok();
}

Result<std::vector<UniqueFd>> RecvMessage(int fd, std::span<uint8_t> buffer, size_t max_fds,
                                          Deadline deadline, SysCalls& sys) {
  std::vector<UniqueFd> fds;
  size_t got = 0;
  while (got < buffer.size()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(RecvChunk chunk,
                                 RecvSome(fd, buffer.subspan(got), max_fds - fds.size(), sys));
    for (UniqueFd& f : chunk.fds) fds.push_back(std::move(f));
    if (chunk.would_block) {
      Status s = WaitFor(fd, POLLIN, deadline, sys);
      if (!s.ok()) {
        return s.Context("receiving " + std::to_string(buffer.size()) + "-byte message (" +
                         std::to_string(got) + " received)");
      }
      continue;
    }
    if (chunk.eof) {
      // Part-way or not, the peer went away: what it sent is cut short, not malformed.
      std::string where = got == 0
                              ? ""
                              : " after " + std::to_string(got) + " of " +
                                    std::to_string(buffer.size()) + " bytes (truncated message)";
      return Status(StatusCode::kUnavailable,
                    "peer closed the connection on " + SocketName(fd) + where);
    }
    got += chunk.bytes;
  }
  return fds;
}

}  // namespace weightcache::os
