// LockFile — the identity lock of a daemon (docs/design.md "Lock and readiness").
//
// Contract:
//  * The lock is an open-file-description (OFD) write lock on the whole file (fcntl
//    F_OFD_SETLK), not flock: a probe (IsLockHeld) asks with F_OFD_GETLK, which never takes
//    the lock, so a daemon starting while `ls`, `stop`, the launcher or a client probes can
//    never lose its own lock to the probe. (flock has no "test" operation; the probe had to
//    take a shared lock for an instant, and a daemon starting in that instant exited 7.)
//    OFD locks and flock do not see each other: every weightcache of one host must use the
//    same kind (any build from this one on does).
//  * TryAcquire opens (creating, O_CLOEXEC | O_NOFOLLOW) and takes the lock, non-blocking.
//    On success it records our pid in the file ("<pid>\n"; mode 0644, so that allowed users
//    of a shared daemon can probe it too) so that a loser can name the owner. On contention it
//    returns kAlreadyServed naming the owner's pid: F_OFD_GETLK reports no pid for OFD locks,
//    so the loser reads the pid the owner recorded, retrying for up to kOwnerPidWait while
//    the file is empty (the owner took the lock but has not written yet) or still names a
//    process that is gone (a crashed former owner's pid, before the new owner rewrote it).
//    A lock that became free meanwhile is retried. Only when the owner never records a live
//    pid in time does the message say "another process".
//  * The lock lives exactly as long as the LockFile (the kernel drops it when the last fd of
//    the open file description closes, also when the process dies: there is no stale lock).
//  * A lock file is unlinked only by the holder of its lock (RemoveIfUnlocked: the stale files
//    of a dead daemon, and then its lock file). An acquirer may have opened the inode just
//    before the unlink and take the lock on it once it is released: TryAcquire therefore checks,
//    after taking the lock, that `path` still names the inode it locked (same device and
//    inode), and otherwise opens `path` again and retries. So two processes never hold "the"
//    lock of one path through two inodes.
//  * IsLockHeld reports "held" for a lock held through any other open file description,
//    this process's own LockFiles included (OFD locks conflict between descriptions).
//  * Move-only. Thread-safe: no shared state.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::os {

// How long a loser waits for the owner to record its pid before naming "another process".
inline constexpr std::chrono::milliseconds kOwnerPidWait{2000};

class LockFile {
 public:
  static Result<LockFile> TryAcquire(const std::string& path);
  // Takes over a lock another process passed us (an upgrade's handover, docs/upgrade.md):
  // `fd` must be an open file description of `path` (same device and inode: kProtocol
  // otherwise) that holds the lock (F_OFD_SETLK on it succeeds: the description that holds a
  // lock may take it again; kAlreadyServed when another one holds it). Records our pid. The
  // lock is then shared with the sender until it closes its fd, which it does by exiting.
  static Result<LockFile> Adopt(UniqueFd fd, const std::string& path);

  LockFile(LockFile&&) noexcept = default;
  LockFile& operator=(LockFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }

 private:
  LockFile(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// True if some open file description holds the lock on `path`; false if not or the file does
// not exist (a socket whose lock is not held is stale). Never takes the lock.
bool IsLockHeld(const std::string& path);

// The pid recorded in a lock file, if it parses as one.
std::optional<pid_t> ReadLockOwner(const std::string& path);

// What RemoveIfUnlocked did.
struct RemovedUnderLock {
  bool held = false;  // another open file description holds the lock: nothing removed
  std::vector<std::string> removed;  // those of `guarded` that existed, then `lock_path` if it did
};

// The only way a lock file and the files it guards (a dead daemon's socket, a dead keeper's
// socket) are removed: takes the lock at `lock_path` without waiting (creating the file when
// it is absent, so that nobody can take it meanwhile), and only while holding it unlinks each
// of `guarded` (ENOENT is not an error), then `lock_path` itself, then releases the lock. A
// lock held by anyone else (a live daemon, or a daemon starting right now) removes nothing:
// `held`. A lock whose directory does not exist guards nothing: nothing is removed or created.
// No pid is recorded: the file is emptied, so a daemon that waits for this lock
// meanwhile waits for an owner's pid (kOwnerPidWait) and then retries on a new file.
Result<RemovedUnderLock> RemoveIfUnlocked(const std::string& lock_path,
                                          const std::vector<std::string>& guarded);

}  // namespace weightcache::os
