// The upload pipeline on a real GPU: a multi-file dataset written to disk is loaded into
// device memory (cuMemAlloc) as many tensors; the device bytes equal the files', and the
// checksums the pipeline computed on the host equal the GPU kernel's over device memory and
// the host checksum of the file bytes. Buffered and O_DIRECT reads. Skips (with the reason)
// where there is no driver or device.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/checksum.h"
#include "common/unique_fd.h"
#include "cuda/checksum_gpu.h"
#include "cuda/driver_api.h"
#include "cuda/upload_pipeline.h"
#include "support/test_env.h"

namespace weightcache::cuda {
namespace {

#define ASSERT_CU_OK(call)                                                   \
  do {                                                                       \
    CUresult rc_ = (call);                                                   \
    ASSERT_EQ(rc_, CUDA_SUCCESS) << DriverError(api_, rc_, #call).message(); \
  } while (0)

class UploadGpuTest : public ::testing::TestWithParam<ReadMode> {
 protected:
  void SetUp() override {
    Result<const DriverApi*> api = LoadDriver();
    if (!api.ok()) GTEST_SKIP() << "no usable CUDA driver: " << api.status().ToString();
    api_ = *api;
    int count = 0;
    ASSERT_CU_OK(api_->cuDeviceGetCount(&count));
    if (count == 0) GTEST_SKIP() << "CUDA driver present but no GPU visible";
    ASSERT_CU_OK(api_->cuDeviceGet(&device_, 0));
    ASSERT_CU_OK(api_->cuDevicePrimaryCtxRetain(&context_, device_));
    ASSERT_CU_OK(api_->cuCtxSetCurrent(context_));
  }
  void TearDown() override {
    if (region_ != 0) api_->cuMemFree(region_);
    if (context_ != nullptr) api_->cuDevicePrimaryCtxRelease(device_);
  }

  const DriverApi* api_ = nullptr;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUdeviceptr region_ = 0;
};

TEST_P(UploadGpuTest, MultiFileDatasetLandsIntact) {
  // Three "shards": tensors of random sizes packed back to back after a small header, as in
  // a safetensors file; the last one ends short of a chunk.
  weightcache::testing::TempDir dir;
  const size_t file_sizes[] = {(size_t{96} << 20) + 7, size_t{40} << 20, (size_t{3} << 20) + 4099};
  std::mt19937_64 rng(42);
  std::vector<std::string> contents;
  std::vector<UniqueFd> fds;
  std::vector<UploadSource> sources;
  std::vector<UploadItem> items;
  uint64_t device_bytes = 0;
  for (size_t f = 0; f < std::size(file_sizes); ++f) {
    std::string bytes(file_sizes[f], '\0');
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      const uint64_t r = rng();
      std::memcpy(&bytes[i], &r, 8);
    }
    const std::string path = dir.Join("shard-" + std::to_string(f) + ".bin");
    weightcache::testing::WriteFile(path, bytes);
    contents.push_back(std::move(bytes));
    fds.emplace_back(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fds.back().valid()) << path;
    sources.push_back({fds.back().get(), path});
    uint64_t off = 4096 + 13;  // "header"
    while (off < file_sizes[f]) {
      const uint64_t len = std::min<uint64_t>(1 + rng() % (size_t{9} << 20), file_sizes[f] - off);
      items.push_back({f, off, len, device_bytes, std::nullopt});  // dst: an offset until allocated
      device_bytes += (len + 255) / 256 * 256;
      off += len;
    }
  }
  ASSERT_CU_OK(api_->cuMemAlloc(&region_, device_bytes));
  for (UploadItem& it : items) it.dst += region_;

  UploadOptions options;
  options.read_mode = GetParam();
  options.checksums = ChecksumMode::kCompute;
  auto pipeline = UploadPipeline::Create(api_, options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status().ToString();
  auto report = pipeline->Run(sources, items);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  std::printf("upload (%s): %zu items, %.1f MiB in %.3f s, %.2f GB/s, O_DIRECT sources %zu\n",
              GetParam() == ReadMode::kDirect ? "direct" : "buffered", items.size(),
              report->bytes / 1048576.0, report->seconds, report->gb_per_s, report->direct_sources);

  std::vector<DeviceRange> ranges;
  for (const UploadItem& it : items) ranges.push_back({it.dst, it.length});
  auto gpu = GpuTensorChecksums(api_, nullptr, ranges);
  if (!GpuChecksumKernelBuilt()) {
    EXPECT_EQ(gpu.status().code(), StatusCode::kUnavailable);
  } else {
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const UploadItem& it = items[i];
    const std::string& file = contents[it.source];
    const uint64_t want = TensorChecksum(file.data() + it.file_offset, it.length);
    ASSERT_EQ(report->checksums[i], want) << "item " << i;
    if (gpu.ok()) {
      ASSERT_EQ((*gpu)[i], want) << "item " << i;
    }
    std::string back(it.length, '\0');
    ASSERT_CU_OK(api_->cuMemcpyDtoH(back.data(), it.dst, it.length));
    ASSERT_TRUE(std::memcmp(back.data(), file.data() + it.file_offset, it.length) == 0)
        << "item " << i << " of " << sources[it.source].path << " differs on the device";
  }
}

INSTANTIATE_TEST_SUITE_P(ReadModes, UploadGpuTest,
                         ::testing::Values(ReadMode::kBuffered, ReadMode::kDirect),
                         [](const auto& info) {
                           return info.param == ReadMode::kDirect ? std::string("Direct")
                                                                  : std::string("Buffered");
                         });

}  // namespace
}  // namespace weightcache::cuda
