// The daemon's upgrader (daemon_parts.h): the handover to a successor.
#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>

#include "common/logging.h"
#include "daemon/daemon_parts.h"
#include "protocol/messages.h"

namespace weightcache::daemon {

using protocol::CacheState;
using protocol::MessageType;

// ---- upgrade (docs/upgrade.md) -----------------------------------------------------------------

namespace {

// After a handover, how long we keep accepting connects that resolved the socket path just
// before the successor's rename (they reach our listener within microseconds of it).
constexpr std::chrono::milliseconds kHandoverAcceptGrace{50};

// A successor whose channel failed (EOF, EPIPE): it exited or crashed before taking over.
Status SuccessorGone(pid_t pid, const Status& how) {
  const bool closed = how.code() == StatusCode::kUnavailable || how.code() == StatusCode::kIo;
  return Status(closed ? StatusCode::kInternal : how.code(),
                "successor pid " + std::to_string(pid) +
                    " ended the handover without taking over (" + how.message() + ")");
}

}  // namespace

void Daemon::HandleUpgrade(Connection& conn, std::span<const uint8_t> payload) {
  auto request = protocol::DecodeUpgradeRequest(payload);
  if (!request.ok()) {
    CloseWithError(conn, request.status(),
                   "bad Upgrade from " + conn.Describe() + ": " + request.status().ToString());
    return;
  }
  // Only the daemon's own uid: the successor runs as this daemon, with its memory.
  if (conn.peer.uid != ::geteuid()) {
    LOG_WARN << "refused Upgrade from " << conn.Describe();
    QueueError(conn, PermissionDenied("Upgrade refused for " + conn.Describe() + ": only uid " +
                                      std::to_string(::geteuid()) +
                                      " (the daemon's owner) may upgrade it"));
    return;
  }
  const std::string binary = request->binary.empty() ? options_.self_binary : request->binary;
  Status started = StartUpgrade(binary, conn.Describe(), conn.id);
  if (!started.ok()) {
    QueueError(conn, started);
    return;
  }
}

Status Daemon::StartUpgrade(const std::string& binary, const std::string& requested_by,
                            uint64_t requester) {
  if (!options_.start_successor) {
    return Status(StatusCode::kUnavailable,
                  "this daemon was not started by `weightcache serve`: it has no binary to "
                  "start a successor from");
  }
  if (upgrade_) {
    return Status(StatusCode::kUnavailable, "an upgrade is in progress (successor pid " +
                                                std::to_string(upgrade_->successor->pid()) + ")");
  }
  if (state_ != CacheState::kReady || !store_) {
    return Status(StatusCode::kUnavailable,
                  "cache " + options_.config.ShortDigest() + " is " +
                      std::string(protocol::CacheStateName(state_)) +
                      ": only a ready cache is handed over (a loading daemon restarts "
                      "as fast as its successor would load)");
  }
  if (publication_ || committing_conn_ != 0) {
    return Status(StatusCode::kUnavailable,
                  "a publish is in progress (pid " + std::to_string(publisher_pid_) + ")");
  }
  auto fail = [&](const Status& why) {
    LOG_WARN << "upgrade requested by " << requested_by << " failed: " << why.ToString();
    return why;
  };
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return fail(IoError("socketpair for the upgrade channel", errno));
  }
  UniqueFd ours(pair[0]);
  UniqueFd theirs(pair[1]);
  const auto started = Clock::now();
  if (events_.on_handing_over) events_.on_handing_over();
  auto successor = options_.start_successor(binary, theirs.get());
  if (!successor.ok()) {
    if (events_.on_handover_failed) events_.on_handover_failed();
    Status status = successor.status();
    return fail(status.Context("starting successor " + binary));
  }
  theirs.Reset();  // the successor has its own copy: its exit is our EOF
  LOG_INFO << "upgrade requested by " << requested_by << ": successor pid " << (*successor)->pid()
           << " (" << binary << ") takes the handover";
  upgrade_.emplace(PendingUpgrade{std::move(successor).value(), std::move(ours), requester, started,
                                  started + options_.upgrade_timeout});
  Status sent = SendHandover(upgrade_->channel.get(), options_.config, *store_, lock_.fd(),
                             std::chrono::milliseconds(5'000));
  if (!sent.ok()) {
    FinishUpgrade(SuccessorGone(upgrade_->successor->pid(), sent));
    return Status::Ok();  // FinishUpgrade answered the requester
  }
  Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, upgrade_->channel.get(), EPOLLIN);
  if (!added.ok()) FinishUpgrade(added);
  return Status::Ok();
}

void Daemon::OnUpgradeChannel() {
  auto frame = protocol::ReadFrame(upgrade_->channel.get(), protocol::Expect::kKeeperReply,
                                   os::Deadline::After(std::chrono::milliseconds(1'000)));
  if (!frame.ok()) return FinishUpgrade(SuccessorGone(upgrade_->successor->pid(), frame.status()));
  if (frame->type == MessageType::kError) {
    auto error = protocol::DecodeError(frame->payload);
    if (!error.ok()) return FinishUpgrade(error.status());
    return FinishUpgrade(Status(error->code, "successor pid " +
                                                 std::to_string(upgrade_->successor->pid()) +
                                                 " refused the handover: " + error->message));
  }
  if (frame->type != MessageType::kHandoverDone ||
      !protocol::CheckEmptyHandoff(frame->type, frame->payload).ok()) {
    return FinishUpgrade(
        ProtocolError("successor pid " + std::to_string(upgrade_->successor->pid()) + " sent " +
                      protocol::MessageTypeName(frame->type) + " instead of HandoverDone"));
  }
  FinishUpgrade(Status::Ok());
}

void Daemon::FinishUpgrade(const Status& result) {
  PendingUpgrade upgrade = std::move(*upgrade_);
  upgrade_.reset();
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, upgrade.channel.get(), nullptr);
  const pid_t pid = upgrade.successor->pid();
  Connection* requester = nullptr;
  for (auto& [fd, conn] : connections_) {
    if (conn->id == upgrade.requester) requester = conn.get();
  }
  if (requester != nullptr) {
    requester->last_request = Clock::now();
  }
  if (!result.ok()) {
    upgrade.successor.reset();  // killed and reaped: it can no longer touch the path
    // It may have renamed its socket over ours before it died: publish ours again (we hold
    // the lock, so the path is ours), after taking what waits in our backlog.
    AcceptAll();
    auto listen_fd =
        os::ListenUnix(options_.paths.socket, socket_mode_, os::Blocking::kNonBlocking);
    if (listen_fd.ok()) {
      (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
      socket_.ReplaceFd(std::move(listen_fd).value());
      if (!accept_paused_until_) (void)EpollCtl(epoll_.get(), EPOLL_CTL_ADD, socket_.fd(), EPOLLIN);
    } else {
      LOG_ERROR << "re-publishing " << options_.paths.socket
                << " after the failed upgrade: " << listen_fd.status().ToString();
    }
    LOG_WARN << "upgrade failed, serving on: " << result.ToString();
    if (events_.on_handover_failed) events_.on_handover_failed();
    if (requester != nullptr) {
      QueueError(*requester, result);
      FlushAndRearm(*requester);
    }
    return;
  }
  const auto took =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - upgrade.started);
  upgrade.successor->Release();
  if (events_.on_handed_over) events_.on_handed_over();
  LOG_INFO << "handed over to successor pid " << pid << " in " << took.count() / 1000.0
           << " ms; serving what waits in the backlog, then exiting";
  if (requester != nullptr) {
    protocol::UpgradeReply reply;
    reply.successor_pid = pid;
    reply.handover_us = static_cast<uint64_t>(took.count());
    QueueFrame(*requester, protocol::EncodeUpgradeReply(reply));
    requester->closing = true;
    FlushAndRearm(*requester);
  }
  // The path is the successor's now. A connect that resolved it just before the rename
  // lands in our backlog within microseconds: keep accepting for a grace period, then stop
  // listening (the loop does, at listen_until), so that no such connect is reset by the close.
  handed_over_until_ = Clock::now() + options_.drain_timeout;
  handover_listen_until_ = Clock::now() + kHandoverAcceptGrace;
}

void Daemon::StopListeningAfterHandover() {
  if (!handover_listen_until_) return;
  handover_listen_until_.reset();
  AcceptAll();
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
  socket_.Abandon();  // the path is the successor's: closed, not unlinked
  accept_paused_until_.reset();
}

}  // namespace weightcache::daemon
