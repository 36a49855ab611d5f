#include "launcher/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

extern char** environ;

namespace weightcache::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// glibc 2.36 has wrappers, older ones do not; the raw syscalls work wherever the kernel does
// (pidfd_open: Linux 5.3).
int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0u)); }
int PidfdSendSignal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0u));
}

ExitInfo DecodeWaitStatus(int status) {
  ExitInfo info;
  if (WIFEXITED(status)) {
    info.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    info.signal = WTERMSIG(status);
  }
  return info;
}

// A poll() timeout for what is left until `deadline`: rounded up (so a wait never ends early
// and spins), never negative, at most INT_MAX ms.
int PollTimeout(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

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

// argv/envp for posix_spawn: pointers into `strings`, which must outlive them.
std::vector<char*> NullTerminated(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
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

}  // namespace

std::string ExitInfo::ToString() const {
  if (exited()) return "exit code " + std::to_string(exit_code);
  return "killed by signal " + std::to_string(signal) + " (" + ::strsignal(signal) + ")";
}

Result<ChildProcess> ChildProcess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty() || options.argv[0].empty() || options.argv[0][0] != '/') {
    return InvalidArgument("spawn needs an absolute program path");
  }
  const Stdio streams[3] = {options.in, options.out, options.err};
  const auto uses = [&](Stdio s) { return std::ranges::find(streams, s) != std::end(streams); };

  UniqueFd log;
  if (uses(Stdio::kLog)) {
    if (options.log_path.empty()) return InvalidArgument("a kLog stream needs a log_path");
    log.Reset(::open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    if (!log) return IoError("opening log file " + options.log_path, errno);
  }
  UniqueFd null;
  if (uses(Stdio::kNull)) {
    null.Reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!null) return IoError("opening /dev/null", errno);
  }
  // For each piped stream, the end the child gets (dup2'ed onto 0, 1 or 2) and the parent's.
  UniqueFd child_end[3];
  StdioPipes pipes;
  UniqueFd* const parent_end[3] = {&pipes.in, &pipes.out, &pipes.err};
  for (int i = 0; i < 3; ++i) {
    if (streams[i] != Stdio::kPipe) continue;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return IoError("pipe2", errno);
    UniqueFd read_end(fds[0]);
    UniqueFd write_end(fds[1]);
    child_end[i] = std::move(i == STDIN_FILENO ? read_end : write_end);
    *parent_end[i] = std::move(i == STDIN_FILENO ? write_end : read_end);
  }

  SpawnAttrs a;
  for (int i = 0; i < 3; ++i) {
    // dup2 clears CLOEXEC on the target only; the originals stay CLOEXEC and vanish at exec.
    int source = -1;  // kInherit: the parent's stream stays
    if (streams[i] == Stdio::kLog) source = log.get();
    if (streams[i] == Stdio::kNull) source = null.get();
    if (streams[i] == Stdio::kPipe) source = child_end[i].get();
    if (source >= 0) posix_spawn_file_actions_adddup2(&a.actions, source, i);
  }
  for (const auto& [source, target] : options.pass_fds) {
    if (source < 0 || target <= STDERR_FILENO) {
      return InvalidArgument("pass_fds: fd " + std::to_string(source) + " onto " +
                             std::to_string(target) + " (targets start at 3)");
    }
    posix_spawn_file_actions_adddup2(&a.actions, source, target);
  }
  sigset_t empty;
  sigset_t all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&a.attr, &empty);
  posix_spawnattr_setsigdefault(&a.attr, &all);
  int flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (options.session == Session::kNew) flags |= POSIX_SPAWN_SETSID;
  posix_spawnattr_setflags(&a.attr, static_cast<short>(flags));

  std::vector<std::string> env = MergedEnv(options.env_overrides);
  std::vector<std::string> argv = options.argv;
  std::vector<char*> envp = NullTerminated(env);
  std::vector<char*> args = NullTerminated(argv);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, args[0], &a.actions, &a.attr, args.data(), envp.data());
  if (rc != 0) return IoError("spawning " + options.argv[0], rc);

  UniqueFd pidfd(PidfdOpen(pid));
  if (!pidfd) {
    // Without a pidfd we cannot watch it safely: take it down while the pid is still ours
    // (an unreaped child's pid cannot be recycled, so kill() here is exact).
    const int err = errno;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return IoError("pidfd_open for child " + std::to_string(pid), err);
  }
  return ChildProcess(pid, pidfd.Release(), std::move(pipes));
}

void ChildTraits::Close(NoContext /*unused*/, const Handle& h) noexcept {
  PidfdSendSignal(h.pidfd, SIGKILL);
  while (::waitpid(h.pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  ::close(h.pidfd);
}

void ChildProcess::Reaped(int wait_status) {
  exit_ = DecodeWaitStatus(wait_status);
  ::close(child_.Release().pidfd);
}

Status ChildProcess::Signal(int sig) {
  if (exit_.has_value()) {
    return InternalError("signal " + std::to_string(sig) + " to child " + std::to_string(pid_) +
                         ", which is reaped (" + exit_->ToString() + ")");
  }
  if (!child_) return InternalError("signal " + std::to_string(sig) + " to a detached child");
  if (PidfdSendSignal(child_.get().pidfd, sig) != 0) {
    // ESRCH: it has exited and waits to be reaped; the pidfd will report it.
    if (errno == ESRCH) return Status::Ok();
    return IoError("pidfd_send_signal to child " + std::to_string(pid_), errno);
  }
  return Status::Ok();
}

Result<std::optional<ExitInfo>> ChildProcess::TryReap() {
  if (exit_.has_value()) return exit_;
  if (!child_) return InternalError("reap of a detached child");
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid_, &status, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (r < 0) return IoError("waitpid for child " + std::to_string(pid_), errno);
  if (r == 0) return std::optional<ExitInfo>();
  Reaped(status);
  return exit_;
}

Result<std::optional<ExitInfo>> ChildProcess::WaitFor(std::chrono::milliseconds timeout) {
  if (exit_.has_value()) return exit_;
  if (!child_) return InternalError("wait for a detached child");
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    pollfd p{child_.get().pidfd, POLLIN, 0};
    const int n = ::poll(&p, 1, PollTimeout(deadline));
    if (n > 0) {
      // Exited: the waitpid in Wait() returns at once.
      WEIGHTCACHE_ASSIGN_OR_RETURN(ExitInfo exit, Wait());
      return std::optional<ExitInfo>(exit);
    }
    if (n < 0 && errno != EINTR) {
      return IoError("poll on the pidfd of child " + std::to_string(pid_), errno);
    }
    if (n == 0 && Clock::now() >= deadline) return std::optional<ExitInfo>();
  }
}

Result<ExitInfo> ChildProcess::Wait() {
  if (exit_.has_value()) return *exit_;
  if (!child_) return InternalError("wait for a detached child");
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
  }
  if (r < 0) return IoError("waitpid for child " + std::to_string(pid_), errno);
  Reaped(status);
  return *exit_;
}

void ChildProcess::Detach() {
  pid_ = -1;
  if (child_) ::close(child_.Release().pidfd);
}

std::vector<std::string> TailLines(const std::string& path, size_t max_lines, size_t max_bytes) {
  std::vector<std::string> lines;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return lines;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return lines;
  const off_t size = st.st_size;
  const off_t start =
      size > static_cast<off_t>(max_bytes) ? size - static_cast<off_t>(max_bytes) : 0;
  std::string buf(static_cast<size_t>(size - start), '\0');
  size_t got = 0;
  while (got < buf.size()) {
    ssize_t n =
        ::pread(fd.get(), buf.data() + got, buf.size() - got, start + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  buf.resize(got);
  // When the read began mid-file its first line is partial: drop it.
  size_t pos = 0;
  if (start > 0) {
    size_t nl = buf.find('\n');
    pos = nl == std::string::npos ? buf.size() : nl + 1;
  }
  while (pos < buf.size()) {
    size_t nl = buf.find('\n', pos);
    if (nl == std::string::npos) nl = buf.size();
    lines.emplace_back(buf.substr(pos, nl - pos));
    pos = nl + 1;
  }
  if (lines.size() > max_lines)
    lines.erase(lines.begin(), lines.end() - static_cast<long>(max_lines));
  return lines;
}

}  // namespace weightcache::launcher
