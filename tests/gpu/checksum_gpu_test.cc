// The checksum kernel on a real GPU: its per-chunk XXH64 and the tensor checksums equal the
// host implementation (common/checksum.h) over random data of awkward sizes, aligned and not,
// and a one-byte change on the device changes exactly that tensor's checksum. Skips (with the
// reason) where there is no driver, no device or no kernel in this build.
#include "cuda/checksum_gpu.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/checksum.h"
#include "cuda/driver_api.h"

namespace weightcache::cuda {
namespace {

#define ASSERT_CU_OK(call)                                                   \
  do {                                                                       \
    CUresult rc_ = (call);                                                   \
    ASSERT_EQ(rc_, CUDA_SUCCESS) << DriverError(api_, rc_, #call).message(); \
  } while (0)

class ChecksumGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<const DriverApi*> api = LoadDriver();
    if (!api.ok()) GTEST_SKIP() << "no usable CUDA driver: " << api.status().ToString();
    api_ = *api;
    int count = 0;
    ASSERT_CU_OK(api_->cuDeviceGetCount(&count));
    if (count == 0) GTEST_SKIP() << "CUDA driver present but no GPU visible";
    if (!GpuChecksumKernelBuilt()) {
      GTEST_SKIP() << "built without the checksum kernel (WEIGHTCACHE_BUILD_KERNELS=OFF)";
    }
    ASSERT_CU_OK(api_->cuDeviceGet(&device_, 0));
    ASSERT_CU_OK(api_->cuDevicePrimaryCtxRetain(&context_, device_));
    ASSERT_CU_OK(api_->cuCtxSetCurrent(context_));
  }
  void TearDown() override {
    for (CUdeviceptr p : allocations_) api_->cuMemFree(p);
    if (context_ != nullptr) api_->cuDevicePrimaryCtxRelease(device_);
  }
  // Device memory holding `host` (one allocation per call), at `misalign` bytes past the
  // allocation's start.
  CUdeviceptr Upload(const std::vector<uint8_t>& host, size_t misalign = 0) {
    CUdeviceptr p = 0;
    EXPECT_EQ(api_->cuMemAlloc(&p, host.size() + misalign + 1), CUDA_SUCCESS);
    allocations_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(api_->cuMemcpyHtoD(p + misalign, host.data(), host.size()), CUDA_SUCCESS);
    }
    return p + misalign;
  }
  static std::vector<uint8_t> Random(size_t n, uint32_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i + 8 <= n; i += 8) {
      const uint64_t r = rng();
      std::memcpy(&v[i], &r, 8);
    }
    for (size_t i = n / 8 * 8; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
    return v;
  }

  const DriverApi* api_ = nullptr;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  std::vector<CUdeviceptr> allocations_;
};

TEST_F(ChecksumGpuTest, KernelEqualsHostOnAwkwardSizes) {
  const size_t sizes[] = {0,
                          1,
                          7,
                          kChecksumChunkBytes - 1,
                          kChecksumChunkBytes,
                          kChecksumChunkBytes + 1,
                          (size_t{64} << 20) + 13};
  std::vector<std::vector<uint8_t>> host;
  std::vector<DeviceRange> ranges;
  for (size_t misalign : {size_t{0}, size_t{3}}) {
    for (size_t i = 0; i < std::size(sizes); ++i) {
      host.push_back(Random(sizes[i], static_cast<uint32_t>(i)));
      ranges.push_back({Upload(host.back(), misalign), sizes[i]});
    }
  }
  auto got = GpuTensorChecksums(api_, nullptr, ranges);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ((*got)[i], TensorChecksum(host[i].data(), host[i].size()))
        << "range " << i << ": " << ranges[i].size
        << " bytes, device address % 16 = " << ranges[i].ptr % 16;
  }

  auto kernel = ChecksumKernel::Create(api_);
  ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
  auto chunks = kernel->ChunkHashes(nullptr, std::span<const DeviceRange>(ranges).last(1));
  ASSERT_TRUE(chunks.ok()) << chunks.status().ToString();
  std::vector<uint64_t> want(ChecksumChunkCount(host.back().size()));
  HashChunks(host.back().data(), host.back().size(), want);
  EXPECT_EQ(*chunks, want);
}

TEST_F(ChecksumGpuTest, OneByteChangedOnDeviceChangesOnlyThatTensor) {
  const auto a = Random(3 * kChecksumChunkBytes + 5, 10);
  const auto b = Random(kChecksumChunkBytes, 11);
  std::vector<DeviceRange> ranges = {{Upload(a), a.size()}, {Upload(b), b.size()}};
  auto kernel = ChecksumKernel::Create(api_);
  ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
  auto before = kernel->Checksums(nullptr, ranges);
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  ASSERT_CU_OK(api_->cuMemsetD8(ranges[0].ptr + 2 * kChecksumChunkBytes + 1,
                                static_cast<unsigned char>(a[2 * kChecksumChunkBytes + 1] ^ 0x40),
                                1));
  ASSERT_CU_OK(api_->cuCtxSynchronize());
  auto after = kernel->Checksums(nullptr, ranges);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_NE((*after)[0], (*before)[0]);
  EXPECT_EQ((*after)[1], (*before)[1]);
}

TEST_F(ChecksumGpuTest, ThroughputIsRecorded) {
  // Not a timed assertion: the number goes into the test log (ctest -V) for the record;
  // bench/load_bench measures it properly.
  const size_t n = size_t{1} << 30;
  CUdeviceptr p = 0;
  ASSERT_CU_OK(api_->cuMemAlloc(&p, n));
  allocations_.push_back(p);
  ASSERT_CU_OK(api_->cuMemsetD8(p, 0x5A, n));
  auto kernel = ChecksumKernel::Create(api_);
  ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
  std::vector<DeviceRange> ranges = {{p, n}};
  ASSERT_TRUE(kernel->Checksums(nullptr, ranges).ok());  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  auto got = kernel->Checksums(nullptr, ranges);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  std::vector<uint8_t> host(n, 0x5A);
  EXPECT_EQ((*got)[0], TensorChecksum(host.data(), n));
  RecordProperty("checksum_gb_per_s", std::to_string(n / s / 1e9));
  std::printf("gpu checksum: 1 GiB in %.2f ms (%.1f GB/s)\n", s * 1e3, n / s / 1e9);
}

}  // namespace
}  // namespace weightcache::cuda
