// Publishing on the gpu tier (docs/publish.md) in process, over the one fake CUDA driver with
// backed VMM memory: a `--source published:<tag>` gpu daemon (InProcessDaemon) whose arena is a
// cuda::ExportedArena, publishers through client::PublisherAccess (weightcache::Publisher with
// the fake in its Env), attaches through client::Attach. The publish store itself
// (daemon::CreatePublication / CommitPublication) for a refused checksum and a driver failure
// at each step. Every test checks that the fake's books (handles, reservations, mappings,
// context references, fds) come back to where they were.
//
// The daemon's commit and the publisher's checksums need the GPU checksum kernel (the fake runs
// its algorithm on the host for the function a loaded module hands out): without it in the
// build those tests skip, and NoKernel* asserts the refusal instead.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/attachment_impl.h"
#include "client/publisher_internal.h"
#include "common/checksum.h"
#include "cuda/checksum_gpu.h"
#include "daemon/publish_store.h"
#include "identity/device_inventory.h"
#include "identity/resolve.h"
#include "protocol/connection.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"
#include "unit/daemon/in_process_daemon.h"
#include "weightcache/client.h"
#include "weightcache/publisher.h"

namespace weightcache::testing {
namespace {

using cuda::testing::CountOpenFds;
using cuda::testing::FakeDriver;
using ::testing::HasSubstr;

void ExpectError(const Status& status, StatusCode code, const std::string& substring) {
  EXPECT_EQ(status.code(), code) << status.ToString();
  EXPECT_THAT(status.message(), HasSubstr(substring));
}

struct Books {
  int handles, reservations, mappings, context_refs, violations, fds;
  bool operator==(const Books&) const = default;
};

std::string Describe(const Books& b) {
  return "handles " + std::to_string(b.handles) + ", reservations " +
         std::to_string(b.reservations) + ", mappings " + std::to_string(b.mappings) +
         ", context refs " + std::to_string(b.context_refs) + ", violations " +
         std::to_string(b.violations) + ", fds " + std::to_string(b.fds);
}

bool IsRelease(const std::string& function) {
  for (const char* word : {"Release", "Free", "Unmap", "Destroy", "Unload", "Unregister"}) {
    if (function.find(word) != std::string::npos) return true;
  }
  return false;
}

// A plan of F32 tensors (one larger than a checksum chunk, one tied alias) and its bytes.
struct Weights {
  std::vector<PublishTensor> plan;
  std::vector<std::vector<uint8_t>> bytes;  // empty for the alias
};

Weights MakeWeights(int seed) {
  Weights w;
  std::mt19937 rng(seed);
  const uint64_t rows[] = {300, 5, 7};
  for (int i = 0; i < 3; ++i) {
    const uint64_t cols = i == 0 ? 256 : 17;
    PublishTensor t{
        "layers." + std::to_string(i) + ".weight", "F32", {rows[i], cols}, rows[i] * cols * 4};
    std::vector<uint8_t> b(t.nbytes);
    for (auto& byte : b) byte = static_cast<uint8_t>(rng());
    w.plan.push_back(std::move(t));
    w.bytes.push_back(std::move(b));
  }
  w.plan.push_back({"lm_head.weight", "F32", {7, 17}, 7 * 17 * 4, "layers.2.weight"});
  w.bytes.emplace_back();
  return w;
}

class PublishGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_ = std::make_unique<FakeDriver>(4096);
    fake_->BackVmmMemory();
    env_ = identity::Env::Default();
    env_.load_driver = [fake = fake_.get()]() -> Result<const cuda::DriverApi*> {
      return fake->api();
    };
    env_.lookup = identity::MapEnv({});
    identity_.source = "published:gpu-unit";
    identity_.model_id = "llama-fused";
    identity_.runtime_dir = dir_.Join("run");
    identity_.tier = Tier::kGpu;
    identity_.device = "1";
    before_ = BooksNow();
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_TRUE(daemon_->Stop().ok());
    }
    daemon_.reset();
    fake_.reset();
  }

  void StartDaemon() {
    auto options = DaemonOptionsFor(identity_, env_);
    ASSERT_TRUE(options.ok()) << options.status().ToString();
    auto started = InProcessDaemon::Start(std::move(options).value());
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    daemon_ = std::move(started).value();
    // An awaiting gpu daemon retains the device's context for its publisher at once (its warmer
    // thread): wait for that reference, so that the books a test takes now include it (ctest's
    // timeout bounds a daemon that never takes it).
    while (fake_->total_context_refs() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  Books BooksNow() const {
    return Books{fake_->live_handles(),       fake_->live_reservations(), fake_->live_mappings(),
                 fake_->total_context_refs(), fake_->violations(),        CountOpenFds()};
  }

  Result<Publisher> Begin(const Weights& w, const IdentityOptions& identity) {
    PublishOptions o;
    o.identity = identity;
    o.metadata = "engine 1.0";
    return client::PublisherAccess::Begin(o, w.plan, env_);
  }

  // Fills every tensor with bytes of its own (not the aliases) through CopyIn.
  static void Fill(Publisher& p, const Weights& w) {
    for (size_t i = 0; i < w.plan.size(); ++i) {
      if (!w.plan[i].alias_of.empty()) continue;
      Status copied = p.CopyIn(i, w.bytes[i].data(), w.bytes[i].size());
      ASSERT_TRUE(copied.ok()) << copied.ToString();
    }
  }

  TempDir dir_;
  std::unique_ptr<FakeDriver> fake_;
  identity::Env env_;
  IdentityOptions identity_;
  Books before_{};
  std::unique_ptr<InProcessDaemon> daemon_;
};

TEST_F(PublishGpuTest, PublishedBytesAreWhatAnAttachMaps) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  StartDaemon();
  const Weights w = MakeWeights(1);
  {
    auto p = Begin(w, identity_);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(p->tier(), Tier::kGpu);
    EXPECT_TRUE(p->Data(0).empty());  // device memory: no host span
    const Publisher::Destination d0 = p->DestinationOf(0);
    EXPECT_EQ(d0.tier, Tier::kGpu);
    EXPECT_EQ(d0.size, w.plan[0].nbytes);
    // The alias is its target's region.
    EXPECT_EQ(p->DestinationOf(3).address, p->DestinationOf(2).address);
    ExpectError(p->CopyIn(1, w.bytes[0].data(), w.bytes[0].size()), StatusCode::kInvalidArgument,
                "tensor 'layers.1.weight' has " + std::to_string(w.plan[1].nbytes) + " bytes");
    Fill(*p, w);
    Status committed = p->Commit();
    ASSERT_TRUE(committed.ok()) << committed.ToString();
    EXPECT_EQ(p->DestinationOf(0).address, 0u);
  }
  ASSERT_TRUE(daemon_->WaitLoaded().ok());
  {
    AttachOptions a;
    a.identity = identity_;
    a.on_missing = OnMissing::kError;
    auto attached = client::Attach(a, env_);
    ASSERT_TRUE(attached.ok()) << attached.status().ToString();
    EXPECT_EQ(attached->tier(), Tier::kGpu);
    EXPECT_EQ(attached->metadata(), "engine 1.0");
    ASSERT_EQ(attached->tensors().size(), w.plan.size());
    for (size_t i = 0; i < w.plan.size(); ++i) {
      const Tensor* t = attached->Find(w.plan[i].name);
      ASSERT_NE(t, nullptr) << w.plan[i].name;
      // The checksum the daemon's kernel verified over its arena is the source bytes' own.
      const auto& bytes = w.plan[i].alias_of.empty() ? w.bytes[i] : w.bytes[2];
      EXPECT_EQ(t->checksum, TensorChecksum(bytes.data(), bytes.size())) << w.plan[i].name;
    }
    EXPECT_EQ(attached->Find("lm_head.weight")->data, attached->Find("layers.2.weight")->data);
    // What the attached mapping holds, read by the checksum kernel over the client's mapping.
    std::vector<cuda::DeviceRange> ranges;
    for (const auto& t : w.plan) {
      const Tensor* found = attached->Find(t.name);
      ranges.push_back({static_cast<CUdeviceptr>(found->data), found->nbytes});
    }
    fake_->set_current_context(FakeDriver::ContextOf(1));
    auto sums = cuda::GpuTensorChecksums(fake_->api(), nullptr, ranges);
    ASSERT_TRUE(sums.ok()) << sums.status().ToString();
    for (size_t i = 0; i < w.plan.size(); ++i) {
      EXPECT_EQ((*sums)[i], attached->Find(w.plan[i].name)->checksum) << w.plan[i].name;
    }
    fake_->set_current_context(nullptr);
  }
  // Published, the daemon serves fds and lets its warm context go (after the reply; ctest's
  // timeout bounds a reference kept for ever).
  while (fake_->total_context_refs() != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(fake_->violations(), 0) << fake_->violation_log().front();
}

TEST_F(PublishGpuTest, APublisherGoneMidCopyLeavesTheDaemonAwaitingWithEverythingReleased) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  StartDaemon();
  const Books idle = BooksNow();
  const Weights w = MakeWeights(2);
  {
    auto p = Begin(w, identity_);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ASSERT_TRUE(p->CopyIn(0, w.bytes[0].data(), w.bytes[0].size()).ok());
    EXPECT_GT(fake_->live_handles(), 0);
  }  // dropped mid-copy: its mapping and connection go, as with a SIGKILLed process
  // The daemon sees the hangup on its event loop: wait for it to destroy the arena (its
  // handles, mapping, VA, exported fds and context reference; ctest's timeout bounds a hang).
  while (!(BooksNow() == idle)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(Describe(BooksNow()), Describe(idle));
  auto conn = protocol::Connection::Connect(daemon_->socket(), std::chrono::seconds(10));
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  auto status = conn->QueryStatus(os::Deadline::After(std::chrono::seconds(10)));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, protocol::CacheState::kAwaiting);
  // The next publisher is accepted at once.
  auto next = Begin(w, identity_);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  Fill(*next, w);
  ASSERT_TRUE(next->Commit().ok());
  EXPECT_TRUE(daemon_->WaitLoaded().ok());
}

TEST_F(PublishGpuTest, APublisherOnAnotherGpuIsRefusedNamingBothUuids) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  StartDaemon();
  IdentityOptions other = identity_;
  other.device = "0";
  other.socket = daemon_->socket();  // the gpu-1 daemon's socket, from a gpu-0 publisher
  auto p = Begin(MakeWeights(3), other);
  ASSERT_FALSE(p.ok());
  ExpectError(p.status(), StatusCode::kMismatch,
              "serves GPU " + identity::FormatGpuUuid(FakeDriver::UuidOf(1)) +
                  ", but this publisher's device is " +
                  identity::FormatGpuUuid(FakeDriver::UuidOf(0)));
  EXPECT_EQ(fake_->live_handles(), 0);  // refused before any PublishBegin
}

TEST_F(PublishGpuTest, NoKernelRefusesAGpuPublishBeforeConnecting) {
  if (cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built with the GPU checksum kernel";
  auto p = Begin(MakeWeights(4), identity_);  // no daemon: the kernel is checked first
  ASSERT_FALSE(p.ok());
  ExpectError(p.status(), StatusCode::kUnavailable,
              "publishing to the gpu tier needs the GPU checksum kernel");
}

// ---- the publish store over the fake driver ----------------------------------------------

class PublishGpuStoreTest : public PublishGpuTest {
 protected:
  void SetUp() override {
    PublishGpuTest::SetUp();
    auto id = identity::ResolveIdentity(identity_, env_);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    target_.driver = fake_->api();
    target_.device = *id->device;
    const Weights w = MakeWeights(5);
    for (const auto& t : w.plan)
      plan_.tensors.push_back({t.name, t.dtype, t.shape, t.nbytes, t.alias_of});
    weights_ = w;
    before_ = BooksNow();
  }

  // Creates, fills (cuMemcpyHtoD into the daemon's own mapping) and commits with `checksums`
  // (the true ones when empty). The publication is gone when it returns.
  Result<daemon::WeightStore> Publish(std::vector<uint64_t> checksums = {}) {
    auto pub = daemon::CreatePublication(Tier::kGpu, plan_, "weightcache:test", 0, &target_);
    if (!pub.ok()) return pub.status();
    const auto allocations = pub->gpu_arena->allocations();
    for (size_t i = 0; i < plan_.tensors.size(); ++i) {
      if (!plan_.tensors[i].alias_of.empty()) continue;
      const auto& place = pub->layout.placements[i];
      const CUresult rc =
          fake_->api()->cuMemcpyHtoD(allocations[place.allocation].ptr + place.offset,
                                     weights_.bytes[i].data(), weights_.bytes[i].size());
      if (rc != CUDA_SUCCESS) return InternalError("cuMemcpyHtoD failed");
    }
    if (checksums.empty()) {
      for (size_t i = 0; i < plan_.tensors.size(); ++i) {
        const auto& b = plan_.tensors[i].alias_of.empty() ? weights_.bytes[i] : weights_.bytes[2];
        checksums.push_back(TensorChecksum(b.data(), b.size()));
      }
    }
    return daemon::CommitPublication(std::move(pub).value(), checksums);
  }

  daemon::GpuPublishTarget target_;
  protocol::PublishBegin plan_;
  Weights weights_;
};

TEST_F(PublishGpuStoreTest, AChecksumTheArenaDoesNotHoldIsRefusedNamingTheFirstSuchTensor) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  std::vector<uint64_t> sums;
  for (size_t i = 0; i < plan_.tensors.size(); ++i) {
    const auto& b = plan_.tensors[i].alias_of.empty() ? weights_.bytes[i] : weights_.bytes[2];
    sums.push_back(TensorChecksum(b.data(), b.size()));
  }
  sums[1] ^= 1;
  sums[3] ^= 1;
  auto store = Publish(sums);
  ASSERT_FALSE(store.ok());
  ExpectError(store.status(), StatusCode::kInvalidArgument,
              "tensor 'layers.1.weight' (plan index 1): the publisher's checksum " +
                  std::to_string(sums[1]) + " but the arena holds " + std::to_string(sums[1] ^ 1));
  fake_->set_current_context(nullptr);
  EXPECT_EQ(Describe(BooksNow()), Describe(before_));
}

TEST_F(PublishGpuStoreTest, AVerifiedCommitLeavesOnlyTheExportedFds) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  {
    auto store = Publish();
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ(store->tier(), Tier::kGpu);
    EXPECT_EQ(store->summary().tensor_count, 4u);
    // No mapping, reservation, handle or context reference stays in the daemon: the fds serve.
    EXPECT_EQ(fake_->live_mappings(), 0);
    EXPECT_EQ(fake_->live_reservations(), 0);
    EXPECT_EQ(fake_->live_handles(), 0);
    EXPECT_EQ(fake_->total_context_refs(), 0);
    EXPECT_EQ(store->fds().size(), 1u);
    const std::string held = fake_->ExportedBytes(store->fds()[0], 0, weights_.bytes[0].size());
    EXPECT_EQ(held, std::string(weights_.bytes[0].begin(), weights_.bytes[0].end()));
  }
  fake_->set_current_context(nullptr);
  EXPECT_EQ(Describe(BooksNow()), Describe(before_));
}

// A daemon that serves fills (serve --fill-serve) keeps the arena's creating handles as well:
// its fill source maps them, as exportable memory (docs/fleet.md "Two daemons on one GPU").
TEST_F(PublishGpuStoreTest, AVerifiedCommitForAFillSourceKeepsTheCreatingHandlesToo) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  target_.keep_creating_handles = true;
  {
    auto store = Publish();
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_EQ(store->creating_handles().size(), 1u);
    EXPECT_EQ(fake_->live_handles(), 1);
    EXPECT_EQ(fake_->live_mappings(), 0);
    EXPECT_EQ(fake_->live_reservations(), 0);
    EXPECT_EQ(fake_->total_context_refs(), 0);
  }
  fake_->set_current_context(nullptr);
  EXPECT_EQ(Describe(BooksNow()), Describe(before_));
}

TEST_F(PublishGpuStoreTest, ADriverFailureAtEveryStepReleasesEverything) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  const int start = fake_->steps();
  fake_->ClearCalls();
  {
    auto store = Publish();
    ASSERT_TRUE(store.ok()) << store.status().ToString();
  }
  const std::vector<std::string> calls = fake_->calls();
  const int total = fake_->steps() - start;
  fake_->set_current_context(nullptr);
  ASSERT_EQ(Describe(BooksNow()), Describe(before_));
  int failed = 0;
  for (int k = 1; k <= total; ++k) {
    if (IsRelease(calls[k - 1]) || calls[k - 1] == "cuCtxGetCurrent" ||
        calls[k - 1] == "cuCtxSetCurrent") {
      continue;
    }
    fake_->FailStep(fake_->steps() + k, CUDA_ERROR_OUT_OF_MEMORY);
    auto store = Publish();
    fake_->FailStep(0, CUDA_SUCCESS);
    EXPECT_FALSE(store.ok()) << "step " << k << " (" << calls[k - 1] << ")";
    if (!store.ok()) {
      ++failed;
      // The driver's error travels up (the fill's copy is this test's own).
      const std::string named = calls[k - 1] == "cuMemcpyHtoD"
                                    ? "cuMemcpyHtoD failed"
                                    : "CUDA_ERROR_OUT_OF_MEMORY (injected by FakeDriver)";
      EXPECT_THAT(store.status().ToString(), HasSubstr(named)) << "step " << k;
    }
    fake_->set_current_context(nullptr);
    EXPECT_EQ(Describe(BooksNow()), Describe(before_))
        << "step " << k << " (" << calls[k - 1] << ")";
  }
  EXPECT_GT(failed, 5);
}

TEST_F(PublishGpuStoreTest, NoKernelRefusesTheGpuArena) {
  if (cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built with the GPU checksum kernel";
  auto pub = daemon::CreatePublication(Tier::kGpu, plan_, "weightcache:test", 0, &target_);
  ASSERT_FALSE(pub.ok());
  ExpectError(pub.status(), StatusCode::kUnavailable,
              "publishing to the gpu tier needs the GPU checksum kernel, which this build of the "
              "daemon lacks");
  EXPECT_EQ(Describe(BooksNow()), Describe(before_));
}

}  // namespace
}  // namespace weightcache::testing
