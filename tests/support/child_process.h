// TestChild — one process a test spawns (a `weightcache serve` daemon, a client, a one-shot
// command), its standard streams on /dev/null, a log file or pipes, its exit watched through a
// pidfd; and WaitForStatus, which polls daemon sockets until a Status reply is the one wanted.
// Every tier's support code spawns and waits through these (test_env's RunCommand, the
// integration tier's ServeProcess, the gpu tier's Daemon and PipedChild). The spawning, the
// pidfd and the exit are the launcher's ChildProcess (launcher/child_process.h), the one
// spawner of the project; this adds the tests' conveniences (exit codes as a shell reports
// them, waits with a timeout, line-wise pipes).
//
// Contract:
//  * Spawn() starts argv[0] (a path, no PATH search; a relative one is taken from the current
//    directory) with this process's environment plus the overrides, every signal unblocked and
//    at its default disposition, in the test's own process group (a Ctrl-C or a kill of the
//    test's group reaches its children too).
//  * Exit codes are the exit status, or 128 + the signal when the child was killed.
//  * WaitExit blocks in poll() on the pidfd: it returns as soon as the child exits, never
//    later, and never sleeps in steps. Signals go through the pidfd, so they can never reach
//    a recycled pid.
//  * Destruction SIGKILLs and reaps a child that is still running and closes the pipes: no test
//    leaks a process (a daemon, or a client holding GPU memory).
//  * Move-only. Not thread-safe: one test thread drives a TestChild (different TestChilds may
//    live on different threads; every fd is CLOEXEC, so a concurrent spawn inherits none).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "launcher/child_process.h"
#include "protocol/messages.h"
#include "weightcache/status.h"

namespace weightcache::testing {

// Where one standard stream of the child goes: kInherit (the test's own), kNull (/dev/null),
// kLog (appended to ChildSpec::log_path) or kPipe (a pipe to the test: WriteLine for stdin,
// ReadLine / DrainOutput for stdout and stderr).
using Stdio = launcher::Stdio;

struct ChildSpec {
  std::vector<std::string> argv;  // argv[0]: the program's path
  // "NAME=VALUE" entries replacing NAME in (or adding to) the inherited environment.
  std::vector<std::string> env_overrides;
  std::string log_path = {};  // where the kLog streams go; created 0600 if absent, appended to
  Stdio in = Stdio::kNull;
  Stdio out = Stdio::kLog;
  Stdio err = Stdio::kLog;
};

class TestChild {
 public:
  // kInvalidArgument for an empty argv or a kLog stream without a log_path; an I/O error when
  // the log, a pipe, the spawn or the pidfd fails (no child is left running then).
  static Result<TestChild> Spawn(const ChildSpec& spec);

  // Moving a TestChild onto one that still runs kills and reaps that one first.
  TestChild(TestChild&& other) noexcept = default;
  TestChild& operator=(TestChild&& other) noexcept = default;
  TestChild(const TestChild&) = delete;
  TestChild& operator=(const TestChild&) = delete;
  ~TestChild() = default;

  pid_t pid() const { return process_.pid(); }
  const std::string& log_path() const { return log_path_; }
  // The log file as it is now ("" when there is none).
  std::string Log() const;

  // Sends `sig` through the pidfd. A child that exited but is not reaped yet is no error; one
  // already reaped (its exit code known) is kInternal.
  Status Signal(int sig);
  // The exit code once the child has exited (it is then reaped), or std::nullopt if it still
  // runs after `timeout` (0: just look).
  std::optional<int> WaitExit(std::chrono::milliseconds timeout);
  // Blocks until the child exits; its exit code.
  int WaitExit();
  bool Running() { return !WaitExit(std::chrono::milliseconds(0)).has_value(); }
  // SIGKILL, then reap: the exit code (128 + SIGKILL, unless it had ended before).
  int Kill();
  // "exit code 3", "killed by signal 9 (Killed)", or "running".
  std::string DescribeExit() const;

  // Writes `line` and a '\n' to the stdin pipe; CloseStdin closes it (the child reads EOF).
  Status WriteLine(const std::string& line);
  void CloseStdin() { stdin_.Reset(); }
  // The next line of the stdout pipe, without its '\n': kTimeout when none is complete by
  // `timeout`, kUnavailable when the child closed its stdout first.
  Result<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Reads the stdout and stderr pipes (those that are pipes) together until both reach EOF,
  // so that neither can fill up and block the child; appends what they carried.
  Status DrainOutput(std::string* out, std::string* err);

 private:
  TestChild(launcher::ChildProcess process, std::string log_path);

  // Declared first, so destroyed last: the child is killed and reaped after the pipes close.
  launcher::ChildProcess process_;
  std::string log_path_;
  UniqueFd stdin_;               // write end
  UniqueFd stdout_;              // read end
  std::string stdout_buffered_;  // read but not yet returned by ReadLine
  UniqueFd stderr_;              // read end
};

// `weightcache serve <serve_args>` (CliPath()), stdin on /dev/null, stdout and stderr appended
// to `log_path`, at WEIGHTCACHE_LOG_LEVEL=info: the tests read the daemon's info lines, and
// ctest runs them with WEIGHTCACHE_LOG_LEVEL=warn. `env_overrides` as in ChildSpec.
Result<TestChild> SpawnServe(const std::vector<std::string>& serve_args,
                             const std::vector<std::string>& env_overrides,
                             const std::string& log_path);

// The Status reply of the daemon at `socket` (2 s to connect, 5 s for the reply).
Result<protocol::StatusReply> QueryStatus(const std::string& socket);

// What WaitForStatus waits for.
struct StatusWait {
  // The sockets to ask, listed again on every round (a daemon creates its socket late).
  std::function<std::vector<std::string>()> sockets;
  // Whether a reply is the one waited for.
  std::function<bool(const protocol::StatusReply&)> reached;
  std::string what;  // for the error messages, e.g. "state ready"
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
};

struct FoundStatus {
  std::string socket;
  protocol::StatusReply status;
};

// Asks every listed socket for its Status, round after round, until one reply is `reached`:
// that socket and its reply. Between rounds it waits on `daemon`'s exit, so a daemon that dies
// ends the wait at once: kInternal with its exit and its log. kTimeout, with the last reply or
// error seen and the log, when nothing reached `what` in time.
Result<FoundStatus> WaitForStatus(TestChild& daemon, const StatusWait& wait);

}  // namespace weightcache::testing
