// `serve --seed-from` on the gpu tier (serve/seed_fill.h, docs/seeding.md) over the fake CUDA
// driver with backed VMM memory: a daemon runs in process on fake GPU 0 (its real socket, its
// exported fds), and the load of the same identity on fake GPU 1 seeds from it through the real
// SeedFiller — discovery of the peer, peer access checked, the peer's fds imported and mapped
// with access for GPU 1, copied with cuMemcpyDtoDAsync — then the loader's checks. The fake
// faults a copy whose mappings lack access for the copying device, as a GPU would.
//
// The seeded cache holds the bytes and layout of a disk load on GPU 1 and releases everything
// it imported; a pair without peer access is refused up front by name, before the peer is
// attached, and the disk load follows; a copy that fails reads the disk, leaving nothing behind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "daemon/weight_store.h"
#include "identity/device_inventory.h"
#include "identity/resolve.h"
#include "protocol/manifest.h"
#include "serve/seed_fill.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"
#include "unit/daemon/in_process_daemon.h"

namespace weightcache::testing {
namespace {

using cuda::testing::FakeDriver;
using namespace std::chrono_literals;

class GpuSeedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 6, 2, 11, "f32,bf16", 4096, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    fake_.emplace(4096);
    fake_->BackVmmMemory();
    env_.load_driver = [this]() -> Result<const cuda::DriverApi*> { return fake_->api(); };
    env_.lookup = identity::MapEnv({});
    auto opened = checkpoint::Checkpoint::Open(ref_.dir);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    checkpoint_.emplace(std::move(opened).value());
  }

  IdentityOptions On(const std::string& device) const {
    IdentityOptions identity;
    identity.model_dir = ref_.dir;
    identity.tier = Tier::kGpu;
    identity.device = device;
    identity.runtime_dir = dir_.Join("run");
    return identity;
  }

  // The peer: the cache of our identity on fake GPU 0, ready.
  void StartPeer() {
    auto options = DaemonOptionsFor(On("0"), env_);
    ASSERT_TRUE(options.ok()) << options.status().ToString();
    options->keeper.enabled = false;
    auto started = InProcessDaemon::Start(std::move(options).value());
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    peer_ = std::move(started).value();
    ASSERT_TRUE(peer_->WaitLoaded().ok());
  }

  // The load of our identity on fake GPU 1, seeded with `seed_from` ("" for none). The seed's
  // own error, when it failed, goes to *seed_error.
  Result<daemon::WeightStore> LoadOnGpu1(const std::string& seed_from,
                                         Status* seed_error = nullptr) {
    auto id = identity::ResolveIdentity(On("1"), env_);
    if (!id.ok()) return id.status();
    daemon::LoadOptions options;
    options.threads = 2;
    options.device = *id->device;
    options.driver = fake_->api();
    options.cache_name = "weightcache:test";
    daemon::PeerFill seed = serve::SeedFiller(*id, seed_from, 5s, env_);
    if (seed) {
      options.peer_fill = [seed, seed_error](const daemon::PeerFillRequest& request) {
        auto seeded = seed(request);
        if (!seeded.ok() && seed_error != nullptr) *seed_error = seeded.status();
        return seeded;
      };
    }
    daemon::LoadControl control;
    control.progress = [](uint64_t, uint64_t) {};
    std::string memory;
    return daemon::LoadGpuStore(*checkpoint_, options, control, &memory);
  }

  // The store's manifest, then every allocation's bytes read back through its exported fd.
  std::vector<std::string> Contents(const daemon::WeightStore& store) const {
    std::vector<uint8_t> manifest(store.summary().manifest.size);
    EXPECT_EQ(::pread(store.summary().manifest.fd.get(), manifest.data(), manifest.size(), 0),
              static_cast<ssize_t>(manifest.size()));
    auto decoded = protocol::Manifest::Decode(manifest);
    EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
    if (!decoded.ok()) return {};
    std::vector<std::string> out = {std::string(manifest.begin(), manifest.end())};
    const std::vector<int> fds = store.fds();
    for (size_t a = 0; a < fds.size(); ++a) {
      out.push_back(fake_->ExportedBytes(fds[a], 0, decoded->allocation_sizes()[a]));
      EXPECT_EQ(out.back().size(), decoded->allocation_sizes()[a]) << "allocation " << a;
    }
    return out;
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::optional<checkpoint::Checkpoint> checkpoint_;
  std::optional<FakeDriver> fake_;
  identity::Env env_ = identity::Env::Default();
  std::unique_ptr<InProcessDaemon> peer_;
};

TEST_F(GpuSeedTest, GpuOneSeedsFromGpuZerosCacheWithTheBytesOfADiskLoad) {
  StartPeer();
  const std::string gpu0 = identity::FormatGpuUuid(FakeDriver::UuidOf(0));
  const int imports_before = fake_->CallCount("cuMemImportFromShareableHandle");
  std::vector<std::string> seeded_contents;
  {
    Status seed_error;
    auto seeded = LoadOnGpu1("auto", &seed_error);
    ASSERT_TRUE(seeded.ok()) << seeded.status().ToString();
    EXPECT_TRUE(seed_error.ok()) << seed_error.ToString();
    EXPECT_EQ(seeded->summary().origin, "peer " + gpu0);
    EXPECT_NE(seeded->summary().filled_from.find("the peer cache of " + gpu0), std::string::npos)
        << seeded->summary().filled_from;
    // The peer's allocations were imported (and its memory read through them), with peer
    // access asked first.
    EXPECT_GT(fake_->CallCount("cuMemImportFromShareableHandle"), imports_before);
    EXPECT_EQ(fake_->CallCount("cuDeviceCanAccessPeer"), 1);
    EXPECT_GT(fake_->CallCount("cuMemcpyDtoDAsync"), 0);
    seeded_contents = Contents(*seeded);
  }
  auto from_disk = LoadOnGpu1("");
  ASSERT_TRUE(from_disk.ok()) << from_disk.status().ToString();
  EXPECT_EQ(from_disk->summary().origin, "disk");
  EXPECT_EQ(seeded_contents, Contents(*from_disk));
  EXPECT_EQ(fake_->violations(), 0) << ::testing::PrintToString(fake_->violation_log());
}

TEST_F(GpuSeedTest, WithoutPeerAccessThePeerIsRefusedByNameAndTheDiskFollows) {
  StartPeer();
  fake_->SetPeerAccess(false);
  const std::string gpu0 = identity::FormatGpuUuid(FakeDriver::UuidOf(0));
  const std::string gpu1 = identity::FormatGpuUuid(FakeDriver::UuidOf(1));
  const int imports_before = fake_->CallCount("cuMemImportFromShareableHandle");
  Status seed_error;
  auto store = LoadOnGpu1("auto", &seed_error);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->summary().origin, "disk");
  EXPECT_EQ(seed_error.code(), StatusCode::kUnavailable) << seed_error.ToString();
  EXPECT_NE(seed_error.message().find(gpu1 + " has no peer access to " + gpu0), std::string::npos)
      << seed_error.ToString();
  // Refused before the peer was attached: nothing of it was imported.
  EXPECT_EQ(fake_->CallCount("cuMemImportFromShareableHandle"), imports_before);
  EXPECT_EQ(fake_->violations(), 0) << ::testing::PrintToString(fake_->violation_log());
}

TEST_F(GpuSeedTest, AFailedCopyReadsTheDiskAndReleasesTheImportedPeer) {
  StartPeer();
  const int handles_with_peer = fake_->live_handles();
  const int mappings_with_peer = fake_->live_mappings();
  fake_->FailCall("cuMemcpyDtoDAsync", 1, CUDA_ERROR_UNKNOWN);
  Status seed_error;
  {
    auto store = LoadOnGpu1("auto", &seed_error);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ(store->summary().origin, "disk");
    // "auto" names each peer it skipped, with its reason.
    EXPECT_EQ(seed_error.code(), StatusCode::kUnavailable) << seed_error.ToString();
    EXPECT_NE(seed_error.message().find(peer_->socket() + ": cuda error: seed: cuMemcpyDtoDAsync: "
                                                          "CUDA_ERROR_UNKNOWN"),
              std::string::npos)
        << seed_error.ToString();
  }
  // The store is gone: what is left is the peer's own.
  EXPECT_EQ(fake_->live_handles(), handles_with_peer);
  EXPECT_EQ(fake_->live_mappings(), mappings_with_peer);
  EXPECT_EQ(fake_->violations(), 0) << ::testing::PrintToString(fake_->violation_log());
}

}  // namespace
}  // namespace weightcache::testing
