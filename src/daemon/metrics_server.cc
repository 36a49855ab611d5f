#include "daemon/metrics_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <list>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "os/tcp_socket.h"
#include "os/unix_socket.h"

namespace weightcache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kExpositionType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextType = "text/plain; charset=utf-8";

std::string Plain(std::string_view status, std::string_view body,
                  std::string_view extra_headers = {}) {
  return HttpResponse(status, kTextType, body, extra_headers);
}

}  // namespace

std::string HttpResponse(std::string_view status, std::string_view content_type,
                         std::string_view body, std::string_view extra_headers, bool head_only) {
  std::string out = "HTTP/1.1 ";
  out += status;
  out += "\r\nContent-Type: ";
  out += content_type;
  out += "\r\nContent-Length: " + std::to_string(body.size());
  out += "\r\nConnection: close\r\n";
  out += extra_headers;
  out += "\r\n";
  if (!head_only) out += body;
  return out;
}

// One scraper's connection: reading its request head, then writing the response, then
// lingering (our side shut, its leftovers read and dropped) until it closes.
struct MetricsServer::Conn {
  enum class Phase { kReading, kWriting, kLingering };
  UniqueFd fd;
  Clock::time_point accepted;
  Clock::time_point deadline;
  Phase phase = Phase::kReading;
  std::string in;
  std::string out;
  size_t sent = 0;
};

namespace {

// The listener an upgrade's predecessor passed us (`serve --metrics-fd`): a listening stream
// socket of the address's family (and port, unless it is 0). CLOEXEC and non-blocking again:
// inheriting cleared the first, and nothing guarantees the second.
Status CheckInheritedListener(int fd, bool unix_path, uint16_t want_port, uint16_t* port) {
  auto fail = [fd](const std::string& why) {
    return InvalidArgument("--metrics-fd " + std::to_string(fd) + ": " + why);
  };
  int flags = ::fcntl(fd, F_GETFD);
  if (flags < 0) return fail("not an open fd");
  if (::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) != 0) return IoError("fcntl(F_SETFD)", errno);
  int status_flags = ::fcntl(fd, F_GETFL);
  if (status_flags < 0 || ::fcntl(fd, F_SETFL, status_flags | O_NONBLOCK) != 0) {
    return IoError("fcntl(F_SETFL, O_NONBLOCK)", errno);
  }
  int type = 0;
  int listening = 0;
  socklen_t len = sizeof(type);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return fail("not a socket");
  len = sizeof(listening);
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || type != SOCK_STREAM ||
      listening == 0) {
    return fail("not a listening stream socket");
  }
  sockaddr_storage addr{};
  len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return IoError("getsockname on --metrics-fd", errno);
  }
  if (unix_path) {
    if (addr.ss_family != AF_UNIX) return fail("not a Unix socket, but --metrics-addr is a path");
    return Status::Ok();
  }
  if (addr.ss_family == AF_INET) {
    *port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    *port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  } else {
    return fail("not a TCP socket, but --metrics-addr is HOST:PORT");
  }
  if (want_port != 0 && *port != want_port) {
    return fail("listens on port " + std::to_string(*port) + ", not on --metrics-addr's " +
                std::to_string(want_port));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<MetricsServer>> MetricsServer::Create(MetricsServerOptions options,
                                                             Render render) {
  UniqueFd inherited(options.inherited_fd);  // ours from here, whatever happens
  UniqueFd listener;
  std::optional<PathNode> node;
  std::string endpoint;
  uint16_t port = 0;
  const bool unix_path = !options.address.empty() && options.address.front() == '/';
  if (unix_path) {
    const std::string& path = options.address;
    if (inherited) {
      WEIGHTCACHE_RETURN_IF_ERROR(CheckInheritedListener(inherited.get(), true, 0, &port));
      listener = std::move(inherited);
    } else {
      auto probe = os::ProbeUnixListener(path, std::chrono::milliseconds(1'000));
      if (!probe.ok()) {
        Status status = probe.status();
        return status.Context("--metrics-addr");
      }
      if (probe->state == os::UnixListenerProbe::State::kLive) {
        Status busy(StatusCode::kIo,
                    "--metrics-addr " + path + ": " +
                        (probe->pid > 0 ? "pid " + std::to_string(probe->pid) : "a process") +
                        " listens there; the address is busy (give each daemon its own "
                        "--metrics-addr)");
        busy.WithErrno(EADDRINUSE);
        return busy;
      }
      if (probe->state == os::UnixListenerProbe::State::kStale) {
        LOG_INFO << "metrics: replacing stale socket " << path << " (nobody listens there)";
      }
      auto unix_listener = os::ListenUnix(path, 0600, os::Blocking::kNonBlocking, options.backlog);
      if (!unix_listener.ok()) {
        Status status = unix_listener.status();
        return status.Context("--metrics-addr");
      }
      listener = std::move(unix_listener).value();
    }
    // The node at the path now: ours (just renamed there), or, inherited, the predecessor's,
    // which it gives up at its HandOff.
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      node = PathNode{path, st.st_dev, st.st_ino};
    }
    endpoint = "unix:" + path;
  } else {
    auto where = os::SplitHostPort(options.address);
    if (!where.ok()) {
      Status status = where.status();
      return status.Context("--metrics-addr (HOST:PORT or an absolute Unix socket path)");
    }
    if (inherited) {
      WEIGHTCACHE_RETURN_IF_ERROR(
          CheckInheritedListener(inherited.get(), false, where->port, &port));
      listener = std::move(inherited);
    } else {
      auto tcp = os::ListenTcp(*where, options.backlog);
      if (!tcp.ok()) {
        Status status = tcp.status();
        return status.Context("--metrics-addr");
      }
      listener = std::move(tcp->fd);
      port = tcp->port;
    }
    std::string host =
        where->host.find(':') != std::string::npos ? "[" + where->host + "]" : where->host;
    endpoint = "http://" + host + ":" + std::to_string(port) + "/metrics";
  }
  UniqueFd wakeup(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeup) return IoError("eventfd for the metrics server", errno);
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer(
      std::move(options), std::move(render), std::move(listener), std::move(wakeup), node));
  server->endpoint_ = std::move(endpoint);
  server->port_ = port;
  return server;
}

MetricsServer::MetricsServer(MetricsServerOptions options, Render render, UniqueFd listener,
                             UniqueFd wakeup, std::optional<PathNode> node)
    : options_(std::move(options)),
      render_(std::move(render)),
      listener_(std::move(listener)),
      listener_fd_(listener_.get()),
      wakeup_(std::move(wakeup)),
      node_(std::move(node)) {}

MetricsServer::~MetricsServer() {
  if (thread_.joinable()) {
    stopping_.store(true);
    uint64_t one = 1;
    // The eventfd is non-blocking and far from its limit: this write cannot fail in a way
    // that matters (the thread also polls it with a timeout).
    (void)::write(wakeup_.get(), &one, sizeof(one));
    thread_.join();
  }
  // Only while it is still the node we bound: a socket moved over it is someone else's.
  struct stat st {};
  if (node_ && ::lstat(node_->path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
      st.st_dev == node_->dev && st.st_ino == node_->ino) {
    ::unlink(node_->path.c_str());
  }
}

void MetricsServer::Start() {
  thread_ = std::thread([this] { Main(); });
}

void MetricsServer::HandOff() {
  node_.reset();  // the successor's path now
  handed_off_.store(true);
  uint64_t one = 1;
  (void)::write(wakeup_.get(), &one, sizeof(one));  // as in the destructor
  if (!thread_.joinable()) listener_.Reset();
}

std::string MetricsServer::Respond(const std::string& head) {
  auto line_end = head.find("\r\n");
  std::string line = head.substr(0, line_end);
  auto sp1 = line.find(' ');
  auto sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos ||
      line.find(' ', sp2 + 1) != std::string::npos) {
    return Plain("400 Bad Request", "malformed request line\n");
  }
  std::string method = line.substr(0, sp1);
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string version = line.substr(sp2 + 1);
  bool token = !method.empty() && std::all_of(method.begin(), method.end(),
                                              [](char c) { return c >= 'A' && c <= 'Z'; });
  if (!token || target.empty() || (version != "HTTP/1.1" && version != "HTTP/1.0")) {
    return Plain("400 Bad Request", "malformed request line\n");
  }
  if (method != "GET" && method != "HEAD") {
    return Plain("405 Method Not Allowed", "only GET and HEAD are served\n",
                 "Allow: GET, HEAD\r\n");
  }
  std::string path = target.substr(0, target.find('?'));
  if (path != "/metrics") return Plain("404 Not Found", "only /metrics is served\n");
  return HttpResponse("200 OK", kExpositionType, render_(), {}, method == "HEAD");
}

namespace {

// Closes a connection to make room. Its unread bytes are read first (best effort), so that the
// close is a FIN, not a reset that could destroy what it was already sent.
void CloseForRoom(int fd, std::string_view last_words, os::SysCalls& sys) {
  std::array<char, 4096> sink{};
  for (int i = 0; i < 16; ++i) {
    iovec iov{sink.data(), sink.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (sys.RecvMsg(fd, &msg, MSG_DONTWAIT) <= 0) break;
  }
  if (!last_words.empty()) {
    iovec iov{const_cast<char*>(last_words.data()), last_words.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    (void)sys.SendMsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  }
}

}  // namespace

// One connection's step of the state machine (reading → writing → lingering), after its poll
// said `revents` (0: only its deadline may have passed). False: close it.
bool MetricsServer::Advance(Conn& c, short revents, Clock::time_point now,
                            std::vector<char>& buffer) {
  os::SysCalls& sys = *options_.sys;
  bool drop = false;
  if (revents != 0 && c.phase != Conn::Phase::kWriting) {
    iovec iov{buffer.data(), buffer.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    ssize_t n = sys.RecvMsg(c.fd.get(), &msg, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      drop = true;  // the peer closed (or reset) its side
    } else if (n > 0 && c.phase == Conn::Phase::kReading) {
      c.in.append(buffer.data(), static_cast<size_t>(n));
      auto end = c.in.find("\r\n\r\n");
      if (end != std::string::npos && end + 4 <= options_.max_request_bytes) {
        c.out = Respond(c.in.substr(0, end + 2));
      } else if (c.in.size() >= options_.max_request_bytes) {
        c.out = Plain("431 Request Header Fields Too Large",
                      "the request is larger than " + std::to_string(options_.max_request_bytes) +
                          " bytes\n");
      }
      if (!c.out.empty()) {
        c.phase = Conn::Phase::kWriting;
        c.in.clear();
        c.deadline = now + options_.request_timeout;
      }
    }
  } else if (revents != 0) {  // writing
    iovec iov{c.out.data() + c.sent, c.out.size() - c.sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    ssize_t n = sys.SendMsg(c.fd.get(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      drop = true;
    } else if (n > 0) {
      c.sent += static_cast<size_t>(n);
    }
    if (!drop && c.sent == c.out.size()) {
      // Shut our side and read what the peer still sends until it closes, so that its
      // unread request bytes do not turn our close into a reset that loses the response.
      (void)::shutdown(c.fd.get(), SHUT_WR);
      c.phase = Conn::Phase::kLingering;
      c.deadline = now + options_.request_timeout;
    }
  }
  if (!drop && now >= c.deadline) {
    if (c.phase == Conn::Phase::kReading) {
      c.out = Plain("408 Request Timeout", "the request did not arrive in time\n");
      c.phase = Conn::Phase::kWriting;
      c.deadline = now + options_.request_timeout;
    } else {
      drop = true;  // a response the peer does not take, or a peer that never closes
    }
  }
  return !drop;
}

void MetricsServer::Main() {
  os::SysCalls& sys = *options_.sys;
  std::list<Conn> conns;
  std::vector<char> buffer(4096);
  const std::string evicted_response =
      Plain("408 Request Timeout", "no complete request in time while others waited\n");
  // A connection that may be closed to make room now (the contract in the header): one that
  // lingers after its response, else the oldest that has not sent its head within the grace.
  auto evictable = [&](Clock::time_point now) {
    auto oldest_reading = conns.end();
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      if (it->phase == Conn::Phase::kLingering) return it;
      if (it->phase == Conn::Phase::kReading && now - it->accepted >= options_.eviction_grace &&
          (oldest_reading == conns.end() || it->accepted < oldest_reading->accepted)) {
        oldest_reading = it;
      }
    }
    return oldest_reading;
  };
  // A failed accept (no fds) pauses the listener briefly instead of spinning on it.
  Clock::time_point accept_paused_until{};  // in the past: accepting
  while (true) {
    auto now = Clock::now();
    const bool paused = now < accept_paused_until;
    // Full, and nothing to close yet: newcomers wait in the backlog until a slot frees or the
    // youngest reading connection's grace ends.
    const bool full = conns.size() >= options_.max_connections && evictable(now) == conns.end();
    const bool accepting = listener_ && !paused && !full;
    std::vector<pollfd> fds;
    fds.push_back({wakeup_.get(), POLLIN, 0});
    fds.push_back(
        {listener_ ? listener_.get() : -1, static_cast<short>(accepting ? POLLIN : 0), 0});
    auto next = paused ? accept_paused_until : now + std::chrono::seconds(60);
    for (auto& c : conns) {
      short events = c.phase == Conn::Phase::kWriting ? POLLOUT : POLLIN;
      fds.push_back({c.fd.get(), events, 0});
      next = std::min(next, c.deadline);
      if (full && c.phase == Conn::Phase::kReading) {
        next = std::min(next, c.accepted + options_.eviction_grace);
      }
    }
    auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
    int rc = sys.Poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0)));
    if (rc < 0 && errno != EINTR) {
      LOG_WARN << "metrics server: poll failed: " << IoError("poll", errno).ToString();
      return;
    }
    if (rc > 0 && (fds[0].revents & POLLIN) != 0) {
      uint64_t value = 0;
      (void)::read(wakeup_.get(), &value, sizeof(value));
      if (stopping_.load()) return;
      // Handed off: the successor accepts on the same listener; ours closes, and the
      // connections accepted so far are answered.
      if (handed_off_.load()) listener_.Reset();
    }
    now = Clock::now();

    // Per connection, by its poll slot (connections accepted below are not in this round).
    size_t slot = 2;
    for (auto it = conns.begin(); it != conns.end(); ++slot) {
      const short revents = rc > 0 ? fds[slot].revents : 0;
      const bool drop = !Advance(*it, revents, now, buffer);
      it = drop ? conns.erase(it) : std::next(it);
    }

    if (rc > 0 && listener_ && (fds[1].revents & POLLIN) != 0) {
      while (true) {
        if (conns.size() >= options_.max_connections) {
          auto victim = evictable(now);
          if (victim == conns.end()) break;  // the rest waits in the backlog
          const bool answered = victim->phase == Conn::Phase::kLingering;
          CloseForRoom(victim->fd.get(), answered ? std::string_view() : evicted_response, sys);
          conns.erase(victim);
        }
        auto accepted = os::AcceptConnection(listener_.get(), os::Blocking::kNonBlocking, sys);
        if (!accepted.ok()) {
          LOG_DEBUG << "metrics server: " << accepted.status().ToString();
          accept_paused_until = now + std::chrono::milliseconds(100);
          break;
        }
        if (!accepted->has_value()) break;
        Conn& conn = conns.emplace_back();
        conn.fd = std::move(**accepted);
        conn.accepted = now;
        conn.deadline = now + options_.request_timeout;
      }
    }
  }
}

}  // namespace weightcache::daemon
