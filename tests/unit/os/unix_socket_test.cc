#include "os/unix_socket.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "os/fd_passing.h"
#include "support/test_env.h"

namespace weightcache::os {
namespace {

using std::chrono::milliseconds;
using weightcache::testing::TempDir;

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

TEST(UnixSocketTest, ListenPublishesA0600SocketAndNoTemporary) {
  TempDir dir;
  std::string path = dir.Join("abc.sock");
  auto listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ListDir(dir.path()), std::vector<std::string>{"abc.sock"});
  EXPECT_TRUE(::fcntl(listener->get(), F_GETFD) & FD_CLOEXEC);
}

TEST(UnixSocketTest, ConnectAcceptAndPeerCredentials) {
  TempDir dir;
  std::string path = dir.Join("c.sock");
  auto listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok());

  auto none = AcceptConnection(listener->get());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());  // nothing pending: would block, not an error

  auto client = ConnectUnix(path, milliseconds(1000));
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto accepted = AcceptConnection(listener->get());
  ASSERT_TRUE(accepted.ok());
  ASSERT_TRUE(accepted->has_value());
  auto cred = PeerCredentials((*accepted)->get());
  ASSERT_TRUE(cred.ok());
  EXPECT_EQ(cred->pid, ::getpid());
  EXPECT_EQ(cred->uid, ::getuid());
  EXPECT_EQ(cred->gid, ::getgid());
}

TEST(UnixSocketTest, RenameReplacesAStaleSocket) {
  TempDir dir;
  std::string path = dir.Join("s.sock");
  { ASSERT_TRUE(ListenUnix(path).ok()); }  // closed: the file stays behind, stale
  auto stale = ConnectUnix(path, milliseconds(100));
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().sys_errno(), ECONNREFUSED);

  auto fresh = ListenUnix(path);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_TRUE(ConnectUnix(path, milliseconds(1000)).ok());
}

TEST(UnixSocketTest, RefusesToReplaceANonSocket) {
  TempDir dir;
  std::string path = dir.Join("precious.txt");
  weightcache::testing::WriteFile(path, "keep me");
  auto r = ListenUnix(path);
  ASSERT_FALSE(r.ok());
  // A runtime condition (exit 1, issue 39 §10), not a usage error (exit 2).
  EXPECT_EQ(r.status().code(), StatusCode::kIo);
  EXPECT_EQ(r.status().message(),
            path +
                " exists and is not a socket (a regular file); refusing to replace it: remove "
                "it, or choose another socket path");
  EXPECT_EQ(weightcache::testing::ReadFile(path), "keep me");
}

// The liveness test of an address no lock guards (`serve --metrics-addr PATH`): each state.
TEST(UnixSocketTest, ProbeTellsAbsentStaleLiveAndNotASocketApart) {
  using State = UnixListenerProbe::State;
  TempDir dir;
  const std::string path = dir.Join("m.sock");
  auto absent = ProbeUnixListener(path, milliseconds(100));
  ASSERT_TRUE(absent.ok()) << absent.status().ToString();
  EXPECT_EQ(absent->state, State::kAbsent);
  {
    auto listener = ListenUnix(path);
    ASSERT_TRUE(listener.ok()) << listener.status().ToString();
    auto live = ProbeUnixListener(path, milliseconds(1000));
    ASSERT_TRUE(live.ok()) << live.status().ToString();
    EXPECT_EQ(live->state, State::kLive);
    EXPECT_EQ(live->pid, ::getpid());
  }  // closed: the node stays behind, stale
  auto stale = ProbeUnixListener(path, milliseconds(100));
  ASSERT_TRUE(stale.ok()) << stale.status().ToString();
  EXPECT_EQ(stale->state, State::kStale);

  const std::string file = dir.Join("precious.txt");
  weightcache::testing::WriteFile(file, "keep me");
  auto not_socket = ProbeUnixListener(file, milliseconds(100));
  ASSERT_FALSE(not_socket.ok());
  EXPECT_EQ(not_socket.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_socket.status().message().find("is not a socket"), std::string::npos);
}

TEST(UnixSocketTest, TooLongPathIsRejectedNamingPathAndLimit) {
  std::string path = "/tmp/" + std::string(120, 'p') + ".sock";
  auto r = ListenUnix(path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(path), std::string::npos);
  EXPECT_NE(r.status().message().find("107-byte sun_path limit"), std::string::npos);
  auto c = ConnectUnix(path, milliseconds(10));
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
}

TEST(UnixSocketTest, ConnectToAbsentPathIsNotFound) {
  TempDir dir;
  auto r = ConnectUnix(dir.Join("absent.sock"), milliseconds(10));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(r.status().sys_errno(), ENOENT);
}

TEST(UnixSocketTest, AcceptRetriesEintrThroughTheSeam) {
  struct EintrOnce : SysCalls {
    int calls = 0;
    int Accept4(int fd, sockaddr* a, socklen_t* l, int flags) override {
      if (calls++ == 0) {
        errno = EINTR;
        return -1;
      }
      return SysCalls::Accept4(fd, a, l, flags);
    }
  } sys;
  TempDir dir;
  std::string path = dir.Join("e.sock");
  auto listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok());
  auto client = ConnectUnix(path, milliseconds(1000));
  ASSERT_TRUE(client.ok());
  auto accepted = AcceptConnection(listener->get(), Blocking::kNonBlocking, sys);
  ASSERT_TRUE(accepted.ok());
  EXPECT_TRUE(accepted->has_value());
  EXPECT_EQ(sys.calls, 2);
}

}  // namespace
}  // namespace weightcache::os
