// The GPU checksum launcher (cuda/checksum_gpu.h) against the fake driver, whose
// cuLaunchKernel runs the kernel's algorithm on the host: the range table, empty and
// misaligned ranges, chunk-to-tensor recombination, and the exact errors and cleanup when a
// driver call fails. The real kernel on a real GPU: tests/gpu/checksum_gpu_test.cc.
#include "cuda/checksum_gpu.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/checksum.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::cuda {
namespace {

using testing::FakeDriver;

class ChecksumGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!GpuChecksumKernelBuilt()) {
      GTEST_SKIP() << "built with WEIGHTCACHE_BUILD_KERNELS=OFF; see UnavailableWithoutKernel";
    }
  }
  // Fake device memory holding random bytes.
  CUdeviceptr DeviceBytes(size_t n, uint32_t seed) {
    CUdeviceptr p = 0;
    EXPECT_EQ(fake_.api()->cuMemAlloc(&p, n == 0 ? 1 : n), CUDA_SUCCESS);
    std::mt19937 rng(seed);
    auto* b = reinterpret_cast<uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(rng());
    return p;
  }
  FakeDriver fake_;
};

TEST_F(ChecksumGpuTest, ChecksumsEqualHostChecksums) {
  const size_t sizes[] = {
      0, 1, 7, kChecksumChunkBytes - 1, kChecksumChunkBytes + 1, 3 * kChecksumChunkBytes + 13};
  std::vector<DeviceRange> ranges;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    ranges.push_back({DeviceBytes(sizes[i], static_cast<uint32_t>(i)), sizes[i]});
  }
  // A misaligned range: the bytewise path.
  ranges.push_back({ranges.back().ptr + 3, ranges.back().size - 3});
  const int allocs = fake_.live_device_allocs();

  auto got = GpuTensorChecksums(fake_.api(), nullptr, ranges);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ((*got)[i],
              TensorChecksum(reinterpret_cast<const void*>(ranges[i].ptr), ranges[i].size))
        << "range " << i;
  }
  EXPECT_EQ(fake_.live_device_allocs(), allocs) << "scratch not freed";
  EXPECT_EQ(fake_.loaded_modules(), 0) << "module not unloaded";
  EXPECT_EQ(fake_.CallCount("cuLaunchKernel"), 1) << "one launch for all ranges";
}

TEST_F(ChecksumGpuTest, OnlyEmptyRangesNeedNoLaunch) {
  std::vector<DeviceRange> ranges = {{0, 0}, {0, 0}};
  auto got = GpuTensorChecksums(fake_.api(), nullptr, ranges);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, (std::vector<uint64_t>{TensorChecksum(nullptr, 0), TensorChecksum(nullptr, 0)}));
  EXPECT_EQ(fake_.CallCount("cuLaunchKernel"), 0);
}

TEST_F(ChecksumGpuTest, NullNonEmptyRangeIsInvalidArgument) {
  std::vector<DeviceRange> ranges = {{0, 16}};
  auto got = GpuTensorChecksums(fake_.api(), nullptr, ranges);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("null device range"), std::string::npos);
}

TEST_F(ChecksumGpuTest, ChunkHashesNameTheChunks) {
  std::vector<DeviceRange> ranges = {
      {DeviceBytes(2 * kChecksumChunkBytes + 1, 9), 2 * kChecksumChunkBytes + 1}};
  auto kernel = ChecksumKernel::Create(fake_.api());
  ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
  auto hashes = kernel->ChunkHashes(nullptr, ranges);
  ASSERT_TRUE(hashes.ok());
  std::vector<uint64_t> want(3);
  HashChunks(reinterpret_cast<const void*>(ranges[0].ptr), ranges[0].size, want);
  EXPECT_EQ(*hashes, want);
}

TEST_F(ChecksumGpuTest, ModuleLoadFailureIsNamed) {
  fake_.FailCall("cuModuleLoadData", 1, CUDA_ERROR_INVALID_IMAGE);
  auto got = ChecksumKernel::Create(fake_.api());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCuda);
  EXPECT_EQ(got.status().driver_error(), CUDA_ERROR_INVALID_IMAGE);
  EXPECT_NE(got.status().message().find("cuModuleLoadData of the embedded checksum kernel"),
            std::string::npos);
}

TEST_F(ChecksumGpuTest, GetFunctionFailureUnloadsTheModule) {
  fake_.FailCall("cuModuleGetFunction", 1, CUDA_ERROR_NOT_FOUND);
  auto got = ChecksumKernel::Create(fake_.api());
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("cuModuleGetFunction(weightcache_chunk_xxh64)"),
            std::string::npos);
  EXPECT_EQ(fake_.loaded_modules(), 0);
}

TEST_F(ChecksumGpuTest, LaunchFailureFreesScratch) {
  std::vector<DeviceRange> ranges = {{DeviceBytes(100, 1), 100}};
  const int allocs = fake_.live_device_allocs();
  fake_.FailCall("cuLaunchKernel", 1, CUDA_ERROR_LAUNCH_FAILED);
  auto got = GpuTensorChecksums(fake_.api(), nullptr, ranges);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCuda);
  EXPECT_NE(got.status().message().find("cuLaunchKernel(checksum) over 1 chunks in 1 ranges"),
            std::string::npos)
      << got.status().message();
  EXPECT_NE(got.status().message().find("CUDA_ERROR_LAUNCH_FAILED"), std::string::npos);
  EXPECT_EQ(fake_.live_device_allocs(), allocs);
  EXPECT_EQ(fake_.loaded_modules(), 0);
}

TEST_F(ChecksumGpuTest, KernelFaultSurfacesAtSynchronize) {
  std::vector<DeviceRange> ranges = {{DeviceBytes(100, 1), 100}};
  fake_.FailCall("cuStreamSynchronize", 1, CUDA_ERROR_ILLEGAL_ADDRESS);
  auto got = GpuTensorChecksums(fake_.api(), nullptr, ranges);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().driver_error(), CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_NE(got.status().message().find("checksum kernel over 1 device ranges"), std::string::npos);
}

TEST(ChecksumGpuUnavailableTest, UnavailableWithoutKernel) {
  if (GpuChecksumKernelBuilt()) GTEST_SKIP() << "this build embeds the kernel";
  FakeDriver fake;
  auto got = ChecksumKernel::Create(fake.api());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(got.status().message().find("WEIGHTCACHE_BUILD_KERNELS"), std::string::npos);
}

}  // namespace
}  // namespace weightcache::cuda
