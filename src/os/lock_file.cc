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

// Whether `path` still names the inode open at `fd`: false once the holder of the lock
// unlinked it (RemoveIfUnlocked) or replaced it, after we had opened it.
Result<bool> StillNamed(int fd, const std::string& path) {
  struct stat open_file {};
  struct stat named {};
  if (::fstat(fd, &open_file) != 0) return IoError("fstat lock file " + path, errno);
  if (::lstat(path.c_str(), &named) != 0) {
    if (errno == ENOENT) return false;
    return IoError("lstat lock file " + path, errno);
  }
  return open_file.st_dev == named.st_dev && open_file.st_ino == named.st_ino;
}

UniqueFd OpenLockFile(const std::string& path) {
  return UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
}

// How often an acquirer reopens a lock file that was unlinked under it before it gives up: each
// round means another process took and removed the lock meanwhile, which a stale-file sweep
// does once per identity.
constexpr int kReopenLimit = 100;

}  // namespace

Result<LockFile> LockFile::TryAcquire(const std::string& path) {
  UniqueFd fd = OpenLockFile(path);
  if (!fd) return IoError("open lock file " + path, errno);
  const auto give_up_at = Clock::now() + kOwnerPidWait;
  int reopened = 0;
  while (true) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(bool taken, TrySetLock(fd.get(), path));
    if (taken) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(bool named, StillNamed(fd.get(), path));
      if (named) break;
      // Locked an inode its former holder had unlinked (RemoveIfUnlocked): not the lock of
      // `path` any more. Open the file that `path` names now (creating it) and try again.
      if (++reopened > kReopenLimit) {
        return IoError("lock file " + path + " was removed under us " +
                           std::to_string(kReopenLimit) + " times in a row",
                       ESTALE);
      }
      fd = OpenLockFile(path);
      if (!fd) return IoError("open lock file " + path, errno);
      continue;
    }
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

Result<RemovedUnderLock> RemoveIfUnlocked(const std::string& lock_path,
                                          const std::vector<std::string>& guarded) {
  RemovedUnderLock result;
  for (int attempt = 0;; ++attempt) {
    struct stat st {};
    const bool existed = ::lstat(lock_path.c_str(), &st) == 0;  // else we create it here
    UniqueFd fd = OpenLockFile(lock_path);
    // No such directory (a cache that never started): nothing of it can be there.
    if (!fd && errno == ENOENT) return result;
    if (!fd) return IoError("open lock file " + lock_path, errno);
    WEIGHTCACHE_ASSIGN_OR_RETURN(bool taken, TrySetLock(fd.get(), lock_path));
    if (!taken) {
      result.held = true;
      return result;
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(bool named, StillNamed(fd.get(), lock_path));
    if (!named) {
      // Another remover unlinked it between our open and our lock: look again.
      if (attempt >= kReopenLimit) {
        return IoError("lock file " + lock_path + " keeps being removed", ESTALE);
      }
      continue;
    }
    // Ours now. A daemon that opened this file meanwhile waits for a recorded pid: leave none.
    if (::ftruncate(fd.get(), 0) != 0) return IoError("truncate lock file " + lock_path, errno);
    for (const std::string& path : guarded) {
      if (::unlink(path.c_str()) == 0) {
        result.removed.push_back(path);
      } else if (errno != ENOENT) {
        return IoError("removing " + path + " (its lock " + lock_path + " is ours)", errno);
      }
    }
    // The lock file last, still holding it (TryAcquire's StillNamed makes that safe).
    if (::unlink(lock_path.c_str()) != 0 && errno != ENOENT) {
      return IoError("removing lock file " + lock_path, errno);
    }
    if (existed) result.removed.push_back(lock_path);
    return result;  // closing fd releases the lock on the unlinked inode
  }
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
