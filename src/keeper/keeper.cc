#include "keeper/keeper.h"

#include <poll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/logging.h"
#include "os/unix_socket.h"
#include "protocol/messages.h"

namespace weightcache::keeper {
namespace {

// A reply is a few bytes (a WithdrawReply: 96 + the config JSON, and its fds): a fresh socket's
// buffer takes it at once, so a peer that lets it sit this long is not reading.
constexpr std::chrono::milliseconds kReplyTimeout{1000};
// After a failed accept (no fds): the listener rests this long instead of spinning.
constexpr std::chrono::milliseconds kAcceptPause{100};
// A refused connection is read (and what it sent discarded) this long at most, waiting for
// its peer to read our Error and close its end.
constexpr std::chrono::milliseconds kRefusedLinger{1000};
// Run's poll set: the listener, the signalfd, the depositor pipe, then the connections.
constexpr size_t kFirstConnection = 3;
// How often the keeper checks that its socket is still in place (SocketInPlace).
constexpr std::chrono::milliseconds kSocketCheckInterval{2000};

// The inode of the socket at `path`, or 0 when there is none.
ino_t SocketInode(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

std::string Short(const std::string& digest) { return digest.substr(0, 16); }

}  // namespace

struct Keeper::Connection {
  Connection(UniqueFd socket, os::PeerCred cred, Clock::time_point deadline_at)
      : fd(std::move(socket)), peer(cred), deadline(deadline_at) {}
  UniqueFd fd;
  os::PeerCred peer;
  protocol::FrameReader reader{protocol::Expect::kKeeperRequest};
  Clock::time_point deadline;  // closed when no complete request arrives by then
  // Refused: our Error is sent and our side shut down; what the peer still sends is read and
  // discarded until it closes (or the deadline), so that closing never resets the connection
  // under an Error the peer has not read yet.
  bool refused = false;
};

Result<std::unique_ptr<Keeper>> Keeper::Create(KeeperOptions options) {
  auto lock = os::LockFile::TryAcquire(options.lock);
  if (!lock.ok() && lock.status().code() == StatusCode::kAlreadyServed) {
    const std::optional<pid_t> owner = os::ReadLockOwner(options.lock);
    return Status(StatusCode::kAlreadyServed,
                  "keeper " + options.socket + ": another keeper" +
                      (owner ? " (pid " + std::to_string(*owner) + ")" : "") +
                      " already holds this cache's lock " + options.lock);
  }
  if (!lock.ok()) {
    Status status = lock.status();
    return status.Context("keeper " + options.socket);
  }
  // We hold the lock, so a socket already there is a dead keeper's: ListenUnix renames over it
  // (and refuses anything that is not a socket, kIo naming the path).
  const mode_t mode = options.allow_uids.empty() ? 0600 : 0666;
  auto listener = os::ListenUnix(options.socket, mode, os::Blocking::kNonBlocking);
  if (!listener.ok()) {
    Status status = listener.status();
    return status.Context("publishing keeper socket " + options.socket);
  }
  return std::unique_ptr<Keeper>(
      new Keeper(std::move(options), std::move(lock).value(), std::move(listener).value()));
}

Keeper::Keeper(KeeperOptions options, os::LockFile lock, UniqueFd listener)
    : options_(std::move(options)),
      lock_(std::move(lock)),
      listener_(std::move(listener)),
      started_(Clock::now()),
      socket_inode_(SocketInode(options_.socket)) {}

Keeper::~Keeper() {
  // The path first, while the listener and the lock are still ours: nobody finds our socket
  // with its lock free while we could still answer on it.
  if (::unlink(options_.socket.c_str()) != 0 && errno != ENOENT) {
    LOG_WARN << "could not remove keeper socket " << options_.socket << ": "
             << std::strerror(errno);
  }
}

bool Keeper::PeerAllowed(uid_t uid) const {
  return uid == ::geteuid() || std::find(options_.allow_uids.begin(), options_.allow_uids.end(),
                                         uid) != options_.allow_uids.end();
}

Status Keeper::Run(int signal_fd, int depositor_fd) {
  // accept() rests (too many connections) while now < accept_paused_until: the clock's epoch
  // is long past, so nothing rests at first.
  Clock::time_point accept_paused_until{};
  Clock::time_point next_socket_check = started_ + kSocketCheckInterval;
  // Watched until the deposit: the depositor's end closing first means it died or gave up.
  const bool watching_depositor = depositor_fd >= 0;
  while (!dropped_) {
    Clock::time_point now = Clock::now();
    if (!deposit_ && !watching_depositor && now - started_ >= options_.deposit_timeout) {
      return Status(StatusCode::kTimeout,
                    "keeper " + options_.socket + ": no deposit arrived within " +
                        std::to_string(options_.deposit_timeout.count()) + " ms");
    }
    std::erase_if(connections_, [&](const std::unique_ptr<Connection>& c) {
      if (now < c->deadline) return false;
      if (!c->refused) {
        LOG_WARN << "keeper: closing an idle connection from pid " << c->peer.pid;
      }
      return true;
    });
    if (now >= next_socket_check) {
      // Nobody can reach a keeper whose socket was removed (its runtime dir deleted): the
      // memory it holds can never be adopted or dropped, so it goes now.
      if (SocketInode(options_.socket) != socket_inode_) {
        LOG_WARN << "keeper " << options_.socket << ": its socket was removed; releasing "
                 << (deposit_ ? "the deposit" : "nothing") << " and exiting";
        return Status::Ok();
      }
      next_socket_check = now + kSocketCheckInterval;
    }

    Clock::time_point wake = deposit_ || watching_depositor ? Clock::time_point::max()
                                                            : started_ + options_.deposit_timeout;
    for (const auto& c : connections_) wake = std::min(wake, c->deadline);
    const bool accept_paused = now < accept_paused_until;
    if (accept_paused) wake = std::min(wake, accept_paused_until);
    wake = std::min(wake, next_socket_check);

    std::vector<pollfd> fds;
    fds.push_back({accept_paused ? -1 : listener_.get(), POLLIN, 0});
    fds.push_back({signal_fd, POLLIN, 0});
    fds.push_back({deposit_ ? -1 : depositor_fd, POLLIN, 0});
    for (const auto& c : connections_) fds.push_back({c->fd.get(), POLLIN, 0});
    int timeout_ms = -1;
    if (wake != Clock::time_point::max()) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(wake - now).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return IoError("keeper poll", errno);
    }
    if (signal_fd >= 0 && fds[1].revents != 0) {
      signalfd_siginfo info{};
      if (::read(signal_fd, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
        LOG_INFO << "keeper " << options_.socket << ": "
                 << ::strsignal(static_cast<int>(info.ssi_signo)) << ", releasing "
                 << (deposit_ ? "the deposit" : "nothing") << " and exiting";
        return Status::Ok();
      }
    }
    // Connections first (their indices are fixed until AcceptAll adds more): a deposit that
    // arrived with its depositor's end closing is taken, not lost.
    std::vector<Connection*> closing;
    for (size_t i = 0; i < connections_.size(); ++i) {
      if (fds[kFirstConnection + i].revents == 0) continue;
      if (!OnReadable(*connections_[i]) || dropped_) closing.push_back(connections_[i].get());
      if (dropped_) break;
    }
    std::erase_if(connections_, [&](const std::unique_ptr<Connection>& c) {
      return std::find(closing.begin(), closing.end(), c.get()) != closing.end();
    });
    if (dropped_) break;
    if (!deposit_ && fds[2].revents != 0) {
      // Only ever closed, never written: readable means EOF, or its error.
      LOG_INFO << "keeper " << options_.socket
               << ": its depositor exited or gave up before depositing; exiting";
      return Status::Ok();
    }
    if (fds[0].revents != 0) {
      AcceptAll();
      if (connections_.size() > options_.max_connections) {
        accept_paused_until = Clock::now() + kAcceptPause;
      }
    }
  }
  LOG_INFO << "keeper " << options_.socket << ": dropped, exiting";
  return Status::Ok();
}

void Keeper::AcceptAll() {
  while (connections_.size() <= options_.max_connections) {
    auto accepted = os::AcceptConnection(listener_.get(), os::Blocking::kNonBlocking);
    if (!accepted.ok()) {
      LOG_WARN << "keeper: accept failed: " << accepted.status().ToString();
      return;
    }
    if (!accepted->has_value()) return;
    UniqueFd fd = std::move(**accepted);
    auto cred = os::PeerCredentials(fd.get());
    if (!cred.ok()) continue;
    auto conn = std::make_unique<Connection>(std::move(fd), *cred,
                                             Clock::now() + options_.connection_timeout);
    if (!PeerAllowed(cred->uid)) {
      LOG_WARN << "keeper: refused pid " << cred->pid << " uid " << cred->uid;
      if (Refuse(*conn,
                 PermissionDenied("peer pid " + std::to_string(cred->pid) + " uid " +
                                  std::to_string(cred->uid) + " is not allowed by keeper pid " +
                                  std::to_string(::getpid()) + " (same uid " +
                                  std::to_string(::geteuid()) + " or --allow-uid required)"))) {
        connections_.push_back(std::move(conn));
      }
      continue;
    }
    connections_.push_back(std::move(conn));
  }
}

bool Keeper::OnReadable(Connection& conn) {
  if (conn.refused) return DrainRefused(conn);
  while (true) {
    auto frame = conn.reader.ReadAvailable(conn.fd.get());
    if (!frame.ok()) {
      if (frame.status().code() != StatusCode::kUnavailable) {
        LOG_WARN << "keeper: bad frame from pid " << conn.peer.pid << ": "
                 << frame.status().ToString();
        return Refuse(conn, frame.status());
      }
      return false;
    }
    if (!frame->has_value()) return true;
    conn.deadline = Clock::now() + options_.connection_timeout;
    if (!Handle(conn, std::move(**frame))) return false;
    if (dropped_) return false;
    if (conn.refused) return DrainRefused(conn);
  }
}

bool Keeper::Reply(Connection& conn, Result<std::vector<uint8_t>> frame, std::span<const int> fds) {
  if (!frame.ok()) {
    LOG_ERROR << "keeper: cannot encode a reply: " << frame.status().ToString();
    return false;
  }
  Status sent =
      protocol::WriteFrame(conn.fd.get(), *frame, fds, os::Deadline::After(kReplyTimeout));
  if (!sent.ok()) {
    LOG_WARN << "keeper: reply to pid " << conn.peer.pid << " failed: " << sent.ToString();
    return false;
  }
  return true;
}

bool Keeper::Refuse(Connection& conn, const Status& status) {
  if (!Reply(conn, protocol::EncodeError(status))) return false;
  // Closing now could lose the Error: a close with the peer's request still unread resets the
  // connection, and the peer's next write fails. Shut our side instead (the peer reads the
  // Error, then EOF) and keep reading until the peer closes.
  if (::shutdown(conn.fd.get(), SHUT_WR) != 0) return false;
  conn.refused = true;
  conn.deadline = Clock::now() + kRefusedLinger;
  return true;
}

bool Keeper::DrainRefused(Connection& conn) {
  char buf[4096];
  while (true) {
    // A plain read: fds the peer passed are closed by the kernel, never installed here.
    const ssize_t n = ::read(conn.fd.get(), buf, sizeof(buf));
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);  // open until EOF or an error
  }
}

protocol::KeeperQuery Keeper::MakeQuery() const {
  protocol::KeeperQuery q;
  q.keeper_pid = ::getpid();
  const Clock::time_point since = deposit_ ? deposited_at_ : started_;
  q.age_ms = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since).count());
  if (deposit_) {
    q.state = protocol::KeeperState::kHolding;
    q.bytes = deposit_->bytes();
    q.fd_count = static_cast<uint32_t>(deposit_->allocations.size());
    q.depositor_pid = deposit_->info.depositor_pid;
    q.config_digest = deposit_->info.config_digest;
    q.config_json = deposit_->info.config_json;
  }
  return q;
}

bool Keeper::Handle(Connection& conn, protocol::Frame frame) {
  using protocol::MessageType;
  const bool owner = conn.peer.uid == ::geteuid();
  const std::string keeper = "keeper pid " + std::to_string(::getpid());
  switch (frame.type) {
    case MessageType::kDeposit: {
      if (!owner) {
        return Refuse(
            conn, PermissionDenied("Deposit is accepted from uid " + std::to_string(::geteuid()) +
                                   " only (peer pid " + std::to_string(conn.peer.pid) + " uid " +
                                   std::to_string(conn.peer.uid) + ")"));
      }
      if (deposit_) {
        return Refuse(conn, Status(StatusCode::kAlreadyServed,
                                   keeper + " already holds cache " + deposit_->info.config_digest +
                                       " (deposited by pid " +
                                       std::to_string(deposit_->info.depositor_pid) + ")"));
      }
      auto handoff = protocol::DecodeHandoff(std::move(frame));
      if (!handoff.ok()) {
        LOG_WARN << "keeper: refused a deposit from pid " << conn.peer.pid << ": "
                 << handoff.status().ToString();
        return Refuse(conn, handoff.status());
      }
      deposit_ = std::move(handoff).value();
      deposited_at_ = Clock::now();
      LOG_INFO << "keeper " << options_.socket << ": holding cache "
               << Short(deposit_->info.config_digest) << " (" << deposit_->allocations.size()
               << " allocations, " << deposit_->bytes() << " bytes) from pid "
               << deposit_->info.depositor_pid;
      return Reply(conn, protocol::EncodeEmptyHandoff(MessageType::kDepositReply));
    }
    case MessageType::kWithdraw: {
      auto digest = protocol::DecodeWithdraw(frame.payload);
      if (!digest.ok()) return Refuse(conn, digest.status());
      if (!deposit_) {
        return Reply(conn, protocol::EncodeError(NotFound(keeper + " holds no deposit yet")));
      }
      if (*digest != deposit_->info.config_digest) {
        return Reply(
            conn, protocol::EncodeError(Status(
                      StatusCode::kMismatch,
                      "keeper holds cache " + deposit_->info.config_digest + ", not " + *digest)));
      }
      const std::vector<int> fds = deposit_->frame_fds();
      return Reply(conn, protocol::EncodeWithdrawReply(deposit_->info), fds);
    }
    case MessageType::kQuery: {
      Status empty = protocol::CheckEmptyHandoff(frame.type, frame.payload);
      if (!empty.ok()) return Refuse(conn, empty);
      return Reply(conn, protocol::EncodeQueryReply(MakeQuery()));
    }
    case MessageType::kDrop: {
      Status empty = protocol::CheckEmptyHandoff(frame.type, frame.payload);
      if (!empty.ok()) return Refuse(conn, empty);
      if (!owner) {
        return Refuse(
            conn, PermissionDenied("Drop is accepted from uid " + std::to_string(::geteuid()) +
                                   " only (peer pid " + std::to_string(conn.peer.pid) + " uid " +
                                   std::to_string(conn.peer.uid) + ")"));
      }
      LOG_INFO << "keeper " << options_.socket << ": Drop from pid " << conn.peer.pid;
      deposit_.reset();  // the fds close here: their memory goes with the last holder
      dropped_ = true;
      (void)Reply(conn, protocol::EncodeEmptyHandoff(MessageType::kDropReply));
      return false;
    }
    default:
      return Refuse(conn, ProtocolError("unexpected " + protocol::MessageTypeName(frame.type) +
                                        " frame at a keeper"));
  }
}

}  // namespace weightcache::keeper
