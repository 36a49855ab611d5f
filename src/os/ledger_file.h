// The primitives of a small shared file that separate processes read and rewrite in turn (the
// device's budget ledger, docs/budget.md): a blocking OFD lock and an atomic replacement.
//
// Contract:
//  * ExclusiveFileLock::Acquire opens its lock file (creating 0600, O_CLOEXEC | O_NOFOLLOW)
//    and waits in fcntl(F_OFD_SETLKW) (EINTR retried) until the whole-file write lock is ours.
//    Nothing is written into the lock file and it is never unlinked (the reasoning of
//    os/lock_file.h: unlinking races with an acquirer that opened the old inode). The kernel
//    drops the lock when the object is destroyed or the process dies, so a holder killed in
//    its critical section never leaves the lock stuck. OFD locks conflict between open file
//    descriptions, so two threads of one process exclude each other too. Move-only.
//  * AcquireUntil is Acquire with a bound: it polls F_OFD_SETLK (non-blocking) with a short
//    sleep between tries, and gives up with kTimeout at `deadline`, so that a caller that must
//    not hang (a daemon's ledger updates) survives a holder that is hung or on a slow disk.
//  * WriteFileAtomically replaces a file by temp + fsync + rename: a reader sees the old file
//    or the new one, never a torn one, also when the writer is killed half-way. The temp name
//    is fixed (<path>.tmp), so writers of one path must be serialized (by the lock above); a
//    stale temp of a killed writer is truncated by the next one.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::os {

class ExclusiveFileLock {
 public:
  // kIo naming the path when it cannot be opened or locked.
  static Result<ExclusiveFileLock> Acquire(const std::string& path);
  // kTimeout naming the path when another open file description still holds the lock at
  // `deadline`; kIo as Acquire.
  static Result<ExclusiveFileLock> AcquireUntil(const std::string& path,
                                                std::chrono::steady_clock::time_point deadline);

  ExclusiveFileLock(ExclusiveFileLock&&) noexcept = default;
  ExclusiveFileLock& operator=(ExclusiveFileLock&&) noexcept = default;

  const std::string& path() const { return path_; }

 private:
  ExclusiveFileLock(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// `path` now holds `contents` (mode 0600). kIo naming the file on any failure; the temp is
// removed then and `path` is unchanged.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

}  // namespace weightcache::os
