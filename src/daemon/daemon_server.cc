// The daemon's server (daemon_parts.h): accepting, flow control, the requests.
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>

#include "common/logging.h"
#include "daemon/daemon_parts.h"
#include "os/fd_passing.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "protocol/messages.h"

namespace weightcache::daemon {

using protocol::CacheState;
using protocol::MessageType;

namespace {

// Replies a peer may leave unread in its socket before we stop reading its requests (beyond
// an AttachReply's fds, which always stop it: one set of fds in flight per connection).
constexpr int kMaxUnreadReplyBytes = 256 * 1024;
// Accept back-off after a failed accept (no fds, no memory): doubling between these.
constexpr std::chrono::milliseconds kAcceptBackoffMin{50};
constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};
// At most one log line per this interval about failing accepts (with the count since).
constexpr std::chrono::seconds kAcceptLogInterval{10};

// Bytes we sent on `fd` that its peer has not read yet (SIOCOUTQ: for AF_UNIX, what our
// sends still occupy in the peer's receive queue); 0 when unknown.
int UnreadBytes(int fd) {
  int queued = 0;
  if (::ioctl(fd, SIOCOUTQ, &queued) != 0) return 0;
  return queued;
}

}  // namespace

// ---- connections ------------------------------------------------------------------------------

bool Daemon::PeerAllowed(const os::PeerCred& peer) const {
  if (peer.uid == ::geteuid()) return true;
  if (std::find(options_.allow_uids.begin(), options_.allow_uids.end(), peer.uid) !=
      options_.allow_uids.end()) {
    return true;
  }
  return std::find(options_.allow_gids.begin(), options_.allow_gids.end(), peer.gid) !=
         options_.allow_gids.end();
}

void Daemon::AcceptAll() {
  while (true) {
    auto accepted =
        os::AcceptConnection(socket_.fd(), os::Blocking::kNonBlocking, *options_.env.syscalls);
    if (!accepted.ok()) {
      // EMFILE and friends. The listener stays readable (the connection waits in the
      // backlog), so retrying at once would spin: pause it instead.
      PauseAccepting(accepted.status());
      return;
    }
    if (!accepted->has_value()) return;
    if (accept_failures_ > 0) {
      LOG_INFO << "accepting again on " << options_.paths.socket << " after " << accept_failures_
               << " failed accept(s)";
      accept_failures_ = 0;
      accept_failures_unlogged_ = 0;
      accept_backoff_ = std::chrono::milliseconds(0);
    }
    UniqueFd fd = std::move(**accepted);
    auto cred = os::PeerCredentials(fd.get());
    if (!cred.ok()) {
      LOG_WARN << "dropping a connection without peer credentials: " << cred.status().ToString();
      continue;
    }
    auto refuse = [&](const Status& why) {
      // Best effort, one non-blocking send: a fresh socket's buffer takes a small frame.
      auto frame = protocol::EncodeError(why);
      if (frame.ok()) (void)os::SendSome(fd.get(), *frame, {}, *options_.env.syscalls);
    };
    if (!PeerAllowed(*cred)) {
      LOG_WARN << "refused connection from pid " << cred->pid << " uid " << cred->uid << " gid "
               << cred->gid << ": not our uid " << ::geteuid() << " nor in --allow-uid/--allow-gid";
      refuse(PermissionDenied(
          "peer pid " + std::to_string(cred->pid) + " uid " + std::to_string(cred->uid) +
          " is not allowed by daemon pid " + std::to_string(::getpid()) + " (same uid " +
          std::to_string(::geteuid()) + " or --allow-uid/--allow-gid required)"));
      continue;
    }
    if (connections_.size() >= options_.max_connections) {
      LOG_WARN << "refused connection from pid " << cred->pid << ": " << options_.max_connections
               << " connections open";
      refuse(Status(StatusCode::kUnavailable, "daemon has too many connections (" +
                                                  std::to_string(options_.max_connections) + ")"));
      continue;
    }
    const int raw = fd.get();
    Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, raw, EPOLLIN | EPOLLRDHUP);
    if (!added.ok()) {
      LOG_WARN << added.ToString();
      continue;
    }
    LOG_DEBUG << "connection from pid " << cred->pid << " uid " << cred->uid;
    auto conn =
        std::make_unique<Connection>(std::move(fd), *cred, Clock::now(), *options_.env.syscalls);
    conn->armed = EPOLLIN | EPOLLRDHUP;
    conn->id = next_connection_id_++;
    connections_.emplace(raw, std::move(conn));
    ScheduleSweep();  // its handshake deadline
  }
}

void Daemon::PauseAccepting(const Status& error) {
  const auto now = Clock::now();
  ++accept_failures_;
  accept_backoff_ = std::clamp(2 * accept_backoff_, kAcceptBackoffMin, kAcceptBackoffMax);
  accept_paused_until_ = now + accept_backoff_;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, socket_.fd(), nullptr);
  if (accept_failures_ == 1 || now >= accept_log_next_) {
    LOG_WARN << "accept on " << options_.paths.socket << ": " << error.ToString()
             << "; not accepting for " << accept_backoff_.count() << " ms ("
             << accept_failures_unlogged_ + 1 << " failed accept(s) since the last such line, "
             << connections_.size() << " connection(s) open)";
    accept_failures_unlogged_ = 0;
    accept_log_next_ = now + kAcceptLogInterval;
  } else {
    ++accept_failures_unlogged_;
  }
}

void Daemon::ResumeAccepting() {
  accept_paused_until_.reset();
  if (state_ == CacheState::kDraining) return;  // the listener is gone
  Status added = EpollCtl(epoll_.get(), EPOLL_CTL_ADD, socket_.fd(), EPOLLIN);
  if (!added.ok()) {
    LOG_WARN << "resuming accepts: " << added.ToString();
  }
}

void Daemon::ScheduleSweep() {
  if (sweep_at_) return;
  const auto shortest = std::min(options_.handshake_timeout, options_.stall_timeout);
  const auto tick = std::clamp<std::chrono::milliseconds>(
      shortest / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(100));
  sweep_at_ = Clock::now() + tick;
}

bool Daemon::Sweep(Clock::time_point now) {
  bool again = false;
  std::vector<int> expired, caught_up;
  for (auto& [fd, conn_ptr] : connections_) {
    Connection& conn = *conn_ptr;
    const int unread = UnreadBytes(fd);
    const bool held = conn.hold != Connection::Hold::kNone;
    const bool backed_up = !conn.outbox.empty() || (held && unread > 0);
    if (backed_up) {
      if (!conn.backed_up_since) conn.backed_up_since = now;
      if (now - *conn.backed_up_since >= options_.stall_timeout) {
        LOG_WARN << "closing connection of " << conn.Describe() << ": its replies (" << unread
                 << " bytes in its socket, " << conn.outbox.size() << " queued) stayed unread for "
                 << options_.stall_timeout.count() << " ms (--stall-timeout)";
        expired.push_back(fd);
        continue;
      }
      again = true;
      continue;
    }
    conn.backed_up_since.reset();
    if (held) {
      // Its peer caught up: read its requests again (level-triggered, so anything already
      // waiting in its socket is reported at once).
      conn.hold = Connection::Hold::kNone;
      caught_up.push_back(fd);
    }
    if (IsPublisher(conn)) {
      if (now - publish_begun_ >= options_.publish_timeout) {
        AbandonPublication("its publisher (pid " + std::to_string(publisher_pid_) +
                           ") did not commit within " +
                           std::to_string(options_.publish_timeout.count()) +
                           " ms of its PublishBegin (--publish-timeout)");
        expired.push_back(fd);
        continue;
      }
      again = true;
    }
    if (!conn.attached && !conn.closing && !IsPublisher(conn) && !IsCommitting(conn) &&
        !IsUpgrading(conn) && !AwaitsPromotion(conn)) {
      if (now - conn.last_request >= options_.handshake_timeout) {
        LOG_WARN << "closing connection of " << conn.Describe() << ": no "
                 << (conn.greeting != Connection::Greeting::kNone ? "further " : "")
                 << "request within " << options_.handshake_timeout.count()
                 << " ms (--handshake-timeout)";
        expired.push_back(fd);
        continue;
      }
      again = true;
    }
  }
  for (int fd : expired) CloseConnection(fd);
  for (int fd : caught_up) {
    if (auto it = connections_.find(fd); it != connections_.end()) FlushAndRearm(*it->second);
  }
  return again;
}

bool Daemon::Readable(Connection& conn) {
  if (!conn.outbox.empty() || conn.closing || IsCommitting(conn) || AwaitsPromotion(conn)) {
    return false;
  }
  const int unread = UnreadBytes(conn.fd.get());
  if ((conn.fds_sent && unread > 0) || unread > kMaxUnreadReplyBytes) {
    // Its peer has not read what we sent (an AttachReply's fds, or a pile of replies): read
    // nothing more from it until it does (Sweep checks), or until the stall timeout.
    if (conn.hold != Connection::Hold::kNone) {
      conn.hold = Connection::Hold::kHeldLooked;  // woken by a request, still unread: no more
    } else {
      conn.hold = Connection::Hold::kHeld;
      ScheduleSweep();
    }
    return false;
  }
  if (conn.hold != Connection::Hold::kNone) {
    // Caught up before Sweep saw it (woken by its next request).
    conn.hold = Connection::Hold::kNone;
    conn.backed_up_since.reset();
  }
  conn.fds_sent = false;  // all read: nothing of ours is in flight any more
  return true;
}

bool Daemon::IsPublisher(const Connection& conn) const {
  return publication_ && publisher_fd_ == conn.fd.get();
}

bool Daemon::IsCommitting(const Connection& conn) const {
  return committing_conn_ != 0 && committing_conn_ == conn.id;
}

bool Daemon::IsUpgrading(const Connection& conn) const {
  return upgrade_ && upgrade_->requester != 0 && upgrade_->requester == conn.id;
}

bool Daemon::AwaitsPromotion(const Connection& conn) const {
  return std::find(promotion_waiters_.begin(), promotion_waiters_.end(), conn.id) !=
         promotion_waiters_.end();
}

void Daemon::OnConnectionEvent(int fd, uint32_t events) {
  Connection& conn = *connections_.at(fd);
  if (events & EPOLLOUT) {
    FlushAndRearm(conn);
    if (connections_.count(fd) == 0) return;
  }
  // Read only while nothing is pending: one request, one reply. A client that pipelines
  // requests without reading the replies is throttled by its own socket, not our memory, and
  // never has more than one AttachReply's fds in flight (Readable).
  while (Readable(conn)) {
    auto frame = conn.reader.ReadAvailable(fd);
    if (!frame.ok()) {
      const Status& status = frame.status();
      if (status.code() == StatusCode::kUnavailable) {
        LOG_DEBUG << "connection closed by " << conn.Describe();
        CloseConnection(fd);
        return;
      }
      CloseWithError(conn, status,
                     "closing connection of " + conn.Describe() + ": " + status.ToString());
      break;
    }
    if (!frame->has_value()) break;  // need more bytes
    conn.last_request = Clock::now();
    HandleFrame(conn, **frame);
    if (!conn.outbox.empty()) FlushAndRearm(conn);
    if (connections_.count(fd) == 0) return;
  }
  if ((events & (EPOLLHUP | EPOLLERR)) && conn.outbox.empty()) {
    CloseConnection(fd);
    return;
  }
  FlushAndRearm(conn);
}

void Daemon::QueueFrame(Connection& conn, Result<std::vector<uint8_t>> frame,
                        std::vector<int> fds) {
  if (!frame.ok()) {
    // Our own reply failed to encode (e.g. a config over the frame bound): a bug or an absurd
    // input; tell the client instead of going silent.
    LOG_ERROR << "encoding a reply for " << conn.Describe() << ": " << frame.status().ToString();
    auto error = protocol::EncodeError(frame.status());
    if (!error.ok()) {
      conn.closing = true;
      return;
    }
    conn.outbox.emplace_back(std::move(error).value(), std::vector<int>{}, *options_.env.syscalls);
    return;
  }
  conn.outbox.emplace_back(std::move(frame).value(), std::move(fds), *options_.env.syscalls);
}

void Daemon::QueueError(Connection& conn, const Status& status) {
  QueueFrame(conn, protocol::EncodeError(status));
}

void Daemon::FlushAndRearm(Connection& conn) {
  const int fd = conn.fd.get();
  while (!conn.outbox.empty()) {
    auto flushed = conn.outbox.front().Flush(fd);
    if (!flushed.ok()) {
      LOG_WARN << "sending to " << conn.Describe() << ": " << flushed.status().ToString();
      CloseConnection(fd);
      return;
    }
    if (!*flushed) break;  // socket full: wait for EPOLLOUT
    conn.outbox.pop_front();
  }
  if (conn.outbox.empty() && conn.closing) {
    CloseConnection(fd);
    return;
  }
  // Held: EPOLLIN only until its one early look (Hold::kHeld), then no events but
  // EPOLLHUP/EPOLLERR (always reported) until Sweep sees its peer read; EPOLLRDHUP would
  // report a half-closed peer again and again.
  // Committing: nothing but EPOLLHUP/EPOLLERR either, until its PublishCommit is answered.
  // Awaiting a promotion: the same, until its Attach is answered.
  const uint32_t want =
      !conn.outbox.empty()                   ? EPOLLOUT
      : conn.hold == Connection::Hold::kHeld ? EPOLLIN
      : (conn.hold == Connection::Hold::kHeldLooked || IsCommitting(conn) || AwaitsPromotion(conn))
          ? 0u
          : (EPOLLIN | EPOLLRDHUP);
  if (!conn.outbox.empty()) ScheduleSweep();  // its stall deadline
  if (want != conn.armed) {
    Status status = EpollCtl(epoll_.get(), EPOLL_CTL_MOD, fd, want);
    if (!status.ok()) {
      LOG_WARN << status.ToString();
      CloseConnection(fd);
      return;
    }
    conn.armed = want;
  }
}

void Daemon::CloseConnection(int fd) {
  auto it = connections_.find(fd);
  if (it == connections_.end()) return;
  if (it->second->attached) {
    --clients_;
    options_.metrics->SetClients(clients_);
    if (events_.on_clients) events_.on_clients(clients_);
  }
  if (fd == publisher_fd_) {
    AbandonPublication("its publisher (pid " + std::to_string(publisher_pid_) +
                       ") closed the connection before PublishCommit");
  }
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  connections_.erase(it);  // closes the fd
}

// ---- requests ---------------------------------------------------------------------------------

void Daemon::CloseWithError(Connection& conn, const Status& status, std::string_view log_line) {
  LOG_WARN << log_line;
  QueueError(conn, status);
  conn.closing = true;
}

template <typename Reply>
void Daemon::FillLoadState(Reply& reply) const {
  reply.state = state_;
  reply.bytes_done = bytes_done_.load();
  reply.bytes_total = bytes_total_.load();
  if (!failure_.ok()) {
    reply.failure_reason = failure_.ToString();
    if (state_ == CacheState::kFailed) reply.failure_code = failure_.code();
  }
}

protocol::StatusReply Daemon::MakeStatusReply() const {
  protocol::StatusReply reply;
  FillLoadState(reply);
  // A demoted cache's memory is host RAM until its promotion.
  reply.tier = demoted_.empty() ? options_.config.tier : Tier::kHost;
  reply.device_uuid = options_.device_key;
  reply.model_id = options_.config.model_id;
  if (store_) {
    reply.tensor_count = store_->summary().tensor_count;
    reply.bytes = store_->summary().resident_bytes;
    reply.origin = store_->summary().origin;
  }
  reply.clients = clients_;
  reply.pid = ::getpid();
  reply.config_digest = options_.config.Digest();
  return reply;
}

void Daemon::HandleFrame(Connection& conn, const protocol::Frame& frame) {
  switch (frame.type) {
    case MessageType::kHello:
      HandleHello(conn, frame.payload);
      return;
    case MessageType::kStatus:
      if (DecodeEmptyRequest(conn, frame)) HandleStatus(conn);
      return;
    case MessageType::kMetrics:
      if (DecodeEmptyRequest(conn, frame)) HandleMetrics(conn);
      return;
    case MessageType::kAttach:
      if (DecodeEmptyRequest(conn, frame)) HandleAttach(conn);
      return;
    case MessageType::kStop:
      if (DecodeEmptyRequest(conn, frame)) HandleStop(conn);
      return;
    case MessageType::kEvict:
      if (DecodeEmptyRequest(conn, frame)) HandleEvict(conn);
      return;
    case MessageType::kUpgrade:
      HandleUpgrade(conn, frame.payload);
      return;
    case MessageType::kPublishBegin:
      HandlePublishBegin(conn, frame.payload);
      return;
    case MessageType::kPublishCommit:
      HandlePublishCommit(conn, frame.payload);
      return;
    default: {
      // FrameReader(kRequest) already refuses reply types; anything else is a bug here.
      Status status = ProtocolError("unexpected " + protocol::MessageTypeName(frame.type) +
                                    " frame from a client");
      CloseWithError(conn, status, conn.Describe() + ": " + status.message());
      return;
    }
  }
}

bool Daemon::DecodeEmptyRequest(Connection& conn, const protocol::Frame& frame) {
  Status empty = protocol::DecodeEmptyRequest(frame.type, frame.payload);
  if (empty.ok()) return true;
  CloseWithError(conn, empty,
                 "bad " + protocol::MessageTypeName(frame.type) + " from " + conn.Describe() +
                     ": " + empty.ToString());
  return false;
}

void Daemon::HandleHello(Connection& conn, std::span<const uint8_t> payload) {
  auto hello = protocol::DecodeHello(payload);
  if (!hello.ok()) {
    CloseWithError(conn, hello.status(),
                   "bad Hello from " + conn.Describe() + ": " + hello.status().ToString());
    return;
  }
  if (hello->protocol_version != protocol::kProtocolVersion) {
    Status status =
        ProtocolError("Hello for protocol version " + std::to_string(hello->protocol_version) +
                      "; this daemon speaks version " + std::to_string(protocol::kProtocolVersion));
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  auto theirs = identity::CacheConfig::FromJson(hello->config);
  if (!theirs.ok()) {
    Status status = theirs.status();
    status.Context("Hello config");
    CloseWithError(conn, status, "bad Hello from " + conn.Describe() + ": " + status.ToString());
    return;
  }
  protocol::HelloReply reply;
  FillLoadState(reply);
  reply.daemon_config = options_.config.ToJson();
  for (auto& d : identity::Diff(options_.config, *theirs)) {
    reply.differences.push_back({d.field, d.ours, d.theirs});
  }
  reply.match = reply.differences.empty();
  conn.hello_at = Clock::now();
  // A miss for this cache: a client of the same model whose config differs (the client's
  // sibling scan, docs/client.md). A Hello of another model id (`ls`'s observer) is no attach.
  if (reply.match) {
    conn.greeting = Connection::Greeting::kMatched;
  } else if (theirs->model_id == options_.config.model_id) {
    conn.greeting = Connection::Greeting::kMismatchCounted;
    RecordAttach(conn, AttachResult::kMismatch);
  } else {
    conn.greeting = Connection::Greeting::kMismatched;
  }
  LOG_DEBUG << "Hello from " << conn.Describe() << " (" << hello->client_name << "): "
            << (reply.match ? "match"
                            : std::to_string(reply.differences.size()) + " differing field(s)");
  QueueFrame(conn, protocol::EncodeHelloReply(reply));
}

void Daemon::HandleStatus(Connection& conn) {
  QueueFrame(conn, protocol::EncodeStatusReply(MakeStatusReply()));
}

void Daemon::HandleMetrics(Connection& conn) {
  const DaemonMetrics& m = *options_.metrics;
  protocol::MetricsReply reply;
  reply.hits = m.hits();
  reply.misses = m.misses();
  reply.attaches_daemon = m.attaches(AttachResult::kDaemon);
  reply.attaches_mismatch = m.attaches(AttachResult::kMismatch);
  reply.attaches_unavailable = m.attaches(AttachResult::kUnavailable);
  reply.attaches_error = m.attaches(AttachResult::kError);
  reply.last_attach_unix_ms = static_cast<uint64_t>(std::max<int64_t>(m.last_attach_unix_ms(), 0));
  reply.clients = clients_;
  QueueFrame(conn, protocol::EncodeMetricsReply(reply));
}

void Daemon::HandleAttach(Connection& conn) {
  if (conn.greeting == Connection::Greeting::kNone) {
    // Out of sequence: the protocol requires a Hello first, so this client is either broken
    // or probing; end the conversation.
    Status status =
        ProtocolError("Attach before a Hello (cache " + options_.config.ShortDigest() + ")");
    RecordAttach(conn, AttachResult::kError);
    CloseWithError(conn, status, conn.Describe() + ": " + status.message());
    return;
  }
  if (conn.greeting != Connection::Greeting::kMatched) {
    // A client may send Attach right behind its Hello (docs/protocol.md §1, pipelining):
    // after a Hello that did not match, the Attach is refused as an application error; the
    // client has the HelloReply with the differences and reports those.
    LOG_DEBUG << conn.Describe() << ": Attach after a non-matching Hello refused";
    if (conn.greeting == Connection::Greeting::kMismatched) {
      RecordAttach(conn, AttachResult::kMismatch);
      conn.greeting = Connection::Greeting::kMismatchCounted;
    }
    QueueError(conn, Status(StatusCode::kMismatch,
                            "Attach refused: the Hello's config does not match this cache (" +
                                options_.config.ShortDigest() + ")"));
    return;
  }
  if (state_ == CacheState::kDemoted && stop_requested_by_.empty()) {
    // Answered once the promotion ends (FinishPromotion), within the client's own deadline: a
    // client that gives up closes its connection, which drops it from the waiters.
    promotion_waiters_.push_back(conn.id);
    if (move_ == Move::kNone) StartPromotion();
    return;
  }
  if (state_ != CacheState::kReady) {
    std::string why = "cache is " + std::string(protocol::CacheStateName(state_));
    if (state_ == CacheState::kLoading) {
      why += " (" + std::to_string(bytes_done_.load()) + "/" + std::to_string(bytes_total_.load()) +
             " bytes)";
    } else if (state_ == CacheState::kFailed) {
      why += ": " + failure_.ToString();
    } else if (state_ == CacheState::kAwaiting) {
      why += " its publisher (" + options_.config.source + ")";
    }
    RecordAttach(conn, AttachResult::kUnavailable);
    QueueError(conn, Status(StatusCode::kUnavailable, why));
    return;
  }
  // The manifest memfd first, then one fd per allocation (docs/protocol.md §4).
  std::vector<int> fds = store_->fds();
  fds.insert(fds.begin(), store_->summary().manifest.fd.get());
  // Counted before the reply is queued (it may be flushed at once), so a client that has its
  // AttachReply finds itself in the metrics.
  RecordAttach(conn, AttachResult::kDaemon);
  if (!conn.attached) {
    conn.attached = true;
    ++clients_;
    options_.metrics->SetClients(clients_);
    LOG_INFO << "attached: " << conn.Describe() << " (" << clients_ << " client(s))";
    if (events_.on_clients) events_.on_clients(clients_);
  }
  QueueFrame(conn, attach_frame_, std::move(fds));
  conn.fds_sent = true;
}

// Requests that end the daemon (Stop, Evict): only the daemon's own uid, even when --allow-uid
// lets other users attach.
bool Daemon::RequireOwner(Connection& conn, std::string_view request, std::string_view verb) {
  if (conn.peer.uid == ::geteuid()) return true;
  LOG_WARN << "refused " << request << " from " << conn.Describe();
  QueueError(conn, PermissionDenied(std::string(request) + " refused for " + conn.Describe() +
                                    ": only uid " + std::to_string(::geteuid()) +
                                    " (the daemon's owner) may " + std::string(verb) + " it"));
  return false;
}

void Daemon::HandleStop(Connection& conn) {
  if (!RequireOwner(conn, "Stop", "stop")) return;
  protocol::StopReply reply;
  reply.clients = clients_;
  QueueFrame(conn, protocol::EncodeStopReply(reply));
  stop_requested_by_ = "Stop requested by " + conn.Describe();
}

// Budget admission asks an idle cache to give its memory back (docs/budget.md). The ledger's
// view may be stale by the time the request arrives: the cache decides on its own state, here.
void Daemon::HandleEvict(Connection& conn) {
  if (!RequireOwner(conn, "Evict", "evict")) return;
  protocol::EvictReply reply;
  reply.clients = clients_;
  if (options_.pinned) {
    reply.reason = "pinned (serve --pin)";
  } else if (clients_ > 0) {
    reply.reason = std::to_string(clients_) + " client(s) attached";
  } else if (state_ == CacheState::kDemoted &&
             (move_ == Move::kDemoting || move_ == Move::kPromoting ||
              !promotion_waiters_.empty())) {
    reply.reason = move_ == Move::kDemoting ? "being demoted" : "being promoted for an attach";
  } else if (state_ == CacheState::kDemoted && stop_requested_by_.empty()) {
    reply.evicted = true;  // a demoted cache asked for its host memory: it stops
  } else if (state_ != CacheState::kReady) {
    reply.reason = "not ready (" + std::string(protocol::CacheStateName(state_)) + ")";
  } else if (!stop_requested_by_.empty()) {
    reply.reason = "already stopping";
  } else {
    reply.evicted = true;
    if (Status can = CanDemote(); can.ok()) {
      reply.reason = "demoted to host";
    } else if (options_.demotion.enabled) {
      LOG_INFO << "not demoting (" << can.message() << "): stopping instead";
    }
  }
  QueueFrame(conn, protocol::EncodeEvictReply(reply));
  if (!reply.evicted) {
    LOG_INFO << "Evict from " << conn.Describe() << " refused: " << reply.reason;
    return;
  }
  if (!reply.reason.empty()) {
    LOG_INFO << "Evict from " << conn.Describe() << ": demoting to host RAM";
    StartDemotion();
    return;
  }
  options_.metrics->RecordEviction();
  stop_requested_by_ = "evicted to make room under the device's budget, for " + conn.Describe();
}

}  // namespace weightcache::daemon
