#include "keeper/keeper_client.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <string>

#include "common/unique_fd.h"
#include "os/fd_passing.h"
#include "os/lock_file.h"
#include "os/read_file.h"
#include "os/unix_socket.h"
#include "protocol/messages.h"

namespace weightcache::keeper {
namespace {

using protocol::Frame;
using protocol::MessageType;

// One request, one reply: the reply of type `expected`, or the keeper's Error as its Status.
Result<Frame> Exchange(const std::string& socket, Result<std::vector<uint8_t>> request,
                       std::span<const int> fds, MessageType expected,
                       std::chrono::milliseconds timeout) {
  WEIGHTCACHE_RETURN_IF_ERROR(request.status());
  const os::Deadline deadline = os::Deadline::After(timeout);
  auto conn = os::ConnectUnix(socket, timeout);
  if (!conn.ok()) {
    Status status = conn.status();
    return status.Context("keeper " + socket);
  }
  WEIGHTCACHE_RETURN_IF_ERROR(protocol::WriteFrame(conn->get(), *request, fds, deadline));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Frame reply, protocol::ReadFrame(conn->get(), protocol::Expect::kKeeperReply, deadline));
  if (reply.type == MessageType::kError) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::ErrorReply error, protocol::DecodeError(reply.payload));
    return Status(error.code, "keeper: " + error.message);
  }
  if (reply.type != expected) {
    return ProtocolError("expected " + protocol::MessageTypeName(expected) +
                         " from the keeper, got " + protocol::MessageTypeName(reply.type));
  }
  return reply;
}

// What the keeper's would-be process reports when exec fails (a status code, then why).
constexpr std::string_view kExecFailed = "10 exec of the keeper program failed\n";

// The keeper's word on its start, from its ready pipe: "0 <pid>" or "<code> <message>".
Result<pid_t> ParseReady(const std::string& text, const std::string& socket) {
  const size_t space = text.find(' ');
  if (text.empty() || space == std::string::npos) {
    return Status(StatusCode::kUnavailable, "keeper for " + socket + " exited before it was ready" +
                                                (text.empty() ? "" : " (" + text + ")"));
  }
  const std::string code_text = text.substr(0, space);
  std::string rest = text.substr(space + 1);
  while (!rest.empty() && rest.back() == '\n') rest.pop_back();
  uint32_t code = 0;
  for (char c : code_text) {
    if (c < '0' || c > '9' || code > 1000) return ProtocolError("keeper ready line: " + text);
    code = code * 10 + static_cast<uint32_t>(c - '0');
  }
  if (code == 0) {
    pid_t pid = 0;
    for (char c : rest) {
      if (c < '0' || c > '9' || pid > 100'000'000) {
        return ProtocolError("keeper ready line: " + text);
      }
      pid = pid * 10 + (c - '0');
    }
    if (pid <= 0) return ProtocolError("keeper ready line: " + text);
    return pid;
  }
  if (!IsErrorCodeValue(code)) return ProtocolError("keeper ready line: " + text);
  return Status(static_cast<StatusCode>(code), "keeper: " + rest);
}

}  // namespace

Result<StartingKeeper> StartingKeeper::Start(const SpawnOptions& options, bool watch_depositor) {
  std::string program = options.program;
  if (program.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(program, os::SelfExecutable());
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return IoError("pipe2", errno);
  UniqueFd ready_read(pipe_fds[0]);
  UniqueFd ready_write(pipe_fds[1]);
  // The depositor pipe: the keeper gets the read end, we keep the write end until the deposit.
  UniqueFd depositor_read;
  UniqueFd depositor_write;
  if (watch_depositor) {
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return IoError("pipe2", errno);
    depositor_read = UniqueFd(pipe_fds[0]);
    depositor_write = UniqueFd(pipe_fds[1]);
  }
  UniqueFd dev_null(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!dev_null) return IoError("open /dev/null", errno);

  // Everything the children need is built before fork: after it, only async-signal-safe calls.
  std::vector<std::string> args = {program,
                                   "keeper",
                                   "--socket",
                                   options.socket,
                                   "--deposit-timeout",
                                   std::to_string(options.deposit_timeout.count() / 1000.0),
                                   "--ready-fd",
                                   std::to_string(ready_write.get())};
  if (watch_depositor) {
    args.push_back("--depositor-fd");
    args.push_back(std::to_string(depositor_read.get()));
  }
  for (uid_t uid : options.allow_uids) {
    args.push_back("--allow-uid");
    args.push_back(std::to_string(uid));
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // The keeper's log lines go to our stderr when it is a file or a terminal. A pipe or a
  // socket is not handed on: a keeper outlives its daemon, and holding the write end would keep
  // whoever reads the daemon's output (a supervisor, a test) from ever seeing EOF.
  struct stat err_stat {};
  const bool stderr_kept = ::fstat(STDERR_FILENO, &err_stat) == 0 && !S_ISFIFO(err_stat.st_mode) &&
                           !S_ISSOCK(err_stat.st_mode);
  const int inherited[] = {ready_write.get(), depositor_read.get()};
  pid_t first = ::fork();
  if (first < 0) return IoError("fork", errno);
  if (first == 0) {
    // The intermediate child: a new session, then the keeper forks off it and it exits, so
    // the keeper is nobody's child but init's (or a subreaper's).
    if (::setsid() < 0) ::_exit(127);
    pid_t second = ::fork();
    if (second != 0) ::_exit(second < 0 ? 127 : 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(dev_null.get(), STDIN_FILENO);
    ::dup2(dev_null.get(), STDOUT_FILENO);
    if (!stderr_kept) ::dup2(dev_null.get(), STDERR_FILENO);
    for (int fd : inherited) {
      if (fd >= 0) ::fcntl(fd, F_SETFD, 0);  // the only fds the keeper inherits
    }
    ::execv(argv[0], argv.data());
    (void)!::write(ready_write.get(), kExecFailed.data(), kExecFailed.size());
    ::_exit(127);
  }
  ready_write.Reset();  // EOF on the pipe once the keeper closes its end
  depositor_read.Reset();
  int wstatus = 0;
  while (::waitpid(first, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return IoError("starting the keeper (setsid or fork failed)", ECHILD);
  }
  return StartingKeeper(std::move(ready_read), std::move(depositor_write), options.socket,
                        os::Deadline::After(options.start_timeout), options.start_timeout);
}

StartingKeeper::StartingKeeper(UniqueFd ready, UniqueFd depositor, std::string socket,
                               os::Deadline deadline, std::chrono::milliseconds start_timeout)
    : ready_(std::move(ready)),
      depositor_(std::move(depositor)),
      socket_(std::move(socket)),
      deadline_(deadline),
      start_timeout_(start_timeout) {}

Result<pid_t> StartingKeeper::WaitReady() {
  if (!ready_) return InternalError("keeper " + socket_ + ": its start was already read");
  std::string text;
  while (true) {
    Status ready = os::WaitFor(ready_.get(), POLLIN, deadline_);
    if (!ready.ok()) {
      return Status(StatusCode::kTimeout, "keeper for " + socket_ + " not ready within " +
                                              std::to_string(start_timeout_.count()) + " ms");
    }
    char buf[512];
    ssize_t n = ::read(ready_.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("reading the keeper's ready pipe", errno);
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > 4096) break;
  }
  ready_.Reset();
  return ParseReady(text, socket_);
}

Result<StartingKeeper> StartKeeper(const SpawnOptions& options) {
  return StartingKeeper::Start(options, /*watch_depositor=*/true);
}

Result<pid_t> SpawnKeeper(const SpawnOptions& options) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(StartingKeeper starting,
                               StartingKeeper::Start(options, /*watch_depositor=*/false));
  return starting.WaitReady();
}

Status DepositToKeeper(const std::string& socket, const protocol::DepositInfo& info,
                       int manifest_fd, std::span<const int> allocation_fds,
                       std::chrono::milliseconds timeout) {
  std::vector<int> fds = {manifest_fd};
  fds.insert(fds.end(), allocation_fds.begin(), allocation_fds.end());
  return Exchange(socket, protocol::EncodeDeposit(info), fds, MessageType::kDepositReply, timeout)
      .status();
}

Result<std::optional<protocol::Handoff>> TryWithdraw(const KeeperPaths& paths,
                                                     const protocol::AdoptOptions& adopt,
                                                     std::chrono::milliseconds timeout,
                                                     const protocol::FdCheck& gpu_fd_check) {
  if (!os::IsLockHeld(paths.lock)) return std::optional<protocol::Handoff>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Frame reply, Exchange(paths.socket, protocol::EncodeWithdraw(adopt.expected_digest), {},
                            MessageType::kWithdrawReply, timeout));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Handoff handoff,
                               protocol::DecodeHandoff(std::move(reply), gpu_fd_check));
  WEIGHTCACHE_RETURN_IF_ERROR(protocol::CheckAdoptable(handoff, adopt));
  return std::optional<protocol::Handoff>(std::move(handoff));
}

Result<std::optional<protocol::KeeperQuery>> QueryKeeper(const KeeperPaths& paths,
                                                         std::chrono::milliseconds timeout) {
  if (!os::IsLockHeld(paths.lock)) return std::optional<protocol::KeeperQuery>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Frame reply, Exchange(paths.socket, protocol::EncodeEmptyHandoff(MessageType::kQuery), {},
                            MessageType::kQueryReply, timeout));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::KeeperQuery query,
                               protocol::DecodeQueryReply(reply.payload));
  return std::optional<protocol::KeeperQuery>(std::move(query));
}

Status DropKeeper(const KeeperPaths& paths, std::chrono::milliseconds timeout) {
  if (!os::IsLockHeld(paths.lock)) {
    return Status(StatusCode::kNoDaemon, "no live keeper at " + paths.socket);
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Frame reply, Exchange(paths.socket, protocol::EncodeEmptyHandoff(MessageType::kDrop), {},
                            MessageType::kDropReply, timeout));
  return protocol::CheckEmptyHandoff(reply.type, reply.payload);
}

}  // namespace weightcache::keeper
