#include "os/ledger_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <utility>

namespace weightcache::os {
namespace {

// Removes the temp and reports `what` failing with `err`.
Status FailWrite(const std::string& tmp, const std::string& what, int err) {
  ::unlink(tmp.c_str());
  return IoError(what, err);
}

// An exclusive OFD lock on the whole file with `command` (F_OFD_SETLKW waits, F_OFD_SETLK
// does not): 0, or the errno.
int LockWholeFile(int fd, int command) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = 0;
  lock.l_len = 0;  // the whole file
  lock.l_pid = 0;  // must be 0 for the OFD commands
  return ::fcntl(fd, command, &lock) == 0 ? 0 : errno;
}

}  // namespace

Result<ExclusiveFileLock> ExclusiveFileLock::Acquire(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return IoError("open lock file " + path, errno);
  while (true) {
    const int err = LockWholeFile(fd.get(), F_OFD_SETLKW);
    if (err == 0) break;
    if (err == EINTR) continue;
    return IoError("fcntl(F_OFD_SETLKW) on lock file " + path, err);
  }
  return ExclusiveFileLock(std::move(fd), path);
}

Result<ExclusiveFileLock> ExclusiveFileLock::AcquireUntil(
    const std::string& path, std::chrono::steady_clock::time_point deadline) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return IoError("open lock file " + path, errno);
  // No blocking wait has a deadline (F_OFD_SETLKW sleeps until the holder lets go): poll the
  // non-blocking command, backing off from 1 ms to 50 ms.
  std::chrono::milliseconds pause{1};
  while (true) {
    const int err = LockWholeFile(fd.get(), F_OFD_SETLK);
    if (err == 0) break;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EACCES) {
      return IoError("fcntl(F_OFD_SETLK) on lock file " + path, err);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return Status(StatusCode::kTimeout,
                    "lock file " + path + " is held by another process (hung, or a slow disk)");
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return ExclusiveFileLock(std::move(fd), path);
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string tmp = path + ".tmp";
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return IoError("create " + tmp, errno);
  size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n = ::write(fd.get(), contents.data() + written, contents.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return FailWrite(tmp, "write " + tmp, n < 0 ? errno : EIO);
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return FailWrite(tmp, "fsync " + tmp, errno);
  fd.Reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return FailWrite(tmp, "rename " + tmp + " to " + path, errno);
  }
  return Status::Ok();
}

}  // namespace weightcache::os
