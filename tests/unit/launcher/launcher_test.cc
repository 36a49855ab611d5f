// The launcher's lifecycle with plain shell processes standing in for daemons: each "daemon"
// publishes its state by writing "<state> <done> <total> [reason]" to the file at its socket
// path, which the test's StateProbe reads. Locks are modelled by a set of held lock paths.
// Everything else is real: processes, pidfds, epoll, signalfd, log files.
#include "launcher/launcher.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>

#include "common/unique_fd.h"
#include "support/test_env.h"

namespace weightcache::launcher {
namespace {

using namespace std::chrono_literals;
using weightcache::testing::ReadFile;
using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;
using Clock = std::chrono::steady_clock;

bool PidGone(pid_t pid) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0u));
  if (fd >= 0) {
    ::close(fd);
    return false;
  }
  return errno == ESRCH;
}

Result<ProbeReport> FileProbe(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFound("no socket at " + path);
  std::string state;
  ProbeReport r;
  f >> state >> r.bytes_done >> r.bytes_total;
  std::getline(f, r.reason);
  if (!r.reason.empty() && r.reason[0] == ' ') r.reason.erase(0, 1);
  if (state == "loading") {
    r.state = ProbeReport::State::kLoading;
  } else if (state == "ready") {
    r.state = ProbeReport::State::kReady;
  } else if (state == "failed") {
    r.state = ProbeReport::State::kFailed;
  } else {
    return ProtocolError("unreadable state '" + state + "' at " + path);
  }
  return r;
}

class LauncherTest : public ::testing::Test {
 protected:
  // A daemon running `script` with $SOCK and $LOCK set to its paths.
  DaemonSpec Daemon(int rank, const std::string& script) {
    DaemonSpec s;
    s.placement.tp_rank = rank;
    s.placement.local_gpu_id = rank * 2;
    s.placement.device_uuid = "GPU-0000000" + std::to_string(rank) + "-0000-4000-8000-000000000000";
    s.name = "tp" + std::to_string(rank) + "-pp0";
    s.socket_path = dir_.Join(s.name + ".sock");
    s.lock_path = dir_.Join(s.name + ".lock");
    s.spawn.argv = {"/bin/sh", "-c", script};
    s.spawn.env_overrides = {"SOCK=" + s.socket_path, "LOCK=" + s.lock_path};
    s.spawn.log_path = dir_.Join(s.name + ".log");
    return s;
  }

  LaunchOptions FastOptions() {
    LaunchOptions o;
    o.ready_timeout = 10s;
    o.stop_grace = 2s;
    o.poll_interval = 20ms;
    o.restart_backoff_initial = 50ms;
    return o;
  }

  Launcher Make(std::vector<DaemonSpec> specs, LaunchOptions options) {
    auto l = Launcher::Create(
        std::move(specs), std::move(options), FileProbe,
        [this](const std::string& lock) -> Result<bool> { return held_locks_.count(lock) > 0; });
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return std::move(l).value();
  }

  // Detached daemons are still our children at the OS level: the test ends and reaps them
  // itself (a detached child is not reaped, so its pid cannot be recycled before this).
  static void KillDetached(const LaunchReport& r) {
    for (const auto& d : r.daemons) {
      ::kill(d.pid, SIGKILL);
      ::waitpid(d.pid, nullptr, 0);
    }
  }

  void ExpectAllGone(const LaunchReport& r) {
    for (const auto& d : r.daemons) {
      EXPECT_GT(d.pid, 0) << d.name;
      EXPECT_TRUE(PidGone(d.pid)) << d.name << " pid " << d.pid << " still exists";
    }
  }

  static constexpr const char* kReadySoon =
      "printf 'loading 5 10' > $SOCK.t && mv $SOCK.t $SOCK; sleep 0.1; "
      "printf 'ready 10 10' > $SOCK.t && mv $SOCK.t $SOCK; exec sleep 30";
  static constexpr const char* kLoadForever =
      "printf 'loading 1 10' > $SOCK.t && mv $SOCK.t $SOCK; exec sleep 30";

  TempDir dir_;
  std::set<std::string> held_locks_;
};

TEST_F(LauncherTest, ExitWhenReadyLeavesReadyDaemonsRunning) {
  Launcher l = Make({Daemon(0, kReadySoon), Daemon(1, kReadySoon)}, FastOptions());
  int ready_calls = 0;
  LaunchReport r = l.Run(-1);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  (void)ready_calls;
  ASSERT_EQ(r.daemons.size(), 2u);
  for (const auto& d : r.daemons) {
    EXPECT_EQ(d.state, DaemonState::kReady) << d.name;
    EXPECT_EQ(d.bytes_done, 10u);
    EXPECT_EQ(d.bytes_total, 10u);
    EXPECT_GT(d.seconds, 0.05);
    EXPECT_FALSE(PidGone(d.pid)) << d.name << " should have been left running";
  }
  EXPECT_EQ(r.daemons[1].placement.local_gpu_id, 2);
  KillDetached(r);
}

TEST_F(LauncherTest, DaemonDyingBeforeReadyFailsTheLaunchFastAndStopsTheOthers) {
  // Daemon 1 dies only once daemon 0's state file is in place: killed earlier, daemon 0's
  // shell would leave its `mv` child running, to put the file back after the clean-up.
  const std::string dies =
      "printf 'loading 0 10' > $SOCK.t && mv $SOCK.t $SOCK; "
      "while [ ! -e " +
      dir_.Join("tp0-pp0.sock") +
      " ]; do sleep 0.01; done; "
      "i=1; while [ $i -le 25 ]; do echo \"load step $i\"; i=$((i+1)); done; "
      "echo 'fatal: shard model-00002 truncated' >&2; exit 5";
  LaunchOptions o = FastOptions();
  Launcher l = Make({Daemon(0, kLoadForever), Daemon(1, dies)}, o);
  LaunchReport r = l.Run(-1);
  // Fast, without a wall-clock assertion (CI machines stall): daemon 0 loads forever, so only
  // the death of daemon 1 — not the 10 s ready timeout (kTimeout) — can end this launch.
  EXPECT_EQ(r.status.code(), StatusCode::kInvalidCheckpoint) << r.status.ToString();
  EXPECT_NE(r.status.message().find("daemon tp1-pp0 (GPU 2 GPU-00000001"), std::string::npos)
      << r.status.message();
  EXPECT_NE(r.status.message().find("died before it was ready: exit code 5"), std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.failed_index, 1);
  ASSERT_EQ(r.failed_log_tail.size(), 20u);
  EXPECT_EQ(r.failed_log_tail.back(), "fatal: shard model-00002 truncated");
  EXPECT_EQ(r.failed_log_tail.front(), "load step 7");
  EXPECT_EQ(r.daemons[0].state, DaemonState::kStopped);
  EXPECT_EQ(r.daemons[1].state, DaemonState::kFailed);
  ASSERT_TRUE(r.daemons[1].exit.has_value());
  EXPECT_EQ(r.daemons[1].exit->exit_code, 5);
  ExpectAllGone(r);
  // Stopped daemons' stale files are cleaned (their locks are free).
  EXPECT_FALSE(std::ifstream(dir_.Join("tp0-pp0.sock")).good());
}

// The ready notice (launcher/ready_notice.h) without a wall-clock assertion: the probes are
// 60 s apart from the first, and the launch must be ready within 30 s, so only the notice the
// "daemon" sends once its state reads ready can end this launch in time (without it: kTimeout).
TEST_F(LauncherTest, AReadyNoticeMakesTheLauncherProbeAtOnce) {
  const std::string notices =
      "printf 'loading 1 10' > $SOCK.t && mv $SOCK.t $SOCK; sleep 0.2; "
      "printf 'ready 10 10' > $SOCK.t && mv $SOCK.t $SOCK; "
      "printf r >&$WEIGHTCACHE_READY_NOTICE_FD; exec sleep 30";
  LaunchOptions o = FastOptions();
  o.ready_timeout = 30s;
  o.first_probe_gap = 60s;
  o.poll_interval = 60s;
  Launcher l = Make({Daemon(0, notices)}, o);
  LaunchReport r = l.Run(-1);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.daemons[0].state, DaemonState::kReady);
  EXPECT_EQ(r.daemons[0].bytes_done, 10u);
  KillDetached(r);
}

// A notice is a hint, never a state: one sent while the daemon still reads `loading` (and a
// flood of them) leaves it loading until its socket says ready.
TEST_F(LauncherTest, ANoticeBeforeReadyIsOnlyAHint) {
  const std::string early =
      "printf 'loading 1 10' > $SOCK.t && mv $SOCK.t $SOCK; "
      "i=0; while [ $i -lt 200 ]; do printf f >&$WEIGHTCACHE_READY_NOTICE_FD; i=$((i+1)); done; "
      "sleep 0.3; printf 'ready 10 10' > $SOCK.t && mv $SOCK.t $SOCK; exec sleep 30";
  std::vector<DaemonState> seen;
  LaunchOptions o = FastOptions();
  o.on_progress = [&seen](const std::vector<DaemonSnapshot>& d) { seen.push_back(d[0].state); };
  Launcher l = Make({Daemon(0, early)}, o);
  LaunchReport r = l.Run(-1);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.daemons[0].state, DaemonState::kReady);
  EXPECT_GT(r.daemons[0].seconds, 0.25);  // not before its socket said so
  ASSERT_FALSE(seen.empty());
  EXPECT_NE(std::find(seen.begin(), seen.end(), DaemonState::kLoading), seen.end());
  KillDetached(r);
}

TEST_F(LauncherTest, ExitSevenIsReportedAsAlreadyServed) {
  Launcher l = Make({Daemon(0, "echo 'lock held by pid 4242' >&2; exit 7")}, FastOptions());
  LaunchReport r = l.Run(-1);
  EXPECT_EQ(r.status.code(), StatusCode::kAlreadyServed) << r.status.ToString();
  EXPECT_NE(r.status.message().find(
                "exited with code 7: its identity is already served by another daemon (" +
                dir_.Join("tp0-pp0.sock") + ")"),
            std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.failed_log_tail.back(), "lock held by pid 4242");
}

TEST_F(LauncherTest, DaemonReportingFailedFailsTheLaunchWithItsReason) {
  const std::string fails =
      "printf 'failed 3 10 tensor model.embed: checksum mismatch' > $SOCK.t && mv $SOCK.t $SOCK;"
      " exec sleep 30";
  Launcher l = Make({Daemon(0, kReadySoon), Daemon(1, fails)}, FastOptions());
  LaunchReport r = l.Run(-1);
  EXPECT_EQ(r.status.code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status.message().find("reported failed: tensor model.embed: checksum mismatch"),
            std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.failed_index, 1);
  ExpectAllGone(r);
}

TEST_F(LauncherTest, TimeoutStopsEveryDaemonAndNamesTheLaggards) {
  LaunchOptions o = FastOptions();
  o.ready_timeout = 300ms;
  Launcher l = Make({Daemon(0, kReadySoon), Daemon(1, kLoadForever)}, o);
  LaunchReport r = l.Run(-1);
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout);
  EXPECT_NE(r.status.message().find("daemons not ready after 0.3"), std::string::npos)
      << r.status.message();
  EXPECT_NE(r.status.message().find("tp1-pp0 (GPU 2"), std::string::npos);
  EXPECT_NE(r.status.message().find("loading 0.0/0.0 GB"), std::string::npos) << r.status.message();
  EXPECT_EQ(r.status.message().find("tp0-pp0"), std::string::npos) << "tp0 was ready";
  EXPECT_EQ(r.failed_index, 1);
  ExpectAllGone(r);
}

TEST_F(LauncherTest, StoppedAndTermIgnoringDaemonsAreStillTakenDown) {
  LaunchOptions o = FastOptions();
  o.ready_timeout = 300ms;
  o.stop_grace = 1s;
  // One daemon SIGSTOPs itself (a daemon stuck in the kernel, or under a debugger): SIGCONT
  // after SIGTERM lets it die at once. The other ignores SIGTERM: SIGKILL after the grace.
  Launcher l = Make({Daemon(0, "kill -STOP $$; sleep 30"), Daemon(1, "trap '' TERM; sleep 30")}, o);
  const auto t0 = Clock::now();
  LaunchReport r = l.Run(-1);
  const auto elapsed = Clock::now() - t0;
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout);
  // The grace period was honoured (a lower bound: a loaded machine only makes it longer).
  EXPECT_GE(elapsed, 1200ms);
  ASSERT_TRUE(r.daemons[0].exit.has_value());
  EXPECT_EQ(r.daemons[0].exit->signal, SIGTERM);
  ASSERT_TRUE(r.daemons[1].exit.has_value());
  EXPECT_EQ(r.daemons[1].exit->signal, SIGKILL);
  ExpectAllGone(r);
}

TEST_F(LauncherTest, AStaleSocketIsRemovedBeforeStartWhenItsLockIsFree) {
  WriteFile(dir_.Join("tp0-pp0.sock"), "ready 1 1");
  WriteFile(dir_.Join("tp0-pp0.lock"), "");
  // The daemon refuses to start over a leftover socket: it only gets going if it was removed.
  // Its lock file goes too, removed while the launcher held that lock (os::RemoveIfUnlocked).
  Launcher l = Make(
      {Daemon(0, std::string("[ -e $SOCK ] && exit 9; [ -e $LOCK ] && exit 8; ") + kReadySoon)},
      FastOptions());
  LaunchReport r = l.Run(-1);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ::kill(r.daemons[0].pid, SIGKILL);
  ::waitpid(r.daemons[0].pid, nullptr, 0);
}

TEST_F(LauncherTest, AHeldLockMeansAlreadyServedAndNothingIsStarted) {
  WriteFile(dir_.Join("tp1-pp0.sock"), "ready 1 1");
  held_locks_.insert(dir_.Join("tp1-pp0.lock"));
  Launcher l = Make({Daemon(0, kReadySoon), Daemon(1, kReadySoon)}, FastOptions());
  LaunchReport r = l.Run(-1);
  EXPECT_EQ(r.status.code(), StatusCode::kAlreadyServed);
  EXPECT_NE(r.status.message().find("tp1-pp0: " + dir_.Join("tp1-pp0.sock") +
                                    " is already served: its lock"),
            std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.daemons[0].pid, -1);
  EXPECT_FALSE(std::ifstream(dir_.Join("tp0-pp0.log")).good()) << "nothing may start";
  // The live daemon's socket is untouched.
  EXPECT_EQ(ReadFile(dir_.Join("tp1-pp0.sock")), "ready 1 1");
}

// Blocks `sig` for this thread and gives a signalfd for it; undone on destruction.
class BlockedSignal {
 public:
  explicit BlockedSignal(int sig) : sig_(sig) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    ::pthread_sigmask(SIG_BLOCK, &set, &old_);
    fd_.Reset(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  }
  ~BlockedSignal() {
    fd_.Reset();
    // Drain a signal raised but never read, then restore the mask.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig_);
    timespec zero{};
    while (::sigtimedwait(&set, nullptr, &zero) > 0) {
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  int fd() const { return fd_.get(); }

 private:
  int sig_;
  sigset_t old_;
  UniqueFd fd_;
};

TEST_F(LauncherTest, SignalDuringStartUpStopsEverythingAndFails) {
  BlockedSignal sig(SIGUSR1);
  ASSERT_GE(sig.fd(), 0);
  LaunchOptions o = FastOptions();
  int rounds = 0;
  o.on_progress = [&](const std::vector<DaemonSnapshot>&) {
    if (++rounds == 3) ::raise(SIGUSR1);
  };
  Launcher l = Make({Daemon(0, kLoadForever), Daemon(1, kLoadForever)}, o);
  LaunchReport r = l.Run(sig.fd());
  EXPECT_EQ(r.status.code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status.message().find("interrupted by SIGUSR1 before every daemon was ready"),
            std::string::npos)
      << r.status.message();
  EXPECT_EQ(r.stop_signal, SIGUSR1);
  for (const auto& d : r.daemons) EXPECT_EQ(d.state, DaemonState::kStopped);
  ExpectAllGone(r);
}

TEST_F(LauncherTest, SuperviseRestartsADaemonThatDiesAndStopsOnSignal) {
  BlockedSignal sig(SIGUSR1);
  // First run: ready, then crash. Second run: ready and stays.
  const std::string flaky = std::string(
                                "if [ ! -e $SOCK.crashed ]; then touch $SOCK.crashed; "
                                "printf 'ready 10 10' > $SOCK.t && mv $SOCK.t $SOCK; sleep 0.3; "
                                "rm -f $SOCK; exit 1; fi; ") +
                            kReadySoon;
  LaunchOptions o = FastOptions();
  o.mode = SupervisionMode::kSupervise;
  bool ready_once = false;
  o.on_ready = [&](const std::vector<DaemonSnapshot>& all) {
    ready_once = true;
    EXPECT_EQ(all[1].restarts, 0);
  };
  o.on_progress = [&](const std::vector<DaemonSnapshot>& all) {
    if (all[1].restarts == 1 && all[1].state == DaemonState::kReady) ::raise(SIGUSR1);
  };
  Launcher l = Make({Daemon(0, kReadySoon), Daemon(1, flaky)}, o);
  LaunchReport r = l.Run(sig.fd());
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(ready_once);
  EXPECT_EQ(r.stop_signal, SIGUSR1);
  EXPECT_EQ(r.daemons[0].restarts, 0);
  EXPECT_EQ(r.daemons[1].restarts, 1);
  const std::string log = ReadFile(dir_.Join("tp1-pp0.log"));
  EXPECT_NE(log.find("weightcache launch: starting tp1-pp0 (restart 1)"), std::string::npos) << log;
  ExpectAllGone(r);
}

TEST_F(LauncherTest, SocketPathIsFoundThroughTheLocatorByPid) {
  // The daemon picks its own path and records its pid next to it, as a lock file does.
  DaemonSpec spec = Daemon(0, std::string("echo \"$SOCK\" > $SOCK.owner.$$; ") + kReadySoon);
  spec.socket_path.clear();
  spec.lock_path.clear();
  std::vector<pid_t> asked;
  auto l = Launcher::Create(
      {spec}, FastOptions(), FileProbe, [](const std::string&) -> Result<bool> { return false; },
      [&](pid_t pid) -> std::optional<PublishedPaths> {
        asked.push_back(pid);
        const std::string owner = dir_.Join("tp0-pp0.sock.owner." + std::to_string(pid));
        if (!std::ifstream(owner).good()) return std::nullopt;
        return PublishedPaths{dir_.Join("tp0-pp0.sock"), dir_.Join("tp0-pp0.lock")};
      });
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  LaunchReport r = l->Run(-1);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.daemons[0].socket_path, dir_.Join("tp0-pp0.sock"));
  ASSERT_FALSE(asked.empty());
  EXPECT_EQ(asked.front(), r.daemons[0].pid);
  ::kill(r.daemons[0].pid, SIGKILL);
  ::waitpid(r.daemons[0].pid, nullptr, 0);
}

TEST(RestartDelayTest, DoublesAndCaps) {
  EXPECT_EQ(RestartDelay(1, 1000ms, 60000ms), 1000ms);
  EXPECT_EQ(RestartDelay(2, 1000ms, 60000ms), 2000ms);
  EXPECT_EQ(RestartDelay(4, 1000ms, 60000ms), 8000ms);
  EXPECT_EQ(RestartDelay(7, 1000ms, 60000ms), 60000ms);
  EXPECT_EQ(RestartDelay(1000, 1000ms, 60000ms), 60000ms);
}

TEST(LauncherCreateTest, RejectsAnEmptyPlan) {
  auto l = Launcher::Create({}, LaunchOptions{}, FileProbe,
                            [](const std::string&) -> Result<bool> { return false; });
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("launch plan has no daemons"), std::string::npos);
}

TEST(LauncherCreateTest, AnUnknownSocketPathNeedsALocator) {
  DaemonSpec spec;
  spec.name = "tp0-pp0";
  spec.spawn.argv = {"/bin/true"};
  auto l = Launcher::Create({spec}, LaunchOptions{}, FileProbe,
                            [](const std::string&) -> Result<bool> { return false; });
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("daemon tp0-pp0 has no socket path and no locator"),
            std::string::npos);
}

TEST(FormatProgressLineTest, SummarisesEveryDaemonOnOneLine) {
  std::vector<DaemonSnapshot> d(2);
  d[0].placement.local_gpu_id = 0;
  d[0].state = DaemonState::kReady;
  d[0].bytes_done = d[0].bytes_total = 4'000'000'000;
  d[1].placement.local_gpu_id = 2;
  d[1].state = DaemonState::kLoading;
  d[1].bytes_done = 1'000'000'000;
  d[1].bytes_total = 4'000'000'000;
  d[1].bytes_per_second = 2.5e9;
  EXPECT_EQ(FormatProgressLine(d, 1.25),
            "[launch 1.2s] 1/2 ready  5.0/8.0 GB  gpu0 ready | gpu2 2.5 GB/s 25%");
}

}  // namespace
}  // namespace weightcache::launcher
