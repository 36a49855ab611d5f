// The fleet transport (docs/fleet.md "Transport") over real UCX on loopback TCP: arena sources
// are arena_source_tool processes serving memfds with a known pattern; the test process is
// the fetching node. Kills are SIGKILL mid-transfer, decided by the fetch's own progress (never
// by a timer).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arena_pattern.h"
#include "fleet/arena_transfer.h"
#include "fleet/ucx_support.h"
#include "os/tcp_socket.h"
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

class FleetTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Loopback TCP only: the same transport on a developer's machine, in CI's container and
    // here, whatever shared-memory or RDMA devices UCX would otherwise pick (docs/fleet.md).
    setenv("UCX_TLS", "tcp", 0);
  }

  // Starts a source serving regions of `sizes` with the pattern of `seed`; its endpoint.
  std::string StartSource(const std::vector<uint64_t>& sizes, uint64_t seed,
                          const std::string& allow = "127.0.0.1",
                          const std::string& manifest = "manifest",
                          const std::string& hostile = "") {
    std::string regions;
    for (uint64_t bytes : sizes) regions += (regions.empty() ? "" : ",") + std::to_string(bytes);
    ChildSpec spec;
    spec.argv = {ARENA_SOURCE_TOOL, "--regions", regions,      "--seed", std::to_string(seed),
                 "--allow",         allow,       "--manifest", manifest};
    if (!hostile.empty()) {
      spec.argv.push_back("--hostile");
      spec.argv.push_back(hostile);
    }
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
      {"bad-version", "version 99, this build speaks 1"},
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

// Not a UCX peer at all: a TCP server that answers with garbage.
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
