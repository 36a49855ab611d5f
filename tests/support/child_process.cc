#include "support/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "protocol/connection.h"
#include "support/test_env.h"

extern char** environ;

namespace weightcache::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Raw syscalls: older glibc has no wrappers; the kernel has them from Linux 5.3.
int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0U)); }
int PidfdSendSignal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0U));
}

// RAII for the two posix_spawn attribute objects, so every early return destroys them.
struct SpawnAttrs {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  SpawnAttrs() {
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attr);
  }
  ~SpawnAttrs() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
  SpawnAttrs(const SpawnAttrs&) = delete;
  SpawnAttrs& operator=(const SpawnAttrs&) = delete;
};

// This process's environment with each "NAME=VALUE" of `overrides` replacing NAME.
std::vector<std::string> MergedEnv(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& kv : overrides) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    std::erase_if(env, [&](const std::string& s) { return s.starts_with(key); });
    env.push_back(kv);
  }
  return env;
}

std::vector<char*> NullTerminated(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// A poll() timeout for what is left until `deadline`: rounded up (so a wait never ends early
// and spins), never negative, at most INT_MAX ms.
int PollTimeout(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

}  // namespace

// ---- spawning -------------------------------------------------------------------------------

Result<TestChild> TestChild::Spawn(const ChildSpec& spec) {
  if (spec.argv.empty() || spec.argv[0].empty()) return InvalidArgument("spawn needs a program");
  const Stdio streams[3] = {spec.in, spec.out, spec.err};
  const auto uses = [&](Stdio s) { return std::find(streams, streams + 3, s) != streams + 3; };

  UniqueFd log;
  if (uses(Stdio::kLog)) {
    if (spec.log_path.empty()) return InvalidArgument("a kLog stream needs a log_path");
    log.Reset(::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    if (!log) return IoError("opening log file " + spec.log_path, errno);
  }
  UniqueFd null;
  if (uses(Stdio::kNull)) {
    null.Reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!null) return IoError("opening /dev/null", errno);
  }
  // For each piped stream, the end the child gets (dup2'ed onto 0, 1 or 2) and the test's end.
  UniqueFd child_end[3];
  UniqueFd test_end[3];
  for (int i = 0; i < 3; ++i) {
    if (streams[i] != Stdio::kPipe) continue;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return IoError("pipe2", errno);
    UniqueFd read_end(fds[0]);
    UniqueFd write_end(fds[1]);
    child_end[i] = std::move(i == STDIN_FILENO ? read_end : write_end);
    test_end[i] = std::move(i == STDIN_FILENO ? write_end : read_end);
  }

  SpawnAttrs a;
  for (int i = 0; i < 3; ++i) {
    // dup2 clears CLOEXEC on the target only; the originals stay CLOEXEC and vanish at exec.
    int source = -1;
    if (streams[i] == Stdio::kLog) source = log.get();
    if (streams[i] == Stdio::kNull) source = null.get();
    if (streams[i] == Stdio::kPipe) source = child_end[i].get();
    if (source >= 0) posix_spawn_file_actions_adddup2(&a.actions, source, i);
  }
  // A test thread may block signals (for a signalfd); the child must not inherit that.
  sigset_t empty;
  sigset_t all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&a.attr, &empty);
  posix_spawnattr_setsigdefault(&a.attr, &all);
  posix_spawnattr_setflags(&a.attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<std::string> env = MergedEnv(spec.env_overrides);
  std::vector<std::string> argv = spec.argv;
  std::vector<char*> envp = NullTerminated(env);
  std::vector<char*> args = NullTerminated(argv);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, args[0], &a.actions, &a.attr, args.data(), envp.data());
  if (rc != 0) return IoError("spawning " + spec.argv[0], rc);

  UniqueFd pidfd(PidfdOpen(pid));
  if (!pidfd) {
    // Unwatchable: take it down while the pid is still ours (an unreaped child's pid cannot
    // be recycled, so kill() here is exact).
    const int err = errno;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return IoError("pidfd_open for child " + std::to_string(pid), err);
  }
  TestChild child(pid, std::move(pidfd), spec.log_path);
  child.stdin_ = std::move(test_end[STDIN_FILENO]);
  child.stdout_ = std::move(test_end[STDOUT_FILENO]);
  child.stderr_ = std::move(test_end[STDERR_FILENO]);
  return child;
}

Result<TestChild> SpawnServe(const std::vector<std::string>& serve_args,
                             const std::vector<std::string>& env_overrides,
                             const std::string& log_path) {
  ChildSpec spec;
  spec.argv = {CliPath(), "serve"};
  spec.argv.insert(spec.argv.end(), serve_args.begin(), serve_args.end());
  spec.env_overrides = env_overrides;
  spec.env_overrides.emplace_back("WEIGHTCACHE_LOG_LEVEL=info");  // the last one wins
  spec.log_path = log_path;
  return TestChild::Spawn(spec);
}

// ---- ownership ------------------------------------------------------------------------------

TestChild::TestChild(TestChild&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      pidfd_(std::move(other.pidfd_)),
      log_path_(std::move(other.log_path_)),
      stdin_(std::move(other.stdin_)),
      stdout_(std::move(other.stdout_)),
      stdout_buffered_(std::move(other.stdout_buffered_)),
      stderr_(std::move(other.stderr_)),
      exit_code_(std::exchange(other.exit_code_, std::nullopt)),
      exit_signal_(std::exchange(other.exit_signal_, 0)) {}

TestChild& TestChild::operator=(TestChild&& other) noexcept {
  if (this != &other) {
    KillAndReap();
    pid_ = std::exchange(other.pid_, -1);
    pidfd_ = std::move(other.pidfd_);
    log_path_ = std::move(other.log_path_);
    stdin_ = std::move(other.stdin_);
    stdout_ = std::move(other.stdout_);
    stdout_buffered_ = std::move(other.stdout_buffered_);
    stderr_ = std::move(other.stderr_);
    exit_code_ = std::exchange(other.exit_code_, std::nullopt);
    exit_signal_ = std::exchange(other.exit_signal_, 0);
  }
  return *this;
}

TestChild::~TestChild() { KillAndReap(); }

void TestChild::KillAndReap() {
  if (pid_ >= 0 && !exit_code_) Kill();
}

std::string TestChild::Log() const { return log_path_.empty() ? "" : ReadFile(log_path_); }

// ---- signals and exit -----------------------------------------------------------------------

Status TestChild::Signal(int sig) {
  if (pid_ < 0 || exit_code_) {
    return InternalError("signal " + std::to_string(sig) + " to pid " + std::to_string(pid_) +
                         ", which is reaped (" + DescribeExit() + ")");
  }
  // ESRCH: it has exited and waits to be reaped; WaitExit will report it.
  if (PidfdSendSignal(pidfd_.get(), sig) != 0 && errno != ESRCH) {
    return IoError("pidfd_send_signal to pid " + std::to_string(pid_), errno);
  }
  return Status::Ok();
}

void TestChild::Reap(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    exit_signal_ = WTERMSIG(wait_status);
    exit_code_ = 128 + exit_signal_;
  } else {
    exit_code_ = WEXITSTATUS(wait_status);
  }
  pidfd_.Reset();
}

std::optional<int> TestChild::WaitExit(milliseconds timeout) {
  if (exit_code_ || pid_ < 0) return exit_code_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    pollfd p{pidfd_.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, PollTimeout(deadline));
    if (n > 0) return WaitExit();  // exited: the waitpid does not block
    if (n < 0 && errno != EINTR) {
      // poll on a valid pidfd does not fail; should it, fall back to a non-blocking look.
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) Reap(status);
      return exit_code_;
    }
    if (n == 0 && Clock::now() >= deadline) return std::nullopt;
  }
}

int TestChild::WaitExit() {
  if (exit_code_ || pid_ < 0) return exit_code_.value_or(-1);
  int status = 0;
  pid_t r = -1;
  while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
  }
  if (r != pid_) return -1;  // not our child (cannot happen: we own it until reaped)
  Reap(status);
  return *exit_code_;
}

int TestChild::Kill() {
  if (exit_code_ || pid_ < 0) return exit_code_.value_or(-1);
  PidfdSendSignal(pidfd_.get(), SIGKILL);  // ESRCH: already exited, the wait reaps it
  return WaitExit();
}

std::string TestChild::DescribeExit() const {
  if (!exit_code_) return "running";
  if (exit_signal_ != 0) {
    return "killed by signal " + std::to_string(exit_signal_) + " (" + ::strsignal(exit_signal_) +
           ")";
  }
  return "exit code " + std::to_string(*exit_code_);
}

// ---- pipes ----------------------------------------------------------------------------------

Status TestChild::WriteLine(const std::string& line) {
  if (!stdin_) {
    return InternalError("stdin of pid " + std::to_string(pid_) + " is not an open pipe");
  }
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(stdin_.get(), data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("writing to the stdin of pid " + std::to_string(pid_), errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<std::string> TestChild::ReadLine(milliseconds timeout) {
  if (!stdout_) {
    return InternalError("stdout of pid " + std::to_string(pid_) + " is not an open pipe");
  }
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const size_t nl = stdout_buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = stdout_buffered_.substr(0, nl);
      stdout_buffered_.erase(0, nl + 1);
      return line;
    }
    const int left = PollTimeout(deadline);
    if (left == 0) {
      return Status(StatusCode::kTimeout, "no line from pid " + std::to_string(pid_) +
                                              " (partial: \"" + stdout_buffered_ + "\"); log:\n" +
                                              Log());
    }
    pollfd p{stdout_.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, left);
    if (n < 0 && errno != EINTR) return IoError("poll", errno);
    if (n <= 0) continue;
    char buf[4096];
    const ssize_t got = ::read(stdout_.get(), buf, sizeof(buf));
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("reading the stdout of pid " + std::to_string(pid_), errno);
    }
    if (got == 0) {
      return Status(StatusCode::kUnavailable, "pid " + std::to_string(pid_) +
                                                  " closed its stdout (partial: \"" +
                                                  stdout_buffered_ + "\"); log:\n" + Log());
    }
    stdout_buffered_.append(buf, static_cast<size_t>(got));
  }
}

Status TestChild::DrainOutput(std::string* out, std::string* err) {
  if (stdout_) {
    out->append(stdout_buffered_);
    stdout_buffered_.clear();
  }
  UniqueFd* pipes[2] = {&stdout_, &stderr_};
  std::string* sinks[2] = {out, err};
  pollfd fds[2] = {{stdout_.get(), POLLIN, 0}, {stderr_.get(), POLLIN, 0}};  // -1: ignored
  char buf[65536];
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return IoError("poll", errno);
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      const int read_errno = errno;
      pipes[i]->Reset();
      fds[i].fd = -1;
      if (n < 0) return IoError("reading the output of pid " + std::to_string(pid_), read_errno);
    }
  }
  return Status::Ok();
}

// ---- daemon Status --------------------------------------------------------------------------

Result<protocol::StatusReply> QueryStatus(const std::string& socket) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn,
                               protocol::Connection::Connect(socket, std::chrono::seconds(2)));
  return conn.QueryStatus(os::Deadline::After(std::chrono::seconds(5)));
}

Result<FoundStatus> WaitForStatus(TestChild& daemon, const StatusWait& wait) {
  // How long to wait between rounds when the daemon stays alive: there is no signal for a
  // state change but the Status reply itself.
  constexpr milliseconds kRound(10);
  const auto deadline = Clock::now() + wait.timeout;
  std::string last = "no socket yet";
  for (;;) {
    if (daemon.WaitExit(milliseconds(0)).has_value()) {
      return InternalError("daemon pid " + std::to_string(daemon.pid()) + " ended (" +
                           daemon.DescribeExit() + ") before " + wait.what + "; log:\n" +
                           daemon.Log());
    }
    for (const std::string& socket : wait.sockets()) {
      Result<protocol::StatusReply> st = QueryStatus(socket);
      if (!st.ok()) {
        last = socket + ": " + st.status().ToString();
        continue;
      }
      if (wait.reached(*st)) return FoundStatus{socket, *st};
      last = socket + ": " + std::string(protocol::CacheStateName(st->state)) + " (daemon pid " +
             std::to_string(st->pid) + ")";
    }
    if (Clock::now() >= deadline) {
      return Status(StatusCode::kTimeout, "daemon pid " + std::to_string(daemon.pid()) + ": " +
                                              wait.what + " not reached within " +
                                              std::to_string(wait.timeout.count()) +
                                              " ms; last: " + last + "; log:\n" + daemon.Log());
    }
    // The pause between rounds; the daemon's exit ends it at once (reported above).
    daemon.WaitExit(std::min(kRound, std::chrono::ceil<milliseconds>(deadline - Clock::now())));
  }
}

}  // namespace weightcache::testing
