#include "launcher/child_process.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "support/test_env.h"

namespace weightcache::launcher {
namespace {

using weightcache::testing::ReadFile;
using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

// True once `pid` no longer names a process we could open (exited and reaped).
bool PidGone(pid_t pid) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0u));
  if (fd >= 0) {
    ::close(fd);
    return false;
  }
  return errno == ESRCH;
}

SpawnOptions Shell(const TempDir& dir, const std::string& script) {
  SpawnOptions o;
  o.argv = {"/bin/sh", "-c", script};
  o.log_path = dir.Join("child.log");
  return o;
}

TEST(ChildProcessTest, StdoutAndStderrGoToTheLogAndExitCodeIsReported) {
  TempDir dir;
  WriteFile(dir.Join("child.log"), "earlier line\n");
  auto child = ChildProcess::Spawn(Shell(dir, "echo to-out; echo to-err >&2; exit 3"));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto exit = child->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(exit->exited());
  EXPECT_EQ(exit->exit_code, 3);
  EXPECT_EQ(exit->ToString(), "exit code 3");
  // Appended, not truncated: restarts keep the history.
  EXPECT_EQ(ReadFile(dir.Join("child.log")), "earlier line\nto-out\nto-err\n");
}

TEST(ChildProcessTest, PidfdBecomesReadableWhenTheChildExitsAndTryReapReapsIt) {
  TempDir dir;
  auto child = ChildProcess::Spawn(Shell(dir, "read line || exit 4; exit 0"));  // stdin: /dev/null
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  pollfd p{child->pidfd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  auto exit = child->TryReap();
  ASSERT_TRUE(exit.ok());
  ASSERT_TRUE(exit->has_value());
  EXPECT_EQ((*exit)->exit_code, 4);  // `read` hit EOF at once
  EXPECT_TRUE(child->reaped());
  EXPECT_TRUE(PidGone(child->pid()));
}

TEST(ChildProcessTest, TryReapOfARunningChildIsEmpty) {
  TempDir dir;
  auto child = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  ASSERT_TRUE(child.ok());
  auto exit = child->TryReap();
  ASSERT_TRUE(exit.ok());
  EXPECT_FALSE(exit->has_value());
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  auto done = child->Wait();
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->signal, SIGTERM);
  EXPECT_EQ(done->ToString(), "killed by signal 15 (Terminated)");
}

TEST(ChildProcessTest, ChildStartsWithSignalsUnblockedEvenWhenTheParentBlocksThem) {
  TempDir dir;
  sigset_t term, old;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &term, &old), 0);
  auto child = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  pollfd p{child->pidfd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1) << "SIGTERM was blocked in the child";
  auto exit = child->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->signal, SIGTERM);
}

TEST(ChildProcessTest, RunsInItsOwnSession) {
  TempDir dir;
  auto child = ChildProcess::Spawn(Shell(dir, "cut -d' ' -f6 /proc/$$/stat > " + dir.Join("sid")));
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(child->Wait().ok());
  EXPECT_EQ(std::stoi(ReadFile(dir.Join("sid"))), child->pid());
}

TEST(ChildProcessTest, EnvironmentOverridesReplaceInheritedValues) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "echo \"$WC_LAUNCHER_TEST_VAR\"");
  ::setenv("WC_LAUNCHER_TEST_VAR", "inherited", 1);
  o.env_overrides = {"WC_LAUNCHER_TEST_VAR=overridden"};
  auto child = ChildProcess::Spawn(o);
  ::unsetenv("WC_LAUNCHER_TEST_VAR");
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(child->Wait().ok());
  EXPECT_EQ(ReadFile(dir.Join("child.log")), "overridden\n");
}

TEST(ChildProcessTest, DestroyingARunningChildKillsAndReapsIt) {
  TempDir dir;
  pid_t pid;
  {
    auto child = ChildProcess::Spawn(Shell(dir, "trap '' TERM; exec sleep 30"));
    ASSERT_TRUE(child.ok());
    pid = child->pid();
    EXPECT_FALSE(PidGone(pid));
  }
  EXPECT_TRUE(PidGone(pid));
}

TEST(ChildProcessTest, SpawnErrorsNameTheProgramOrLog) {
  TempDir dir;
  SpawnOptions relative = Shell(dir, "true");
  relative.argv[0] = "sh";
  auto r = ChildProcess::Spawn(relative);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("absolute program path"), std::string::npos);

  SpawnOptions missing = Shell(dir, "true");
  missing.argv[0] = dir.Join("no-such-binary");
  auto m = ChildProcess::Spawn(missing);
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("spawning " + dir.Join("no-such-binary")), std::string::npos)
      << m.status().ToString();
  EXPECT_EQ(m.status().sys_errno(), ENOENT);

  SpawnOptions bad_log = Shell(dir, "true");
  bad_log.log_path = dir.Join("no-dir/child.log");
  auto l = ChildProcess::Spawn(bad_log);
  EXPECT_EQ(l.status().code(), StatusCode::kNotFound);
  EXPECT_NE(l.status().message().find("opening log file " + dir.Join("no-dir/child.log")),
            std::string::npos);
}

TEST(TailLinesTest, LastLinesOfAFile) {
  TempDir dir;
  std::string text;
  for (int i = 1; i <= 30; ++i) text += "line " + std::to_string(i) + "\n";
  WriteFile(dir.Join("log"), text);
  auto tail = TailLines(dir.Join("log"), 20);
  ASSERT_EQ(tail.size(), 20u);
  EXPECT_EQ(tail.front(), "line 11");
  EXPECT_EQ(tail.back(), "line 30");
  // A byte window that starts mid-line drops the partial line.
  auto small = TailLines(dir.Join("log"), 20, 12);
  ASSERT_EQ(small.size(), 1u);
  EXPECT_EQ(small[0], "line 30");
  EXPECT_TRUE(TailLines(dir.Join("absent"), 20).empty());
  WriteFile(dir.Join("no-newline"), "a\nb");
  EXPECT_EQ(TailLines(dir.Join("no-newline"), 5), (std::vector<std::string>{"a", "b"}));
}

}  // namespace
}  // namespace weightcache::launcher
