// MetricsServer — `serve --metrics-addr`: a small, strict HTTP/1.1 responder for
// `GET /metrics` (Prometheus text exposition, daemon/metrics.h), on its own thread.
//
// Contract:
//  * Address: "HOST:PORT" (TCP; port 0 picks a free one, see port()) or an absolute path (a
//    Unix socket, published 0600 like the daemon's). Create binds and listens, so a bad or
//    busy address fails `serve` before anything is loaded.
//  * A Unix path is busy when someone listens there (os::ProbeUnixListener: a connect that is
//    accepted, e.g. another daemon's metrics or cache socket): Create fails with kIo naming
//    the listener's pid, and the path is never touched. Only a stale socket (its connect
//    refused: nobody listens) is replaced. No lock guards an arbitrary path, so the connect is
//    the liveness test. At destruction the path is removed only while it is still the node we
//    bound (same device and inode): a socket someone else moved there stays.
//  * Upgrade (docs/upgrade.md): listener_fd() is inherited by the successor, which passes it
//    as `inherited_fd` and serves the same listener (the same port, the same path node) instead
//    of binding; HandOff() then stops our accepting (what is accepted is still answered) and
//    gives up the path, which is the successor's to remove.
//  * Start runs the thread; the destructor stops and joins it (an eventfd wakes its poll),
//    closing every connection. The `render` callback runs on that thread and must be
//    thread-safe (DaemonMetrics::Render is).
//  * Each connection: one request, one response, then close (`Connection: close`). The
//    request head (up to the blank line) must arrive within `request_timeout` (else 408) and
//    fit in `max_request_bytes` (else 431); a request line that is not `METHOD TARGET
//    HTTP/1.x` gets 400; a method other than GET or HEAD gets 405 (with `Allow: GET, HEAD`);
//    a target other than /metrics gets 404. A response not taken by the peer within
//    `request_timeout` is dropped.
//  * At most `max_connections` are open. When all are taken and another connection waits in
//    the listen backlog, room is made: first by closing a connection that already has its
//    response (lingering), else the oldest one that has not sent a complete request head
//    within `eviction_grace` of its accept (an idle connection or a slowloris; it is sent a
//    best-effort 408). A connection younger than that, or one being answered, is never
//    closed for room; while only such connections hold the slots, newcomers wait in the
//    backlog (`backlog` deep) for at most the grace. So a scrape waits behind a slowloris for
//    at most `eviction_grace`, never for its timeout, and is never refused. Nothing here
//    ever blocks, and the daemon's socket loop is never touched.
//  * Socket traffic goes through os::SysCalls (accept4, poll, recvmsg, sendmsg).
//  * Thread-safety: Create, Start, HandOff and the destructor on one thread (serve's main);
//    endpoint(), port() and listener_fd() are immutable once Start ran.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "os/syscalls.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

struct MetricsServerOptions {
  std::string address;  // "HOST:PORT" or an absolute Unix socket path
  std::chrono::milliseconds request_timeout{2'000};
  // How long a connection may go without a complete request head before it can be closed to
  // make room for a waiting one (the contract above). A scraper sends its request with the
  // handshake's last packet, so this only has to cover scheduling.
  std::chrono::milliseconds eviction_grace{250};
  size_t max_request_bytes = 8192;
  size_t max_connections = 16;
  int backlog = 1024;  // the listen backlog: where scrapers wait while every slot is taken
  // An upgrade's successor: the predecessor's listening socket (`serve --metrics-fd`), served
  // instead of binding `address` (which it must be a listener of: family, and the port unless
  // it is 0). Create owns it from the call on, also when it fails.
  int inherited_fd = -1;
  os::SysCalls* sys = &os::SysCalls::Default();
};

class MetricsServer {
 public:
  using Render = std::function<std::string()>;

  static Result<std::unique_ptr<MetricsServer>> Create(MetricsServerOptions options, Render render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  void Start();
  // The upgrade's successor serves our listener now (it inherited listener_fd()): stop
  // accepting, answer what was accepted, and leave the path (the successor's) in place.
  void HandOff();
  // The listening socket, for the successor to inherit (valid until HandOff or destruction).
  int listener_fd() const { return listener_fd_; }
  // Where it listens, for the log line: "http://127.0.0.1:9400/metrics" or "unix:/path".
  const std::string& endpoint() const { return endpoint_; }
  uint16_t port() const { return port_; }  // TCP only (0 for a Unix socket)

 private:
  struct Conn;
  // The filesystem node of a Unix listener's path (removed at exit only while it is still it).
  struct PathNode {
    std::string path;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  MetricsServer(MetricsServerOptions options, Render render, UniqueFd listener, UniqueFd wakeup,
                std::optional<PathNode> node);
  void Main();
  bool Advance(Conn& c, short revents, std::chrono::steady_clock::time_point now,
               std::vector<char>& buffer);
  // A complete (or refused) request head: the response to send.
  std::string Respond(const std::string& head);

  MetricsServerOptions options_;
  Render render_;
  UniqueFd listener_;  // the thread's once started (closed there at HandOff)
  int listener_fd_ = -1;
  UniqueFd wakeup_;
  std::optional<PathNode> node_;  // a Unix listener's, until HandOff
  std::atomic<bool> stopping_{false};
  std::atomic<bool> handed_off_{false};
  std::string endpoint_;
  uint16_t port_ = 0;
  std::thread thread_;
};

// The HTTP response `status` ("404 Not Found") with a text body and Connection: close.
std::string HttpResponse(std::string_view status, std::string_view content_type,
                         std::string_view body, std::string_view extra_headers = {},
                         bool head_only = false);

}  // namespace weightcache::daemon
