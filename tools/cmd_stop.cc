// `weightcache stop`: ask daemons to stop, and wait until they have
// (docs/design.md "Command line").
//
// Which daemons: the identity flags of `serve` (the same socket `serve` computed), or
// --socket PATH alone (a literal socket), or --all (every live cache of the namespace, or of
// every namespace with --all-namespaces). Each gets a Stop request; `stop` then waits until
// the socket is gone AND its lock is free, i.e. the daemon has exited and a successor can
// start at once. Exit codes: 0 all stopped; 3 no live daemon at the socket; 6 timeout;
// otherwise the daemon's refusal (e.g. 1 for another uid's daemon).
//
// A stopped daemon drops its keeper itself (docs/keeper.md). A cache whose daemon is gone but
// whose keeper lives (an orphan: the daemon was killed) is stopped by dropping the keeper: its
// memory is freed, and `stop` waits until the keeper has exited. --all includes orphans.
//
// --all then removes the stale files of every cache of the namespace (or of all) whose locks are
// free (daemon/stale_files.h: socket, lock, keeper socket and lock, ledger entries of dead
// owners), one line per cache; `--json` prints them in `cleaned`.
#include <sys/stat.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_common.h"
#include "daemon/stale_files.h"
#include "identity/paths.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "protocol/connection.h"

namespace weightcache::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct StopArgs {
  IdentityOptions identity;
  bool all = false;
  bool all_namespaces = false;
  bool json = false;
  double timeout_s = 30;
};

using identity::LockPathFor;

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

struct Target {
  std::string socket;
  std::string lock;
  bool orphan = false;  // no live daemon: its keeper is dropped instead (DropOrphan)
};

keeper::KeeperPaths KeeperOf(const std::string& socket) {
  const std::string keeper_socket = identity::KeeperSocketFor(socket);
  return {keeper_socket, LockPathFor(keeper_socket)};
}

// Whether `socket`'s daemon is gone but its keeper lives.
bool IsOrphan(const std::string& socket) {
  return !os::IsLockHeld(LockPathFor(socket)) && os::IsLockHeld(KeeperOf(socket).lock);
}

// Frees an orphan's memory: Drop to its keeper.
Status DropOrphan(const Target& t, std::chrono::milliseconds timeout) {
  const keeper::KeeperPaths k = KeeperOf(t.socket);
  auto held = keeper::QueryKeeper(k, timeout);
  Status dropped = keeper::DropKeeper(k, timeout);
  if (!dropped.ok()) return dropped.Context("freeing the orphan keeper of " + t.socket);
  std::cerr << "weightcache stop: " << t.socket << ": no daemon; its keeper"
            << (held.ok() && held->has_value()
                    ? " (pid " + std::to_string((*held)->keeper_pid) + ", " +
                          std::to_string((*held)->bytes) + " bytes)"
                    : std::string())
            << " is freeing the cache's memory" << std::endl;
  return Status::Ok();
}

// Sends Stop; returns the daemon's pid for the log line.
Status SendStop(const Target& t, std::chrono::milliseconds timeout) {
  if (!os::IsLockHeld(t.lock)) {
    return Status(StatusCode::kNoDaemon, "no live daemon at " + t.socket +
                                             (PathExists(t.socket) ? " (stale socket)" : ""));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn, protocol::Connection::Connect(t.socket, timeout));
  auto reply = conn.Stop(os::Deadline::After(timeout));
  if (!reply.ok()) {
    Status status = reply.status();
    return status.Context("stopping " + t.socket);
  }
  std::cerr << "weightcache stop: " << t.socket << ": stopping (" << reply->clients
            << " attached client(s) keep their mappings)" << std::endl;
  return Status::Ok();
}

// --all's last step: the stale files of every cache whose locks are free, one line each.
Status SweepAfterStop(const StopArgs& args, const std::string& runtime_dir, const std::string& ns,
                      nlohmann::json& out) {
  auto sweep = daemon::SweepStaleFiles(
      runtime_dir, args.all_namespaces ? std::nullopt : std::optional<std::string>(ns));
  if (!sweep.ok()) return sweep.status();
  for (const daemon::CleanedCache& c : sweep->cleaned) {
    std::cerr << "weightcache stop: " << daemon::DescribeCleaned(c) << std::endl;
  }
  for (const std::string& w : sweep->warnings) {
    std::cerr << "weightcache stop: warning: " << w << std::endl;
  }
  out["cleaned"] = daemon::CleanedToJson(sweep->cleaned);
  out["warnings"] = sweep->warnings;
  return Status::Ok();
}

int Run(StopArgs& args) {
  constexpr std::string_view kCmd = "stop";
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  nlohmann::json out = {{"stopped", nlohmann::json::array()}};
  const auto finish = [&](int code) {
    if (args.json) {
      out["exit_code"] = code;
      std::cout << out.dump() << std::endl;
    }
    return code;
  };
  std::vector<Target> targets;
  std::string runtime_dir;
  const std::string ns = args.identity.namespace_name.empty()
                             ? std::string(identity::kDefaultNamespace)
                             : args.identity.namespace_name;
  if (args.all) {
    auto runtime = identity::ResolveRuntimeDir(args.identity.runtime_dir, identity::ProcessEnv());
    if (!runtime.ok()) return finish(Fail(kCmd, runtime.status()));
    runtime_dir = runtime->path;
    auto entries = identity::ListAllCacheSockets(runtime->path);
    if (!entries.ok()) return finish(Fail(kCmd, entries.status()));
    for (const auto& e : *entries) {
      if (!args.all_namespaces && e.namespace_name != ns) continue;
      const std::string lock = LockPathFor(e.socket);
      if (os::IsLockHeld(lock)) targets.push_back({e.socket, lock});
    }
    auto keepers = identity::ListAllKeeperSockets(runtime->path);
    if (!keepers.ok()) return finish(Fail(kCmd, keepers.status()));
    for (const auto& k : *keepers) {
      if (!args.all_namespaces && k.namespace_name != ns) continue;
      const std::string socket = identity::CacheSocketForKeeper(k.socket);
      if (IsOrphan(socket)) targets.push_back({socket, LockPathFor(socket), true});
    }
    if (targets.empty()) {
      std::cerr << "weightcache stop: no live daemon under " << runtime->path << std::endl;
      if (Status s = SweepAfterStop(args, runtime_dir, ns, out); !s.ok()) {
        return finish(Fail(kCmd, s));
      }
      return finish(kExitOk);
    }
  } else if (args.identity.model_dir.empty()) {
    const std::string& socket = args.identity.socket;
    if (socket.empty()) {
      return finish(Fail(kCmd, InvalidArgument("give the identity flags (--model …), --socket PATH "
                                               "or --all")));
    }
    if (socket.find('{') != std::string::npos) {
      return finish(Fail(kCmd, InvalidArgument("--socket " + socket +
                                               " is a template; without --model it cannot be "
                                               "expanded (give the identity flags too)")));
    }
    targets.push_back({socket, LockPathFor(socket)});
  } else {
    auto id = identity::ResolveIdentity(args.identity);
    if (!id.ok()) return finish(Fail(kCmd, id.status()));
    targets.push_back({id->paths.socket, id->paths.lock});
  }
  for (Target& t : targets) t.orphan = t.orphan || IsOrphan(t.socket);

  Status first_error;
  std::vector<Target> waiting;
  for (const auto& t : targets) {
    Status s = t.orphan ? DropOrphan(t, timeout) : SendStop(t, timeout);
    if (!s.ok()) {
      std::cerr << "weightcache stop: " << s.ToString() << std::endl;
      if (first_error.ok()) first_error = s;
      continue;
    }
    waiting.push_back(t);
  }
  // Stopped = the socket is withdrawn and the lock released (the process has exited).
  const auto deadline = Clock::now() + timeout;
  for (const auto& t : waiting) {
    // A stopped daemon drops its keeper before it exits; an orphan's keeper exits on its Drop.
    const std::string keeper_lock = KeeperOf(t.socket).lock;
    while ((!t.orphan && PathExists(t.socket)) || os::IsLockHeld(t.lock) ||
           os::IsLockHeld(keeper_lock)) {
      if (Clock::now() >= deadline) {
        return finish(Fail(
            kCmd, Status(StatusCode::kTimeout, "daemon at " + t.socket + " still running after " +
                                                   std::to_string(args.timeout_s) + " s")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::cerr << "weightcache stop: " << t.socket << ": stopped" << std::endl;
    out["stopped"].push_back(t.socket);
  }
  if (args.all) {
    if (Status s = SweepAfterStop(args, runtime_dir, ns, out); !s.ok()) {
      return finish(Fail(kCmd, s));
    }
  }
  if (!first_error.ok()) return finish(ExitCodeFor(first_error));
  return finish(kExitOk);
}

}  // namespace

void RegisterStopCommand(CLI::App& root) {
  auto args = std::make_shared<StopArgs>();
  CLI::App* sub = root.add_subcommand(
      "stop",
      "Stop daemons: by identity flags, by --socket PATH, or --all; waits for exit. --all then "
      "removes the stale files (socket, lock, keeper's, ledger entries) of every cache whose "
      "lock is free");
  AddIdentityFlags(sub, &args->identity, IdentityScope::kOneCache);
  // The identity is one way to name a daemon among three: --model is optional here.
  sub->get_option("--model")->required(false);
  sub->add_flag("--all", args->all, "every live daemon of the namespace");
  sub->add_flag("--all-namespaces", args->all_namespaces, "with --all: of every namespace");
  sub->add_flag("--json", args->json,
                "print one JSON object: the sockets stopped and, with --all, the stale files "
                "removed (`cleaned`)");
  sub->add_option("--timeout", args->timeout_s, "seconds to wait for the daemons to exit")
      ->check(Positive());
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
