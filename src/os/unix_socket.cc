#include "os/unix_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "os/regular_file.h"

namespace weightcache::os {
namespace {

Result<sockaddr_un> MakeAddress(const std::string& path) {
  if (path.empty()) return InvalidArgument("empty unix socket path");
  if (path.size() > kMaxUnixPathLength) {
    return InvalidArgument("unix socket path " + path + " is " + std::to_string(path.size()) +
                           " bytes, over the " + std::to_string(kMaxUnixPathLength) +
                           "-byte sun_path limit");
  }
  if (path.find('\0') != std::string::npos) {
    return InvalidArgument("unix socket path contains a NUL byte");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

int SocketTypeFlags(Blocking blocking) {
  return SOCK_STREAM | SOCK_CLOEXEC | (blocking == Blocking::kNonBlocking ? SOCK_NONBLOCK : 0);
}

// "<dir>/.<pid>.<n>.tmp": at most 1+7+1+10+4 = 23 bytes of basename. The final basename of a
// cache socket is "<16 hex>.sock" (21 bytes), so a final path that fits almost always gives a
// temporary path that fits too; when it does not, the length check names the temporary.
std::string TemporaryName(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
  return dir + "." + std::to_string(::getpid()) + "." + std::to_string(counter++) + ".tmp";
}

}  // namespace

Result<UniqueFd> ListenUnix(const std::string& path, mode_t mode, Blocking blocking, int backlog) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(sockaddr_un final_addr, MakeAddress(path));
  (void)final_addr;  // validated only: the bind goes to the temporary name

  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) {
    // A runtime condition (exit 1), not a usage error: the flags were fine, the path is taken.
    return Status(StatusCode::kIo, path + " exists and is not a socket (a " +
                                       std::string(FileTypeName(st.st_mode)) +
                                       "); refusing to replace it: remove it, or choose another "
                                       "socket path");
  }

  std::string temp = TemporaryName(path);
  WEIGHTCACHE_ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddress(temp));
  UniqueFd fd(::socket(AF_UNIX, SocketTypeFlags(blocking), 0));
  if (!fd) return IoError("socket(AF_UNIX) for " + path, errno);

  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return IoError("bind " + temp, errno);
  }
  // From here the temporary node exists; remove it on every failure path.
  auto fail = [&](std::string what, int err) {
    ::unlink(temp.c_str());
    return IoError(std::move(what), err);
  };
  // fchmod on a socket fd does not change the filesystem node, so chmod the path. It is still
  // private under its temporary name, so there is no window with a wider mode at `path`.
  if (::chmod(temp.c_str(), mode) != 0) return fail("chmod " + temp, errno);
  if (::listen(fd.get(), backlog) != 0) return fail("listen " + temp, errno);
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    return fail("rename " + temp + " -> " + path, errno);
  }
  return fd;
}

Result<UniqueFd> ConnectUnix(const std::string& path, std::chrono::milliseconds timeout) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddress(path));
  Deadline deadline = Deadline::After(timeout);
  UniqueFd fd(::socket(AF_UNIX, SocketTypeFlags(Blocking::kNonBlocking), 0));
  if (!fd) return IoError("socket(AF_UNIX) for " + path, errno);
  while (true) {
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
      return fd;
    }
    int err = errno;
    if (err == EINTR) continue;
    // A non-blocking AF_UNIX connect fails with EAGAIN while the listener's backlog is full;
    // it never returns EINPROGRESS. Retry briefly until the deadline.
    if (err == EAGAIN) {
      if (deadline.Expired()) {
        return Status(StatusCode::kTimeout, "connect " + path +
                                                ": listener backlog stayed full for " +
                                                std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    return IoError("connect " + path, err);
  }
}

Result<UnixListenerProbe> ProbeUnixListener(const std::string& path,
                                            std::chrono::milliseconds timeout) {
  using State = UnixListenerProbe::State;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return UnixListenerProbe{State::kAbsent, 0};
    return IoError("lstat " + path, errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return InvalidArgument("refusing to replace " + path + ": it exists and is not a socket");
  }
  auto conn = ConnectUnix(path, timeout);
  if (conn.ok()) {
    auto cred = PeerCredentials(conn->get());
    return UnixListenerProbe{State::kLive, cred.ok() ? cred->pid : 0};
  }
  if (conn.status().code() == StatusCode::kTimeout) return UnixListenerProbe{State::kLive, 0};
  if (conn.status().code() == StatusCode::kNotFound) return UnixListenerProbe{State::kAbsent, 0};
  if (conn.status().sys_errno() == ECONNREFUSED) return UnixListenerProbe{State::kStale, 0};
  return conn.status();
}

Result<std::optional<UniqueFd>> AcceptConnection(int listen_fd, Blocking blocking, SysCalls& sys) {
  int flags = SOCK_CLOEXEC | (blocking == Blocking::kNonBlocking ? SOCK_NONBLOCK : 0);
  while (true) {
    int fd = sys.Accept4(listen_fd, nullptr, nullptr, flags);
    if (fd >= 0) return std::optional<UniqueFd>(UniqueFd(fd));
    int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return std::optional<UniqueFd>();
    return IoError("accept on listening fd " + std::to_string(listen_fd), err);
  }
}

Result<PeerCred> PeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return IoError("getsockopt(SO_PEERCRED) on fd " + std::to_string(fd), errno);
  }
  return PeerCred{cred.pid, cred.uid, cred.gid};
}

Result<SocketPairFds> SocketPair(Blocking blocking) {
  int fds[2];
  if (::socketpair(AF_UNIX, SocketTypeFlags(blocking), 0, fds) != 0) {
    return IoError("socketpair(AF_UNIX)", errno);
  }
  return SocketPairFds{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

Result<SocketPairFds> DatagramPair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return IoError("socketpair(AF_UNIX, SOCK_DGRAM)", errno);
  }
  return SocketPairFds{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

}  // namespace weightcache::os
