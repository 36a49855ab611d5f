// LockFile — the identity lock of a daemon (SPEC §2: ownership).
//
// Contract:
//  * TryAcquire opens (creating, mode 0600, O_CLOEXEC | O_NOFOLLOW) and takes an exclusive,
//    non-blocking flock. On success it writes our pid into the file so that a second daemon
//    can name the owner; on contention it returns kAlreadyServed naming the owner's pid. The
//    lock lives exactly as long as the LockFile (the kernel drops it when the fd closes, also
//    when the process dies: there is no stale lock to clean up).
//  * The file itself is never unlinked: unlinking a lock file races with a new acquirer that
//    opened the old inode. Only the flock state matters, never the file's existence.
//  * IsLockHeld tries a shared lock and releases it at once. flock locks belong to the open
//    file description, so it reports "held" even for a lock held by this same process
//    through another LockFile.
//  * Move-only. Thread-safe: no shared state.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::os {

class LockFile {
 public:
  static Result<LockFile> TryAcquire(const std::string& path);

  LockFile(LockFile&&) noexcept = default;
  LockFile& operator=(LockFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }

 private:
  LockFile(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// True if some open file description holds a flock on `path`; false if not or the file does
// not exist (a socket whose lock is not held is stale).
bool IsLockHeld(const std::string& path);

// The pid recorded in a lock file, if it parses as one.
std::optional<pid_t> ReadLockOwner(const std::string& path);

}  // namespace weightcache::os
