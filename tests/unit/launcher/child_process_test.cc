#include "launcher/child_process.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <string>

#include "support/test_env.h"

namespace weightcache::launcher {
namespace {

using namespace std::chrono_literals;
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

// Everything `fd` carries until EOF.
std::string ReadToEnd(int fd) {
  std::string data;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return data;
    data.append(buf, static_cast<size_t>(n));
  }
}

// What /proc/self/fd/<fd> names in this process ("" when the fd is not open).
std::string OwnFdTarget(int fd) {
  char buf[PATH_MAX];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf));
  return n < 0 ? "" : std::string(buf, static_cast<size_t>(n));
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

// A move-assignment kills and reaps the child it overwrites (as its destruction would) and
// takes over the other; the moved-from owner owns nothing, so its destruction kills nothing.
TEST(ChildProcessTest, MoveAssignmentKillsTheOverwrittenChildAndKeepsTheOther) {
  TempDir dir;
  auto first = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  auto second = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  ASSERT_TRUE(first.ok() && second.ok());
  const pid_t overwritten = first->pid();
  const pid_t kept = second->pid();
  {
    ChildProcess moved_from = std::move(*second);
    *first = std::move(moved_from);
    EXPECT_EQ(moved_from.pidfd(), -1);  // NOLINT(bugprone-use-after-move): empty, by contract
  }
  EXPECT_TRUE(PidGone(overwritten));
  EXPECT_FALSE(PidGone(kept));
  EXPECT_EQ(first->pid(), kept);
  ASSERT_TRUE(first->Signal(SIGKILL).ok());
  auto exit = first->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->signal, SIGKILL);
  EXPECT_EQ(first->pidfd(), -1);  // reaped: the pidfd is closed
  EXPECT_TRUE(PidGone(kept));
}

// Detach gives the child up: destroying the owner neither kills nor reaps it, and the owner
// refuses to signal it.
TEST(ChildProcessTest, DetachedChildOutlivesItsOwner) {
  TempDir dir;
  pid_t pid;
  {
    auto child = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
    ASSERT_TRUE(child.ok());
    pid = child->pid();
    child->Detach();
    EXPECT_EQ(child->pidfd(), -1);
    const Status refused = child->Signal(SIGTERM);
    EXPECT_EQ(refused.code(), StatusCode::kInternal);
    EXPECT_EQ(refused.message(), "signal 15 to a detached child");
  }
  EXPECT_FALSE(PidGone(pid));
  ASSERT_EQ(::kill(pid, SIGKILL), 0);  // still our unreaped child: its pid is exact
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status));
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

TEST(ChildProcessTest, PipesCarryStdinToTheChildAndItsStdoutAndStderrBack) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "read line; echo \"out $line\"; echo \"err $line\" >&2; exit 2");
  o.in = o.out = o.err = Stdio::kPipe;
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  StdioPipes pipes = child->TakePipes();
  ASSERT_TRUE(pipes.in.valid() && pipes.out.valid() && pipes.err.valid());
  // Taken once: a second call hands over nothing.
  StdioPipes again = child->TakePipes();
  EXPECT_FALSE(again.in.valid() || again.out.valid() || again.err.valid());

  const std::string line = "hello\n";
  ASSERT_EQ(::write(pipes.in.get(), line.data(), line.size()), static_cast<ssize_t>(line.size()));
  pipes.in.Reset();
  // A few bytes each: neither pipe can fill up while the other is read to its end.
  EXPECT_EQ(ReadToEnd(pipes.out.get()), "out hello\n");
  EXPECT_EQ(ReadToEnd(pipes.err.get()), "err hello\n");
  auto exit = child->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 2);
  // Nothing went to a log: no kLog stream, so the log file was never created.
  EXPECT_NE(::access(o.log_path.c_str(), F_OK), 0);
}

TEST(ChildProcessTest, StdinDefaultsToDevNullAndKNullDiscardsOutput) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "readlink /proc/$$/fd/0 >&2; echo discarded");
  o.out = Stdio::kNull;  // stdin keeps its default, /dev/null; stderr goes to the log
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto exit = child->Wait();
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 0);
  EXPECT_EQ(ReadFile(o.log_path), "/dev/null\n");
}

TEST(ChildProcessTest, InheritedStreamsAreTheParents) {
  const std::string parent_stdin = OwnFdTarget(STDIN_FILENO);
  if (parent_stdin.empty()) GTEST_SKIP() << "this test process has no stdin to hand down";
  TempDir dir;
  SpawnOptions o = Shell(dir, "readlink /proc/$$/fd/0");
  o.in = Stdio::kInherit;
  o.out = Stdio::kPipe;
  o.err = Stdio::kNull;
  o.log_path.clear();  // no kLog stream: no log needed
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  StdioPipes pipes = child->TakePipes();
  EXPECT_FALSE(pipes.in.valid());
  EXPECT_FALSE(pipes.err.valid());
  EXPECT_EQ(ReadToEnd(pipes.out.get()), parent_stdin + "\n");
  ASSERT_TRUE(child->Wait().ok());
}

TEST(ChildProcessTest, EnvironmentOverridesAddVariablesAndTheLastOfOneNameWins) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "echo \"$WC_SPAWN_NEW $WC_SPAWN_KEPT $WC_SPAWN_KEPT_TOO\"");
  ::setenv("WC_SPAWN_KEPT", "kept", 1);
  ::setenv("WC_SPAWN_KEPT_TOO", "kept-too", 1);  // shares a prefix with an override's name
  ::unsetenv("WC_SPAWN_NEW");
  o.env_overrides = {"WC_SPAWN_NEW=first", "WC_SPAWN_NEW=second", "WC_SPAWN_KEPT_=x"};
  auto child = ChildProcess::Spawn(o);
  ::unsetenv("WC_SPAWN_KEPT");
  ::unsetenv("WC_SPAWN_KEPT_TOO");
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(child->Wait().ok());
  EXPECT_EQ(ReadFile(o.log_path), "second kept kept-too\n");
}

TEST(ChildProcessTest, ChildStartsWithDefaultDispositionsEvenWhenTheParentIgnoresSignals) {
  // An ignored signal stays ignored across exec unless the spawn resets it.
  TempDir dir;
  struct sigaction ignore {};
  struct sigaction old {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(::sigaction(SIGTERM, &ignore, &old), 0);
  auto child = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  ASSERT_EQ(::sigaction(SIGTERM, &old, nullptr), 0);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  auto exit = child->WaitFor(30s);
  ASSERT_TRUE(exit.ok()) << exit.status().ToString();
  ASSERT_TRUE(exit->has_value()) << "SIGTERM was ignored in the child";
  EXPECT_EQ((*exit)->signal, SIGTERM);
}

TEST(ChildProcessTest, SessionInheritKeepsTheParentsProcessGroupAndSession) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "cut -d' ' -f5,6 /proc/$$/stat");
  o.session = Session::kInherit;
  auto child = ChildProcess::Spawn(o);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  ASSERT_TRUE(child->Wait().ok());
  EXPECT_EQ(ReadFile(o.log_path),
            std::to_string(::getpgrp()) + " " + std::to_string(::getsid(0)) + "\n");
}

TEST(ChildProcessTest, WaitForTimesOutOnARunningChildAndReapsOneThatExits) {
  TempDir dir;
  auto child = ChildProcess::Spawn(Shell(dir, "exec sleep 30"));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto running = child->WaitFor(0ms);
  ASSERT_TRUE(running.ok());
  EXPECT_FALSE(running->has_value());
  running = child->WaitFor(50ms);
  ASSERT_TRUE(running.ok());
  EXPECT_FALSE(running->has_value());
  EXPECT_FALSE(child->reaped());

  ASSERT_TRUE(child->Signal(SIGKILL).ok());
  auto exit = child->WaitFor(30s);
  ASSERT_TRUE(exit.ok()) << exit.status().ToString();
  ASSERT_TRUE(exit->has_value());
  EXPECT_EQ((*exit)->signal, SIGKILL);
  EXPECT_TRUE(child->reaped());
  EXPECT_TRUE(PidGone(child->pid()));
  // Reaped: later waits report the same exit; a signal is refused with how it ended.
  auto later = child->WaitFor(0ms);
  ASSERT_TRUE(later.ok());
  ASSERT_TRUE(later->has_value());
  EXPECT_EQ((*later)->signal, SIGKILL);
  Status late = child->Signal(SIGTERM);
  EXPECT_EQ(late.code(), StatusCode::kInternal);
  EXPECT_NE(late.message().find("which is reaped (killed by signal 9"), std::string::npos)
      << late.ToString();
}

TEST(ChildProcessTest, ALogStreamNeedsALogPath) {
  TempDir dir;
  SpawnOptions o = Shell(dir, "true");
  o.log_path.clear();
  o.out = Stdio::kNull;  // stderr is still kLog
  auto r = ChildProcess::Spawn(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("a kLog stream needs a log_path"), std::string::npos)
      << r.status().ToString();
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
