// What a daemon (or a tool) does with a keeper (docs/keeper.md): start one, deposit a ready
// cache with it, withdraw and check that cache after a restart, ask what it holds, drop it.
// The daemon's policy over them (deposit at ready, withdraw at start, drop at a deliberate
// stop) is daemon/keeper_link.h; `ls` and `stop` use QueryKeeper and DropKeeper for orphans.
//
// Contract:
//  * Paths come from identity::CachePaths (keeper_socket, keeper_lock): the one rule lives
//    there. A keeper whose lock is free is stale (it died; its socket is a leftover) and is
//    treated exactly like an absent one: TryWithdraw and QueryKeeper return std::nullopt,
//    DropKeeper kNoDaemon. They never connect to a stale socket.
//  * StartKeeper and SpawnKeeper start `<program> keeper ...` detached: a double fork with
//    setsid in between, so the keeper is not our child (init or the nearest subreaper reaps
//    it), leads no terminal session, has no PDEATHSIG, starts with every signal unblocked and
//    stdin/stdout on /dev/null. Its stderr is ours, for its few log lines, when ours is a file
//    or a terminal; a pipe or socket is replaced by /dev/null (a keeper that outlives us must
//    not hold the pipe a supervisor reads our output from: it would never see EOF). SpawnKeeper
//    (and StartingKeeper::WaitReady) returns once the keeper has published its socket (it says
//    so on a pipe), with the keeper's pid, or the keeper's own start error (a live keeper for
//    the same cache: kAlreadyServed naming its pid).
//  * Refusals arrive as the keeper's Error: the Status of its code, message "keeper: <why>".
//  * Every call runs under one timeout. Fds passed in are borrowed; fds returned are owned.
//  * Thread-safe: no shared state (StartKeeper forks; only async-signal-safe calls run between
//    fork and exec, so it is safe in a threaded daemon).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "os/syscalls.h"
#include "protocol/handoff.h"
#include "weightcache/status.h"

namespace weightcache::keeper {

struct KeeperPaths {
  std::string socket;
  std::string lock;
};

struct SpawnOptions {
  std::string program;  // the weightcache binary; "" = this process's own (/proc/self/exe)
  std::string socket;   // KeeperPaths::socket (the keeper derives its lock by the path rule)
  std::vector<uid_t> allow_uids;
  std::chrono::milliseconds deposit_timeout{60'000};
  std::chrono::milliseconds start_timeout{10'000};
};

// A keeper being started (StartKeeper): forked and exec'ing, its ready line not read yet. It
// holds the write end of the keeper's depositor pipe (`--depositor-fd`): a keeper whose
// depositor pipe closes before a deposit arrived exits, so a daemon that dies or gives up
// between the start and the deposit leaves no keeper behind, however long its load takes (the
// deposit timeout does not apply). Keep it until the deposit's reply came back: destroying it
// earlier abandons the keeper. Move-only; not thread-safe.
class StartingKeeper {
 public:
  StartingKeeper(StartingKeeper&&) noexcept = default;
  StartingKeeper& operator=(StartingKeeper&&) noexcept = default;
  // Blocks until the keeper reported its start (bounded by SpawnOptions::start_timeout,
  // counted from StartKeeper): its pid, or its own start error as SpawnKeeper's. Once only.
  Result<pid_t> WaitReady();
  // Gives the keeper up: closes our end of its depositor pipe, so that it exits unless it
  // already holds a deposit. WaitReady still reads its start afterwards.
  void Abandon() { depositor_.Reset(); }

 private:
  friend Result<StartingKeeper> StartKeeper(const SpawnOptions& options);
  friend Result<pid_t> SpawnKeeper(const SpawnOptions& options);
  // The fork and exec; with `watch_depositor` the keeper gets --depositor-fd.
  static Result<StartingKeeper> Start(const SpawnOptions& options, bool watch_depositor);
  StartingKeeper(UniqueFd ready, UniqueFd depositor, std::string socket, os::Deadline deadline,
                 std::chrono::milliseconds start_timeout);
  UniqueFd ready_;      // the keeper's ready pipe (read end)
  UniqueFd depositor_;  // the depositor pipe's write end; -1 for SpawnKeeper's keepers
  std::string socket_;
  os::Deadline deadline_;
  std::chrono::milliseconds start_timeout_;
};

// Starts a keeper that watches its depositor (this process, through the StartingKeeper), and
// returns without waiting for it: a daemon starts it when its load starts, so that the
// keeper's fork, exec and start overlap the load, and only the deposit is left at ready.
Result<StartingKeeper> StartKeeper(const SpawnOptions& options);

// Starts a keeper and waits for its start; it waits for its deposit up to
// SpawnOptions::deposit_timeout, whoever makes it. The keeper's pid.
Result<pid_t> SpawnKeeper(const SpawnOptions& options);

// Hands a ready cache to the keeper: `manifest_fd` (the sealed manifest memfd) and one fd per
// allocation, in manifest order. The keeper's checks (protocol::DecodeHandoff) come back as
// its Error.
Status DepositToKeeper(const std::string& socket, const protocol::DepositInfo& info,
                       int manifest_fd, std::span<const int> allocation_fds,
                       std::chrono::milliseconds timeout);

// The cache the keeper at `paths` holds, checked (protocol::DecodeHandoff, then
// protocol::CheckAdoptable against `adopt`): std::nullopt when there is no live keeper; an
// error — nothing adopted — when there is one but it holds nothing (kNotFound), another cache
// (kMismatch naming both digests), or anything that fails a check.
Result<std::optional<protocol::Handoff>> TryWithdraw(const KeeperPaths& paths,
                                                     const protocol::AdoptOptions& adopt,
                                                     std::chrono::milliseconds timeout,
                                                     const protocol::FdCheck& gpu_fd_check = {});

// What the keeper at `paths` holds; std::nullopt when there is no live keeper.
Result<std::optional<protocol::KeeperQuery>> QueryKeeper(const KeeperPaths& paths,
                                                         std::chrono::milliseconds timeout);

// Tells the keeper its cache is dead: it closes the fds and exits. kNoDaemon when there is no
// live keeper.
Status DropKeeper(const KeeperPaths& paths, std::chrono::milliseconds timeout);

}  // namespace weightcache::keeper
