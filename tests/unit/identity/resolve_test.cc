// identity::ResolveIdentity over an Env with the fake CUDA driver: the device is resolved once,
// with its CUDA ordinal (the driver's own index, or for an inventory file the position of its
// UUID among the devices the driver shows), and identity::CudaDevice is the one step from it to
// a CUdevice. Also the trusted-uid rule and the gpu tier without a driver.
#include "identity/resolve.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::testing {
namespace {

using cuda::testing::FakeDriver;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FakeUuid(CUdevice device) {
  return identity::FormatGpuUuid(FakeDriver::UuidOf(device));
}

class ResolveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 3, 1, 1, "f32", 256, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    env_ = identity::Env::Default();
    env_.load_driver = [this]() -> Result<const cuda::DriverApi*> { return fake_.api(); };
    env_.lookup = identity::MapEnv({});
    options_.model_dir = ref_.dir;
    options_.runtime_dir = dir_.Join("run");
    options_.tier = Tier::kGpu;
  }
  // An inventory file listing `uuids` as physical devices 0..n-1.
  std::string Inventory(const std::vector<std::string>& uuids) {
    std::string json = "[";
    for (size_t i = 0; i < uuids.size(); ++i) {
      json += (i ? "," : "") + std::string("{\"index\":") + std::to_string(i) + ",\"uuid\":\"" +
              uuids[i] + "\",\"name\":\"GPU\",\"memory_bytes\":1024}";
    }
    const std::string path = dir_.Join("inventory.json");
    WriteFile(path, json + "]");
    return path;
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  FakeDriver fake_;
  identity::Env env_;
  IdentityOptions options_;
};

TEST_F(ResolveTest, TheDriversDeviceCarriesItsOrdinalAndOpensThroughIt) {
  options_.device = "1";
  auto id = identity::ResolveIdentity(options_, env_);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  ASSERT_TRUE(id->device.has_value());
  EXPECT_EQ(id->device_key, FakeUuid(1));
  EXPECT_EQ(id->device->cuda_ordinal, 1);
  auto dev = identity::CudaDevice(fake_.api(), *id->device);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_EQ(*dev, 1);
}

TEST_F(ResolveTest, AnInventoryDeviceGetsTheOrdinalTheDriverShowsItAt) {
  // The file lists the driver's devices in the other order: its index 0 is the driver's 1.
  options_.device_inventory = Inventory({FakeUuid(1), FakeUuid(0)});
  options_.device = "0";
  auto id = identity::ResolveIdentity(options_, env_);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->device_key, FakeUuid(1));
  EXPECT_EQ(id->device->index, 0);
  EXPECT_EQ(id->device->cuda_ordinal, 1);
}

TEST_F(ResolveTest, AnInventoryDeviceTheDriverDoesNotShowHasNoOrdinalAndCudaDeviceSaysSo) {
  const std::string absent = "GPU-00000000-0000-0000-0000-0000000000aa";
  options_.device_inventory = Inventory({absent});
  options_.device = "0";
  auto id = identity::ResolveIdentity(options_, env_);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->device->cuda_ordinal, -1);
  auto dev = identity::CudaDevice(fake_.api(), *id->device);
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(dev.status().message(),
              HasSubstr("device " + absent + " is not among the devices the CUDA driver shows"));
}

TEST_F(ResolveTest, CudaDeviceRefusesAnOrdinalThatNowNamesAnotherDevice) {
  identity::DeviceInfo device;
  device.uuid = FakeUuid(0);
  device.cuda_ordinal = 1;
  auto dev = identity::CudaDevice(fake_.api(), device);
  ASSERT_FALSE(dev.ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(dev.status().message(), HasSubstr("the driver now shows " + FakeUuid(1)));
}

TEST_F(ResolveTest, AnEmptyGpuDeviceIsTheCurrentContextsDevice) {
  fake_.set_current_context(FakeDriver::ContextOf(1));
  auto id = identity::ResolveIdentity(options_, env_);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->device_key, FakeUuid(1));
  EXPECT_EQ(id->device->cuda_ordinal, 1);
}

TEST_F(ResolveTest, TheGpuTierWithoutADriverIsTheDriversError) {
  env_.load_driver = []() -> Result<const cuda::DriverApi*> {
    return Status(StatusCode::kUnavailable, "libcuda.so.1: cannot open shared object file");
  };
  options_.device = "0";
  auto id = identity::ResolveIdentity(options_, env_);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(id.status().message(), HasSubstr("libcuda.so.1"));
}

TEST_F(ResolveTest, TrustedUidsAreOursThenTheConfiguredOnesElseTheVariable) {
  auto configured = identity::TrustedUids({1001}, identity::MapEnv({}));
  ASSERT_TRUE(configured.ok());
  EXPECT_THAT(*configured, ElementsAre(::geteuid(), 1001u));
  auto from_env =
      identity::TrustedUids({}, identity::MapEnv({{"WEIGHTCACHE_TRUSTED_UIDS", "7,8"}}));
  ASSERT_TRUE(from_env.ok());
  EXPECT_THAT(*from_env, ElementsAre(::geteuid(), 7u, 8u));
  auto bad = identity::TrustedUids({}, identity::MapEnv({{"WEIGHTCACHE_TRUSTED_UIDS", "7,x"}}));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("WEIGHTCACHE_TRUSTED_UIDS=\"7,x\": expected comma-separated numeric uids"));
}

}  // namespace
}  // namespace weightcache::testing
