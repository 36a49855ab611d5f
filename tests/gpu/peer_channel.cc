#include "gpu/peer_channel.h"

#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace weightcache::testing {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Word(uint64_t seed, uint64_t index, uint64_t word) {
  return SplitMix(seed * 0x100000001b3ull ^ (index << 48) ^ word);
}

constexpr size_t kMaxText = size_t{16} << 20;  // 10,000 legacy IPC handles in hex fit

}  // namespace

Status SendMessage(int sock, const std::string& text, const std::vector<int>& fds) {
  if (fds.size() > static_cast<size_t>(kMaxFds)) return InvalidArgument("too many fds");
  // Length-prefixed so a message is never split or merged on a stream socket.
  std::string frame = std::to_string(text.size()) + "\n" + text;
  iovec iov = {frame.data(), frame.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFds), 0);
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  if (n < 0) return IoError("sendmsg", errno);
  size_t sent = static_cast<size_t>(n);
  while (sent < frame.size()) {  // the rest without fds
    n = ::send(sock, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0) return IoError("send", errno);
    sent += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ReceiveMessage(int sock, std::string* text, std::vector<UniqueFd>* fds) {
  text->clear();
  fds->clear();
  std::string buf;
  size_t want = 0;
  bool have_len = false;
  while (!have_len || buf.size() < want) {
    char chunk[65536];
    iovec iov = {chunk, have_len ? std::min(sizeof(chunk), want - buf.size()) : 1};
    std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFds), 0);
    msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("recvmsg", errno);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds->emplace_back(fd);  // wrapped before anything else happens
        }
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) return ProtocolError("control data truncated");
    if (n == 0) return Status(StatusCode::kIo, "peer closed the channel (did it die?)");
    if (!have_len) {
      if (chunk[0] == '\n') {
        want = std::stoull(buf);
        if (want > kMaxText) return ProtocolError("message too long");
        buf.clear();
        have_len = true;
      } else {
        buf.push_back(chunk[0]);
      }
    } else {
      buf.append(chunk, static_cast<size_t>(n));
    }
  }
  *text = std::move(buf);
  return Status::Ok();
}

Result<Child> SpawnWithChannel(const std::vector<std::string>& argv) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return IoError("socketpair", errno);
  }
  UniqueFd ours(sv[0]);
  UniqueFd theirs(sv[1]);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return IoError("fork", errno);
  if (pid == 0) {
    // dup2 clears CLOEXEC on the target, so exactly this fd crosses the exec.
    if (::dup2(theirs.get(), kChildChannelFd) < 0) ::_exit(126);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return Child{pid, std::move(ours)};
}

int WaitChild(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

void FillPattern(uint64_t seed, uint64_t index, void* data, uint64_t size) {
  auto* bytes = static_cast<unsigned char*>(data);
  uint64_t words = size / 8;
  for (uint64_t w = 0; w < words; ++w) {
    uint64_t v = Word(seed, index, w);
    std::memcpy(bytes + w * 8, &v, 8);
  }
  uint64_t tail = Word(seed, index, words);
  std::memcpy(bytes + words * 8, &tail, size - words * 8);
}

int64_t FirstMismatch(uint64_t seed, uint64_t index, const void* data, uint64_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint64_t words = size / 8;
  for (uint64_t w = 0; w <= words; ++w) {
    uint64_t v = Word(seed, index, w);
    uint64_t n = w < words ? 8 : size - words * 8;
    if (std::memcmp(bytes + w * 8, &v, n) != 0) {
      for (uint64_t b = 0; b < n; ++b) {
        if (bytes[w * 8 + b] != reinterpret_cast<const unsigned char*>(&v)[b]) {
          return static_cast<int64_t>(w * 8 + b);
        }
      }
    }
  }
  return -1;
}

}  // namespace weightcache::testing
