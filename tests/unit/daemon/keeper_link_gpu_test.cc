// The gpu tier's deposit/adopt checks (daemon/keeper_link.h) over the one fake CUDA driver:
// a gpu store loaded and exported (the fds a deposit carries), handed back as a withdrawn
// Handoff would be (duplicates of those fds and the manifest memfd), then VerifyGpuHandoff:
// the import and mapping of every withdrawn fd, the checksum kernel over every tensor, and the
// release of everything it imported. Its failures: a manifest whose checksum the memory does
// not have, and an import the driver refuses.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "cuda/checksum_gpu.h"
#include "daemon/keeper_link.h"
#include "daemon/weight_store.h"
#include "identity/resolve.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::testing {
namespace {

using cuda::testing::CountOpenFds;
using cuda::testing::FakeDriver;

UniqueFd Dup(int fd) { return UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

class KeeperLinkGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 6, 2, 7, "f32,bf16", 4096, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    auto opened = checkpoint::Checkpoint::Open(ref_.dir);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    checkpoint_.emplace(std::move(opened).value());
    fake_.emplace(4096);
    fake_->BackVmmMemory();
    identity::Env env = identity::Env::Default();
    env.load_driver = [this]() -> Result<const cuda::DriverApi*> { return fake_->api(); };
    env.lookup = identity::MapEnv({});
    IdentityOptions identity;
    identity.model_dir = ref_.dir;
    identity.tier = Tier::kGpu;
    identity.device = "1";
    identity.runtime_dir = dir_.Join("run");
    auto id = identity::ResolveIdentity(identity, env);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    gpu_.driver = fake_->api();
    gpu_.device = *id->device;
    daemon::LoadOptions options;
    options.threads = 2;
    options.device = gpu_.device;
    options.driver = fake_->api();
    options.cache_name = "weightcache:test";
    daemon::LoadControl control;
    control.progress = [](uint64_t, uint64_t) {};
    std::string memory;
    auto store = daemon::LoadGpuStore(*checkpoint_, options, control, &memory);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_.emplace(std::move(store).value());
  }

  // What a withdrawal hands back: duplicates of the deposited fds, the manifest mapped from
  // its memfd (or `manifest_bytes` instead, for a corrupted one).
  protocol::Handoff Withdrawn(std::optional<std::vector<uint8_t>> manifest_bytes = {}) {
    protocol::Handoff h;
    const daemon::StoreSummary& s = store_->summary();
    h.info.manifest_size = s.manifest.size;
    h.info.allocation_count = static_cast<uint32_t>(store_->fds().size());
    h.manifest_fd = Dup(s.manifest.fd.get());
    if (manifest_bytes) {
      auto m = protocol::Manifest::Decode(*manifest_bytes);
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      if (m.ok()) h.manifest = std::move(m).value();
    } else {
      auto region = os::MapReadOnly(s.manifest.fd.get(), s.manifest.size);
      EXPECT_TRUE(region.ok());
      auto m = protocol::Manifest::DecodeMapped(std::move(region).value());
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      if (m.ok()) h.manifest = std::move(m).value();
    }
    for (int fd : store_->fds()) h.allocations.push_back(Dup(fd));
    return h;
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::optional<checkpoint::Checkpoint> checkpoint_;
  std::optional<FakeDriver> fake_;
  daemon::GpuAdoptContext gpu_;
  std::optional<daemon::WeightStore> store_;
};

TEST_F(KeeperLinkGpuTest, EveryWithdrawnFdIsImportedAndAllTensorsChecksummedInOneLaunch) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  protocol::Handoff handoff = Withdrawn();
  ASSERT_EQ(handoff.manifest.tensor_count(), checkpoint_->tensors().size());
  const int fds_before = CountOpenFds();
  const int mappings_before = fake_->live_mappings();
  const int refs_before = fake_->total_context_refs();
  const int imports_before = fake_->CallCount("cuMemImportFromShareableHandle");
  const int launches_before = fake_->CallCount("cuLaunchKernel");
  protocol::AdoptOptions adopt;
  adopt.checksums = protocol::ChecksumCheck::kFull;
  Status verified = daemon::VerifyGpuHandoff(gpu_, handoff, adopt);
  ASSERT_TRUE(verified.ok()) << verified.ToString();
  EXPECT_EQ(fake_->CallCount("cuMemImportFromShareableHandle") - imports_before,
            static_cast<int>(handoff.allocations.size()));
  // Every tensor's range goes to the kernel in one launch: one scratch allocation and one
  // synchronization for the whole check, not one per tensor.
  EXPECT_EQ(fake_->CallCount("cuLaunchKernel") - launches_before, 1);
  // Nothing imported stays: no mapping, no context reference, no fd.
  EXPECT_EQ(fake_->live_mappings(), mappings_before);
  EXPECT_EQ(fake_->total_context_refs(), refs_before);
  EXPECT_EQ(CountOpenFds(), fds_before);
  EXPECT_EQ(fake_->violations(), 0);
  // The handoff's fds are still its own: the store built from it serves them.
  daemon::WeightStore adopted = daemon::StoreFromHandoff(std::move(handoff));
  EXPECT_EQ(adopted.tier(), Tier::kGpu);
  EXPECT_EQ(adopted.fds().size(), store_->fds().size());
  EXPECT_EQ(adopted.summary().tensor_count, store_->summary().tensor_count);
  EXPECT_EQ(adopted.summary().tensor_bytes, store_->summary().tensor_bytes);
  EXPECT_EQ(adopted.summary().resident_bytes, store_->summary().resident_bytes);
}

// The withdrawal's own check is a sample of no tensors (ValidateKeptHandoff checks after it):
// it must not call the checksum function at all. A call with no ranges made every gpu-tier
// re-adoption fail ("no checksum at withdrawal") on an H200 once the checks were batched.
TEST_F(KeeperLinkGpuTest, ASampleOfNoTensorsCallsNoChecksum) {
  protocol::Handoff handoff = Withdrawn();
  ASSERT_EQ(handoff.tier(), Tier::kGpu);
  protocol::AdoptOptions adopt;
  adopt.expected_digest = handoff.info.config_digest;
  adopt.checksums = protocol::ChecksumCheck::kSample;
  adopt.sample_tensors = 0;
  int calls = 0;
  adopt.gpu_checksum =
      [&calls](std::span<const protocol::ChecksumRange>) -> Result<std::vector<uint64_t>> {
    ++calls;
    return InternalError("no checksum at withdrawal");
  };
  Status checked = protocol::CheckAdoptable(handoff, adopt);
  EXPECT_TRUE(checked.ok()) << checked.ToString();
  EXPECT_EQ(calls, 0);
}

TEST_F(KeeperLinkGpuTest, AChecksumTheMemoryDoesNotHaveIsRefusedNamingTheTensor) {
  if (!cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the GPU checksum kernel";
  protocol::Handoff good = Withdrawn();
  std::vector<protocol::TensorEntry> tensors;
  for (size_t i = 0; i < good.manifest.tensor_count(); ++i) {
    tensors.push_back(good.manifest.tensor(i));
  }
  tensors.back().checksum ^= 1;
  const std::string corrupted(tensors.back().name);
  auto bytes = protocol::EncodeManifest(Tier::kGpu, good.manifest.allocation_sizes(), tensors);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  protocol::Handoff handoff = Withdrawn(*bytes);
  const int mappings_before = fake_->live_mappings();
  protocol::AdoptOptions adopt;  // a sample: the last tensor is always in it
  adopt.checksums = protocol::ChecksumCheck::kSample;
  adopt.sample_tensors = 2;
  Status verified = daemon::VerifyGpuHandoff(gpu_, handoff, adopt);
  EXPECT_EQ(verified.code(), StatusCode::kProtocol) << verified.ToString();
  EXPECT_NE(verified.message().find("'" + corrupted + "'"), std::string::npos)
      << verified.ToString();
  EXPECT_NE(verified.message().find("in memory"), std::string::npos) << verified.ToString();
  EXPECT_EQ(fake_->live_mappings(), mappings_before);
}

// A build without the kernel cannot check kept memory, so it adopts nothing: the refusal names
// the kernel, and what was imported to check it is released.
TEST_F(KeeperLinkGpuTest, WithoutTheKernelTheAdoptionIsRefusedNamingItAndLeaksNothing) {
  if (cuda::GpuChecksumKernelBuilt()) GTEST_SKIP() << "built with the GPU checksum kernel";
  protocol::Handoff handoff = Withdrawn();
  const int fds_before = CountOpenFds();
  const int mappings_before = fake_->live_mappings();
  const int handles_before = fake_->live_handles();
  Status verified = daemon::VerifyGpuHandoff(gpu_, handoff, {});
  EXPECT_EQ(verified.code(), StatusCode::kUnavailable) << verified.ToString();
  EXPECT_NE(verified.ToString().find("the checksum kernel"), std::string::npos)
      << verified.ToString();
  EXPECT_EQ(fake_->CallCount("cuLaunchKernel"), 0);
  EXPECT_EQ(fake_->live_mappings(), mappings_before);
  EXPECT_EQ(fake_->live_handles(), handles_before);
  EXPECT_EQ(CountOpenFds(), fds_before);
}

TEST_F(KeeperLinkGpuTest, AnImportTheDriverRefusesFailsTheAdoptionAndLeaksNothing) {
  protocol::Handoff handoff = Withdrawn();
  const int fds_before = CountOpenFds();
  const int mappings_before = fake_->live_mappings();
  const int handles_before = fake_->live_handles();
  fake_->FailCall("cuMemImportFromShareableHandle", 1, CUDA_ERROR_INVALID_HANDLE);
  Status verified = daemon::VerifyGpuHandoff(gpu_, handoff, {});
  EXPECT_FALSE(verified.ok());
  EXPECT_NE(verified.ToString().find("importing the kept allocations"), std::string::npos)
      << verified.ToString();
  EXPECT_EQ(fake_->live_mappings(), mappings_before);
  EXPECT_EQ(fake_->live_handles(), handles_before);
  EXPECT_EQ(CountOpenFds(), fds_before);
}

}  // namespace
}  // namespace weightcache::testing
