// Keeper — the process that holds one cache's fds so that they outlive its daemon
// (docs/keeper.md). It has no CUDA context and no checkpoint code: this module links only
// common/, os/ and protocol/.
//
// Lifecycle:
//   Create  takes the keeper's OFD lock (a second keeper for the same cache gets
//           kAlreadyServed naming the owner's pid), then publishes its socket like the daemon
//           (bound under a temporary name, 0600 — 0666 with allow_uids, where SO_PEERCRED is
//           the access control —, renamed into place; a socket already there is stale since
//           we hold the lock).
//   Run     serves Deposit (once), Withdraw, Query and Drop (protocol/handoff.h) from one poll
//           loop. It returns OK after a Drop (the deposit's fds are closed: the memory is
//           freed once no daemon or client holds it either) or a SIGTERM/SIGINT/SIGHUP on the
//           signalfd, or once its socket path no longer names its socket (checked every
//           2 s: a removed runtime dir leaves it unreachable, so what it holds could never be
//           adopted or dropped), or once its depositor's pipe closed before a deposit
//           arrived; kTimeout when no deposit arrived within deposit_timeout of Create (only
//           without a depositor pipe).
//   destroy unlinks the socket, then releases the lock.
//
// Contract:
//  * Peers: our uid, or one of allow_uids (SO_PEERCRED, at accept); a refused peer gets an
//    Error frame (kPermissionDenied naming its pid and uid); our side is shut down and what
//    the peer still sends is discarded until it closes (at most 1 s), so the Error is never
//    lost to a reset. Deposit and Drop are
//    accepted from our uid only.
//  * A deposit is checked by protocol::DecodeHandoff before it is held (host tier: sealed
//    memfds of at least each allocation's size); a second deposit is kAlreadyServed. Withdraw
//    hands out duplicates of the fds and keeps holding them: the keeper stays the cache's
//    keeper across any number of daemon restarts, until Drop.
//  * A malformed frame, a refused request or a peer that neither sends a complete request nor
//    reads its reply within connection_timeout closes that connection only (after an Error
//    frame where one can be sent); the deposit is never affected.
//  * Signals: the keeper only reads the signalfd its caller (the process's main) created with
//    the signals already blocked; the library installs no handlers.
//  * Not thread-safe: Create and Run on one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "os/lock_file.h"
#include "protocol/handoff.h"
#include "weightcache/status.h"

namespace weightcache::keeper {

struct KeeperOptions {
  std::string socket;  // identity::CachePaths::keeper_socket
  std::string lock;    // identity::CachePaths::keeper_lock
  std::vector<uid_t> allow_uids;
  // A keeper whose deposit has not arrived by then exits (its depositor died first).
  std::chrono::milliseconds deposit_timeout{60'000};
  // A connection that has not completed a request or read its reply by then is closed.
  std::chrono::milliseconds connection_timeout{10'000};
  size_t max_connections = 64;
};

class Keeper {
 public:
  static Result<std::unique_ptr<Keeper>> Create(KeeperOptions options);
  ~Keeper();
  Keeper(const Keeper&) = delete;
  Keeper& operator=(const Keeper&) = delete;

  // `signal_fd`: a signalfd for SIGTERM, SIGINT and SIGHUP (borrowed), or -1.
  // `depositor_fd`: the read end of a pipe whose write end only the depositor holds
  // (borrowed), or -1. Given, it replaces deposit_timeout: the keeper waits for the deposit as
  // long as the pipe is open, and returns OK once it closes with nothing deposited.
  Status Run(int signal_fd, int depositor_fd = -1);

 private:
  struct Connection;
  using Clock = std::chrono::steady_clock;

  Keeper(KeeperOptions options, os::LockFile lock, UniqueFd listener);

  void AcceptAll();
  // Reads what `conn` sent; false when the connection is to be closed.
  bool OnReadable(Connection& conn);
  // One complete request; false when the connection is to be closed.
  bool Handle(Connection& conn, protocol::Frame frame);
  bool Reply(Connection& conn, Result<std::vector<uint8_t>> frame, std::span<const int> fds = {});
  // Sends `status` as an Error and shuts our side: true while the connection stays open to be
  // drained (DrainRefused), false when it is to be closed now (the Error could not be sent).
  bool Refuse(Connection& conn, const Status& status);
  // Reads and discards what a refused peer still sends; false once it closed.
  bool DrainRefused(Connection& conn);
  bool PeerAllowed(uid_t uid) const;
  protocol::KeeperQuery MakeQuery() const;

  // Acquisition order: the lock first; the socket path is unlinked (in ~Keeper) before the
  // listener closes and before the lock is released.
  KeeperOptions options_;
  os::LockFile lock_;
  UniqueFd listener_;
  std::vector<std::unique_ptr<Connection>> connections_;
  Clock::time_point started_;
  std::optional<protocol::Handoff> deposit_;
  Clock::time_point deposited_at_;
  bool dropped_ = false;
  ino_t socket_inode_ = 0;  // our socket's; another (or none) at the path: we are unreachable
};

}  // namespace weightcache::keeper
