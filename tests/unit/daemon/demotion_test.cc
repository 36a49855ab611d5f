// Demotion to host RAM and promotion back (`serve --demote host`, docs/budget.md) with a gpu-tier
// daemon run in process over the fake CUDA driver with backed VMM memory: an Evict demotes an
// idle cache (state `demoted`, tier host, the ledger hook told), an Attach promotes it back and
// gets the same bytes in the same layout; a host budget too small stops the cache instead; a
// promotion that fails refuses the waiting attach and leaves the cache demoted, and the next
// attach promotes it; with --demote host-pinned the promotion copies from the host copy pinned
// behind the demotion, a failed pinning leaves a staged promotion, and an Evict of a pinned
// demoted cache stops it and unpins.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "keeper/keeper_client.h"
#include "protocol/connection.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"
#include "unit/daemon/in_process_daemon.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

// The value of the weightcache_cache_bytes sample whose labels end in tier="<tier>"; "" when
// the exposition has no such sample.
std::string CacheBytesOnTier(const std::string& exposition, const std::string& tier) {
  const std::string key = "tier=\"" + tier + "\"} ";
  size_t line = 0;
  while (line < exposition.size()) {
    size_t end = exposition.find('\n', line);
    if (end == std::string::npos) end = exposition.size();
    const std::string_view text(exposition.data() + line, end - line);
    const size_t at = text.find(key);
    if (text.starts_with("weightcache_cache_bytes{") && at != std::string_view::npos) {
      return std::string(text.substr(at + key.size()));
    }
    line = end + 1;
  }
  return "";
}
using cuda::testing::FakeDriver;
using protocol::CacheState;

// The ledger hook's view: every tier the daemon said its memory moved to, and the memory it
// named there (the fds' count and, for host memfds, their bytes).
class MovedLog {
 public:
  void Add(Tier tier, std::span<const int> fds = {}) {
    MutexLock lock(mu_);
    tiers_.push_back(tier);
    uint64_t bytes = 0;
    for (const int fd : fds) {
      struct stat st {};
      if (tier == Tier::kHost && ::fstat(fd, &st) == 0) bytes += static_cast<uint64_t>(st.st_size);
    }
    fds_.push_back({fds.size(), bytes});
    cv_.NotifyAll();
  }
  // (fd count, host bytes) of each move, in order.
  std::vector<std::pair<size_t, uint64_t>> Fds() {
    MutexLock lock(mu_);
    return fds_;
  }
  // Blocks until `n` moves were reported (no timeout: ctest's bounds a hang).
  std::vector<Tier> WaitFor(size_t n) {
    MutexLock lock(mu_);
    while (tiers_.size() < n) cv_.Wait(mu_);
    return tiers_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<Tier> tiers_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::vector<std::pair<size_t, uint64_t>> fds_ WEIGHTCACHE_GUARDED_BY(mu_);
};

class DemotionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 6, 2, 7, "f32,bf16", 4096, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    fake_.emplace(4096);
    fake_->BackVmmMemory();
    env_.load_driver = [this]() -> Result<const cuda::DriverApi*> { return fake_->api(); };
    env_.lookup = identity::MapEnv({});
    identity_.model_dir = ref_.dir;
    identity_.tier = Tier::kGpu;
    identity_.device = "1";
    identity_.runtime_dir = dir_.Join("run");
  }

  std::unique_ptr<InProcessDaemon> Start(daemon::DemotionOptions demotion) {
    auto options = DaemonOptionsFor(identity_, env_);
    EXPECT_TRUE(options.ok()) << options.status().ToString();
    if (!options.ok()) return nullptr;
    options->keeper.enabled = false;
    options->demotion = std::move(demotion);
    auto started = InProcessDaemon::Start(std::move(options).value());
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (!started.ok()) return nullptr;
    Status loaded = (*started)->WaitLoaded();
    EXPECT_TRUE(loaded.ok()) << loaded.ToString();
    return std::move(started).value();
  }

  daemon::DemotionOptions Demote() {
    daemon::DemotionOptions d;
    d.enabled = true;
    d.moved = [this](Tier tier, std::span<const int> fds) { moved_.Add(tier, fds); };
    return d;
  }

  // `--demote host-pinned`: the host copy pinned behind the demotion.
  daemon::DemotionOptions DemoteHostPinned() {
    daemon::DemotionOptions d = Demote();
    d.pin_host_copy = true;
    return d;
  }

  // Hello then Attach on a new connection; the connection closes with the reply (a detach).
  Result<protocol::AttachReply> Attach(const InProcessDaemon& d) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn, protocol::Connection::Connect(d.socket(), 5s));
    protocol::Hello hello;
    hello.config = d.options().config.ToJson();
    hello.client_name = "demotion_test";
    WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::HelloReply hr,
                                 conn.SendHello(hello, os::Deadline::After(30s)));
    last_hello_state_ = hr.state;
    return conn.Attach(os::Deadline::After(60s));
  }

  // Each allocation's bytes, read through the fake's books of the exported memory.
  std::vector<std::string> Bytes(const protocol::AttachReply& reply) {
    std::vector<std::string> out;
    const auto& sizes = reply.manifest.allocation_sizes();
    for (size_t a = 0; a < reply.fds.size(); ++a) {
      out.push_back(fake_->ExportedBytes(reply.fds[a].get(), 0, sizes[a]));
    }
    return out;
  }

  // An Evict, repeated while the daemon still counts a client that just closed its
  // connection (its disconnect is processed after our request may arrive).
  protocol::EvictReply Evict(const InProcessDaemon& d) {
    for (;;) {
      auto conn = protocol::Connection::Connect(d.socket(), 5s);
      EXPECT_TRUE(conn.ok()) << conn.status().ToString();
      if (!conn.ok()) return {};
      auto reply = conn->Evict(os::Deadline::After(30s));
      EXPECT_TRUE(reply.ok()) << reply.status().ToString();
      if (!reply.ok()) return {};
      if (reply->evicted || reply->clients == 0) return *reply;
      std::this_thread::sleep_for(10ms);
    }
  }

  // A first attach's bytes (then its detach), and an Evict that demotes, waited for until the
  // ledger hook heard of it.
  std::vector<std::string> AttachThenDemote(const InProcessDaemon& d) {
    std::vector<std::string> before;
    {
      auto first = Attach(d);
      EXPECT_TRUE(first.ok()) << first.status().ToString();
      if (first.ok()) before = Bytes(*first);
    }
    EXPECT_TRUE(Evict(d).evicted);
    moved_.WaitFor(1);
    return before;
  }

  // The pinned host copy is released behind the promotion, on a thread of its own: true once
  // no registration and no context reference is left (false after 30 s).
  bool EverythingReleasedEventually() {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (fake_->live_host_registrations() != 0 || fake_->total_context_refs() != 0) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  protocol::StatusReply QueryStatus(const InProcessDaemon& d) {
    auto conn = protocol::Connection::Connect(d.socket(), 5s);
    EXPECT_TRUE(conn.ok()) << conn.status().ToString();
    if (!conn.ok()) return {};
    auto status = conn->QueryStatus(os::Deadline::After(30s));
    EXPECT_TRUE(status.ok()) << status.status().ToString();
    return status.ok() ? *status : protocol::StatusReply{};
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::optional<FakeDriver> fake_;
  identity::Env env_ = identity::Env::Default();
  IdentityOptions identity_;
  MovedLog moved_;
  CacheState last_hello_state_ = CacheState::kLoading;
};

TEST_F(DemotionTest, EvictDemotesToHostAndTheNextAttachPromotesTheSameBytes) {
  auto d = Start(Demote());
  ASSERT_NE(d, nullptr);
  std::vector<std::string> before;
  std::vector<uint64_t> sizes;
  {
    auto first = Attach(*d);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    before = Bytes(*first);
    sizes = first->manifest.allocation_sizes();
  }
  ASSERT_FALSE(before.empty());
  for (const auto& b : before) ASSERT_FALSE(b.empty());

  protocol::EvictReply evicted = Evict(*d);
  EXPECT_TRUE(evicted.evicted);
  EXPECT_EQ(evicted.reason, "demoted to host");
  EXPECT_EQ(moved_.WaitFor(1), std::vector<Tier>{Tier::kHost});
  protocol::StatusReply status = QueryStatus(*d);
  EXPECT_EQ(status.state, CacheState::kDemoted);
  EXPECT_EQ(status.tier, Tier::kHost);
  // The bytes are counted where they are: on the host tier while demoted, 0 on the gpu tier.
  const std::string demoted_metrics = d->options().metrics->Render();
  const std::string held = CacheBytesOnTier(demoted_metrics, "host");
  EXPECT_NE(held, "") << demoted_metrics;
  EXPECT_NE(held, "0") << demoted_metrics;
  EXPECT_EQ(CacheBytesOnTier(demoted_metrics, "gpu"), "0") << demoted_metrics;

  auto second = Attach(*d);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(last_hello_state_, CacheState::kDemoted);
  EXPECT_EQ(second->manifest.allocation_sizes(), sizes);
  EXPECT_EQ(Bytes(*second), before);
  EXPECT_EQ(moved_.WaitFor(2), (std::vector<Tier>{Tier::kHost, Tier::kGpu}));
  // The hook named the memory each time: the host copy's memfds, as many bytes as the
  // allocations (in segments: at least one memfd per allocation), then one fd per allocation.
  uint64_t total = 0;
  for (const uint64_t size : sizes) total += size;
  const auto named = moved_.Fds();
  ASSERT_EQ(named.size(), 2u);
  EXPECT_GE(named[0].first, sizes.size());
  EXPECT_EQ(named[0].second, total);
  EXPECT_EQ(named[1].first, sizes.size());
  status = QueryStatus(*d);
  EXPECT_EQ(status.state, CacheState::kReady);
  EXPECT_EQ(status.tier, Tier::kGpu);
  const std::string metrics = d->options().metrics->Render();
  EXPECT_EQ(CacheBytesOnTier(metrics, "gpu"), held) << metrics;
  EXPECT_EQ(CacheBytesOnTier(metrics, "host"), "0") << metrics;
  EXPECT_NE(metrics.find("weightcache_demotions_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("weightcache_promotions_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("weightcache_evictions_total 0\n"), std::string::npos) << metrics;
  EXPECT_TRUE(d->Stop().ok());
}

// No room under the host budget: the Evict is accepted as a plain eviction, the daemon stops.
TEST_F(DemotionTest, AHostBudgetTooSmallStopsTheCacheInstead) {
  daemon::DemotionOptions demotion = Demote();
  uint64_t asked = 0;
  demotion.host_room = [&asked](uint64_t bytes) {
    asked = bytes;
    return Status(StatusCode::kOutOfMemory, "the host budget is 1 KiB");
  };
  auto d = Start(std::move(demotion));
  ASSERT_NE(d, nullptr);
  protocol::EvictReply evicted = Evict(*d);
  EXPECT_TRUE(evicted.evicted);
  EXPECT_EQ(evicted.reason, "");
  EXPECT_GT(asked, 0u);
  // The daemon drains: its socket goes, and Run ends cleanly.
  while (std::filesystem::exists(d->socket())) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(d->Stop().ok());
  const std::string metrics = d->options().metrics->Render();
  EXPECT_NE(metrics.find("weightcache_evictions_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("weightcache_demotions_total 0\n"), std::string::npos) << metrics;
}

// A promotion that fails (here: the device allocation) refuses the waiting attach with the
// reason, the cache stays demoted with its host copy, and the next attach promotes it.
TEST_F(DemotionTest, AFailedPromotionRefusesTheAttachAndTheNextOnePromotes) {
  auto d = Start(Demote());
  ASSERT_NE(d, nullptr);
  const std::vector<std::string> before = AttachThenDemote(*d);
  ASSERT_FALSE(before.empty());
  fake_->FailCall("cuMemCreate", fake_->CallCount("cuMemCreate") + 1, CUDA_ERROR_OUT_OF_MEMORY);
  auto refused = Attach(*d);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("its promotion back to the GPU failed"),
            std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("CUDA_ERROR_OUT_OF_MEMORY"), std::string::npos)
      << refused.status().ToString();
  EXPECT_EQ(QueryStatus(*d).state, CacheState::kDemoted);
  auto promoted = Attach(*d);
  ASSERT_TRUE(promoted.ok()) << promoted.status().ToString();
  EXPECT_EQ(Bytes(*promoted), before);
  EXPECT_TRUE(d->Stop().ok());
}

// Whether a cuMemHostRegister was called after the last cuMemCreate: a staged promotion pins
// its staging buffers after making the new arena; one from a pinned host copy pins nothing.
bool RegisteredAfterTheLastArena(const FakeDriver& fake) {
  const std::vector<std::string>& calls = fake.calls();
  bool registered = false;
  for (const std::string& call : calls) {
    if (call == "cuMemCreate") registered = false;
    if (call == "cuMemHostRegister") registered = true;
  }
  return registered;
}

// --demote host-pinned: the host copy is pinned behind the demotion (the context held while
// demoted), the promotion copies from it by DMA alone, and then unpins it and lets the context
// go. An Attach sent once the ledger hook heard of the demotion finds the pinning started (the
// hook runs just before it) and waits for it.
TEST_F(DemotionTest, WithHostPinnedThePromotionCopiesFromThePinnedHostCopy) {
  auto d = Start(DemoteHostPinned());
  ASSERT_NE(d, nullptr);
  const std::vector<std::string> before = AttachThenDemote(*d);
  ASSERT_FALSE(before.empty());
  // Pinned: every segment registered, the context retained for it alone.
  while (fake_->live_host_registrations() == 0) std::this_thread::sleep_for(1ms);
  auto promoted = Attach(*d);
  ASSERT_TRUE(promoted.ok()) << promoted.status().ToString();
  EXPECT_EQ(Bytes(*promoted), before);
  EXPECT_EQ(moved_.WaitFor(2), (std::vector<Tier>{Tier::kHost, Tier::kGpu}));
  EXPECT_FALSE(RegisteredAfterTheLastArena(*fake_)) << "the promotion staged its copy";
  // Unpinned and the context released once promoted (the daemon keeps only the fds).
  EXPECT_TRUE(EverythingReleasedEventually());
  EXPECT_GT(fake_->CallCount("cuMemHostUnregister"), 0);
  EXPECT_TRUE(d->Stop().ok());
}

// The attaches that waited for the promotion are answered before the pinned host copy is let
// go, and the loop serves others meanwhile: unpinning 16 GiB took 2.0–3.3 s on the H200
// machine, and the loop used to do it before it answered (found by demote_bench's
// kept_unpin_and_close_s). The first unpin is held back until the attach has its reply.
TEST_F(DemotionTest, WithHostPinnedTheWaitingAttachIsAnsweredBeforeTheHostCopyIsUnpinned) {
  auto d = Start(DemoteHostPinned());
  ASSERT_NE(d, nullptr);
  const std::vector<std::string> before = AttachThenDemote(*d);
  ASSERT_FALSE(before.empty());
  while (fake_->live_host_registrations() == 0) std::this_thread::sleep_for(1ms);
  moved_.WaitFor(1);
  std::atomic<bool> answered{false};
  // 1: the attach had its reply when the first unpin began; 2: it had not after 20 s.
  std::atomic<int> first_unpin{0};
  fake_->BeforeCall("cuMemHostUnregister", [&] {
    if (first_unpin.load() != 0) return;
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (!answered.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    first_unpin = answered.load() ? 1 : 2;
  });
  auto promoted = Attach(*d);
  ASSERT_TRUE(promoted.ok()) << promoted.status().ToString();
  answered = true;
  EXPECT_EQ(Bytes(*promoted), before);
  // The loop is free while the host copy goes: a status query is answered.
  EXPECT_EQ(QueryStatus(*d).state, CacheState::kReady);
  EXPECT_TRUE(EverythingReleasedEventually());
  EXPECT_EQ(first_unpin.load(), 1) << "2: the attach waited for the unpin";
  EXPECT_TRUE(d->Stop().ok());
}

// Pinning that fails costs the promotion only its speed: it stages, with the same bytes.
TEST_F(DemotionTest, WithHostPinnedAFailedPinningLeavesAStagedPromotion) {
  daemon::DemotionOptions demotion = DemoteHostPinned();
  // The hook runs on the loop just before the pinning starts: its first registration fails.
  demotion.moved = [this](Tier tier, std::span<const int> /*fds*/) {
    if (tier == Tier::kHost) {
      fake_->FailCall("cuMemHostRegister", fake_->CallCount("cuMemHostRegister") + 1,
                      CUDA_ERROR_OUT_OF_MEMORY);
    }
    moved_.Add(tier);
  };
  auto d = Start(std::move(demotion));
  ASSERT_NE(d, nullptr);
  const std::vector<std::string> before = AttachThenDemote(*d);
  ASSERT_FALSE(before.empty());
  auto promoted = Attach(*d);
  ASSERT_TRUE(promoted.ok()) << promoted.status().ToString();
  EXPECT_EQ(Bytes(*promoted), before);
  EXPECT_TRUE(RegisteredAfterTheLastArena(*fake_)) << "staging buffers pinned for the copy";
  EXPECT_EQ(fake_->live_host_registrations(), 0);
  EXPECT_EQ(fake_->total_context_refs(), 0);
  EXPECT_TRUE(d->Stop().ok());
}

// A demoted cache that is pinning (or pinned) and has no waiting attach is idle: an Evict stops
// it, and its pinned copy is let go with it.
TEST_F(DemotionTest, WithHostPinnedAnEvictOfThePinnedCacheStopsItAndUnpins) {
  auto d = Start(DemoteHostPinned());
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(Evict(*d).evicted);
  moved_.WaitFor(1);
  while (fake_->live_host_registrations() == 0) std::this_thread::sleep_for(1ms);
  protocol::EvictReply again = Evict(*d);
  EXPECT_TRUE(again.evicted);
  EXPECT_EQ(again.reason, "");
  while (std::filesystem::exists(d->socket())) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(d->Stop().ok());
  EXPECT_EQ(fake_->live_host_registrations(), 0);
  EXPECT_EQ(fake_->total_context_refs(), 0);
}

// The keeper's deposit is dropped when the demotion starts, before the copy: a daemon killed in
// the middle of its demotion must give its GPU memory back, not leave it to the keeper as an
// orphan the ledger no longer counts (found on the H200 by scripts/gpu-budget.sh step 5). With a
// real keeper process (the built CLI's `keeper`), the keeper is asked what it holds from inside
// the demotion's first device-to-host copy.
TEST_F(DemotionTest, TheKeeperIsDroppedBeforeTheDemotionCopiesAnything) {
  auto options = DaemonOptionsFor(identity_, env_);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  options->keeper.enabled = true;
  options->keeper.program = CliPath();
  options->demotion = Demote();
  const keeper::KeeperPaths paths{options->paths.keeper_socket, options->paths.keeper_lock};
  auto started = InProcessDaemon::Start(std::move(options).value());
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  std::unique_ptr<InProcessDaemon> d = std::move(started).value();
  ASSERT_TRUE(d->WaitLoaded().ok());
  // The deposit follows ready: wait until the keeper holds the cache.
  for (;;) {
    auto held = keeper::QueryKeeper(paths, 5s);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    if (held->has_value() && (*held)->state == protocol::KeeperState::kHolding) break;
    std::this_thread::sleep_for(5ms);
  }
  // 1: no live keeper during the copy; 2: the keeper still held the cache; 3: a query error.
  std::atomic<int> during_copy{0};
  fake_->BeforeCall("cuMemcpyDtoHAsync", [&] {
    if (during_copy.load() != 0) return;
    auto held = keeper::QueryKeeper(paths, 5s);
    during_copy = !held.ok() ? 3 : held->has_value() ? 2 : 1;
  });
  ASSERT_TRUE(Evict(*d).evicted);
  moved_.WaitFor(1);
  EXPECT_EQ(during_copy.load(), 1) << "2: the keeper still held the GPU memory during the copy";
  EXPECT_TRUE(d->Stop().ok());
}

}  // namespace
}  // namespace weightcache::testing
