// `weightcache keeper`: the process that holds one cache's fds so that they outlive its daemon
// (docs/keeper.md). Internal: a daemon starts it (keeper::SpawnKeeper), so the root `--help`
// does not list it; `weightcache keeper --help` explains it.
//
// Exit codes: 0 after a Drop or SIGTERM/SIGINT/SIGHUP, or when --depositor-fd closed before a
// deposit; 6 when no deposit arrived within --deposit-timeout; 7 when a keeper for this socket
// already runs; 2 usage; 1 otherwise.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli_common.h"
#include "common/unique_fd.h"
#include "identity/paths.h"
#include "keeper/keeper.h"

namespace weightcache::cli {
namespace {

struct KeeperArgs {
  std::string socket;
  std::vector<uint32_t> allow_uids;
  double deposit_timeout_s = 60;
  int ready_fd = -1;
  int depositor_fd = -1;
};

// Tells the spawner how the start went, on the pipe it passed (--ready-fd), then closes it:
// "0 <pid>" once the socket is published, "<status code> <message>" when the start failed.
void ReportReady(int fd, const Status& status) {
  if (fd < 0) return;
  std::string line = status.ok() ? "0 " + std::to_string(::getpid())
                                 : std::to_string(static_cast<uint32_t>(status.code())) + " " +
                                       std::string(status.message());
  line += "\n";
  (void)!::write(fd, line.data(), line.size());
  ::close(fd);
}

int Run(const KeeperArgs& args) {
  constexpr std::string_view kCmd = "keeper";
  auto signals = TakeShutdownSignals();
  if (!signals.ok()) {
    ReportReady(args.ready_fd, signals.status());
    return Fail(kCmd, signals.status());
  }
  keeper::KeeperOptions options;
  options.socket = args.socket;
  options.lock = identity::LockPathFor(args.socket);
  options.allow_uids.assign(args.allow_uids.begin(), args.allow_uids.end());
  options.deposit_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(args.deposit_timeout_s * 1000));
  // The depositor pipe's read end (StartKeeper): owned from here, checked to be a pipe.
  UniqueFd depositor(args.depositor_fd);
  if (depositor) {
    struct stat st {};
    if (::fstat(depositor.get(), &st) != 0 || !S_ISFIFO(st.st_mode)) {
      Status status = InvalidArgument("--depositor-fd " + std::to_string(args.depositor_fd) +
                                      " is not an open pipe");
      ReportReady(args.ready_fd, status);
      return Fail(kCmd, status);
    }
    ::fcntl(depositor.get(), F_SETFD, FD_CLOEXEC);
  }
  auto keeper = keeper::Keeper::Create(options);
  if (!keeper.ok()) {
    ReportReady(args.ready_fd, keeper.status());
    return Fail(kCmd, keeper.status());
  }
  ReportReady(args.ready_fd, Status::Ok());
  Status done = (*keeper)->Run(signals->get(), depositor.get());
  if (!done.ok()) return Fail(kCmd, done);
  return kExitOk;
}

}  // namespace

void RegisterKeeperCommand(CLI::App& root) {
  auto args = std::make_shared<KeeperArgs>();
  CLI::App* sub = root.add_subcommand(
      "keeper",
      "Internal: hold one cache's memory (its sealed memfds or VMM fds) so that it outlives "
      "the daemon. A daemon starts it next to its socket (<digest16>.keeper.sock) and deposits "
      "its ready cache; a restarted daemon withdraws and checks it instead of reloading. It "
      "exits on Drop, on SIGTERM, or when no deposit arrives (its depositor exited first, or "
      "in time). See docs/keeper.md.");
  sub->group("");  // internal: not in the root --help
  sub->add_option("--socket", args->socket, "the keeper socket to publish (its lock: .keeper.lock)")
      ->required();
  sub->add_option("--allow-uid", args->allow_uids,
                  "a uid besides ours that may Query and Withdraw (the socket is then 0666; "
                  "SO_PEERCRED decides)");
  sub->add_option("--deposit-timeout", args->deposit_timeout_s,
                  "seconds to wait for the deposit before exiting (default 60)")
      ->check(Positive());
  sub->add_option("--depositor-fd", args->depositor_fd,
                  "an inherited pipe whose write end only the depositor holds: the keeper waits "
                  "for the deposit while it is open (no --deposit-timeout) and exits if it "
                  "closes first (the depositor died or gave up)")
      ->check(AtLeast(0));
  sub->add_option("--ready-fd", args->ready_fd,
                  "an inherited fd on which to report the start (\"0 <pid>\" or the error), then "
                  "close");
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
