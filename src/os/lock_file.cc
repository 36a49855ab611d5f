#include "os/lock_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>

namespace weightcache::os {

Result<LockFile> LockFile::TryAcquire(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return IoError("open lock file " + path, errno);
  while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    if (err == EINTR) continue;
    if (err == EWOULDBLOCK) {
      std::optional<pid_t> owner = ReadLockOwner(path);
      return Status(StatusCode::kAlreadyServed,
                    "lock " + path + " is held by " +
                        (owner ? "pid " + std::to_string(*owner) : std::string("another process")) +
                        ": another daemon already serves this identity");
    }
    return IoError("flock " + path, err);
  }
  // We own the lock: record our pid. The file may hold a dead owner's pid, so truncate first.
  std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd.get(), 0) != 0) return IoError("truncate lock file " + path, errno);
  if (::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return IoError("write pid into lock file " + path, errno);
  }
  return LockFile(std::move(fd), path);
}

bool IsLockHeld(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) return false;
  while (::flock(fd.get(), LOCK_SH | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    return errno == EWOULDBLOCK;
  }
  ::flock(fd.get(), LOCK_UN);
  return false;
}

std::optional<pid_t> ReadLockOwner(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) return std::nullopt;
  char buf[32];
  ssize_t n = ::pread(fd.get(), buf, sizeof(buf), 0);
  if (n <= 0) return std::nullopt;
  pid_t pid = 0;
  auto [end, ec] = std::from_chars(buf, buf + n, pid);
  if (ec != std::errc() || pid <= 0 || end == buf) return std::nullopt;
  return pid;
}

}  // namespace weightcache::os
