#include "launcher/ready_notice.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <string>

#include "os/unix_socket.h"

namespace weightcache::launcher {

Result<ReadyNoticeChannel> MakeReadyNoticeChannel() {
  auto pair = os::DatagramPair();
  if (!pair.ok()) {
    Status s = pair.status();
    return s.Context("a daemon's ready notice");
  }
  return ReadyNoticeChannel{std::move(pair->first), std::move(pair->second)};
}

bool DrainReadyNotices(int launcher_end) {
  char byte[16];
  while (true) {
    const ssize_t n = ::recv(launcher_end, byte, sizeof(byte), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    // EAGAIN: read empty. 0 is an empty datagram (a datagram socket has no end-of-file, and
    // a peer that exits raises no event); anything else is a failed socket.
    return n == 0 || errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

Result<std::optional<ReadyNotice>> ReadyNotice::Take() {
  const char* value = std::getenv(kReadyNoticeEnv);
  if (value == nullptr || *value == '\0') return std::optional<ReadyNotice>();
  const std::string text = value;
  ::unsetenv(kReadyNoticeEnv);
  const std::string what = std::string(kReadyNoticeEnv) + "=" + text;
  int fd = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), fd);
  if (ec != std::errc() || end != text.data() + text.size() || fd < 0) {
    return InvalidArgument(what + ": not a file descriptor number");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError(what + ": fstat", errno);
  int type = 0;
  socklen_t len = sizeof(type);
  if (!S_ISSOCK(st.st_mode) || ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
      type != SOCK_DGRAM) {
    return InvalidArgument(what + ": fd " + text +
                           " is not a datagram socket (the launcher passes one; see "
                           "docs/launcher.md \"Readiness\")");
  }
  if (::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) return IoError(what + ": FD_CLOEXEC", errno);
  return std::optional<ReadyNotice>(ReadyNotice(UniqueFd(fd)));
}

void ReadyNotice::Send(What what) const {
  const char byte = static_cast<char>(what);
  // MSG_DONTWAIT: a launcher that stopped reading fills the queue, and we must not wait on it;
  // MSG_NOSIGNAL: one that has gone is ECONNREFUSED here, not a SIGPIPE.
  while (::send(fd_.get(), &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

}  // namespace weightcache::launcher
