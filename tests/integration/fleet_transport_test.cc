// The fleet transport (docs/fleet.md "Transport") for host memory: the native TCP protocol on
// loopback. Arena sources are arena_source_tool processes serving memfds with a known pattern;
// the test process is the fetching node, or a raw peer speaking the protocol by hand (and
// breaking it). Kills are SIGKILL mid-transfer, decided by the fetch's own progress (never by
// a timer). CUDA regions (UCX) are covered by the refusal test only: CI's UCX has no CUDA.
#include <arpa/inet.h>
#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arena_pattern.h"
#include "common/unique_fd.h"
#include "fleet/arena_transfer.h"
#include "fleet/arena_transfer_hello.h"
#include "fleet/ucx_support.h"
#include "os/tcp_socket.h"
#include "protocol/wire.h"
#include "support/child_process.h"
#include "support/test_env.h"

namespace weightcache {
namespace {

using testing::ChildSpec;
using ::testing::HasSubstr;
using testing::MatchesPattern;
using testing::TempDir;
using testing::TestChild;

using testing::kMiB;

// Every TCP socket in LISTEN state that process `pid` holds, as "a.b.c.d:port" (IPv6:
// "[hex]:port"): the inodes of its fds (/proc/PID/fd) matched against /proc/PID/net/tcp{,6}.
std::vector<std::string> ListeningTcpSockets(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  std::set<std::string> inodes;
  if (DIR* dir = opendir((proc + "/fd").c_str()); dir != nullptr) {
    while (const dirent* entry = readdir(dir)) {
      char target[256] = {};
      const std::string link = proc + "/fd/" + entry->d_name;
      const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      const std::string text(target, static_cast<size_t>(n));
      if (text.rfind("socket:[", 0) == 0) inodes.insert(text.substr(8, text.size() - 9));
    }
    closedir(dir);
  }
  std::vector<std::string> out;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::ifstream in(proc + table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: TCP_LISTEN
      const size_t colon = local.find(':');
      const std::string host = local.substr(0, colon);
      const unsigned port = std::stoul(local.substr(colon + 1), nullptr, 16);
      if (host.size() == 8) {
        const uint32_t raw = std::stoul(host, nullptr, 16);  // the kernel's byte order
        in_addr address{};
        address.s_addr = raw;
        char text[INET_ADDRSTRLEN] = {};
        inet_ntop(AF_INET, &address, text, sizeof(text));
        out.push_back(std::string(text) + ":" + std::to_string(port));
      } else {
        out.push_back("[" + host + "]:" + std::to_string(port));
      }
    }
  }
  return out;
}

// A blocking TCP connection to `endpoint` (an IPv4 host:port), or an invalid fd.
UniqueFd ConnectRaw(const std::string& endpoint) {
  auto split = os::SplitHostPort(endpoint);
  if (!split.ok()) return UniqueFd();
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(split->port);
  inet_pton(AF_INET, split->host.c_str(), &to.sin_addr);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) return UniqueFd();
  timeval limit{10, 0};  // a test that breaks never hangs in a recv
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  return fd;
}

// Reads exactly `bytes`; false on EOF, an error or the receive timeout.
bool ReadExactly(int fd, uint8_t* into, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = recv(fd, into, bytes, 0);
    if (n <= 0) return false;
    into += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// The hello, whole: its header and body. False if the source closed or refused instead.
bool ReadHello(int fd) {
  std::vector<uint8_t> header(fleet::kHelloHeaderBytes);
  if (!ReadExactly(fd, header.data(), header.size())) return false;
  auto body_bytes = fleet::DecodeHelloHeader(header);
  if (!body_bytes.ok()) return false;
  std::vector<uint8_t> body(*body_bytes);
  return ReadExactly(fd, body.data(), body.size()) && fleet::DecodeHelloBody(body).ok();
}

// How many bytes the peer sends before it closes the connection (-1: no close within the
// receive timeout).
int64_t BytesBeforeClose(int fd) {
  int64_t total = 0;
  uint8_t buffer[4096];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return total;
    if (n < 0) return -1;
    total += n;
  }
}

// Waits (polling, up to `timeout`) until the child's log has `text`.
bool WaitForLog(TestChild& child, const std::string& text,
                std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (child.Log().find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

class FleetTransportTest : public ::testing::Test {
 protected:
  // Starts a source serving regions of `sizes` with the pattern of `seed`; its endpoint.
  // `extra`: more arena_source_tool flags (--max-peers, --idle-timeout-ms).
  std::string StartSource(const std::vector<uint64_t>& sizes, uint64_t seed,
                          const std::string& allow = "127.0.0.1",
                          const std::string& manifest = "manifest", const std::string& hostile = "",
                          const std::vector<std::string>& extra = {}) {
    std::string regions;
    for (uint64_t bytes : sizes) regions += (regions.empty() ? "" : ",") + std::to_string(bytes);
    ChildSpec spec;
    spec.argv = {ARENA_SOURCE_TOOL, "--regions", regions,      "--seed", std::to_string(seed),
                 "--allow",         allow,       "--manifest", manifest};
    if (!hostile.empty()) {
      spec.argv.push_back("--hostile");
      spec.argv.push_back(hostile);
    }
    spec.argv.insert(spec.argv.end(), extra.begin(), extra.end());
    spec.env_overrides = {"WEIGHTCACHE_LOG_LEVEL=info"};
    spec.log_path = dir_.Join("source-" + std::to_string(sources_.size()) + ".log");
    spec.in = testing::Stdio::kPipe;
    spec.out = testing::Stdio::kPipe;
    auto child = TestChild::Spawn(spec);
    EXPECT_TRUE(child.ok()) << child.status().ToString();
    if (!child.ok()) return "";
    auto line = child->ReadLine(std::chrono::seconds(60));
    EXPECT_TRUE(line.ok()) << line.status().ToString() << "\n" << child->Log();
    sources_.push_back(std::move(*child));
    if (!line.ok() || line->rfind("endpoint ", 0) != 0) return "";
    return line->substr(9);
  }

  // Destination regions of `sizes`, zero-filled.
  void MakeDestination(const std::vector<uint64_t>& sizes) {
    buffers_.clear();
    for (uint64_t bytes : sizes) buffers_.emplace_back(bytes, 0);
  }
  // Options that fetch from `sources` into a fresh zero-filled destination of `sizes`.
  fleet::FetchOptions FetchInto(const std::vector<uint64_t>& sizes,
                                std::vector<std::string> sources) {
    MakeDestination(sizes);
    fleet::FetchOptions options;
    options.sources = std::move(sources);
    options.destination = Destination();
    return options;
  }
  std::vector<fleet::DestinationRegion> Destination() {
    std::vector<fleet::DestinationRegion> out;
    for (auto& buffer : buffers_) out.push_back({buffer.data(), buffer.size()});
    return out;
  }
  // Whether the destination holds the pattern of `seed` everywhere.
  bool DestinationMatches(uint64_t seed) const {
    uint64_t offset = 0;
    for (const auto& buffer : buffers_) {
      if (!MatchesPattern(seed, offset, buffer.data(), buffer.size())) return false;
      offset += buffer.size();
    }
    return true;
  }

  TempDir dir_;
  std::vector<TestChild> sources_;
  std::vector<std::vector<uint8_t>> buffers_;
};

TEST_F(FleetTransportTest, OneSourceFillsEveryRegionWithItsBytes) {
  const std::vector<uint64_t> sizes = {3 * kMiB + 5, kMiB, 4096};
  const std::string source = StartSource(sizes, 7, "127.0.0.1", "manifest-A");
  ASSERT_FALSE(source.empty());
  fleet::FetchOptions options = FetchInto(sizes, {source});
  options.stripe_bytes = kMiB;
  std::string seen_manifest;
  options.accept = [&](const std::string& from, std::span<const uint8_t> manifest) {
    EXPECT_EQ(from, source);
    seen_manifest.assign(manifest.begin(), manifest.end());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // counted as setup
    return Status::Ok();
  };
  uint64_t last_done = 0;
  options.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GT(done, last_done);
    EXPECT_EQ(total, 4 * kMiB + 5 + 4096);
    last_done = done;
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(seen_manifest, "manifest-A");
  EXPECT_EQ(result->bytes, 4 * kMiB + 5 + 4096);
  // The hello and accept() are setup; the reads alone are the transfer its rate is of.
  EXPECT_GE(result->setup_seconds, 0.05);
  EXPECT_GT(result->transfer_seconds, 0);
  EXPECT_NEAR(result->setup_seconds + result->transfer_seconds, result->seconds, 1e-6);
  EXPECT_DOUBLE_EQ(result->transfer_gb_per_s,
                   static_cast<double>(result->bytes) / result->transfer_seconds / 1e9);
  EXPECT_EQ(last_done, result->bytes);
  ASSERT_EQ(result->sources.size(), 1u);
  EXPECT_TRUE(result->sources[0].used);
  EXPECT_TRUE(result->sources[0].status.ok()) << result->sources[0].status.ToString();
  EXPECT_EQ(result->sources[0].bytes, result->bytes);
  // 4 stripes of region 0 (the last 5 bytes), 1 of region 1, 1 of region 2.
  ASSERT_EQ(result->stripes.size(), 6u);
  EXPECT_EQ(result->stripes[3].bytes, 5u);
  EXPECT_EQ(result->stripes[3].offset, 3 * kMiB);
  EXPECT_EQ(result->stripes[5].region, 2u);
  EXPECT_TRUE(DestinationMatches(7));
}

TEST_F(FleetTransportTest, TwoSourcesAreStripedAcrossAndBothServe) {
  const std::vector<uint64_t> sizes = {16 * kMiB};
  const std::string a = StartSource(sizes, 7);
  const std::string b = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a, b});
  options.stripe_bytes = kMiB;
  options.max_in_flight_per_source = 2;
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->sources[0].bytes, 0u);
  EXPECT_GT(result->sources[1].bytes, 0u);
  EXPECT_EQ(result->sources[0].bytes + result->sources[1].bytes, 16 * kMiB);
  EXPECT_TRUE(DestinationMatches(7));
}

// A source that serves other bytes is the caller's problem (the checksums catch it), but the
// result says which source served each stripe, so that the caller can blame the right one.
TEST_F(FleetTransportTest, EachStripeNamesTheSourceThatServedIt) {
  const std::vector<uint64_t> sizes = {8 * kMiB};
  const std::string good = StartSource(sizes, 7);
  const std::string poisoned = StartSource(sizes, 666);
  ASSERT_FALSE(good.empty());
  ASSERT_FALSE(poisoned.empty());
  fleet::FetchOptions options = FetchInto(sizes, {good, poisoned});
  options.stripe_bytes = kMiB;
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_EQ(result->stripes.size(), 8u);
  size_t from_poisoned = 0;
  for (const fleet::StripeRecord& stripe : result->stripes) {
    const uint64_t seed = stripe.source == 0 ? 7 : 666;
    from_poisoned += stripe.source == 1 ? 1 : 0;
    EXPECT_TRUE(
        MatchesPattern(seed, stripe.offset, buffers_[0].data() + stripe.offset, stripe.bytes))
        << "stripe at " << stripe.offset << " attributed to source " << stripe.source;
  }
  EXPECT_GT(from_poisoned, 0u);
  EXPECT_FALSE(DestinationMatches(7));
}

TEST_F(FleetTransportTest, ASourceKilledMidTransferIsDroppedAndTheOtherFinishes) {
  const std::vector<uint64_t> sizes = {64 * kMiB};
  const std::string a = StartSource(sizes, 7);
  const std::string b = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a, b});
  options.stripe_bytes = kMiB / 4;
  options.max_in_flight_per_source = 1;
  options.stripe_timeout = std::chrono::seconds(20);
  bool killed = false;
  options.progress = [&](uint64_t done, uint64_t total) {
    if (!killed && done >= total / 8) {
      killed = true;
      sources_[0].Kill();
    }
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(killed);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_FALSE(result->sources[0].status.ok());
  EXPECT_THAT(result->sources[0].status.message(), HasSubstr(a));
  EXPECT_TRUE(result->sources[1].status.ok()) << result->sources[1].status.ToString();
  EXPECT_GT(result->sources[1].bytes, 0u);
  EXPECT_EQ(result->sources[0].bytes + result->sources[1].bytes, 64 * kMiB);
  for (const fleet::StripeRecord& stripe : result->stripes) {
    EXPECT_TRUE(stripe.source == 0 || stripe.source == 1);
  }
  EXPECT_TRUE(DestinationMatches(7));
}

// A source that stops answering without disconnecting (SIGSTOP: its sockets stay open) is
// dropped by the per-stripe timeout, and its stripes go to the other source.
TEST_F(FleetTransportTest, AStalledSourceIsDroppedByTheStripeTimeout) {
  const std::vector<uint64_t> sizes = {32 * kMiB};
  const std::string a = StartSource(sizes, 7);
  const std::string b = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a, b});
  options.stripe_bytes = kMiB / 4;
  options.max_in_flight_per_source = 1;
  options.stripe_timeout = std::chrono::seconds(2);
  bool stopped = false;
  options.progress = [&](uint64_t done, uint64_t total) {
    if (!stopped && done >= total / 8) {
      stopped = true;
      EXPECT_TRUE(sources_[0].Signal(SIGSTOP).ok());
    }
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(stopped);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(result->sources[0].status.code(), StatusCode::kTimeout)
      << result->sources[0].status.ToString();
  EXPECT_THAT(result->sources[0].status.message(),
              HasSubstr("source " + a + ": a read made no progress in 2000 ms"));
  EXPECT_EQ(result->sources[0].bytes + result->sources[1].bytes, 32 * kMiB);
  EXPECT_TRUE(DestinationMatches(7));
}

TEST_F(FleetTransportTest, TheOnlySourceKilledIsAnErrorNamingIt) {
  const std::vector<uint64_t> sizes = {32 * kMiB};
  const std::string a = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a});
  options.stripe_bytes = kMiB / 4;
  options.max_in_flight_per_source = 1;
  options.stripe_timeout = std::chrono::seconds(20);
  options.deadline = std::chrono::seconds(120);
  bool killed = false;
  options.progress = [&](uint64_t done, uint64_t total) {
    if (!killed && done >= total / 8) {
      killed = true;
      sources_[0].Kill();
    }
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(killed);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status().ToString();
  EXPECT_THAT(result.status().message(), HasSubstr("every source failed"));
  EXPECT_THAT(result.status().message(), HasSubstr(a));
}

// A daemon stopped during its fill cancels the fetch: it ends at once, not at the stalled
// read's timeout (60 s) nor the deadline.
TEST_F(FleetTransportTest, ACancelEndsTheFetchWhileItsOnlySourceIsStalled) {
  const std::vector<uint64_t> sizes = {32 * kMiB};
  const std::string a = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a});
  options.stripe_bytes = kMiB / 4;
  options.max_in_flight_per_source = 1;
  options.stripe_timeout = std::chrono::seconds(60);
  options.deadline = std::chrono::seconds(120);
  std::atomic<bool> cancel{false};
  options.cancel = &cancel;
  options.progress = [&](uint64_t done, uint64_t total) {
    if (!cancel.load() && done >= total / 8) {
      EXPECT_TRUE(sources_[0].Signal(SIGSTOP).ok());
      cancel.store(true);
    }
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(cancel.load());
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status().ToString();
  EXPECT_THAT(result.status().message(), HasSubstr("arena fetch: cancelled ("));
  EXPECT_THAT(result.status().message(), HasSubstr(a + ": still serving"));
}

TEST_F(FleetTransportTest, APeerOffTheAllowListIsRefusedAndTheFetcherSaysSo) {
  const std::vector<uint64_t> sizes = {kMiB};
  const std::string a = StartSource(sizes, 7, "10.255.255.1,fd00::/8");
  ASSERT_FALSE(a.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a});
  options.connect_timeout = std::chrono::seconds(30);
  auto result = fleet::FetchArena(options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status().ToString();
  EXPECT_THAT(result.status().message(),
              HasSubstr(a + ": permission denied: source " + a + " rejected the connection"));
  sources_[0].CloseStdin();
  EXPECT_EQ(sources_[0].WaitExit(), 0);
  EXPECT_THAT(sources_[0].Log(), HasSubstr("refused a connection from 127.0.0.1:"));
  EXPECT_THAT(sources_[0].Log(),
              HasSubstr("not on the peer allow-list (10.255.255.1/32,fd00::/8)"));
}

TEST_F(FleetTransportTest, ASourceThatAcceptRefusesIsNeverRead) {
  const std::vector<uint64_t> sizes = {4 * kMiB};
  const std::string wrong = StartSource(sizes, 666, "127.0.0.1", "other-plan");
  const std::string right = StartSource(sizes, 7, "127.0.0.1", "our-plan");
  ASSERT_FALSE(wrong.empty());
  ASSERT_FALSE(right.empty());
  fleet::FetchOptions options = FetchInto(sizes, {wrong, right});
  options.stripe_bytes = kMiB;
  options.accept = [](const std::string&, std::span<const uint8_t> manifest) {
    if (std::string(manifest.begin(), manifest.end()) != "our-plan") {
      return Status(StatusCode::kMismatch, "its plan differs");
    }
    return Status::Ok();
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_FALSE(result->sources[0].used);
  EXPECT_EQ(result->sources[0].bytes, 0u);
  EXPECT_EQ(result->sources[0].status.code(), StatusCode::kMismatch);
  EXPECT_THAT(result->sources[0].status.message(),
              HasSubstr("source " + wrong + " not accepted: its plan differs"));
  EXPECT_EQ(result->sources[1].bytes, 4 * kMiB);
  EXPECT_TRUE(DestinationMatches(7));
}

TEST_F(FleetTransportTest, RegionsThatDoNotMatchTheDestinationAreRefused) {
  const std::string a = StartSource({2 * kMiB}, 7);
  ASSERT_FALSE(a.empty());
  MakeDestination({kMiB});
  fleet::FetchOptions options;
  options.sources = {a};
  options.destination = Destination();
  auto result = fleet::FetchArena(options);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(result.status().message(),
              HasSubstr("source " + a + ": region 0 is 2097152 bytes, the destination's 1048576"));
}

// A hostile source: each malformed hello is an error naming the source and what is wrong,
// never a crash and never a hang.
TEST_F(FleetTransportTest, AHostileHelloIsAnErrorNotACrash) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bad-magic", "bad magic 0xdeadbeef"},
      {"bad-version", "version 99, this build speaks 2"},
      {"huge-body", "a body of 1099511627776 bytes"},
      {"zero-regions", "0 regions"},
      {"many-regions", "4294967295 regions"},
      {"huge-rkey", "an rkey of 2147483647 bytes"},
      {"trailing", "8 bytes past the last region"},
      {"truncated", "no hello within 3000 ms"},
  };
  for (const auto& [mode, expected] : cases) {
    SCOPED_TRACE(mode);
    const std::string a = StartSource({4096}, 7, "127.0.0.1", "m", mode);
    ASSERT_FALSE(a.empty());
    MakeDestination({4096});
    fleet::FetchOptions options;
    options.sources = {a};
    options.destination = Destination();
    options.connect_timeout = std::chrono::seconds(3);
    auto result = fleet::FetchArena(options);
    ASSERT_FALSE(result.ok());
    EXPECT_THAT(result.status().message(), HasSubstr("source " + a));
    EXPECT_THAT(result.status().message(), HasSubstr(expected));
  }
}

// Not an arena source at all: a TCP server that answers with garbage.
TEST_F(FleetTransportTest, ARawTcpPeerSendingGarbageIsAnError) {
  auto listener = os::ListenTcp({"127.0.0.1", 0});
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  const std::string endpoint = "127.0.0.1:" + std::to_string(listener->port);
  std::atomic<bool> done{false};
  std::thread peer([&] {
    std::vector<int> accepted;
    while (!done) {
      pollfd fd{listener->fd.get(), POLLIN, 0};
      if (poll(&fd, 1, 50) <= 0) continue;
      const int conn = accept4(listener->fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      accepted.push_back(conn);
      std::vector<uint8_t> garbage(size_t{64} << 10);
      for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 131 + 7);
      (void)send(conn, garbage.data(), garbage.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    for (int conn : accepted) close(conn);
  });
  MakeDestination({4096});
  fleet::FetchOptions options;
  options.sources = {endpoint};
  options.destination = Destination();
  options.connect_timeout = std::chrono::seconds(3);
  auto result = fleet::FetchArena(options);
  done = true;
  peer.join();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable) << result.status().ToString();
  EXPECT_THAT(result.status().message(), HasSubstr("source " + endpoint));
}

// The source side of untrusted input: raw TCP clients that send garbage to the listener, or
// connect and never speak, neither crash the server nor keep it from serving a real fetcher
// afterwards, and Stop() returns with them still connected.
TEST_F(FleetTransportTest, GarbageClientsNeitherCrashNorBlockASource) {
  std::vector<uint8_t> arena(kMiB);
  testing::FillPattern(7, 0, arena.data(), arena.size());
  fleet::ArenaServerOptions server_options;
  server_options.allow = *fleet::PeerAllowList::Parse("127.0.0.1");
  server_options.regions = {{arena.data(), arena.size()}};
  auto server = fleet::ArenaServer::Start(std::move(server_options));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto address = os::SplitHostPort((*server)->endpoint());
  ASSERT_TRUE(address.ok());
  std::vector<int> clients;
  for (int k = 0; k < 4; ++k) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(address->port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
    if (k % 2 == 0) {
      std::vector<uint8_t> garbage(size_t{16} << 10);
      for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 31 + k);
      (void)send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
    }
    clients.push_back(fd);
  }
  MakeDestination({kMiB});
  fleet::FetchOptions options;
  options.sources = {(*server)->endpoint()};
  options.destination = Destination();
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_TRUE(DestinationMatches(7));
  (*server)->Stop();
  for (int fd : clients) close(fd);
}

// Issue 39 item 1: a source listens on the one port --fill-serve names, on its address, and
// nowhere else (UCX's tcp transport opened a listening port of its own on every network
// device, serving reads and writes of any address to anyone who connected to it).
TEST_F(FleetTransportTest, ASourceListensOnExactlyTheFillServePort) {
  const std::vector<uint64_t> sizes = {kMiB};
  const std::string a = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  EXPECT_THAT(ListeningTcpSockets(sources_[0].pid()), ::testing::ElementsAre(a));
  // Serving a peer opens nothing more.
  fleet::FetchOptions options = FetchInto(sizes, {a});
  std::vector<std::string> during;
  options.progress = [&](uint64_t, uint64_t) { during = ListeningTcpSockets(sources_[0].pid()); };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_THAT(during, ::testing::ElementsAre(a));
  EXPECT_THAT(ListeningTcpSockets(sources_[0].pid()), ::testing::ElementsAre(a));
}

// A fetch into host memory opens no listening socket in the filler (UCX's tcp iface did: a
// remote write into the filler).
TEST_F(FleetTransportTest, TheFillerOpensNoListeningSocket) {
  const std::vector<uint64_t> sizes = {8 * kMiB};
  const std::string a = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  fleet::FetchOptions options = FetchInto(sizes, {a});
  options.stripe_bytes = kMiB;
  size_t checks = 0;
  std::vector<std::string> seen;
  options.progress = [&](uint64_t, uint64_t) {
    ++checks;
    for (std::string& s : ListeningTcpSockets(getpid())) seen.push_back(std::move(s));
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(checks, 8u);
  EXPECT_THAT(seen, ::testing::IsEmpty());
  EXPECT_TRUE(DestinationMatches(7));
}

// A raw peer off the allow-list, on every port the source listens on: closed before a byte of
// the hello, and logged with its address.
TEST_F(FleetTransportTest, APeerOffTheAllowListGetsNoByteOnAnyPort) {
  const std::string a = StartSource({kMiB}, 7, "10.255.255.1");
  ASSERT_FALSE(a.empty());
  const std::vector<std::string> ports = ListeningTcpSockets(sources_[0].pid());
  ASSERT_FALSE(ports.empty());
  for (const std::string& port : ports) {
    SCOPED_TRACE(port);
    UniqueFd fd = ConnectRaw(port);
    ASSERT_TRUE(fd.valid());
    EXPECT_EQ(BytesBeforeClose(fd.get()), 0);
  }
  EXPECT_TRUE(WaitForLog(sources_[0], "refused a connection from 127.0.0.1:")) << sources_[0].Log();
  EXPECT_THAT(sources_[0].Log(), HasSubstr("not on the peer allow-list (10.255.255.1/32)"));
}

// Issue 39 items 1 and 2: an allowed peer that asks for bytes outside the served regions, or
// sends anything but a read request (a put), is dropped without an answer and logged with its
// address; the source neither crashes nor stops serving.
TEST_F(FleetTransportTest, AnAllowedPeerBreakingTheProtocolIsDroppedAndTheSourceServesOn) {
  const std::vector<uint64_t> sizes = {kMiB, 4096};
  const std::string a = StartSource(sizes, 7);
  ASSERT_FALSE(a.empty());
  auto request = [](uint32_t opcode, uint32_t region, uint64_t offset, uint64_t length) {
    std::vector<uint8_t> frame;
    protocol::wire::PutU32(frame, opcode);
    protocol::wire::PutU32(frame, region);
    protocol::wire::PutU64(frame, offset);
    protocol::wire::PutU64(frame, length);
    return frame;
  };
  std::vector<uint8_t> put = request(2, 0, 0x10, 8);
  put.insert(put.end(), 8, 0xAB);  // the bytes a put would write
  std::vector<uint8_t> garbage(fleet::kReadRequestBytes);
  for (size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<uint8_t>(i * 97 + 13);
  const std::vector<std::pair<std::vector<uint8_t>, std::string>> cases = {
      {request(1, 1, 4088, 16), "a bad request: offset 4088 + length 16 past region 1's 4096"},
      {request(1, 0, UINT64_MAX - 7, 16),
       "a bad request: offset 18446744073709551608 + length 16 past region 0's 1048576"},
      {request(1, 2, 0, 16), "a bad request: region 2 of 2"},
      {request(1, 0, 0, 0), "a bad request: a length of 0"},
      {request(1, 0, 0, uint64_t{1} << 40), "a bad request: a length of 1099511627776"},
      {put, "a bad request: opcode 2 (not a read"},
      {garbage, "a bad request: opcode"},
  };
  for (const auto& [frame, expected] : cases) {
    SCOPED_TRACE(expected);
    UniqueFd fd = ConnectRaw(a);
    ASSERT_TRUE(fd.valid());
    ASSERT_TRUE(ReadHello(fd.get()));
    sockaddr_in local{};
    socklen_t length = sizeof(local);
    ASSERT_EQ(getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &length), 0);
    ASSERT_EQ(send(fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(frame.size()));
    EXPECT_EQ(BytesBeforeClose(fd.get()), 0);  // not a byte of any region
    EXPECT_TRUE(WaitForLog(
        sources_[0],
        "dropped peer 127.0.0.1:" + std::to_string(ntohs(local.sin_port)) + ": " + expected))
        << sources_[0].Log();
  }
  ASSERT_TRUE(sources_[0].Running());
  // A well-formed read on a raw connection gets exactly its bytes.
  UniqueFd fd = ConnectRaw(a);
  ASSERT_TRUE(fd.valid());
  ASSERT_TRUE(ReadHello(fd.get()));
  const std::vector<uint8_t> read = request(1, 1, 96, 4000);
  ASSERT_EQ(send(fd.get(), read.data(), read.size(), MSG_NOSIGNAL), 24);
  std::vector<uint8_t> bytes(4000);
  ASSERT_TRUE(ReadExactly(fd.get(), bytes.data(), bytes.size()));
  EXPECT_TRUE(MatchesPattern(7, kMiB + 96, bytes.data(), bytes.size()));
  // And a fetch, afterwards, is served whole.
  fleet::FetchOptions options = FetchInto(sizes, {a});
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_TRUE(DestinationMatches(7));
  EXPECT_TRUE(sources_[0].Running());
}

// Issue 39 item 4: a peer that connects and then asks for nothing is reaped after the idle
// timeout and its slot is freed; a filler turned away meanwhile is told the source is full,
// not that it is off the allow-list.
TEST_F(FleetTransportTest, AnIdlePeerIsReapedAndAFullSourceSaysSo) {
  const std::vector<uint64_t> sizes = {kMiB};
  const std::string a = StartSource(sizes, 7, "127.0.0.1", "manifest", "",
                                    {"--max-peers", "1", "--idle-timeout-ms", "1500"});
  ASSERT_FALSE(a.empty());
  UniqueFd idle = ConnectRaw(a);
  ASSERT_TRUE(idle.valid());
  ASSERT_TRUE(ReadHello(idle.get()));
  const auto connected = std::chrono::steady_clock::now();

  fleet::FetchOptions options = FetchInto(sizes, {a});
  auto turned_away = fleet::FetchArena(options);
  ASSERT_FALSE(turned_away.ok());
  EXPECT_EQ(turned_away.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(turned_away.status().message(), HasSubstr("source " + a + ": the source is full"));
  EXPECT_THAT(turned_away.status().message(), ::testing::Not(HasSubstr("allow-list")));
  EXPECT_TRUE(WaitForLog(sources_[0], "refused 127.0.0.1:"));
  EXPECT_THAT(sources_[0].Log(), HasSubstr("the source is full (1 peers connected already"));

  // The idle one is closed by the source once its timeout passed.
  EXPECT_EQ(BytesBeforeClose(idle.get()), 0);
  EXPECT_GE(std::chrono::steady_clock::now() - connected, std::chrono::milliseconds(1500));
  EXPECT_TRUE(WaitForLog(sources_[0], "idle: no request in 1500 ms (its slot is freed)"));
  auto served = fleet::FetchArena(FetchInto(sizes, {a}));
  ASSERT_TRUE(served.ok()) << served.status().ToString();
  EXPECT_TRUE(DestinationMatches(7));
}

// Issue 39 item 3: a source that accepts the connection but never sends its hello (a forged
// registry entry) does not hold the fetch back: the good source serves it all, long before
// connect_timeout, and the silent one is reported unused.
TEST_F(FleetTransportTest, ASilentSourceDoesNotDelayTheFetch) {
  auto silent = os::ListenTcp({"127.0.0.1", 0});  // the kernel completes connects; no accept
  ASSERT_TRUE(silent.ok()) << silent.status().ToString();
  const std::string quiet = "127.0.0.1:" + std::to_string(silent->port);
  const std::vector<uint64_t> sizes = {8 * kMiB};
  const std::string good = StartSource(sizes, 7);
  ASSERT_FALSE(good.empty());
  fleet::FetchOptions options = FetchInto(sizes, {quiet, good});
  options.stripe_bytes = kMiB;
  options.connect_timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  auto result = fleet::FetchArena(options);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_LT(elapsed, std::chrono::seconds(30));
  EXPECT_LT(result->setup_seconds, 30.0);
  EXPECT_FALSE(result->sources[0].used);
  EXPECT_EQ(result->sources[0].bytes, 0u);
  EXPECT_EQ(result->sources[0].status.code(), StatusCode::kUnavailable);
  EXPECT_THAT(result->sources[0].status.message(), HasSubstr("source " + quiet + ": no hello"));
  EXPECT_THAT(result->sources[0].status.message(), HasSubstr("(not used)"));
  EXPECT_TRUE(result->sources[1].used);
  EXPECT_EQ(result->sources[1].bytes, 8 * kMiB);
  EXPECT_TRUE(DestinationMatches(7));
}

// The UCX that stays for CUDA regions: its context never opens UCX's tcp transport, whose
// interfaces listen on a port of their own per network device (before: 127.0.0.1 and every
// other address of the host, outside any allow-list).
TEST_F(FleetTransportTest, AUcxWorkerOpensNoListeningSocket) {
  auto context = fleet::ucx::CreateContext();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  auto worker = fleet::ucx::CreateWorker(context->get(), fleet::ucx::Threading::kMulti);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  EXPECT_THAT(ListeningTcpSockets(getpid()), ::testing::IsEmpty());
}

// The UCX path (CUDA regions'), run over host regions (ucx_for_host_for_test: CI's UCX moves
// no CUDA memory): a source listens on its one UCP listener port and nowhere else (its context
// has no tcp transport), and it fills a destination with its bytes.
TEST_F(FleetTransportTest, TheUcxPathListensOnlyOnItsListenerAndFills) {
  const std::vector<uint64_t> sizes = {4 * kMiB};
  const std::string a = StartSource(sizes, 7, "127.0.0.1", "manifest", "", {"--ucx", "1"});
  ASSERT_FALSE(a.empty());
  EXPECT_THAT(ListeningTcpSockets(sources_[0].pid()), ::testing::ElementsAre(a));
  fleet::FetchOptions options = FetchInto(sizes, {a});
  options.ucx_for_host_for_test = true;
  options.stripe_bytes = kMiB;
  std::vector<std::string> during_source;
  std::vector<std::string> during_filler;
  options.progress = [&](uint64_t, uint64_t) {
    during_source = ListeningTcpSockets(sources_[0].pid());
    during_filler = ListeningTcpSockets(getpid());
  };
  auto result = fleet::FetchArena(options);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_TRUE(DestinationMatches(7));
  EXPECT_THAT(during_source, ::testing::ElementsAre(a));
  EXPECT_THAT(during_filler, ::testing::IsEmpty());
}

// Issue 39 item 3 on the UCX path: a silent source listed with a good one does not hold the
// fetch until connect_timeout.
TEST_F(FleetTransportTest, ASilentSourceDoesNotDelayAUcxFetch) {
  auto silent = os::ListenTcp({"127.0.0.1", 0});
  ASSERT_TRUE(silent.ok()) << silent.status().ToString();
  const std::string quiet = "127.0.0.1:" + std::to_string(silent->port);
  const std::vector<uint64_t> sizes = {4 * kMiB};
  const std::string good = StartSource(sizes, 7, "127.0.0.1", "manifest", "", {"--ucx", "1"});
  ASSERT_FALSE(good.empty());
  fleet::FetchOptions options = FetchInto(sizes, {quiet, good});
  options.ucx_for_host_for_test = true;
  options.stripe_bytes = kMiB;
  options.connect_timeout = std::chrono::seconds(60);
  const auto start = std::chrono::steady_clock::now();
  auto result = fleet::FetchArena(options);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_LT(elapsed, std::chrono::seconds(30));
  EXPECT_FALSE(result->sources[0].used);
  EXPECT_EQ(result->sources[0].bytes, 0u);
  EXPECT_THAT(result->sources[0].status.message(), HasSubstr("source " + quiet + ": no hello"));
  EXPECT_EQ(result->sources[1].bytes, 4 * kMiB);
  EXPECT_TRUE(DestinationMatches(7));
}

// The operator's UCX_TLS may not bring back the transports that serve any address unchecked.
TEST_F(FleetTransportTest, AUcxTlsWithTcpOrCmaIsRefused) {
  EXPECT_TRUE(fleet::ucx::CheckTransports("^tcp,cma").ok());
  EXPECT_TRUE(fleet::ucx::CheckTransports("^cma,tcp,cuda_ipc").ok());
  EXPECT_TRUE(fleet::ucx::CheckTransports("rc,cuda_copy,cuda_ipc,posix").ok());
  for (const char* bad :
       {"tcp", "rc,tcp", "cma,cuda_ipc", "sm,cuda_copy", "all", "shm", "", "^cuda_ipc", "^tcp"}) {
    SCOPED_TRACE(bad);
    const Status status = fleet::ucx::CheckTransports(bad);
    EXPECT_EQ(status.code(), StatusCode::kPermissionDenied);
    EXPECT_THAT(status.message(), HasSubstr("UCX_TLS"));
  }
  EXPECT_THAT(fleet::ucx::CheckTransports("^tcp").message(), HasSubstr("does not exclude cma"));
  setenv("UCX_TLS", "tcp", 1);
  auto context = fleet::ucx::CreateContext();
  unsetenv("UCX_TLS");
  ASSERT_FALSE(context.ok());
  EXPECT_EQ(context.status().code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(context.status().message(), HasSubstr("UCX_TLS=tcp names tcp"));
}

TEST_F(FleetTransportTest, BadOptionsAreRefusedUpFront) {
  MakeDestination({4096});
  fleet::FetchOptions options;
  options.destination = Destination();
  auto result = fleet::FetchArena(options);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("no source"));
  options.sources = {"127.0.0.1:1"};
  options.stripe_bytes = 0;
  result = fleet::FetchArena(options);
  EXPECT_THAT(result.status().message(), HasSubstr("a stripe size of 0"));
  options.stripe_bytes = 4096;
  options.sources.assign(fleet::kMaxFetchSources + 1, "127.0.0.1:1");
  result = fleet::FetchArena(options);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(),
              HasSubstr(std::to_string(fleet::kMaxFetchSources + 1) + " sources (at most " +
                        std::to_string(fleet::kMaxFetchSources) + ")"));

  fleet::ArenaServerOptions server;
  auto started = fleet::ArenaServer::Start(server);
  EXPECT_EQ(started.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(started.status().message(), HasSubstr("no region to serve"));
}

// Device memory needs UCX's CUDA transports: a UCX built without them (Debian's, CI's) refuses
// a CUDA region up front, on either side, naming why (the gpu tier's fill then loads from disk).
TEST_F(FleetTransportTest, CudaRegionsNeedAUcxBuiltWithCuda) {
  auto context = fleet::ucx::CreateContext();
  ASSERT_TRUE(context.ok()) << context.status().ToString();
  if (fleet::ucx::CheckMemoryType(context->get(), UCS_MEMORY_TYPE_CUDA).ok()) {
    GTEST_SKIP() << "this UCX moves CUDA memory (scripts/gpu-fill.sh measures it on a GPU)";
  }
  MakeDestination({4096});
  fleet::ArenaServerOptions server;
  server.regions = {{buffers_[0].data(), buffers_[0].size(), fleet::RegionMemory::kCuda}};
  auto started = fleet::ArenaServer::Start(server);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(started.status().message(), HasSubstr("has no cuda memory support"));

  fleet::FetchOptions options;
  options.sources = {"127.0.0.1:1"};
  options.destination = {{buffers_[0].data(), buffers_[0].size(), fleet::RegionMemory::kCuda}};
  auto fetched = fleet::FetchArena(options);
  ASSERT_FALSE(fetched.ok());
  EXPECT_EQ(fetched.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(fetched.status().message(), HasSubstr("arena fetch: this UCX ("));
  EXPECT_THAT(fetched.status().message(), HasSubstr("has no cuda memory support"));
}

TEST_F(FleetTransportTest, AnUnreachableSourceIsAnErrorNamingIt) {
  // A port nobody listens on: bind one, close it.
  int port = 0;
  {
    auto listener = os::ListenTcp({"127.0.0.1", 0});
    ASSERT_TRUE(listener.ok());
    port = listener->port;
  }
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  MakeDestination({4096});
  fleet::FetchOptions options;
  options.sources = {endpoint};
  options.destination = Destination();
  options.connect_timeout = std::chrono::seconds(5);
  auto result = fleet::FetchArena(options);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(result.status().message(), HasSubstr("source " + endpoint));
}

}  // namespace
}  // namespace weightcache
