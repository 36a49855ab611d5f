// Unix-domain stream sockets: listen (atomic publish), connect, accept, peer credentials.
//
// Contract:
//  * Every socket is created SOCK_CLOEXEC and returned in a UniqueFd that the caller owns.
//  * ListenUnix publishes atomically (docs/design.md "Lock and readiness"): it binds under a
//    temporary name in the same directory, chmods that node to `mode`, listens, and only then
//    renames it onto `path`.
//    A client therefore never sees the final name with a wider mode or without a listener.
//    rename(2) replaces a stale socket left by a dead daemon; the caller must hold the
//    identity lock (LockFile) first, so the replaced socket cannot belong to a live daemon.
//    ListenUnix refuses to replace anything that is not a socket (kIo, a runtime condition,
//    naming the path and what is there). The socket file outlives
//    the fd: the caller unlinks `path` on clean shutdown (a crash leaves it stale, which the
//    lock makes detectable).
//  * Paths longer than kMaxUnixPathLength are rejected before any syscall, naming the path
//    and the limit.
//  * Thread-safe: no shared state (the temporary-name counter is atomic).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

#include "common/unique_fd.h"
#include "os/syscalls.h"
#include "weightcache/status.h"

namespace weightcache::os {

// sizeof(sockaddr_un::sun_path) is 108 and the kernel wants room for the terminating NUL.
inline constexpr size_t kMaxUnixPathLength = 107;

enum class Blocking { kBlocking, kNonBlocking };

// Binds, chmods, listens and renames into place (see the contract above).
Result<UniqueFd> ListenUnix(const std::string& path, mode_t mode = 0600,
                            Blocking blocking = Blocking::kNonBlocking, int backlog = 128);

// Connects to `path`, retrying while the listener's backlog is full until `timeout`.
// The returned socket is non-blocking: the message helpers (fd_passing.h) poll with their
// own deadlines. Errors keep the errno so callers can tell "absent" (ENOENT, kNotFound) and
// "stale, nobody listening" (ECONNREFUSED, kIo) from the rest; kTimeout when the backlog
// stayed full.
Result<UniqueFd> ConnectUnix(const std::string& path, std::chrono::milliseconds timeout);

// Who listens at a Unix socket path (the rule for an address that no lock guards, such as
// `serve --metrics-addr PATH`): nothing there (kAbsent), a socket node whose connect is
// refused (kStale: its listener is gone, e.g. killed with -9), or a live listener (kLive, with
// the pid that created it from SO_PEERCRED; a backlog that stays full for `timeout` counts as
// live, pid 0). A node that is not a socket is kInvalidArgument, as ListenUnix refuses it. The
// probe connection is closed at once: a daemon's socket sees a client that left.
struct UnixListenerProbe {
  enum class State { kAbsent, kStale, kLive };
  State state = State::kAbsent;
  pid_t pid = 0;  // kLive only, 0 when not known
};
Result<UnixListenerProbe> ProbeUnixListener(const std::string& path,
                                            std::chrono::milliseconds timeout);

// Accepts one pending connection. std::nullopt means none is pending (EAGAIN on a
// non-blocking listener) — distinct from an error. EINTR and ECONNABORTED are retried.
Result<std::optional<UniqueFd>> AcceptConnection(int listen_fd,
                                                 Blocking blocking = Blocking::kNonBlocking,
                                                 SysCalls& sys = SysCalls::Default());

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// SO_PEERCRED: the credentials of the process that connected (or created the pair).
Result<PeerCred> PeerCredentials(int fd);

struct SocketPairFds {
  UniqueFd first;
  UniqueFd second;
};

// A connected AF_UNIX stream pair (tests; in-process channels).
Result<SocketPairFds> SocketPair(Blocking blocking = Blocking::kBlocking);
// A connected AF_UNIX datagram pair, close-on-exec (the launcher's ready notice).
Result<SocketPairFds> DatagramPair();

}  // namespace weightcache::os
