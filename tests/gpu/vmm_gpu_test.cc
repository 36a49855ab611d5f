// The VMM arena on a real GPU, across real processes: export here, import in a child (fds over
// SCM_RIGHTS), identical bytes; writes shared both ways; the importer keeps its memory after
// the exporter is killed with SIGKILL; arenas on two devices are distinct. Skips (with the
// reason) where there is no driver or no device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/imported_arena.h"
#include "gpu/peer_channel.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using cuda::DriverApi;
using cuda::ExportedArena;
using cuda::ImportedArena;
using ::testing::HasSubstr;

// Not granularity multiples on purpose: the arena rounds them up.
const std::vector<uint64_t> kRequested = {3 * kMiB, 64 * kMiB + 1, 2 * kMiB};

#define ASSERT_CU_OK(call)                                                         \
  do {                                                                             \
    CUresult rc_ = (call);                                                         \
    ASSERT_EQ(rc_, CUDA_SUCCESS) << cuda::DriverError(api_, rc_, #call).message(); \
  } while (0)

class VmmGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<const DriverApi*> api = cuda::LoadDriver();
    if (!api.ok()) GTEST_SKIP() << "no usable CUDA driver: " << api.status().ToString();
    api_ = *api;
    ASSERT_EQ(api_->cuDeviceGetCount(&device_count_), CUDA_SUCCESS);
    if (device_count_ == 0) GTEST_SKIP() << "CUDA driver present but no GPU visible";
    ASSERT_EQ(api_->cuDeviceGet(&device0_, 0), CUDA_SUCCESS);
    // The gpu tier requires these; on the target hardware a missing one is a failure.
    Status support = cuda::CheckVmmSupport(api_, device0_);
    ASSERT_TRUE(support.ok()) << support.ToString();
  }

  // Fill every allocation of `arena` with the pattern for `seed`.
  void Fill(const ExportedArena& arena, uint64_t seed) {
    for (size_t i = 0; i < arena.allocations().size(); ++i) {
      const cuda::ExportedAllocation& a = arena.allocations()[i];
      std::vector<unsigned char> host(a.size);
      FillPattern(seed, i, host.data(), a.size);
      ASSERT_CU_OK(api_->cuMemcpyHtoD(a.ptr, host.data(), a.size));
    }
    ASSERT_CU_OK(api_->cuCtxSynchronize());
  }

  // Check the `index`th allocation at `ptr` holds the pattern for `seed`.
  void ExpectPattern(CUdeviceptr ptr, uint64_t size, uint64_t seed, uint64_t index) {
    std::vector<unsigned char> host(size);
    ASSERT_CU_OK(api_->cuMemcpyDtoH(host.data(), ptr, size));
    EXPECT_EQ(FirstMismatch(seed, index, host.data(), size), -1)
        << "allocation " << index << " does not hold the pattern of seed " << seed;
  }

  // Send `request` (+ fds) to a fresh helper child and return its one-line reply.
  std::string AskHelper(const std::string& request, const std::vector<int>& fds) {
    Result<Child> child = SpawnWithChannel({WEIGHTCACHE_VMM_PEER_HELPER});
    if (!child.ok()) return "spawn failed: " + child.status().ToString();
    std::string reply;
    std::vector<UniqueFd> none;
    Status s = SendMessage(child->channel.get(), request, fds);
    if (s.ok()) s = ReceiveMessage(child->channel.get(), &reply, &none);
    int code = WaitChild(child->pid);
    if (!s.ok()) return "channel: " + s.ToString() + " (exit " + std::to_string(code) + ")";
    return reply;
  }

  const DriverApi* api_ = nullptr;
  int device_count_ = 0;
  CUdevice device0_ = 0;
};

std::string ImportRequest(int ordinal, uint64_t seed, uint64_t write_seed,
                          const ExportedArena& arena) {
  std::string r = "import " + std::to_string(ordinal) + " " + std::to_string(seed) + " " +
                  std::to_string(write_seed);
  for (const cuda::ExportedAllocation& a : arena.allocations()) r += " " + std::to_string(a.size);
  return r;
}

std::vector<int> FdsOf(const ExportedArena& arena) {
  std::vector<int> fds;
  for (const cuda::ExportedAllocation& a : arena.allocations()) fds.push_back(a.fd);
  return fds;
}

TEST_F(VmmGpuTest, ArenaIsGranularityAlignedContiguousAndReadWrite) {
  Result<ExportedArena> arena = ExportedArena::Create(api_, device0_, kRequested);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  const uint64_t g = arena->granularity();
  EXPECT_EQ(arena->base() % g, 0u);
  CUdeviceptr next = arena->base();
  for (size_t i = 0; i < kRequested.size(); ++i) {
    const cuda::ExportedAllocation& a = arena->allocations()[i];
    EXPECT_EQ(a.size, AlignUp(kRequested[i], g));
    EXPECT_EQ(a.ptr, next);
    next += a.size;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, device0_};
    unsigned long long flags = 0;
    ASSERT_CU_OK(api_->cuMemGetAccess(&flags, &loc, a.ptr));
    EXPECT_EQ(flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    int ordinal = -1;
    ASSERT_CU_OK(api_->cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a.ptr));
    EXPECT_EQ(ordinal, 0);
    struct stat st = {};
    ASSERT_EQ(::fstat(a.fd, &st), 0);
    // Recorded so the gpu log shows what a real VMM fd looks like to fstat.
    RecordProperty("vmm_fd_st_mode_" + std::to_string(i), std::to_string(st.st_mode));
  }
  EXPECT_EQ(arena->total_bytes(), next - arena->base());
  Fill(*arena, 7);
  for (size_t i = 0; i < kRequested.size(); ++i) {
    ExpectPattern(arena->allocations()[i].ptr, arena->allocations()[i].size, 7, i);
  }
}

TEST_F(VmmGpuTest, ChildProcessImportsReadsIdenticalBytesAndItsWritesAreShared) {
  Result<ExportedArena> arena = ExportedArena::Create(api_, device0_, kRequested);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  Fill(*arena, 1234);

  std::string reply = AskHelper(ImportRequest(0, 1234, 5678, *arena), FdsOf(*arena));

  EXPECT_EQ(reply, "ok " + std::to_string(arena->total_bytes()));
  // The child filled the last allocation with another pattern before exiting: the exporter
  // sees it, and the child's exit did not take the memory with it.
  const size_t last = arena->allocations().size() - 1;
  ExpectPattern(arena->allocations()[last].ptr, arena->allocations()[last].size, 5678, last);
  ExpectPattern(arena->allocations()[0].ptr, arena->allocations()[0].size, 1234, 0);
}

TEST_F(VmmGpuTest, ImportedArenaStaysValidAfterTheExporterIsKilled) {
  Result<Child> exporter = SpawnWithChannel({WEIGHTCACHE_VMM_PEER_HELPER});
  ASSERT_TRUE(exporter.ok()) << exporter.status().ToString();
  std::string request = "export 0 99";
  for (uint64_t s : kRequested) request += " " + std::to_string(s);
  ASSERT_TRUE(SendMessage(exporter->channel.get(), request).ok());
  std::string reply;
  std::vector<UniqueFd> fds;
  Status received = ReceiveMessage(exporter->channel.get(), &reply, &fds);
  if (!received.ok()) ::kill(exporter->pid, SIGKILL);
  ASSERT_TRUE(received.ok()) << received.ToString() << " exit " << WaitChild(exporter->pid);
  std::istringstream in(reply);
  std::string verb;
  in >> verb;
  ASSERT_EQ(verb, "exported") << reply;
  std::vector<uint64_t> sizes;
  for (uint64_t s; in >> s;) sizes.push_back(s);
  ASSERT_EQ(sizes.size(), fds.size());

  Result<ImportedArena> arena = ImportedArena::Import(api_, device0_, std::move(fds), sizes);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();

  ASSERT_EQ(::kill(exporter->pid, SIGKILL), 0);
  EXPECT_EQ(WaitChild(exporter->pid), 128 + SIGKILL);

  for (size_t i = 0; i < sizes.size(); ++i) {
    ExpectPattern(arena->allocations()[i].ptr, sizes[i], 99, i);
  }
  // Still writable: the memory is ours now, not a dangling view.
  const cuda::ImportedAllocation& first = arena->allocations()[0];
  std::vector<unsigned char> host(first.size);
  FillPattern(4242, 0, host.data(), first.size);
  ASSERT_CU_OK(api_->cuMemcpyHtoD(first.ptr, host.data(), first.size));
  ExpectPattern(first.ptr, first.size, 4242, 0);
}

TEST_F(VmmGpuTest, PlannedArenaOfManyTensorsHasFewAllocations) {
  std::vector<uint64_t> tensors(1000, 1 * kMiB + 100);
  checkpoint::ArenaPlan plan = checkpoint::PlanArena(tensors, 2 * kMiB, 256 * kMiB);
  Result<ExportedArena> arena = ExportedArena::Create(api_, device0_, plan.allocation_bytes);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(arena->allocations().size(), plan.allocation_bytes.size());
  EXPECT_LE(arena->allocations().size(), 5u);
  for (size_t i = 0; i < plan.allocation_bytes.size(); ++i) {
    EXPECT_EQ(arena->allocations()[i].size % arena->granularity(), 0u);
    EXPECT_GE(arena->allocations()[i].size, plan.allocation_bytes[i]);
  }
}

TEST_F(VmmGpuTest, ImportRejectsAnFdThatIsNotAVmmExportInTheDriver) {
  std::vector<UniqueFd> fds;
  fds.emplace_back(::memfd_create("not-vmm", MFD_CLOEXEC));
  ASSERT_TRUE(fds[0].valid());
  Result<uint64_t> g =
      cuda::AllocationGranularity(api_, device0_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  ASSERT_TRUE(g.ok());
  Result<ImportedArena> arena =
      ImportedArena::Import(api_, device0_, std::move(fds), std::vector<uint64_t>{*g});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kCuda);
  EXPECT_THAT(arena.status().message(), HasSubstr("cuMemImportFromShareableHandle"));
}

TEST_F(VmmGpuTest, ArenasOnTwoDevicesAreDistinct) {
  if (device_count_ < 2) GTEST_SKIP() << "needs 2 GPUs, " << device_count_ << " visible";
  CUdevice device1 = 0;
  ASSERT_CU_OK(api_->cuDeviceGet(&device1, 1));
  Result<ExportedArena> a0 = ExportedArena::Create(api_, device0_, kRequested);
  ASSERT_TRUE(a0.ok()) << a0.status().ToString();
  Result<ExportedArena> a1 = ExportedArena::Create(api_, device1, kRequested);
  ASSERT_TRUE(a1.ok()) << a1.status().ToString();

  EXPECT_TRUE(a0->base() + a0->total_bytes() <= a1->base() ||
              a1->base() + a1->total_bytes() <= a0->base())
      << "VA ranges overlap";
  int ordinal0 = -1, ordinal1 = -1;
  ASSERT_CU_OK(
      api_->cuPointerGetAttribute(&ordinal0, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a0->base()));
  ASSERT_CU_OK(
      api_->cuPointerGetAttribute(&ordinal1, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a1->base()));
  EXPECT_EQ(ordinal0, 0);
  EXPECT_EQ(ordinal1, 1);

  // VMM memory is accessible only where cuMemSetAccess granted it (its own device), so each
  // arena is written and read under its own device's context, not through unified addressing.
  {
    Result<cuda::PrimaryContext> ctx0 = cuda::PrimaryContext::Retain(api_, device0_);
    ASSERT_TRUE(ctx0.ok()) << ctx0.status().ToString();
    Fill(*a0, 1000);
    for (size_t i = 0; i < kRequested.size(); ++i) {
      ExpectPattern(a0->allocations()[i].ptr, a0->allocations()[i].size, 1000, i);
    }
  }
  {
    Result<cuda::PrimaryContext> ctx1 = cuda::PrimaryContext::Retain(api_, device1);
    ASSERT_TRUE(ctx1.ok()) << ctx1.status().ToString();
    Fill(*a1, 1001);
    for (size_t i = 0; i < kRequested.size(); ++i) {
      ExpectPattern(a1->allocations()[i].ptr, a1->allocations()[i].size, 1001, i);
    }
  }
  // A child attaching to device 1 gets device 1's bytes, not device 0's.
  EXPECT_EQ(AskHelper(ImportRequest(1, 1001, 1002, *a1), FdsOf(*a1)),
            "ok " + std::to_string(a1->total_bytes()));
}

}  // namespace
}  // namespace weightcache::testing
