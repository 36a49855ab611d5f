#include "support/child_process.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <system_error>
#include <utility>

#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A poll() timeout for what is left until `deadline`: rounded up (so a wait never ends early
// and spins), never negative, at most INT_MAX ms.
int PollTimeout(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
}

// The exit code as a shell reports it: the exit status, or 128 + the signal that killed it.
int ExitCode(const launcher::ExitInfo& exit) {
  return exit.exited() ? exit.exit_code : 128 + exit.signal;
}

}  // namespace

// ---- spawning -------------------------------------------------------------------------------

Result<TestChild> TestChild::Spawn(const ChildSpec& spec) {
  if (spec.argv.empty() || spec.argv[0].empty()) return InvalidArgument("spawn needs a program");
  launcher::SpawnOptions options{.argv = spec.argv,
                                 .env_overrides = spec.env_overrides,
                                 .log_path = spec.log_path,
                                 .in = spec.in,
                                 .out = spec.out,
                                 .err = spec.err,
                                 .session = launcher::Session::kInherit,
                                 .pass_fds = {}};
  // ChildProcess takes absolute paths only; a relative one names a file in this directory.
  if (options.argv[0].front() != '/') {
    std::error_code ec;
    options.argv[0] = std::filesystem::absolute(spec.argv[0], ec).string();
    if (ec) return IoError("resolving " + spec.argv[0], ec.value());
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(launcher::ChildProcess process,
                               launcher::ChildProcess::Spawn(options));
  return TestChild(std::move(process), spec.log_path);
}

TestChild::TestChild(launcher::ChildProcess process, std::string log_path)
    : process_(std::move(process)), log_path_(std::move(log_path)) {
  launcher::StdioPipes pipes = process_.TakePipes();
  stdin_ = std::move(pipes.in);
  stdout_ = std::move(pipes.out);
  stderr_ = std::move(pipes.err);
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

std::string TestChild::Log() const { return log_path_.empty() ? "" : ReadFile(log_path_); }

// ---- signals and exit -----------------------------------------------------------------------

Status TestChild::Signal(int sig) { return process_.Signal(sig); }

std::optional<int> TestChild::WaitExit(milliseconds timeout) {
  Result<std::optional<launcher::ExitInfo>> exit = process_.WaitFor(timeout);
  // An error: a moved-from TestChild (no child to wait for), or a poll() that failed.
  if (!exit.ok() || !exit->has_value()) return std::nullopt;
  return ExitCode(**exit);
}

int TestChild::WaitExit() {
  Result<launcher::ExitInfo> exit = process_.Wait();
  return exit.ok() ? ExitCode(*exit) : -1;
}

int TestChild::Kill() {
  // Fails only for a child that is reaped already (or a moved-from TestChild): the wait then
  // reports the exit it had.
  (void)process_.Signal(SIGKILL);
  return WaitExit();
}

std::string TestChild::DescribeExit() const {
  const std::optional<launcher::ExitInfo>& exit = process_.exit_info();
  return exit ? exit->ToString() : "running";
}

// ---- pipes ----------------------------------------------------------------------------------

Status TestChild::WriteLine(const std::string& line) {
  if (!stdin_) {
    return InternalError("stdin of pid " + std::to_string(pid()) + " is not an open pipe");
  }
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(stdin_.get(), data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("writing to the stdin of pid " + std::to_string(pid()), errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<std::string> TestChild::ReadLine(milliseconds timeout) {
  if (!stdout_) {
    return InternalError("stdout of pid " + std::to_string(pid()) + " is not an open pipe");
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
      return Status(StatusCode::kTimeout, "no line from pid " + std::to_string(pid()) +
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
      return IoError("reading the stdout of pid " + std::to_string(pid()), errno);
    }
    if (got == 0) {
      return Status(StatusCode::kUnavailable, "pid " + std::to_string(pid()) +
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
      if (n < 0) return IoError("reading the output of pid " + std::to_string(pid()), read_errno);
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
