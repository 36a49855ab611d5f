// ReadyNotice: the daemon's end of the launcher's ready notice channel, over real sockets,
// pipes and files. Each test sets the variable itself and Take() removes it again.
#include "launcher/ready_notice.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "common/unique_fd.h"

namespace weightcache::launcher {
namespace {

void SetVariable(const std::string& value) { ::setenv(kReadyNoticeEnv, value.c_str(), 1); }

TEST(ReadyNoticeTest, NoVariableIsNoNotice) {
  ::unsetenv(kReadyNoticeEnv);
  auto taken = ReadyNotice::Take();
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_FALSE(taken->has_value());
  SetVariable("");
  taken = ReadyNotice::Take();
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_FALSE(taken->has_value());
}

TEST(ReadyNoticeTest, TakesTheLaunchersSocketAndSendsEachNotice) {
  auto channel = MakeReadyNoticeChannel();
  ASSERT_TRUE(channel.ok()) << channel.status().ToString();
  const int fd = channel->daemon_end.get();
  ASSERT_EQ(::fcntl(fd, F_SETFD, 0), 0);  // as a spawned child receives it: inheritable
  SetVariable(std::to_string(fd));
  auto taken = ReadyNotice::Take();
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  ASSERT_TRUE(taken->has_value());
  (void)channel->daemon_end.Release();  // the notice owns it now
  EXPECT_EQ(std::getenv(kReadyNoticeEnv), nullptr) << "the daemon's children must not see it";
  EXPECT_EQ(::fcntl((*taken)->fd(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);

  (*taken)->Send(ReadyNotice::What::kReady);
  (*taken)->Send(ReadyNotice::What::kFailed);
  char got[2] = {};
  ASSERT_EQ(::recv(channel->launcher_end.get(), &got[0], 1, MSG_DONTWAIT), 1);
  ASSERT_EQ(::recv(channel->launcher_end.get(), &got[1], 1, MSG_DONTWAIT), 1);
  EXPECT_EQ(got[0], 'r');
  EXPECT_EQ(got[1], 'f');
  EXPECT_TRUE(DrainReadyNotices(channel->launcher_end.get()));  // empty, peer still there
}

TEST(ReadyNoticeTest, SendingToAGoneLauncherNeitherBlocksNorKills) {
  auto channel = MakeReadyNoticeChannel();
  ASSERT_TRUE(channel.ok());
  SetVariable(std::to_string(channel->daemon_end.get()));
  auto taken = ReadyNotice::Take();
  ASSERT_TRUE(taken.ok() && taken->has_value()) << taken.status().ToString();
  (void)channel->daemon_end.Release();
  channel->launcher_end.Reset();              // the launcher died
  (*taken)->Send(ReadyNotice::What::kReady);  // ECONNREFUSED, no SIGPIPE: we are still here
  (*taken)->Send(ReadyNotice::What::kReady);
}

TEST(ReadyNoticeTest, ALauncherThatStoppedReadingNeverBlocksTheDaemon) {
  auto channel = MakeReadyNoticeChannel();
  ASSERT_TRUE(channel.ok());
  SetVariable(std::to_string(channel->daemon_end.get()));
  auto taken = ReadyNotice::Take();
  ASSERT_TRUE(taken.ok() && taken->has_value());
  (void)channel->daemon_end.Release();
  // Far past any socket buffer: each Send returns (EAGAIN) instead of waiting.
  for (int i = 0; i < 100000; ++i) (*taken)->Send(ReadyNotice::What::kReady);
  EXPECT_TRUE(DrainReadyNotices(channel->launcher_end.get()));
}

TEST(ReadyNoticeTest, AVariableNamingNoDatagramSocketIsRefusedByName) {
  struct Case {
    std::string value;
    std::string error;
  };
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  int stream[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, stream), 0);
  UniqueFd stream_a(stream[0]), stream_b(stream[1]);
  UniqueFd file(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(file);
  const Case cases[] = {
      {"five", "not a file descriptor number"},
      {"5x", "not a file descriptor number"},
      {"-1", "not a file descriptor number"},
      {"99999999999", "not a file descriptor number"},
      {"987654", "fstat"},  // not open
      {std::to_string(pipe_read.get()), "is not a datagram socket"},
      {std::to_string(stream_a.get()), "is not a datagram socket"},
      {std::to_string(file.get()), "is not a datagram socket"},
  };
  for (const Case& c : cases) {
    SetVariable(c.value);
    auto taken = ReadyNotice::Take();
    ASSERT_FALSE(taken.ok()) << c.value;
    EXPECT_NE(taken.status().message().find(std::string(kReadyNoticeEnv) + "=" + c.value),
              std::string::npos)
        << taken.status().message();
    EXPECT_NE(taken.status().message().find(c.error), std::string::npos)
        << c.value << ": " << taken.status().message();
    EXPECT_EQ(std::getenv(kReadyNoticeEnv), nullptr) << "removed even when refused";
  }
  // A refused fd is left as it was: the caller's, not ours to close.
  EXPECT_GE(::fcntl(pipe_read.get(), F_GETFD), 0);
}

}  // namespace
}  // namespace weightcache::launcher
