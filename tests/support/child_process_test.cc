// TestChild and WaitForStatus (support/child_process.h), which every tier's tests spawn and
// wait through: exit codes and 128 + signal, waits that time out on a running child, log
// files, pipes both ways, the signal mask a child starts with, kill-on-destruction, and the
// two ways a Status wait ends without a daemon (it exits; nothing answers in time).
#include "support/child_process.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "common/unique_fd.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

ChildSpec Shell(const std::string& script, const std::string& log_path = "") {
  ChildSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.log_path = log_path;
  if (log_path.empty()) spec.out = spec.err = Stdio::kNull;
  return spec;
}

TEST(TestChildTest, ExitCodeAndTheSignalThatKilledIt) {
  auto exits = TestChild::Spawn(Shell("exit 3"));
  ASSERT_TRUE(exits.ok()) << exits.status().ToString();
  EXPECT_EQ(exits->WaitExit(30s), 3);
  EXPECT_EQ(exits->DescribeExit(), "exit code 3");
  EXPECT_FALSE(exits->Running());

  auto sleeps = TestChild::Spawn(Shell("exec sleep 600"));
  ASSERT_TRUE(sleeps.ok()) << sleeps.status().ToString();
  EXPECT_EQ(sleeps->Kill(), 128 + SIGKILL);
  EXPECT_THAT(sleeps->DescribeExit(), HasSubstr("killed by signal 9"));
}

TEST(TestChildTest, WaitExitTimesOutOnARunningChildAndSignalsReachIt) {
  auto child = TestChild::Spawn(Shell("exec sleep 600"));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->WaitExit(50ms), std::nullopt);
  EXPECT_TRUE(child->Running());
  EXPECT_EQ(child->DescribeExit(), "running");
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  EXPECT_EQ(child->WaitExit(30s), 128 + SIGTERM);
  // Reaped: its pid is no longer ours to signal.
  Status late = child->Signal(SIGTERM);
  EXPECT_EQ(late.code(), StatusCode::kInternal);
  EXPECT_THAT(late.message(), HasSubstr("killed by signal 15"));
}

TEST(TestChildTest, SignalsBlockedInTheTestThreadAreUnblockedInTheChild) {
  sigset_t term;
  sigset_t old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &term, &old), 0);
  auto child = TestChild::Spawn(Shell("exec sleep 600"));
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  EXPECT_EQ(child->WaitExit(30s), 128 + SIGTERM);
}

TEST(TestChildTest, StdoutAndStderrGoToTheLogWithTheEnvironmentOverrides) {
  TempDir dir;
  const std::string log = dir.Join("child.log");
  WriteFile(log, "earlier\n");  // appended to, not truncated
  ChildSpec spec = Shell("echo \"out $WC_CHILD_TEST\"; echo err >&2", log);
  spec.env_overrides = {"WC_CHILD_TEST=first", "WC_CHILD_TEST=second"};
  auto child = TestChild::Spawn(spec);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->WaitExit(30s), 0);
  EXPECT_EQ(child->Log(), "earlier\nout second\nerr\n");
  EXPECT_EQ(child->log_path(), log);

  const std::string fresh = dir.Join("fresh.log");
  auto created = TestChild::Spawn(Shell("true", fresh));
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  EXPECT_EQ(created->WaitExit(30s), 0);
  struct stat st {};
  ASSERT_EQ(::stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
}

TEST(TestChildTest, LinesBothWaysOverPipes) {
  TempDir dir;
  ChildSpec spec;
  spec.argv = {"/bin/cat"};
  spec.in = Stdio::kPipe;
  spec.out = Stdio::kPipe;
  spec.err = Stdio::kLog;
  spec.log_path = dir.Join("cat.err");
  auto cat = TestChild::Spawn(spec);
  ASSERT_TRUE(cat.ok()) << cat.status().ToString();

  Result<std::string> none = cat->ReadLine(50ms);
  EXPECT_EQ(none.status().code(), StatusCode::kTimeout);
  ASSERT_TRUE(cat->WriteLine("first").ok());
  ASSERT_TRUE(cat->WriteLine("second").ok());
  Result<std::string> first = cat->ReadLine(30s);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(*first, "first");
  Result<std::string> second = cat->ReadLine(30s);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(*second, "second");

  cat->CloseStdin();  // cat reads EOF, exits, and closes its stdout
  Result<std::string> eof = cat->ReadLine(30s);
  EXPECT_EQ(eof.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(eof.status().message(), HasSubstr("closed its stdout"));
  EXPECT_EQ(cat->WaitExit(30s), 0);
  EXPECT_EQ(cat->WriteLine("late").code(), StatusCode::kInternal);
}

TEST(TestChildTest, DrainOutputReadsBothPipesSoNeitherBlocksTheChild) {
  // 1 MiB on each stream: far past a pipe's buffer, so reading one stream to its end before
  // the other would deadlock.
  ChildSpec spec = Shell("head -c 1048576 /dev/zero; head -c 1048576 /dev/zero >&2; echo end");
  spec.out = spec.err = Stdio::kPipe;
  auto child = TestChild::Spawn(spec);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  std::string out;
  std::string err;
  ASSERT_TRUE(child->DrainOutput(&out, &err).ok());
  EXPECT_EQ(out.size(), 1048576U + 4);
  EXPECT_EQ(out.substr(out.size() - 4), "end\n");
  EXPECT_EQ(err.size(), 1048576U);
  EXPECT_EQ(child->WaitExit(30s), 0);
}

TEST(TestChildTest, DestructionKillsAndReapsARunningChild) {
  pid_t pid = -1;
  UniqueFd watch;
  {
    auto child = TestChild::Spawn(Shell("exec sleep 600"));
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    pid = child->pid();
    watch.Reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0U)));
    ASSERT_TRUE(watch.valid());
  }
  pollfd p{watch.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 1) << "the child still runs";
  const pid_t waited = ::waitpid(pid, nullptr, WNOHANG);
  const int wait_errno = errno;
  EXPECT_EQ(waited, -1) << "the child was not reaped";
  EXPECT_EQ(wait_errno, ECHILD);
}

TEST(TestChildTest, ARelativeProgramPathIsTakenFromTheCurrentDirectory) {
  TempDir dir;
  WriteFile(dir.Join("prog"), "#!/bin/sh\nexit 6\n");
  ASSERT_EQ(::chmod(dir.Join("prog").c_str(), 0700), 0);
  const std::string cwd = std::filesystem::current_path().string();
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  auto child = TestChild::Spawn(
      {.argv = {"./prog"}, .env_overrides = {}, .out = Stdio::kNull, .err = Stdio::kNull});
  ASSERT_EQ(::chdir(cwd.c_str()), 0);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->WaitExit(30s), 6);
}

TEST(TestChildTest, SpawnErrorsNameTheirCause) {
  ChildSpec empty;
  EXPECT_EQ(TestChild::Spawn(empty).status().code(), StatusCode::kInvalidArgument);

  ChildSpec no_log = Shell("true");
  no_log.err = Stdio::kLog;
  Result<TestChild> r = TestChild::Spawn(no_log);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("log_path"));

  ChildSpec missing = Shell("true");
  missing.argv = {"/nonexistent/program"};
  r = TestChild::Spawn(missing);
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("/nonexistent/program"));
}

TEST(WaitForStatusTest, ADaemonThatExitsEndsTheWaitWithItsExitAndLog) {
  TempDir dir;
  auto daemon = TestChild::Spawn(Shell("echo cannot serve; exit 5", dir.Join("d.log")));
  ASSERT_TRUE(daemon.ok()) << daemon.status().ToString();
  StatusWait wait;
  wait.sockets = [] { return std::vector<std::string>{}; };
  wait.reached = [](const protocol::StatusReply&) { return true; };
  wait.what = "state ready";
  wait.timeout = 600s;  // the exit, not the timeout, ends this wait
  Result<FoundStatus> r = WaitForStatus(*daemon, wait);
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_THAT(r.status().message(), HasSubstr("ended (exit code 5) before state ready"));
  EXPECT_THAT(r.status().message(), HasSubstr("cannot serve"));
}

TEST(WaitForStatusTest, NothingAnsweringTimesOutWithTheLastError) {
  TempDir dir;
  auto daemon = TestChild::Spawn(Shell("exec sleep 600"));
  ASSERT_TRUE(daemon.ok()) << daemon.status().ToString();
  const std::string socket = dir.Join("nobody.sock");  // no such socket
  StatusWait wait;
  wait.sockets = [&] { return std::vector<std::string>{socket}; };
  wait.reached = [](const protocol::StatusReply&) { return true; };
  wait.what = "state ready";
  wait.timeout = 100ms;
  Result<FoundStatus> r = WaitForStatus(*daemon, wait);
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout);
  EXPECT_THAT(r.status().message(), HasSubstr("state ready not reached within 100 ms"));
  EXPECT_THAT(r.status().message(), HasSubstr("last: " + socket + ": "));
  EXPECT_TRUE(daemon->Running());
}

}  // namespace
}  // namespace weightcache::testing
