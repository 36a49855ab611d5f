#include "launcher/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

extern char** environ;

namespace weightcache::launcher {
namespace {

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
  UniqueFd log(::open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  if (!log) return IoError("opening log file " + options.log_path, errno);
  UniqueFd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!null_in) return IoError("opening /dev/null", errno);

  SpawnAttrs a;
  // dup2 clears CLOEXEC on the targets only; the originals stay CLOEXEC and vanish at exec.
  posix_spawn_file_actions_adddup2(&a.actions, null_in.get(), STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&a.actions, log.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&a.actions, log.get(), STDERR_FILENO);
  sigset_t empty, all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&a.attr, &empty);
  posix_spawnattr_setsigdefault(&a.attr, &all);
  posix_spawnattr_setflags(&a.attr,
                           POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSID);

  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& kv : options.env_overrides) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    std::erase_if(env_strings, [&](const std::string& s) { return s.starts_with(key); });
    env_strings.push_back(kv);
  }
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = options.argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, args[0], &a.actions, &a.attr, args.data(), envp.data());
  if (rc != 0) return IoError("spawning " + options.argv[0], rc);

  UniqueFd pidfd(PidfdOpen(pid));
  if (!pidfd) {
    // Without a pidfd we cannot watch it safely: take it down while the pid is still ours
    // (an unreaped child's pid cannot be recycled, so kill() here is exact).
    int err = errno;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return IoError("pidfd_open for child " + std::to_string(pid), err);
  }
  return ChildProcess(pid, std::move(pidfd));
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      pidfd_(std::move(other.pidfd_)),
      exit_(std::exchange(other.exit_, std::nullopt)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    KillAndReap();
    pid_ = std::exchange(other.pid_, -1);
    pidfd_ = std::move(other.pidfd_);
    exit_ = std::exchange(other.exit_, std::nullopt);
  }
  return *this;
}

ChildProcess::~ChildProcess() { KillAndReap(); }

void ChildProcess::KillAndReap() {
  if (pid_ < 0 || exit_.has_value()) return;
  if (pidfd_) PidfdSendSignal(pidfd_.get(), SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  exit_ = DecodeWaitStatus(status);
  pidfd_.Reset();
}

Status ChildProcess::Signal(int sig) {
  if (pid_ < 0 || exit_.has_value() || !pidfd_) {
    return InternalError("signal to child " + std::to_string(pid_) + " that is reaped or detached");
  }
  if (PidfdSendSignal(pidfd_.get(), sig) != 0) {
    // ESRCH: it has exited and waits to be reaped; the pidfd will report it.
    if (errno == ESRCH) return Status::Ok();
    return IoError("pidfd_send_signal to child " + std::to_string(pid_), errno);
  }
  return Status::Ok();
}

Result<std::optional<ExitInfo>> ChildProcess::TryReap() {
  if (exit_.has_value()) return exit_;
  if (pid_ < 0) return InternalError("reap of a detached child");
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid_, &status, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (r < 0) return IoError("waitpid for child " + std::to_string(pid_), errno);
  if (r == 0) return std::optional<ExitInfo>();
  exit_ = DecodeWaitStatus(status);
  pidfd_.Reset();
  return exit_;
}

Result<ExitInfo> ChildProcess::Wait() {
  if (exit_.has_value()) return *exit_;
  if (pid_ < 0) return InternalError("wait for a detached child");
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
  }
  if (r < 0) return IoError("waitpid for child " + std::to_string(pid_), errno);
  exit_ = DecodeWaitStatus(status);
  pidfd_.Reset();
  return *exit_;
}

void ChildProcess::Detach() {
  pid_ = -1;
  pidfd_.Reset();
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
