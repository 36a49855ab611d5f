// `serve --metrics-addr` (docs/metrics.md) as a real process: a known sequence of attaches
// (served, mismatched, out of sequence) read back from GET /metrics with exact values; hostile
// scrapers (oversize, slowloris, bad method, bad target, garbage) get their status while the
// daemon keeps serving attaches; a busy Unix path is refused and a stale one replaced; the
// endpoint survives an upgrade; idle connections never lock a scrape out; promtool finds the
// exposition clean; and a real Prometheus server scrapes the endpoint.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/unique_fd.h"
#include "integration/daemon_process.h"
#include "os/unix_socket.h"
#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

// A blocking TCP connection to 127.0.0.1:port (the test fails if it cannot connect).
UniqueFd ConnectTcp(uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(fd) << std::strerror(errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  return fd;
}

void SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    ASSERT_GT(n, 0) << std::strerror(errno);
    sent += static_cast<size_t>(n);
  }
}

// Sends `request` and returns everything the server sends until it closes.
std::string Exchange(uint16_t port, const std::string& request) {
  UniqueFd fd = ConnectTcp(port);
  SendAll(fd.get(), request);
  bool eof = false;
  std::string reply = ReadUntilEof(fd.get(), 30s, &eof);
  EXPECT_TRUE(eof) << "the server did not close: " << reply;
  return reply;
}

std::string Body(const std::string& response) {
  auto end = response.find("\r\n\r\n");
  return end == std::string::npos ? std::string() : response.substr(end + 4);
}

bool HasLine(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

// The port the daemon printed ("metrics at http://127.0.0.1:PORT/metrics"), polled from its
// log while it starts (bounded).
uint16_t MetricsPort(ServeProcess& serve) {
  static const std::regex kLine(R"(metrics at http://127\.0\.0\.1:(\d+)/metrics)");
  for (int i = 0; i < 3000; ++i) {
    std::smatch m;
    std::string log = serve.Log();
    if (std::regex_search(log, m, kLine)) return static_cast<uint16_t>(std::stoi(m[1].str()));
    if (!serve.Running()) break;
    std::this_thread::sleep_for(10ms);
  }
  ADD_FAILURE() << "no metrics line in the log:\n" << serve.Log();
  return 0;
}

// Sends `request` on the Unix socket `path` and returns everything the server sends until it
// closes; "" when nobody accepts the connection.
std::string ExchangeUnix(const std::string& path, const std::string& request) {
  auto fd = ConnectRaw(path);
  if (!fd.ok()) return "";
  UniqueFd conn(*fd);
  SendAll(conn.get(), request);
  bool eof = false;
  std::string reply = ReadUntilEof(conn.get(), 30s, &eof);
  EXPECT_TRUE(eof) << "the server did not close: " << reply;
  return reply;
}

// A TCP connection to 127.0.0.1:port, or an invalid fd when nobody listens.
UniqueFd TryConnectTcp(uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    return UniqueFd();
  }
  return fd;
}

// A socket node at `path` that nobody listens on: what a daemon killed with -9 leaves.
void MakeStaleSocket(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
}

struct NodeId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const NodeId&) const = default;
};
std::optional<NodeId> NodeOf(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return std::nullopt;
  return NodeId{st.st_dev, st.st_ino};
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// Waits (bounded) for a process that is not our child (an upgrade's successor) to be gone.
bool WaitGone(pid_t pid) {
  for (int i = 0; i < 3000 && Alive(pid); ++i) std::this_thread::sleep_for(10ms);
  return !Alive(pid);
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 12, 1, 3, 4096);
    runtime_ = dir_.Join("run");
  }
  // A daemon killed by a failed assertion leaves its keeper holding the cache: drop it.
  // Upgrade successors are not our children: kill whatever still runs.
  void TearDown() override {
    for (pid_t pid : successors_) {
      if (Alive(pid)) ::kill(pid, SIGKILL);
    }
    DropAllKeepers(runtime_, 5s);
  }

  // `weightcache upgrade --socket S --json`: the successor's pid (0 on failure).
  pid_t Upgrade(const std::string& socket, CommandResult* result) {
    *result = RunCommand({CliPath(), "upgrade", "--socket", socket, "--json"});
    if (result->exit_code != 0) return 0;
    auto j = nlohmann::json::parse(result->out, nullptr, false);
    if (j.is_discarded() || !j.contains("successor_pid")) {
      ADD_FAILURE() << "upgrade --json printed: " << result->out;
      return 0;
    }
    const pid_t pid = j["successor_pid"].get<pid_t>();
    successors_.push_back(pid);
    return pid;
  }

  // A connection that said Hello with `config` and, if it matched, attached.
  Result<protocol::Connection> HelloAndAttach(const std::string& socket,
                                              const identity::CacheConfig& config, bool* matched) {
    auto conn = protocol::Connection::Connect(socket, 2s);
    if (!conn.ok()) return conn.status();
    protocol::Hello hello;
    hello.config = config.ToJson();
    hello.client_name = "daemon_metrics_test";
    auto reply = conn->SendHello(hello, os::Deadline::After(5s));
    if (!reply.ok()) return reply.status();
    *matched = reply->match;
    if (reply->match) {
      auto attached = conn->Attach(os::Deadline::After(5s));
      if (!attached.ok()) return attached.status();
    }
    return conn;
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_;
  std::vector<pid_t> successors_;
};

TEST_F(MetricsTest, CountsAKnownSequenceOfAttachesAndSurvivesHostileScrapers) {
  auto serve = ServeProcess::Start(
      HostServeArgs(model_, runtime_, {"--metrics-addr", "127.0.0.1:0", "--metrics-timeout", "1"}),
      dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  const uint16_t port = MetricsPort(*serve);
  ASSERT_NE(port, 0);

  const identity::CacheConfig config = ConfigFor(model_, "tiny");
  identity::CacheConfig other = config;
  other.revision = "some-other-revision";

  bool matched = false;
  auto first = HelloAndAttach(*socket, config, &matched);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(matched);
  auto second = HelloAndAttach(*socket, config, &matched);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_TRUE(matched);
  auto mismatched = HelloAndAttach(*socket, other, &matched);
  ASSERT_TRUE(mismatched.ok()) << mismatched.status().ToString();
  ASSERT_FALSE(matched);
  {
    // Attach before any Hello: a protocol error, counted as result="error".
    auto rude = protocol::Connection::Connect(*socket, 2s);
    ASSERT_TRUE(rude.ok());
    auto refused = rude->Attach(os::Deadline::After(5s));
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kProtocol) << refused.status().ToString();
  }

  auto status = QueryStatus(*socket);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  auto checkpoint = checkpoint::Checkpoint::Open(model_);
  ASSERT_TRUE(checkpoint.ok());
  const std::string total = std::to_string(checkpoint->total_bytes());

  std::string response = Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  EXPECT_NE(response.find("\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            std::string::npos)
      << response;
  EXPECT_NE(response.find("\r\nConnection: close\r\n"), std::string::npos) << response;
  const std::string body = Body(response);
  EXPECT_NE(response.find("\r\nContent-Length: " + std::to_string(body.size()) + "\r\n"),
            std::string::npos)
      << response;
  for (const std::string& line : {
           R"(weightcache_cache_bytes{device="host",model="tiny",tier="host"} )" +
               std::to_string(status->bytes),
           std::string(R"(weightcache_attaches_total{result="daemon"} 2)"),
           std::string(R"(weightcache_attaches_total{result="mismatch"} 1)"),
           std::string(R"(weightcache_attaches_total{result="unavailable"} 0)"),
           std::string(R"(weightcache_attaches_total{result="error"} 1)"),
           std::string(R"(weightcache_attach_duration_seconds_bucket{le="+Inf"} 2)"),
           std::string("weightcache_attach_duration_seconds_count 2"),
           std::string("weightcache_hits_total 2"),
           std::string("weightcache_misses_total 1"),
           std::string("weightcache_clients 2"),
           std::string(R"(weightcache_daemon_state{state="ready"} 1)"),
           std::string(R"(weightcache_daemon_state{state="loading"} 0)"),
           "weightcache_load_done_bytes " + total,
           "weightcache_load_size_bytes " + total,
           std::string("weightcache_evictions_total 0"),
       }) {
    EXPECT_TRUE(HasLine(body, line)) << line << "\n" << body;
  }
  // HEAD: the headers of the same response, no body.
  std::string head = Exchange(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << head;
  EXPECT_EQ(Body(head), "");

  // A slowloris: half a request, then nothing. It holds a slot until the timeout, and
  // meanwhile scrapes and attaches are served.
  UniqueFd slow = ConnectTcp(port);
  SendAll(slow.get(), "GET /metrics HTTP/1.1\r\nHost:");

  EXPECT_EQ(Exchange(port, "POST /metrics HTTP/1.1\r\n\r\n")
                .rfind("HTTP/1.1 405 Method Not Allowed\r\n", 0),
            0u);
  EXPECT_NE(Exchange(port, "DELETE /metrics HTTP/1.1\r\n\r\n").find("\r\nAllow: GET, HEAD\r\n"),
            std::string::npos);
  EXPECT_EQ(Exchange(port, "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404 Not Found\r\n", 0), 0u);
  EXPECT_EQ(Exchange(port, "GET /metrics/x HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404 ", 0), 0u);
  EXPECT_EQ(Exchange(port, "hello there\r\n\r\n").rfind("HTTP/1.1 400 Bad Request\r\n", 0), 0u);
  EXPECT_EQ(Exchange(port, "GET /metrics SPDY/3\r\n\r\n").rfind("HTTP/1.1 400 ", 0), 0u);
  EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'a') + "\r\n\r\n")
                .rfind("HTTP/1.1 431 Request Header Fields Too Large\r\n", 0),
            0u);

  // `status --json` and `ls --json` carry the same counters, fetched with the Metrics request.
  auto st = RunCommand({CliPath(), "status", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  auto sj = nlohmann::json::parse(st.out);
  ASSERT_EQ(sj["devices"].size(), 1u) << st.out;
  const auto& dev = sj["devices"][0];
  EXPECT_EQ(dev["device"], "host");
  EXPECT_TRUE(dev["budget_bytes"].is_null());  // until the budget ledger fills it
  EXPECT_TRUE(dev["used_bytes"].is_null());
  EXPECT_TRUE(dev["free_bytes"].is_null());
  ASSERT_EQ(dev["caches"].size(), 1u);
  const auto& cache = dev["caches"][0];
  EXPECT_EQ(cache["cache_state"], "host");
  EXPECT_EQ(cache["hits"], 2);
  EXPECT_EQ(cache["misses"], 1);
  EXPECT_EQ(cache["clients"], 2);
  EXPECT_GT(cache["last_attach_unix_ms"].get<uint64_t>(), uint64_t{1'600'000'000'000});
  EXPECT_EQ(dev["lru"], nlohmann::json::array({config.Digest()}));
  auto ls = RunCommand({CliPath(), "ls", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  auto lj = nlohmann::json::parse(ls.out);
  EXPECT_EQ(lj["caches"][0]["hits"], 2) << ls.out;
  EXPECT_EQ(lj["caches"][0]["misses"], 1) << ls.out;
  // Neither listing counted itself as an attach (their Hello is of another model id).
  auto text = RunCommand({CliPath(), "status", "--runtime-dir", runtime_});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("device host (namespace default): budget -, used -, free -"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("LRU (least recently attached first): " + config.Digest().substr(0, 16)),
            std::string::npos)
      << text.out;

  auto third = HelloAndAttach(*socket, config, &matched);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_TRUE(matched);

  bool eof = false;
  std::string timed_out = ReadUntilEof(slow.get(), 30s, &eof);
  EXPECT_TRUE(eof);
  EXPECT_EQ(timed_out.rfind("HTTP/1.1 408 Request Timeout\r\n", 0), 0u) << timed_out;

  std::string after = Body(Exchange(port, "GET /metrics HTTP/1.0\r\n\r\n"));
  EXPECT_TRUE(HasLine(after, R"(weightcache_attaches_total{result="daemon"} 3)")) << after;
  EXPECT_TRUE(HasLine(after, "weightcache_clients 3")) << after;
  EXPECT_TRUE(serve->Running());

  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
}

TEST_F(MetricsTest, ServesOnAUnixSocketAndRefusesABadAddressBeforeLoading) {
  const std::string path = dir_.Join("metrics.sock");
  auto serve = ServeProcess::Start(HostServeArgs(model_, runtime_, {"--metrics-addr", path}),
                                   dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  auto fd = ConnectRaw(path);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  UniqueFd conn(*fd);
  SendAll(conn.get(), "GET /metrics HTTP/1.1\r\n\r\n");
  bool eof = false;
  std::string response = ReadUntilEof(conn.get(), 30s, &eof);
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  EXPECT_TRUE(HasLine(Body(response), R"(weightcache_daemon_state{state="ready"} 1)"));
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
  EXPECT_FALSE(std::filesystem::exists(path));  // unlinked at exit

  auto bad = RunCommand({CliPath(), "serve", "--model", model_, "--tier", "host", "--model-id",
                         "tiny", "--runtime-dir", runtime_, "--metrics-addr", "localhost:99999"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--metrics-addr"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("0..65535"), std::string::npos) << bad.err;
}

// `status`: two caches on one device in LRU order (least recently attached first), which an
// attach reorders.
TEST_F(MetricsTest, StatusListsCachesLeastRecentlyAttachedFirst) {
  const std::string model_b = MakeCheckpoint(dir_.Join("model-b"), 6, 1, 9, 4096);
  auto a = ServeProcess::Start(HostServeArgs(model_, runtime_), dir_.Join("a.log"));
  auto b = ServeProcess::Start(HostServeArgs(model_b, runtime_), dir_.Join("b.log"));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const identity::CacheConfig config_a = ConfigFor(model_, "tiny");
  const identity::CacheConfig config_b = ConfigFor(model_b, "tiny");
  auto socket_of = [&](const identity::CacheConfig& c) {
    for (const auto& s : FindSockets(runtime_)) {
      if (s.find(c.ShortDigest()) != std::string::npos) return s;
    }
    return std::string();
  };
  auto ready = [&](const std::string& socket) {
    for (int i = 0; i < 3000; ++i) {
      auto st = QueryStatus(socket);
      if (st.ok() && st->state == CacheState::kReady) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  };
  std::string sa;
  std::string sb;
  for (int i = 0; i < 3000 && (sa.empty() || sb.empty()); ++i) {
    sa = socket_of(config_a);
    sb = socket_of(config_b);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(ready(sa)) << a->Log();
  ASSERT_TRUE(ready(sb)) << b->Log();
  auto lru = [&] {
    auto st = RunCommand({CliPath(), "status", "--json", "--runtime-dir", runtime_});
    EXPECT_EQ(st.exit_code, 0) << st.err;
    return nlohmann::json::parse(st.out)["devices"][0]["lru"];
  };
  bool matched = false;
  auto attach_b = HelloAndAttach(sb, config_b, &matched);
  ASSERT_TRUE(attach_b.ok() && matched);
  // a never attached: first to go.
  EXPECT_EQ(lru(), nlohmann::json::array({config_a.Digest(), config_b.Digest()}));
  // Attach times are in milliseconds: let the clock pass b's before attaching to a.
  std::this_thread::sleep_for(5ms);
  auto attach_a = HelloAndAttach(sa, config_a, &matched);
  ASSERT_TRUE(attach_a.ok() && matched);
  EXPECT_EQ(lru(), nlohmann::json::array({config_b.Digest(), config_a.Digest()}));
  a->Signal(SIGTERM);
  b->Signal(SIGTERM);
  EXPECT_EQ(a->WaitExit(30s), 0) << a->Log();
  EXPECT_EQ(b->WaitExit(30s), 0) << b->Log();
}

// A real Prometheus (Debian's `prometheus`) scrapes the daemon every second; its HTTP API
// then answers weightcache_attaches_total with the values of a known sequence of attaches.
TEST_F(MetricsTest, ARealPrometheusScrapesTheEndpoint) {
  const std::string prometheus = "/usr/bin/prometheus";
  if (!std::filesystem::exists(prometheus)) {
    ASSERT_FALSE(ToolsRequired()) << prometheus << " (Debian prometheus) is not installed";
    GTEST_SKIP() << prometheus << " (Debian prometheus) is not installed";
  }
  auto serve = ServeProcess::Start(
      HostServeArgs(model_, runtime_, {"--metrics-addr", "127.0.0.1:0"}), dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  const uint16_t port = MetricsPort(*serve);
  ASSERT_NE(port, 0);
  const identity::CacheConfig config = ConfigFor(model_, "tiny");
  identity::CacheConfig other = config;
  other.revision = "other";
  bool matched = false;
  auto a = HelloAndAttach(*socket, config, &matched);
  ASSERT_TRUE(a.ok() && matched);
  auto b = HelloAndAttach(*socket, other, &matched);
  ASSERT_TRUE(b.ok() && !matched);

  // A free port for Prometheus' own web listener: bind :0, read it, close, hand it over.
  uint16_t web_port = 0;
  {
    UniqueFd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t len = sizeof(addr);
    ASSERT_EQ(::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
    web_port = ntohs(addr.sin_port);
  }
  const std::string config_path = dir_.Join("prometheus.yml");
  WriteFile(config_path,
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: weightcache\n    static_configs:\n"
            "      - targets: ['127.0.0.1:" +
                std::to_string(port) + "']\n");
  ChildSpec spec;
  spec.argv = {prometheus, "--config.file=" + config_path,
               "--storage.tsdb.path=" + dir_.Join("tsdb"),
               "--web.listen-address=127.0.0.1:" + std::to_string(web_port)};
  spec.log_path = dir_.Join("prometheus.log");
  auto prom = TestChild::Spawn(spec);
  ASSERT_TRUE(prom.ok()) << prom.status().ToString();

  // Bounded wait (120 s) for the series with the expected values: Prometheus starts, scrapes
  // every second, and the query sees the sample once it is appended.
  const std::string query =
      "GET /api/v1/query?query=weightcache_attaches_total HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Connection: close\r\n\r\n";
  std::string last;
  bool found = false;
  for (int i = 0; i < 240 && !found; ++i) {
    std::this_thread::sleep_for(500ms);
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(web_port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) continue;
    SendAll(fd.get(), query);
    bool eof = false;
    last = ReadUntilEof(fd.get(), 10s, &eof);
    found = last.find(R"("result":"daemon")") != std::string::npos &&
            last.find(R"("result":"mismatch")") != std::string::npos;
  }
  ASSERT_TRUE(found) << last << "\n" << prom->Log();
  EXPECT_NE(last.find(R"("status":"success")"), std::string::npos) << last;
  // Each series: its labels, then the [time, "value"] pair.
  EXPECT_TRUE(std::regex_search(last, std::regex(R"("result":"daemon"\},"value":\[[0-9.]+,"1"\])")))
      << last;
  EXPECT_TRUE(
      std::regex_search(last, std::regex(R"("result":"mismatch"\},"value":\[[0-9.]+,"1"\])")))
      << last;
  EXPECT_TRUE(std::regex_search(last, std::regex(R"("result":"error"\},"value":\[[0-9.]+,"0"\])")))
      << last;
  EXPECT_NE(last.find(R"("job":"weightcache")"), std::string::npos) << last;
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
}

// issue 39 §5.4: an address someone listens on is busy. `serve` fails (exit 1, naming the
// path) and leaves the path alone: another daemon's metrics socket and a cache socket both
// keep serving their own clients.
TEST_F(MetricsTest, ALiveUnixSocketIsBusyAndIsNeverTakenOver) {
  const std::string path = dir_.Join("metrics.sock");
  auto first = ServeProcess::Start(HostServeArgs(model_, runtime_, {"--metrics-addr", path}),
                                   dir_.Join("first.log"));
  ASSERT_NE(first, nullptr);
  auto socket = WaitForState(*first, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << "\n" << first->Log();
  const auto node = NodeOf(path);
  ASSERT_TRUE(node.has_value());

  // Another cache (another checkpoint: another identity), pointed at the first one's metrics
  // socket, then at its cache socket.
  const std::string model_b = MakeCheckpoint(dir_.Join("model-b"), 6, 1, 9, 4096);
  const std::string runtime_b = dir_.Join("run-b");
  for (const std::string& busy : {path, *socket}) {
    auto second = ServeProcess::Start(HostServeArgs(model_b, runtime_b, {"--metrics-addr", busy}),
                                      dir_.Join("second.log"));
    ASSERT_NE(second, nullptr);
    EXPECT_EQ(second->WaitExit(30s), 1) << second->Log();
    EXPECT_NE(second->Log().find("--metrics-addr " + busy + ": pid " +
                                 std::to_string(first->pid()) + " listens there"),
              std::string::npos)
        << second->Log();
  }
  DropAllKeepers(runtime_b, 5s);
  EXPECT_EQ(NodeOf(path), node);
  const std::string response = ExchangeUnix(path, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  auto status = QueryStatus(*socket);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, CacheState::kReady);
  first->Signal(SIGTERM);
  EXPECT_EQ(first->WaitExit(30s), 0) << first->Log();
  EXPECT_FALSE(NodeOf(path).has_value());  // its own socket: removed at exit
}

// A TCP port someone listens on is busy as well: exit 1, "Address already in use".
TEST_F(MetricsTest, ABusyTcpPortFailsServe) {
  UniqueFd taken(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(taken.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(taken.get(), 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(taken.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const CommandResult busy =
      RunCommand({CliPath(), "serve", "--model", model_, "--tier", "host", "--model-id", "tiny",
                  "--runtime-dir", runtime_, "--metrics-addr", address});
  EXPECT_EQ(busy.exit_code, 1) << busy.err;
  EXPECT_NE(busy.err.find("--metrics-addr"), std::string::npos) << busy.err;
  EXPECT_NE(busy.err.find("Address already in use"), std::string::npos) << busy.err;
  EXPECT_TRUE(FindSockets(runtime_).empty());  // refused before the cache was published
}

// A stale socket (nobody listens: a daemon killed with -9) is replaced; at exit the daemon
// removes the path only while it is still the socket it bound.
TEST_F(MetricsTest, AStaleUnixSocketIsReplacedAndOnlyOurOwnIsRemovedAtExit) {
  const std::string path = dir_.Join("metrics.sock");
  MakeStaleSocket(path);
  auto serve = ServeProcess::Start(HostServeArgs(model_, runtime_, {"--metrics-addr", path}),
                                   dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  EXPECT_NE(serve->Log().find("replacing stale socket " + path + " (nobody listens there)"),
            std::string::npos)
      << serve->Log();
  const std::string response = ExchangeUnix(path, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;

  // Someone else's socket moved over the path meanwhile: not ours to remove.
  auto other = os::ListenUnix(dir_.Join("other.sock"));
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  ASSERT_EQ(::rename(dir_.Join("other.sock").c_str(), path.c_str()), 0) << std::strerror(errno);
  const auto theirs = NodeOf(path);
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
  EXPECT_EQ(NodeOf(path), theirs);
}

// issue 39 §5.5: the endpoint is handed over with the cache. After `upgrade` (twice) the same
// path, and the same TCP port (also one that port 0 picked), serve the successor's metrics,
// and no old daemon removed anything.
TEST_F(MetricsTest, TheEndpointIsHandedOverWithTheCache) {
  const std::string path = dir_.Join("metrics.sock");
  for (const std::string& address : {path, std::string("127.0.0.1:0")}) {
    SCOPED_TRACE(address);
    auto serve = ServeProcess::Start(HostServeArgs(model_, runtime_, {"--metrics-addr", address}),
                                     dir_.Join("serve-" + std::to_string(successors_.size())));
    ASSERT_NE(serve, nullptr);
    auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
    ASSERT_TRUE(socket.ok()) << socket.status().ToString() << "\n" << serve->Log();
    const bool unix_path = address == path;
    const uint16_t port = unix_path ? 0 : MetricsPort(*serve);
    auto scrape = [&] {
      const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
      if (unix_path) return ExchangeUnix(path, request);
      UniqueFd fd = TryConnectTcp(port);
      if (!fd) return std::string();
      SendAll(fd.get(), request);
      bool eof = false;
      return ReadUntilEof(fd.get(), 30s, &eof);
    };
    CommandResult up;
    const pid_t successor = Upgrade(*socket, &up);
    ASSERT_GT(successor, 0) << up.err << "\n" << serve->Log();
    EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
    // Only the successor is left to answer.
    const std::string response = scrape();
    EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response << "\n" << serve->Log();
    EXPECT_TRUE(HasLine(Body(response), R"(weightcache_daemon_state{state="ready"} 1)"))
        << response;
    EXPECT_EQ(serve->Log().find("metrics not served"), std::string::npos) << serve->Log();
    const std::string endpoint =
        unix_path ? "unix:" + path : "http://127.0.0.1:" + std::to_string(port) + "/metrics";
    EXPECT_NE(serve->Log().find("metrics at " + endpoint + " (handed over by pid " +
                                std::to_string(serve->pid()) + ")"),
              std::string::npos)
        << serve->Log();
    // The successor hands it on in turn (its own --metrics-fd is not passed twice).
    const pid_t third = Upgrade(*socket, &up);
    ASSERT_GT(third, 0) << up.err << "\n" << serve->Log();
    EXPECT_TRUE(WaitGone(successor));
    const std::string again = scrape();
    EXPECT_EQ(again.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << again << "\n" << serve->Log();
    EXPECT_NE(serve->Log().find("metrics at " + endpoint + " (handed over by pid " +
                                std::to_string(successor) + ")"),
              std::string::npos)
        << serve->Log();
    // The last successor is the path's owner now: it removes it when it stops.
    ASSERT_EQ(::kill(third, SIGTERM), 0);
    EXPECT_TRUE(WaitGone(third));
    if (unix_path) {
      EXPECT_FALSE(NodeOf(path).has_value());
    }
  }
}

// A failed upgrade leaves the old daemon serving metrics where it did.
TEST_F(MetricsTest, AFailedUpgradeLeavesTheOldDaemonServingMetrics) {
  const std::string path = dir_.Join("metrics.sock");
  auto serve = ServeProcess::Start(HostServeArgs(model_, runtime_, {"--metrics-addr", path}),
                                   dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  const std::string quitter = dir_.Join("quitter.sh");
  WriteFile(quitter, "#!/bin/sh\nexit 1\n");
  ASSERT_EQ(::chmod(quitter.c_str(), 0755), 0);
  const CommandResult up =
      RunCommand({CliPath(), "upgrade", "--socket", *socket, "--binary", quitter});
  EXPECT_EQ(up.exit_code, 1) << up.err;
  const std::string response = ExchangeUnix(path, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
  EXPECT_FALSE(NodeOf(path).has_value());
}

// issue 39 §5.6: idle connections and slowlorises never lock a scrape out. With a long
// --metrics-timeout (so that no timeout helps), 40 idle connections and 16 that sent half a
// request, a scrape still gets its 200.
TEST_F(MetricsTest, IdleConnectionsAndSlowlorisesNeverLockAScrapeOut) {
  auto serve = ServeProcess::Start(
      HostServeArgs(model_, runtime_,
                    {"--metrics-addr", "127.0.0.1:0", "--metrics-timeout", "600"}),
      dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  const uint16_t port = MetricsPort(*serve);
  ASSERT_NE(port, 0);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(ConnectTcp(port));
  for (int i = 0; i < 16; ++i) {
    idle.push_back(ConnectTcp(port));
    SendAll(idle.back().get(), "GET /metrics HTTP/1.1\r\nHost:");
  }
  const std::string response = Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << response;
  EXPECT_TRUE(HasLine(Body(response), R"(weightcache_daemon_state{state="ready"} 1)"));
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
}

// 400 scrapes open at once (each sends its request as it connects, as Prometheus does, and
// reads its answer only after all are sent): every one gets its 200.
TEST_F(MetricsTest, FourHundredConcurrentScrapesAreAllAnswered) {
  auto serve = ServeProcess::Start(
      HostServeArgs(model_, runtime_, {"--metrics-addr", "127.0.0.1:0"}), dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  const uint16_t port = MetricsPort(*serve);
  ASSERT_NE(port, 0);
  std::vector<UniqueFd> scrapes;
  for (int i = 0; i < 400; ++i) {
    scrapes.push_back(ConnectTcp(port));
    SendAll(scrapes.back().get(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  int answered = 0;
  for (auto& fd : scrapes) {
    bool eof = false;
    std::string response = ReadUntilEof(fd.get(), 30s, &eof);
    answered += response.rfind("HTTP/1.1 200 OK\r\n", 0) == 0 && eof ? 1 : 0;
  }
  EXPECT_EQ(answered, 400);
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
}

// issue 39 §12: `promtool check metrics` (Debian's prometheus package) finds nothing to
// complain about in a real daemon's exposition.
TEST_F(MetricsTest, PromtoolChecksTheExpositionClean) {
  const std::string promtool = "/usr/bin/promtool";
  if (!std::filesystem::exists(promtool)) {
    ASSERT_FALSE(ToolsRequired()) << promtool << " (Debian prometheus) is not installed";
    GTEST_SKIP() << promtool << " (Debian prometheus) is not installed";
  }
  auto serve = ServeProcess::Start(
      HostServeArgs(model_, runtime_, {"--metrics-addr", "127.0.0.1:0"}), dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  const uint16_t port = MetricsPort(*serve);
  ASSERT_NE(port, 0);
  bool matched = false;
  auto attached = HelloAndAttach(*socket, ConfigFor(model_, "tiny"), &matched);
  ASSERT_TRUE(attached.ok() && matched);
  const std::string body = Body(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n"));
  ASSERT_NE(body.find("weightcache_attaches_total"), std::string::npos) << body;
  const std::string file = dir_.Join("exposition.txt");
  WriteFile(file, body);
  const CommandResult checked =
      RunCommand({"/bin/sh", "-c", promtool + " check metrics < '" + file + "'"});
  EXPECT_EQ(checked.exit_code, 0) << checked.out << checked.err << "\n" << body;
  EXPECT_EQ(checked.out + checked.err, "") << body;
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
}

}  // namespace
}  // namespace weightcache::testing
