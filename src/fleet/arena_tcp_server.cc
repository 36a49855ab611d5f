// The host-memory arena source: the weightcache-native TCP protocol (arena_transfer_hello.h has
// the frames, docs/fleet.md "Transport" the why). One thread polls the listener, a wake-up
// eventfd and every peer; each peer is a small state machine (its hello or refusal owed, then
// requests read and answered in order). The only socket is the one bound to `listen`.
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <list>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "fleet/arena_transfer_hello.h"
#include "fleet/arena_transfer_internal.h"
#include "os/tcp_socket.h"

namespace weightcache::fleet {
namespace tcp_server_detail {

using Clock = std::chrono::steady_clock;

// Requests a peer may have queued (read, not yet answered): past this its socket is not read,
// and TCP's own flow control holds the peer back.
constexpr size_t kMaxQueuedRequests = 16;
// The most bytes sent to one peer per pass, so that one fast reader cannot starve the others.
constexpr uint64_t kSendSliceBytes = uint64_t{4} << 20;

struct Peer {
  UniqueFd fd;
  std::string address;
  std::vector<uint8_t> head;  // the hello (or the test's override), until sent
  size_t head_sent = 0;
  uint8_t request[kReadRequestBytes] = {};
  size_t request_have = 0;
  std::deque<ReadRequest> queue;  // [0] is being sent once the head is out
  uint64_t sent_of_front = 0;
  Clock::time_point last_activity;  // a request received or a byte sent
};

class TcpServer : public ArenaServer::Impl {
 public:
  TcpServer(ArenaServerOptions options, std::vector<uint8_t> hello, AfterHello after,
            std::unique_ptr<ServerThreadHook> hook)
      : options_(std::move(options)),
        hello_(std::move(hello)),
        after_(after),
        hook_(std::move(hook)) {
    for (const ServedRegion& region : options_.regions) sizes_.push_back(region.bytes);
    if (!options_.hello_override_for_test.empty()) hello_ = options_.hello_override_for_test;
  }
  ~TcpServer() override { StopNow(); }

  Status Start() {
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::HostPort where, os::SplitHostPort(options_.listen));
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::TcpListener listener, os::ListenTcp(where, 64));
    listener_ = std::move(listener.fd);
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
      return IoError("arena server: getsockname", errno);
    }
    endpoint_ = FormatSockaddr(reinterpret_cast<const sockaddr*>(&bound));
    wake_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_) return IoError("arena server: eventfd", errno);
    thread_ = std::thread([this] { Run(); });
    LOG_INFO << "fleet: transport listening on " << endpoint_ << " ("
             << (after_ == AfterHello::kServeReads ? "tcp" : "ucx") << ", "
             << options_.regions.size() << " regions, peers " << options_.allow.ToString() << ")";
    return Status::Ok();
  }

  const std::string& endpoint_name() const override { return endpoint_; }
  uint64_t peers_accepted() const override { return accepted_; }
  uint64_t peers_refused() const override { return refused_; }

  void Stop() override { StopNow(); }

 private:
  // Stop's work; non-virtual, so that the destructor can call it.
  void StopNow() {
    {
      MutexLock lock(stop_mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    stopping_ = true;
    if (thread_.joinable()) {
      const uint64_t one = 1;
      // Non-blocking and far from its limit: the write cannot fail in a way that matters.
      (void)!::write(wake_.get(), &one, sizeof(one));
      thread_.join();
    }
    peers_.clear();
    listener_.Reset();
  }

  void Drop(std::list<Peer>::iterator& it, const std::string& why, bool misbehaved) {
    if (misbehaved) {
      LOG_WARN << "fleet: transport " << endpoint_ << " dropped peer " << it->address << ": "
               << why;
    } else {
      LOG_INFO << "fleet: transport " << endpoint_ << ": peer " << it->address << " " << why;
    }
    it = peers_.erase(it);
  }

  void AcceptAll() {
    for (;;) {
      sockaddr_storage from{};
      socklen_t length = sizeof(from);
      UniqueFd fd(os::SysCalls::Default().Accept4(listener_.get(),
                                                  reinterpret_cast<sockaddr*>(&from), &length,
                                                  SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
          LOG_WARN << "fleet: transport " << endpoint_ << ": accept: " << std::strerror(errno);
        }
        return;
      }
      const auto* client = reinterpret_cast<const sockaddr*>(&from);
      const std::string address = FormatSockaddr(client);
      // Before a byte is read from it or sent to it.
      if (!options_.allow.Allows(client)) {
        ++refused_;
        LOG_WARN << "fleet: transport " << endpoint_ << " refused a connection from " << address
                 << ": not on the peer allow-list (" << options_.allow.ToString() << ")";
        continue;  // closed by `fd`
      }
      if (peers_.size() >= options_.max_peers) {
        ++refused_;
        LOG_WARN << "fleet: transport " << endpoint_ << " refused " << address
                 << ": the source is full (" << peers_.size()
                 << " peers connected already, the limit)";
        // 16 bytes into an empty socket buffer: sent whole or not at all.
        const std::vector<uint8_t> refusal = EncodeRefusal(RefusalReason::kFull);
        (void)SendSome(fd.get(), refusal.data(), refusal.size());
        continue;
      }
      ++accepted_;
      LOG_INFO << "fleet: transport " << endpoint_ << " serves " << address;
      Peer& peer = peers_.emplace_back();
      peer.fd = std::move(fd);
      peer.address = address;
      peer.head = hello_;
      peer.last_activity = Clock::now();
    }
  }

  bool Owes(const Peer& peer) const {
    return peer.head_sent < peer.head.size() || !peer.queue.empty();
  }

  // Reads what the peer sent: whole requests are checked and queued. An error (its reason set
  // in `why`, `misbehaved` when the peer broke the protocol) drops it.
  bool Receive(Peer& peer, std::string* why, bool* misbehaved) {
    while (peer.queue.size() < kMaxQueuedRequests) {
      const ssize_t n = RecvSome(peer.fd.get(), peer.request + peer.request_have,
                                 kReadRequestBytes - peer.request_have);
      if (n == 0) {
        *why = peer.request_have == 0 ? "closed the connection"
                                      : "closed the connection inside a request";
        *misbehaved = peer.request_have != 0;
        return false;
      }
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
        *why = std::string("gone: ") + std::strerror(errno);
        return false;
      }
      peer.request_have += static_cast<size_t>(n);
      if (peer.request_have < kReadRequestBytes) continue;
      peer.request_have = 0;
      auto request = DecodeReadRequest(std::span<const uint8_t>(peer.request), sizes_);
      if (!request.ok()) {
        *why = "a bad request: " + request.status().message();
        *misbehaved = true;
        return false;
      }
      peer.queue.push_back(*request);
      peer.last_activity = Clock::now();
    }
    return true;
  }

  // Sends what is owed, up to a slice.
  bool Send(Peer& peer, std::string* why) {
    uint64_t budget = kSendSliceBytes;
    while (budget > 0 && Owes(peer)) {
      const uint8_t* from = nullptr;
      uint64_t left = 0;
      if (peer.head_sent < peer.head.size()) {
        from = peer.head.data() + peer.head_sent;
        left = peer.head.size() - peer.head_sent;
      } else {
        const ReadRequest& front = peer.queue.front();
        from = static_cast<const uint8_t*>(options_.regions[front.region].data) + front.offset +
               peer.sent_of_front;
        left = front.length - peer.sent_of_front;
      }
      const ssize_t n = SendSome(peer.fd.get(), from, std::min(left, budget));
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
        *why = std::string("gone: ") + std::strerror(errno);
        return false;
      }
      const auto sent = static_cast<uint64_t>(n);
      budget -= std::min(budget, sent);
      peer.last_activity = Clock::now();
      if (peer.head_sent < peer.head.size()) {
        peer.head_sent += sent;
        if (peer.head_sent == peer.head.size()) {
          peer.head = {};
          peer.head_sent = 0;
        }
        continue;
      }
      peer.sent_of_front += sent;
      if (peer.sent_of_front == peer.queue.front().length) {
        peer.queue.pop_front();
        peer.sent_of_front = 0;
      }
    }
    return true;
  }

  void Run() {
    if (options_.on_progress_thread) {
      if (Status ready = options_.on_progress_thread(); !ready.ok()) {
        LOG_ERROR << "fleet: transport " << endpoint_
                  << ": preparing the server thread: " << ready.ToString();
      }
    }
    std::vector<pollfd> fds;
    while (!stopping_) {
      int timeout_ms = peers_.empty() ? -1 : 100;
      if (hook_) {
        hook_->Progress();
        if (!hook_->Arm()) timeout_ms = 0;
      }
      fds.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({listener_.get(), POLLIN, 0});
      fds.push_back({hook_ ? hook_->fd() : -1, POLLIN, 0});  // a negative fd is ignored
      for (const Peer& peer : peers_) {
        short events = 0;
        if (peer.queue.size() < kMaxQueuedRequests) events |= POLLIN;
        if (Owes(peer)) events |= POLLOUT;
        fds.push_back({peer.fd.get(), events, 0});
      }
      // Wakes at least every 100 ms to run the timeouts.
      const int polled = os::SysCalls::Default().Poll(fds.data(), fds.size(), timeout_ms);
      if (stopping_) break;
      if (polled < 0 && errno != EINTR) {
        LOG_ERROR << "fleet: transport " << endpoint_ << ": poll: " << std::strerror(errno);
        break;
      }
      const auto now = Clock::now();
      size_t k = 3;
      for (auto it = peers_.begin(); it != peers_.end(); ++k) {
        Peer& peer = *it;
        const short revents = k < fds.size() ? fds[k].revents : 0;
        std::string why;
        bool misbehaved = false;
        if ((revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !Receive(peer, &why, &misbehaved)) {
          Drop(it, why, misbehaved);
          continue;
        }
        if (Owes(peer) && !Send(peer, &why)) {
          Drop(it, why, false);
          continue;
        }
        if (after_ == AfterHello::kClose && !Owes(peer)) {
          Drop(it, "took the hello (it reads over UCX)", false);
          continue;
        }
        const auto quiet = now - peer.last_activity;
        if (Owes(peer) && quiet > options_.send_timeout) {
          Drop(it,
               "took no byte in " + std::to_string(options_.send_timeout.count()) + " ms (stalled)",
               true);
          continue;
        }
        if (!Owes(peer) && quiet > options_.idle_timeout) {
          Drop(it,
               "idle: no request in " + std::to_string(options_.idle_timeout.count()) +
                   " ms (its slot is freed)",
               false);
          continue;
        }
        ++it;
      }
      // After the peers: a slot freed above is free for a connection waiting now.
      if ((fds[1].revents & POLLIN) != 0) AcceptAll();
    }
  }

  ArenaServerOptions options_;
  std::vector<uint8_t> hello_;
  AfterHello after_;
  std::unique_ptr<ServerThreadHook> hook_;  // destroyed after the thread is joined
  std::vector<uint64_t> sizes_;
  std::string endpoint_;
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<bool> stopping_{false};
  Mutex stop_mu_;
  bool stopped_ WEIGHTCACHE_GUARDED_BY(stop_mu_) = false;
  // Declared in acquisition order; the thread is joined (Stop) before any goes.
  UniqueFd listener_;
  UniqueFd wake_;
  std::list<Peer> peers_;  // the server thread's (and Stop's after the join)
  std::thread thread_;
};

}  // namespace tcp_server_detail

Result<std::unique_ptr<ArenaServer::Impl>> StartHelloServer(
    ArenaServerOptions options, std::vector<uint8_t> hello, AfterHello after,
    std::unique_ptr<ServerThreadHook> hook) {
  auto server = std::make_unique<tcp_server_detail::TcpServer>(std::move(options), std::move(hello),
                                                               after, std::move(hook));
  WEIGHTCACHE_RETURN_IF_ERROR(server->Start().Context("arena server"));
  return std::unique_ptr<ArenaServer::Impl>(std::move(server));
}

Result<std::unique_ptr<ArenaServer::Impl>> StartTcpServer(ArenaServerOptions options) {
  Hello hello;
  hello.protocol = HelloProtocol::kTcp;
  hello.manifest = options.manifest;
  for (const ServedRegion& region : options.regions) hello.regions.push_back({0, region.bytes, {}});
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> encoded, EncodeHello(hello));
  return StartHelloServer(std::move(options), std::move(encoded), AfterHello::kServeReads, nullptr);
}

}  // namespace weightcache::fleet
