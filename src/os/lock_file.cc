#include "os/lock_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <thread>

namespace weightcache::os {
namespace {

using Clock = std::chrono::steady_clock;

struct flock WholeFile(short type) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = 0;
  lock.l_len = 0;  // to the end, however the file grows
  lock.l_pid = 0;  // must be 0 for the OFD commands
  return lock;
}

// F_OFD_SETLK: true when taken, false on contention, an error otherwise.
Result<bool> TrySetLock(int fd, const std::string& path) {
  while (true) {
    struct flock lock = WholeFile(F_WRLCK);
    if (::fcntl(fd, F_OFD_SETLK, &lock) == 0) return true;
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EACCES) return false;
    return IoError("fcntl(F_OFD_SETLK) on lock file " + path, err);
  }
}

// Whether `pid` names a live process (EPERM: it lives, under another uid).
bool Alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// We own the lock: record our pid. The file may hold a former owner's pid, so truncate first.
// 0644 whatever mode an older file had (best effort: only its owner may change it).
Status RecordOwner(int fd, const std::string& path) {
  (void)::fchmod(fd, 0644);
  std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0) return IoError("truncate lock file " + path, errno);
  if (::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return IoError("write pid into lock file " + path, errno);
  }
  return Status::Ok();
}

}  // namespace

Result<LockFile> LockFile::TryAcquire(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) return IoError("open lock file " + path, errno);
  const auto give_up_at = Clock::now() + kOwnerPidWait;
  while (true) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(bool taken, TrySetLock(fd.get(), path));
    if (taken) break;
    // Held by another open file description. Its owner records its pid right after taking
    // the lock; until then the file is empty or names a former owner that is gone.
    std::optional<pid_t> owner = ReadLockOwner(path);
    const bool named = owner && Alive(*owner);
    if (named || Clock::now() >= give_up_at) {
      return Status(StatusCode::kAlreadyServed,
                    "lock " + path + " is held by " +
                        (named ? "pid " + std::to_string(*owner)
                               : std::string("another process (it recorded no live pid within " +
                                             std::to_string(kOwnerPidWait.count()) + " ms)")) +
                        ": another daemon already serves this identity");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // The owner may also have exited meanwhile: the next TrySetLock then takes the lock.
  }
  WEIGHTCACHE_RETURN_IF_ERROR(RecordOwner(fd.get(), path));
  return LockFile(std::move(fd), path);
}

Result<LockFile> LockFile::Adopt(UniqueFd fd, const std::string& path) {
  struct stat given {};
  struct stat named {};
  if (::fstat(fd.get(), &given) != 0) return IoError("fstat of the lock fd for " + path, errno);
  if (::lstat(path.c_str(), &named) != 0) return IoError("lstat lock file " + path, errno);
  if (!S_ISREG(given.st_mode) || given.st_dev != named.st_dev || given.st_ino != named.st_ino) {
    return ProtocolError("the lock fd handed over is not lock file " + path);
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(bool taken, TrySetLock(fd.get(), path));
  if (!taken) {
    return Status(StatusCode::kAlreadyServed,
                  "the lock fd handed over does not hold lock " + path + " (another does)");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(RecordOwner(fd.get(), path));
  return LockFile(std::move(fd), path);
}

bool IsLockHeld(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) return false;
  struct flock lock = WholeFile(F_WRLCK);
  while (::fcntl(fd.get(), F_OFD_GETLK, &lock) != 0) {
    if (errno != EINTR) return false;
  }
  return lock.l_type != F_UNLCK;
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
