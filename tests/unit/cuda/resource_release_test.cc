// UniqueHandle (common/unique_handle.h) and every CUDA resource owner built on it, against the
// fake driver: each kind of resource is released exactly once, by its own release call (pinned
// host memory by cuMemFreeHost, never cuMemHostUnregister; device memory by cuMemFree; ...), a
// moved-from owner releases nothing and a move-assignment releases what it overwrote.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "client/fallback_loader.h"
#include "common/unique_fd.h"
#include "common/unique_handle.h"
#include "cuda/checksum_gpu.h"
#include "cuda/upload_resources.h"
#include "cuda/vmm.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::cuda {
namespace {

using testing::CountOpenFds;
using testing::FakeDriver;

// ---- the template itself, with a recording release ------------------------------------------

struct Recorder {
  std::vector<int> closed;
};
struct RecordingTraits {
  using Handle = int;
  using Context = Recorder*;
  static constexpr int Null() { return 0; }
  static void Close(Recorder* r, int h) noexcept { r->closed.push_back(h); }
};
using Recorded = UniqueHandle<RecordingTraits>;

TEST(UniqueHandleTest, ReleasesOnceAndMovesOwnership) {
  Recorder rec;
  {
    Recorded a(&rec, 7);
    EXPECT_TRUE(a.valid());
    Recorded b(std::move(a));
    EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty, by contract
    EXPECT_EQ(b.get(), 7);
    Recorded c(&rec, 8);
    c = std::move(b);  // releases 8, takes 7
    EXPECT_EQ(rec.closed, std::vector<int>{8});
    EXPECT_EQ(c.context(), &rec);
  }
  EXPECT_EQ(rec.closed, (std::vector<int>{8, 7}));
}

TEST(UniqueHandleTest, ReleaseGivesUpWithoutClosingAndResetCloses) {
  Recorder rec;
  Recorded a(&rec, 3);
  EXPECT_EQ(a.Release(), 3);
  EXPECT_FALSE(a.valid());
  a.Reset(4);
  a.Reset(5);
  EXPECT_EQ(rec.closed, std::vector<int>{4});
  a.Reset();
  EXPECT_EQ(rec.closed, (std::vector<int>{4, 5}));
  EXPECT_FALSE(a.valid());
}

TEST(UniqueHandleTest, UniqueFdClosesItsFdOnlyOnce) {
  const int before = CountOpenFds();
  {
    UniqueFd fd(::dup(0));
    ASSERT_TRUE(fd.valid());
    EXPECT_EQ(CountOpenFds(), before + 1);
    UniqueFd moved = std::move(fd);
    EXPECT_FALSE(fd.valid());  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(CountOpenFds(), before + 1);
  }
  EXPECT_EQ(CountOpenFds(), before);
  // Any negative value is empty, as it always was for UniqueFd.
  EXPECT_FALSE(UniqueFd(-2).valid());
  EXPECT_FALSE(UniqueFd().valid());
}

// ---- each CUDA resource kind, by its own release call ---------------------------------------

class ResourceReleaseTest : public ::testing::Test {
 protected:
  ResourceReleaseTest() { fake_.set_current_context(FakeDriver::ContextOf(0)); }
  // Only `release` was called to let go of the resource, once, and no other release call.
  void ExpectReleasedBy(const std::string& release) {
    static const char* const kReleaseCalls[] = {
        "cuMemFreeHost",  "cuMemHostUnregister",      "cuMemFree",    "cuStreamDestroy",
        "cuEventDestroy", "cuModuleUnload",           "cuMemRelease", "cuMemAddressFree",
        "cuMemUnmap",     "cuDevicePrimaryCtxRelease"};
    for (const char* call : kReleaseCalls) {
      EXPECT_EQ(fake_.CallCount(call), call == release ? 1 : 0) << call;
    }
    EXPECT_EQ(fake_.violations(), 0) << ::testing::PrintToString(fake_.violation_log());
  }
  FakeDriver fake_;
};

// Pinned staging memory is registered anonymous memory (cuda/pinned_host_buffer.h): released
// with cuMemHostUnregister, never cuMemFreeHost.
TEST_F(ResourceReleaseTest, PinnedHostMemoryIsReleasedWithCuMemHostUnregister) {
  {
    auto buffer = PinnedHostBuffer::Create(fake_.api(), 4096);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    EXPECT_EQ(fake_.live_host_registrations(), 1);
    EXPECT_EQ(fake_.live_host_buffers(), 0);
    PinnedHostBuffer moved = std::move(*buffer);  // the moved-from one must not free it again
    EXPECT_NE(moved.data(), nullptr);
    moved.data()[4095] = std::byte{7};  // writable, all of it
  }
  EXPECT_EQ(fake_.live_host_registrations(), 0);
  ExpectReleasedBy("cuMemHostUnregister");
}

TEST_F(ResourceReleaseTest, APinRefusedByTheDriverUnmapsAndNamesTheSize) {
  fake_.FailCall("cuMemHostRegister", 1, CUDA_ERROR_OUT_OF_MEMORY);
  auto buffer = PinnedHostBuffer::Create(fake_.api(), 8192);
  ASSERT_FALSE(buffer.ok());
  EXPECT_EQ(buffer.status().code(), StatusCode::kCuda);
  EXPECT_NE(buffer.status().message().find("cuMemHostRegister of a 8192-byte pinned staging "
                                           "buffer: CUDA_ERROR_OUT_OF_MEMORY"),
            std::string::npos)
      << buffer.status().message();
  EXPECT_EQ(fake_.live_host_registrations(), 0);
}

// The fake tells the two pinned-memory kinds apart, so the test above would catch a buffer
// released with the other kind's call.
TEST_F(ResourceReleaseTest, FakeRejectsTheOtherPinnedMemoryReleaseCall) {
  void* p = nullptr;
  ASSERT_EQ(fake_.api()->cuMemHostAlloc(&p, 4096, 0), CUDA_SUCCESS);
  EXPECT_EQ(fake_.api()->cuMemHostUnregister(p), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(fake_.violation_log(),
              ::testing::ElementsAre("cuMemHostUnregister of cuMemHostAlloc'ed memory"));
  EXPECT_EQ(fake_.api()->cuMemFreeHost(p), CUDA_SUCCESS);
}

TEST_F(ResourceReleaseTest, StreamIsDestroyedWithCuStreamDestroy) {
  {
    auto stream = CudaStream::Create(fake_.api());
    ASSERT_TRUE(stream.ok());
    CudaStream moved = std::move(*stream);
    EXPECT_EQ(fake_.live_streams(), 1);
  }
  EXPECT_EQ(fake_.live_streams(), 0);
  ExpectReleasedBy("cuStreamDestroy");
}

TEST_F(ResourceReleaseTest, EventIsDestroyedWithCuEventDestroy) {
  {
    auto event = CudaEvent::Create(fake_.api());
    ASSERT_TRUE(event.ok());
    CudaEvent moved = std::move(*event);
    EXPECT_EQ(fake_.live_events(), 1);
  }
  EXPECT_EQ(fake_.live_events(), 0);
  ExpectReleasedBy("cuEventDestroy");
}

TEST_F(ResourceReleaseTest, ChecksumKernelUnloadsItsModule) {
  if (!GpuChecksumKernelBuilt()) GTEST_SKIP() << "built without the checksum kernel";
  {
    auto kernel = ChecksumKernel::Create(fake_.api());
    ASSERT_TRUE(kernel.ok()) << kernel.status().ToString();
    ChecksumKernel moved = std::move(*kernel);
    EXPECT_EQ(fake_.loaded_modules(), 1);
  }
  EXPECT_EQ(fake_.loaded_modules(), 0);
  ExpectReleasedBy("cuModuleUnload");
}

TEST_F(ResourceReleaseTest, PrimaryContextIsReleasedWithCuDevicePrimaryCtxRelease) {
  {
    auto context = PrimaryContext::Retain(fake_.api(), 1);
    ASSERT_TRUE(context.ok());
    PrimaryContext moved = std::move(*context);
    EXPECT_EQ(moved.device(), 1);
    EXPECT_EQ(fake_.context_refs(1), 1);
  }
  EXPECT_EQ(fake_.context_refs(1), 0);
  ExpectReleasedBy("cuDevicePrimaryCtxRelease");
}

TEST_F(ResourceReleaseTest, VmmHandleIsReleasedWithCuMemRelease) {
  {
    auto handle = VmmHandle::Create(fake_.api(), uint64_t{2} << 20, ArenaAllocationProp(1));
    ASSERT_TRUE(handle.ok());
    VmmHandle moved = std::move(*handle);
    EXPECT_EQ(moved.size(), uint64_t{2} << 20);
    EXPECT_EQ(fake_.live_handles(), 1);
  }
  EXPECT_EQ(fake_.live_handles(), 0);
  ExpectReleasedBy("cuMemRelease");
}

TEST_F(ResourceReleaseTest, VaRangeIsFreedWithCuMemAddressFree) {
  {
    auto va = VaRange::Reserve(fake_.api(), uint64_t{4} << 20, uint64_t{2} << 20);
    ASSERT_TRUE(va.ok());
    VaRange moved = std::move(*va);
    EXPECT_EQ(moved.size(), uint64_t{4} << 20);
    EXPECT_EQ(fake_.live_reservations(), 1);
  }
  EXPECT_EQ(fake_.live_reservations(), 0);
  ExpectReleasedBy("cuMemAddressFree");
}

TEST_F(ResourceReleaseTest, MappingIsUnmappedWithCuMemUnmapBeforeItsRangeIsFreed) {
  auto handle = VmmHandle::Create(fake_.api(), uint64_t{2} << 20, ArenaAllocationProp(1));
  ASSERT_TRUE(handle.ok());
  auto va = VaRange::Reserve(fake_.api(), uint64_t{2} << 20, uint64_t{2} << 20);
  ASSERT_TRUE(va.ok());
  {
    auto mapping = MappedRange::Map(fake_.api(), va->base(), *handle);
    ASSERT_TRUE(mapping.ok());
    MappedRange moved = std::move(*mapping);
    EXPECT_EQ(moved.ptr(), va->base());
    EXPECT_EQ(fake_.live_mappings(), 1);
  }
  EXPECT_EQ(fake_.live_mappings(), 0);
  ExpectReleasedBy("cuMemUnmap");
}

// The client's fallback buffers (client/fallback_loader.h). Device memory is freed by
// cuMemFree in the context it was allocated in, whichever context the destroying thread has
// (none here), which is restored afterwards.
TEST_F(ResourceReleaseTest, FallbackDeviceBufferIsFreedWithCuMemFreeInItsOwnContext) {
  {
    auto buffer = client::DeviceBuffer::Allocate(fake_.api(), 1000);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    client::DeviceBuffer moved = std::move(*buffer);
    EXPECT_EQ(buffer->size(), 0u);  // NOLINT(bugprone-use-after-move): empty, by contract
    EXPECT_EQ(moved.size(), 1000u);
    EXPECT_EQ(fake_.live_device_allocs(), 1);
    fake_.set_current_context(nullptr);
    fake_.ClearCalls();
  }
  EXPECT_EQ(fake_.live_device_allocs(), 0);
  EXPECT_THAT(fake_.calls(), ::testing::ElementsAre("cuCtxGetCurrent", "cuCtxSetCurrent",
                                                    "cuMemFree", "cuCtxSetCurrent"));
  EXPECT_EQ(fake_.current_context(), nullptr);
  ExpectReleasedBy("cuMemFree");
}

TEST_F(ResourceReleaseTest, FallbackHostBufferMovesOwnership) {
  auto buffer = client::HostBuffer::Allocate(1000);
  ASSERT_TRUE(buffer.ok());
  uint8_t* const data = buffer->data();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % checkpoint::kTensorAlignment, 0u);
  client::HostBuffer moved = std::move(*buffer);
  EXPECT_EQ(buffer->data(), nullptr);  // NOLINT(bugprone-use-after-move): empty, by contract
  EXPECT_EQ(buffer->size(), 0u);       // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.size(), 1000u);
}

// Destructors cannot report: a failed release is logged, and the owner is empty afterwards.
TEST_F(ResourceReleaseTest, AFailedReleaseIsNotRetried) {
  fake_.FailCall("cuMemHostUnregister", 1, CUDA_ERROR_UNKNOWN);
  {
    auto buffer = PinnedHostBuffer::Create(fake_.api(), 4096);
    ASSERT_TRUE(buffer.ok());
  }
  EXPECT_EQ(fake_.CallCount("cuMemHostUnregister"), 1);
  EXPECT_EQ(fake_.live_host_registrations(), 1);  // what the driver refused to unpin
}

}  // namespace
}  // namespace weightcache::cuda
