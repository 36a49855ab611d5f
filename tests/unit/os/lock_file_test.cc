#include "os/lock_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "support/test_env.h"

namespace weightcache::os {
namespace {

using weightcache::testing::TempDir;

TEST(LockFileTest, AcquireWritesPidAndMode0644) {
  TempDir dir;
  std::string path = dir.Join("x.lock");
  auto lock = LockFile::TryAcquire(path);
  ASSERT_TRUE(lock.ok()) << lock.status().ToString();
  EXPECT_EQ(ReadLockOwner(path), ::getpid());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  // 0644: allowed users of a shared daemon probe it too (its dir decides who reaches it).
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

// An upgrade's successor adopts the lock's open file description (docs/upgrade.md): it must
// be the lock file's, and it must be the description that holds the lock.
TEST(LockFileTest, AdoptTakesOverTheHoldingDescriptionAndRefusesAnyOther) {
  TempDir dir;
  const std::string path = dir.Join("x.lock");
  const std::string other = dir.Join("y.lock");
  {
    auto held = LockFile::TryAcquire(path);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    // The holder's description, duplicated as SCM_RIGHTS would: adopted, pid recorded.
    auto adopted = LockFile::Adopt(UniqueFd(::fcntl(held->fd(), F_DUPFD_CLOEXEC, 0)), path);
    ASSERT_TRUE(adopted.ok()) << adopted.status().ToString();
    EXPECT_EQ(ReadLockOwner(path), ::getpid());
    // The original closes (the old daemon exits): the lock stays with the adopted description.
    *held = std::move(*adopted);
    EXPECT_TRUE(IsLockHeld(path));

    // Another description of the same file does not hold the lock: refused.
    auto fresh = LockFile::Adopt(UniqueFd(::open(path.c_str(), O_RDWR | O_CLOEXEC)), path);
    ASSERT_FALSE(fresh.ok());
    EXPECT_EQ(fresh.status().code(), StatusCode::kAlreadyServed) << fresh.status().ToString();
    // A description of another file is no lock of this one.
    auto wrong = LockFile::TryAcquire(other);
    ASSERT_TRUE(wrong.ok());
    auto mismatched = LockFile::Adopt(UniqueFd(::fcntl(wrong->fd(), F_DUPFD_CLOEXEC, 0)), path);
    ASSERT_FALSE(mismatched.ok());
    EXPECT_EQ(mismatched.status().code(), StatusCode::kProtocol);
    EXPECT_NE(mismatched.status().message().find("is not lock file " + path), std::string::npos)
        << mismatched.status().ToString();
  }
  EXPECT_FALSE(IsLockHeld(path));
}

TEST(LockFileTest, SecondAcquirerInChildIsAlreadyServedNamingParentPid) {
  TempDir dir;
  std::string path = dir.Join("y.lock");
  auto lock = LockFile::TryAcquire(path);
  ASSERT_TRUE(lock.ok());
  std::string expected = "held by pid " + std::to_string(::getpid());

  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child inherits the parent's fd (same open file description) but opens its own, so
    // its OFD lock conflicts. Exit codes: 0 = the expected error, 1.. = something else.
    auto second = LockFile::TryAcquire(path);
    if (second.ok()) ::_exit(1);
    if (second.status().code() != StatusCode::kAlreadyServed) ::_exit(2);
    if (second.status().message().find(expected) == std::string::npos) ::_exit(3);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(LockFileTest, SecondAcquirerInProcessGetsSpecificError) {
  TempDir dir;
  std::string path = dir.Join("z.lock");
  auto first = LockFile::TryAcquire(path);
  ASSERT_TRUE(first.ok());
  auto second = LockFile::TryAcquire(path);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyServed);
  EXPECT_NE(second.status().message().find("lock " + path + " is held by pid " +
                                           std::to_string(::getpid())),
            std::string::npos)
      << second.status().message();
}

TEST(LockFileTest, IsLockHeldFollowsTheLockLifetime) {
  TempDir dir;
  std::string path = dir.Join("h.lock");
  EXPECT_FALSE(IsLockHeld(path));  // absent
  {
    auto lock = LockFile::TryAcquire(path);
    ASSERT_TRUE(lock.ok());
    EXPECT_TRUE(IsLockHeld(path));
  }
  EXPECT_FALSE(IsLockHeld(path));  // released: a socket next to it would be stale
  // And it can be taken again, recording the new owner.
  auto again = LockFile::TryAcquire(path);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(IsLockHeld(path));
}

TEST(LockFileTest, LockDiesWithTheProcess) {
  TempDir dir;
  std::string path = dir.Join("d.lock");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto lock = LockFile::TryAcquire(path);
    char c = lock.ok() ? 'y' : 'n';
    (void)::write(ready[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  EXPECT_TRUE(IsLockHeld(path));
  EXPECT_EQ(ReadLockOwner(path), child);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  EXPECT_FALSE(IsLockHeld(path));
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// The one way a lock file goes (a dead daemon's stale files, issue 39 §3): only while its lock
// is ours; a held lock removes nothing.
TEST(LockFileTest, RemoveIfUnlockedRemovesTheGuardedFilesAndTheLockOnlyWhileItHoldsIt) {
  TempDir dir;
  const std::string lock_path = dir.Join("a.lock");
  const std::string socket = dir.Join("a.sock");
  const std::string absent = dir.Join("a.keeper.sock");
  {
    auto held = LockFile::TryAcquire(lock_path);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    weightcache::testing::WriteFile(socket, "x");
    auto refused = RemoveIfUnlocked(lock_path, {socket, absent});
    ASSERT_TRUE(refused.ok()) << refused.status().ToString();
    EXPECT_TRUE(refused->held);
    EXPECT_TRUE(refused->removed.empty());
    EXPECT_TRUE(Exists(socket));
    EXPECT_TRUE(Exists(lock_path));
    EXPECT_TRUE(IsLockHeld(lock_path));
    EXPECT_EQ(ReadLockOwner(lock_path), ::getpid());  // untouched
  }
  auto removed = RemoveIfUnlocked(lock_path, {socket, absent});
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_FALSE(removed->held);
  EXPECT_EQ(removed->removed, (std::vector<std::string>{socket, lock_path}));
  EXPECT_FALSE(Exists(socket));
  EXPECT_FALSE(Exists(lock_path));
  // Nothing there: nothing removed, and no lock file left behind by the attempt.
  auto again = RemoveIfUnlocked(lock_path, {socket});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(again->held);
  EXPECT_TRUE(again->removed.empty());
  EXPECT_FALSE(Exists(lock_path));
  // A directory that does not exist yet (a daemon about to create it) holds nothing to remove.
  auto nowhere = RemoveIfUnlocked(dir.Join("absent/a.lock"), {dir.Join("absent/a.sock")});
  ASSERT_TRUE(nowhere.ok()) << nowhere.status().ToString();
  EXPECT_FALSE(nowhere->held);
  EXPECT_TRUE(nowhere->removed.empty());
  EXPECT_FALSE(Exists(dir.Join("absent")));
}

// The race a removal must not lose: an acquirer opened the lock file, the remover (holding the
// lock, no pid recorded) unlinked it and let go, and the acquirer then takes the lock on the
// unlinked inode. It must notice and lock the file that the path names now; otherwise a second
// acquirer would create a new file and two daemons would hold "the" lock of one identity.
TEST(LockFileTest, AnAcquirerWhoseLockFileIsRemovedUnderItLocksTheFileThePathNamesNow) {
  TempDir dir;
  const std::string path = dir.Join("r.lock");
  UniqueFd remover(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  ASSERT_TRUE(remover);
  struct flock fl {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  ASSERT_EQ(::fcntl(remover.get(), F_OFD_SETLK, &fl), 0) << errno;
  std::optional<Result<LockFile>> acquired;
  std::thread acquirer([&] { acquired.emplace(LockFile::TryAcquire(path)); });
  // The acquirer has opened the file and waits for an owner's pid (there is none).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::unlink(path.c_str()), 0);
  remover.Reset();
  acquirer.join();
  ASSERT_TRUE(acquired.has_value());
  ASSERT_TRUE(acquired->ok()) << acquired->status().ToString();
  struct stat named {};
  struct stat locked {};
  ASSERT_EQ(::lstat(path.c_str(), &named), 0) << "the lock was taken on an unlinked file";
  ASSERT_EQ(::fstat((*acquired)->fd(), &locked), 0);
  EXPECT_EQ(named.st_ino, locked.st_ino);
  EXPECT_TRUE(IsLockHeld(path));
  EXPECT_EQ(ReadLockOwner(path), ::getpid());
}

}  // namespace
}  // namespace weightcache::os
