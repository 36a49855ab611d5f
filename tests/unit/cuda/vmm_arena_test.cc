// ExportedArena / ImportedArena against the fault-injecting FakeDriver: the success path, input
// validation, and for every driver call of each lifecycle, failure at that call followed by the
// exact rollback (no handle, reservation, mapping, context reference or fd left behind).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "cuda/exported_arena.h"
#include "cuda/imported_arena.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::cuda {
namespace {

using testing::CountOpenFds;
using testing::FakeDriver;
using ::testing::HasSubstr;

using weightcache::testing::kMiB;
constexpr uint64_t kGranularity = 2 * kMiB;
// Device 1, never an implicit device 0. Requested sizes round to 2, 4 and 2 MiB.
constexpr CUdevice kDevice = 1;
const std::vector<uint64_t> kRequested = {1, 3 * kMiB, 2 * kMiB};
const std::vector<uint64_t> kRounded = {2 * kMiB, 4 * kMiB, 2 * kMiB};

// Nothing of the fake's state is live and no fd was leaked.
void ExpectNothingLive(const FakeDriver& fake, int fds_before) {
  EXPECT_EQ(fake.live_handles(), 0);
  EXPECT_EQ(fake.live_reservations(), 0);
  EXPECT_EQ(fake.live_mappings(), 0);
  EXPECT_EQ(fake.total_context_refs(), 0);
  EXPECT_EQ(CountOpenFds(), fds_before);
  EXPECT_EQ(fake.violations(), 0) << ::testing::PrintToString(fake.violation_log());
}

bool IsCloexec(int fd) {
  int flags = ::fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC) != 0;
}

// Fds of allocations another process exported, one per kRounded size.
std::vector<UniqueFd> ForeignArena(FakeDriver& fake);

// The fds an importer would receive over SCM_RIGHTS: duplicates of the exporter's.
std::vector<UniqueFd> Received(const ExportedArena& arena) {
  std::vector<UniqueFd> fds;
  for (const ExportedAllocation& a : arena.allocations()) {
    fds.emplace_back(::fcntl(a.fd, F_DUPFD_CLOEXEC, 0));
  }
  return fds;
}

// ---- ExportedArena: success path ---------------------------------------------------------------

TEST(ExportedArenaTest, RoundsSizesMapsContiguouslyGrantsAccessAndExportsCloexecFds) {
  FakeDriver fake(kGranularity);
  Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();

  EXPECT_EQ(arena->device(), kDevice);
  EXPECT_EQ(arena->granularity(), kGranularity);
  EXPECT_EQ(arena->total_bytes(), 8 * kMiB);
  EXPECT_EQ(arena->base() % kGranularity, 0u);
  ASSERT_EQ(arena->allocations().size(), 3u);
  CUdeviceptr expected_ptr = arena->base();
  std::vector<int> fds;
  for (size_t i = 0; i < 3; ++i) {
    const ExportedAllocation& a = arena->allocations()[i];
    SCOPED_TRACE("allocation " + std::to_string(i));
    EXPECT_EQ(a.size, kRounded[i]);
    EXPECT_EQ(a.ptr, expected_ptr);
    expected_ptr += a.size;
    EXPECT_EQ(fake.AccessAt(a.ptr, kDevice), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    EXPECT_EQ(fake.AccessAt(a.ptr, 0), CU_MEM_ACCESS_FLAGS_PROT_NONE);
    EXPECT_TRUE(IsCloexec(a.fd)) << "the fake exports without CLOEXEC; the arena must set it";
    fds.push_back(a.fd);
  }
  EXPECT_NE(fds[0], fds[1]);
  EXPECT_NE(fds[1], fds[2]);

  const CUmemAllocationProp& prop = fake.last_create_prop();
  EXPECT_EQ(prop.type, CU_MEM_ALLOCATION_TYPE_PINNED);
  EXPECT_EQ(prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
  EXPECT_EQ(prop.location.id, kDevice);
  EXPECT_EQ(prop.requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);

  EXPECT_EQ(fake.live_handles(), 3);
  EXPECT_EQ(fake.live_reservations(), 1);
  EXPECT_EQ(fake.live_mappings(), 3);
  EXPECT_EQ(fake.context_refs(kDevice), 1);
  EXPECT_NE(fake.current_context(), nullptr);
  EXPECT_EQ(fake.violations(), 0) << ::testing::PrintToString(fake.violation_log());
}

TEST(ExportedArenaTest, DestructorReleasesEverythingAndClosesTheFds) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    EXPECT_EQ(CountOpenFds(), fds_before + 3);
  }
  ExpectNothingLive(fake, fds_before);
}

// What the daemon keeps after its load: the fds, and nothing else of the driver's — no
// mapping, reservation, handle or context reference. The memory stays importable through them.
TEST(ExportedArenaTest, ReleaseToFdsKeepsOnlyTheFdsAndTheyStillImport) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    std::vector<uint64_t> sizes;
    for (const ExportedAllocation& a : arena->allocations()) sizes.push_back(a.size);

    std::vector<UniqueFd> fds = std::move(arena).value().ReleaseToFds();
    ASSERT_EQ(fds.size(), 3u);
    EXPECT_EQ(fake.live_handles(), 0);
    EXPECT_EQ(fake.live_mappings(), 0);
    EXPECT_EQ(fake.live_reservations(), 0);
    EXPECT_EQ(fake.total_context_refs(), 0);
    EXPECT_EQ(CountOpenFds(), fds_before + 3);
    for (const UniqueFd& fd : fds) EXPECT_TRUE(IsCloexec(fd.get()));

    // A client receives duplicates (SCM_RIGHTS) and maps the same memory.
    std::vector<UniqueFd> received;
    for (const UniqueFd& fd : fds) received.emplace_back(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    Result<ImportedArena> client =
        ImportedArena::Import(fake.api(), kDevice, std::move(received), sizes);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    EXPECT_EQ(fake.live_mappings(), 3);
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(ExportedArenaTest, MoveAssignmentReleasesTheOldArenaAndKeepsTheNewOne) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> a = ExportedArena::Create(fake.api(), kDevice, kRequested);
    Result<ExportedArena> b = ExportedArena::Create(fake.api(), 0, std::vector<uint64_t>{kMiB});
    ASSERT_TRUE(a.ok() && b.ok());
    const CUdeviceptr b_base = b->base();
    *a = *std::move(b);
    EXPECT_EQ(a->base(), b_base);
    EXPECT_EQ(a->device(), 0);
    EXPECT_EQ(fake.live_handles(), 1);
    EXPECT_EQ(fake.live_mappings(), 1);
    EXPECT_EQ(fake.live_reservations(), 1);
    EXPECT_EQ(fake.context_refs(kDevice), 0);
    EXPECT_EQ(CountOpenFds(), fds_before + 1);
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(ExportedArenaTest, ReleaseFailureInTheDestructorStillReleasesTheRest) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(arena.ok());
    fake.FailCall("cuMemRelease", 1, CUDA_ERROR_INVALID_VALUE);
  }
  EXPECT_EQ(fake.live_handles(), 1);  // the one the driver refused to release
  EXPECT_EQ(fake.live_mappings(), 0);
  EXPECT_EQ(fake.live_reservations(), 0);
  EXPECT_EQ(fake.total_context_refs(), 0);
  EXPECT_EQ(CountOpenFds(), fds_before);
}

// ---- ExportedArena: input validation and capability checks -------------------------------------

TEST(ExportedArenaTest, RejectsAnEmptyRequestBeforeAnyDriverCall) {
  FakeDriver fake(kGranularity);
  Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, {});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(arena.status().message(), HasSubstr("no allocations requested"));
  EXPECT_TRUE(fake.calls().empty());
}

TEST(ExportedArenaTest, RejectsAZeroSizeNamingTheAllocation) {
  FakeDriver fake(kGranularity);
  Result<ExportedArena> arena =
      ExportedArena::Create(fake.api(), kDevice, std::vector<uint64_t>{kMiB, 0});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(arena.status().message(), HasSubstr("allocation 1 of 2 is empty"));
  EXPECT_TRUE(fake.calls().empty());
}

TEST(ExportedArenaTest, RejectsATotalThatOverflows) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  Result<ExportedArena> arena = ExportedArena::Create(
      fake.api(), kDevice, std::vector<uint64_t>{uint64_t{1} << 62, uint64_t{1} << 62});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(arena.status().message(), HasSubstr("total size overflows at allocation 1 of 2"));
  ExpectNothingLive(fake, fds_before);
}

TEST(ExportedArenaTest, DeviceWithoutPosixFdExportIsUnavailable) {
  FakeDriver fake(kGranularity);
  fake.SetAttribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0);
  const int fds_before = CountOpenFds();
  Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(arena.status().message(),
              HasSubstr("device 1 does not support POSIX file descriptor export"));
  ExpectNothingLive(fake, fds_before);
}

// ---- failure at every driver call, exact rollback ----------------------------------------------

struct Step {
  const char* function;
  int nth;              // 1-based call of `function`
  const char* context;  // what the error message must also name
};

void PrintTo(const Step& step, std::ostream* os) { *os << step.function << " call " << step.nth; }

std::string StepName(const ::testing::TestParamInfo<Step>& info) {
  return std::string(info.param.function) + "_" + std::to_string(info.param.nth);
}

// Every driver call ExportedArena::Create makes for kRequested, in order.
const std::vector<Step> kCreateSteps = {
    {"cuDevicePrimaryCtxRetain", 1, "creating VMM arena on device 1"},
    {"cuCtxSetCurrent", 1, "creating VMM arena on device 1"},
    {"cuDeviceGetAttribute", 1, "creating VMM arena on device 1"},
    {"cuDeviceGetAttribute", 2, "creating VMM arena on device 1"},
    {"cuMemGetAllocationGranularity", 1, "creating VMM arena on device 1"},
    {"cuMemCreate", 1, "allocation 0 of 3"},
    {"cuMemCreate", 2, "allocation 1 of 3"},
    {"cuMemCreate", 3, "allocation 2 of 3"},
    {"cuMemAddressReserve", 1, "creating VMM arena on device 1"},
    {"cuMemMap", 1, "allocation 0 of 3"},
    {"cuMemMap", 2, "allocation 1 of 3"},
    {"cuMemMap", 3, "allocation 2 of 3"},
    {"cuMemSetAccess", 1, "allocation 0 of 3"},
    {"cuMemSetAccess", 2, "allocation 1 of 3"},
    {"cuMemSetAccess", 3, "allocation 2 of 3"},
    {"cuMemExportToShareableHandle", 1, "allocation 0 of 3"},
    {"cuMemExportToShareableHandle", 2, "allocation 1 of 3"},
    {"cuMemExportToShareableHandle", 3, "allocation 2 of 3"},
};

std::vector<std::string> Names(const std::vector<Step>& steps) {
  std::vector<std::string> names;
  for (const Step& s : steps) names.emplace_back(s.function);
  return names;
}

TEST(ExportedArenaRollbackTest, StepListIsEveryDriverCallOfASuccessfulCreate) {
  // Keeps the parameterized list below honest: a new driver call in Create must be added there.
  FakeDriver fake(kGranularity);
  Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ(fake.calls(), Names(kCreateSteps));
}

class ExportedArenaRollbackTest : public ::testing::TestWithParam<Step> {};

TEST_P(ExportedArenaRollbackTest, FailureAtThisCallReturnsItAndReleasesEverything) {
  const Step& step = GetParam();
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  fake.FailCall(step.function, step.nth, CUDA_ERROR_OUT_OF_MEMORY);

  Result<ExportedArena> arena = ExportedArena::Create(fake.api(), kDevice, kRequested);

  ASSERT_FALSE(arena.ok());
  const Status& s = arena.status();
  EXPECT_EQ(s.code(), StatusCode::kCuda);
  EXPECT_EQ(s.driver_error(), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_THAT(s.message(), HasSubstr(std::string(step.function) + "("));
  EXPECT_THAT(s.message(), HasSubstr(step.context));
  EXPECT_THAT(s.message(), HasSubstr("CUDA_ERROR_OUT_OF_MEMORY"));
  ExpectNothingLive(fake, fds_before);
}

INSTANTIATE_TEST_SUITE_P(EveryCall, ExportedArenaRollbackTest, ::testing::ValuesIn(kCreateSteps),
                         StepName);

// ---- ImportedArena: success path ---------------------------------------------------------------

TEST(ImportedArenaTest, MapsContiguouslyReadWriteReleasesHandlesAndClosesFds) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    std::vector<UniqueFd> fds;
    for (uint64_t size : kRounded) fds.push_back(fake.ForeignExport(size, kDevice));
    Result<ImportedArena> arena =
        ImportedArena::Import(fake.api(), kDevice, std::move(fds), kRounded);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();

    EXPECT_EQ(arena->device(), kDevice);
    EXPECT_EQ(arena->total_bytes(), 8 * kMiB);
    ASSERT_EQ(arena->allocations().size(), 3u);
    CUdeviceptr expected_ptr = arena->base();
    for (size_t i = 0; i < 3; ++i) {
      const ImportedAllocation& a = arena->allocations()[i];
      EXPECT_EQ(a.size, kRounded[i]);
      EXPECT_EQ(a.ptr, expected_ptr);
      expected_ptr += a.size;
      EXPECT_EQ(fake.AccessAt(a.ptr, kDevice), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    // Imported handles are released once mapped; the mappings keep the memory alive.
    EXPECT_EQ(fake.live_handles(), 0);
    EXPECT_EQ(fake.live_mappings(), 3);
    EXPECT_EQ(fake.live_reservations(), 1);
    EXPECT_EQ(fake.context_refs(kDevice), 1);
    // The received fds are closed as soon as Import returns.
    EXPECT_EQ(CountOpenFds(), fds_before);
  }
  ExpectNothingLive(fake, fds_before);
}

// The attach path splits Import: Reserve fixes every address before anything is mapped (the
// client builds its tensor table from them while Map runs), then Map maps exactly there.
TEST(ImportedArenaTest, ReserveFixesTheAddressesThatMapThenUses) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ImportedArena> arena = ImportedArena::Reserve(fake.api(), kDevice, kRounded);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    EXPECT_FALSE(arena->mapped());
    EXPECT_EQ(fake.live_mappings(), 0);
    EXPECT_EQ(fake.live_reservations(), 1);
    std::vector<CUdeviceptr> reserved;
    CUdeviceptr expected_ptr = arena->base();
    for (const ImportedAllocation& a : arena->allocations()) {
      EXPECT_EQ(a.ptr, expected_ptr);
      expected_ptr += a.size;
      reserved.push_back(a.ptr);
    }
    ASSERT_EQ(reserved.size(), 3u);

    ASSERT_TRUE(arena->Map(ForeignArena(fake)).ok());
    EXPECT_TRUE(arena->mapped());
    EXPECT_EQ(fake.live_mappings(), 3);
    EXPECT_EQ(CountOpenFds(), fds_before);  // Map closed the fds
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(arena->allocations()[i].ptr, reserved[i]);
      EXPECT_EQ(fake.AccessAt(reserved[i], kDevice), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    // Once only.
    Status again = arena->Map(ForeignArena(fake));
    EXPECT_EQ(again.code(), StatusCode::kInternal);
    EXPECT_THAT(again.message(), HasSubstr("already mapped"));
    EXPECT_EQ(fake.live_mappings(), 3);
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(ImportedArenaTest, AFailedMapLeavesNothingMappedAndTheArenaStillUnwinds) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ImportedArena> arena = ImportedArena::Reserve(fake.api(), kDevice, kRounded);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    std::vector<UniqueFd> two = ForeignArena(fake);
    two.pop_back();
    Status count = arena->Map(std::move(two));
    EXPECT_EQ(count.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(count.message(), HasSubstr("received 2 fds for 3 allocation sizes"));
    EXPECT_EQ(CountOpenFds(), fds_before);  // closed on the error path too

    fake.FailCall("cuMemMap", 3, CUDA_ERROR_NOT_PERMITTED);  // the last allocation
    Status failed = arena->Map(ForeignArena(fake));
    EXPECT_EQ(failed.code(), StatusCode::kCuda);
    EXPECT_THAT(failed.message(), HasSubstr("allocation 2 of 3"));
    EXPECT_FALSE(arena->mapped());
    EXPECT_EQ(fake.live_mappings(), 0);
    EXPECT_EQ(fake.live_handles(), 0);
    EXPECT_EQ(fake.live_reservations(), 1);  // the arena's, until it goes
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(ImportedArenaTest, ImportsAnExportedArenaIntoItsOwnRangeAndLeavesTheExporterIntact) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> exporter = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(exporter.ok());
    std::vector<uint64_t> sizes;
    for (const ExportedAllocation& a : exporter->allocations()) sizes.push_back(a.size);
    {
      Result<ImportedArena> importer =
          ImportedArena::Import(fake.api(), kDevice, Received(*exporter), sizes);
      ASSERT_TRUE(importer.ok()) << importer.status().ToString();
      EXPECT_NE(importer->base(), exporter->base());
      EXPECT_EQ(importer->total_bytes(), exporter->total_bytes());
      EXPECT_EQ(fake.live_mappings(), 6);
      EXPECT_EQ(fake.live_reservations(), 2);
      EXPECT_EQ(fake.live_handles(), 3);  // the exporter's
      EXPECT_EQ(fake.context_refs(kDevice), 2);
    }
    EXPECT_EQ(fake.live_mappings(), 3);
    EXPECT_EQ(fake.live_reservations(), 1);
    EXPECT_EQ(fake.live_handles(), 3);
    EXPECT_EQ(fake.context_refs(kDevice), 1);
    EXPECT_EQ(CountOpenFds(), fds_before + 3);
    for (const ExportedAllocation& a : exporter->allocations()) {
      EXPECT_EQ(fake.AccessAt(a.ptr, kDevice), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
  }
  ExpectNothingLive(fake, fds_before);
}

// ---- The creating handles: a second mapping that stays exportable ------------------------------

// A fill source's memory (docs/fleet.md "Two daemons on one GPU"): UCX's cuda_ipc hands a peer
// on the same host only memory whose mapping CUDA would export again. A mapping of the creating
// handles is; an import of the fds, what the daemon held before, is not.
TEST(CreatingHandlesTest, OutliveTheArenaAndMapExportablyWhereAnImportOfTheFdsDoesNot) {
  FakeDriver fake(kGranularity);
  fake.BackVmmMemory();
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> created = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    const uint8_t marker = 0x5a;
    ASSERT_EQ(fake.api()->cuMemcpyHtoD(created->allocations()[1].ptr + 7, &marker, 1),
              CUDA_SUCCESS);
    std::vector<UniqueFd> fds = created->TakeFds();
    std::vector<VmmHandle> handles = created->TakeHandles();
    ASSERT_EQ(handles.size(), 3u);
    created = InvalidArgument("gone");  // the arena: mappings, VA and context released
    EXPECT_EQ(fake.live_mappings(), 0);
    EXPECT_EQ(fake.total_context_refs(), 0);
    EXPECT_EQ(fake.live_handles(), 3);  // the taken ones, kept without a context

    std::vector<CUmemGenericAllocationHandle> raw;
    for (const VmmHandle& h : handles) raw.push_back(h.get());
    const int imports = fake.CallCount("cuMemImportFromShareableHandle");
    Result<ImportedArena> source = ImportedArena::MapCreated(fake.api(), kDevice, raw, kRounded);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    EXPECT_EQ(fake.CallCount("cuMemImportFromShareableHandle"), imports);
    std::vector<UniqueFd> dups;
    for (const UniqueFd& fd : fds) dups.emplace_back(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    Result<ImportedArena> imported =
        ImportedArena::Import(fake.api(), kDevice, std::move(dups), kRounded);
    ASSERT_TRUE(imported.ok()) << imported.status().ToString();
    for (size_t a = 0; a < 3; ++a) {
      EXPECT_TRUE(fake.MappingExportable(source->allocations()[a].ptr)) << a;
      EXPECT_FALSE(fake.MappingExportable(imported->allocations()[a].ptr)) << a;
      EXPECT_EQ(fake.AccessAt(source->allocations()[a].ptr, kDevice),
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    // The same memory as the fds name.
    uint8_t read = 0;
    ASSERT_EQ(fake.api()->cuMemcpyDtoH(&read, source->allocations()[1].ptr + 7, 1), CUDA_SUCCESS);
    EXPECT_EQ(read, marker);
    EXPECT_EQ(fake.ExportedBytes(fds[1].get(), 7, 1), std::string(1, static_cast<char>(marker)));

    handles.clear();  // the mapping keeps the memory: nothing of it depends on the handles
    EXPECT_EQ(fake.live_handles(), 0);
    EXPECT_EQ(fake.live_mappings(), 6);
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(CreatingHandlesTest, AFailedMapCreatedLeavesNothingMappedAndTheHandlesAsTheyWere) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  {
    Result<ExportedArena> created = ExportedArena::Create(fake.api(), kDevice, kRequested);
    ASSERT_TRUE(created.ok());
    std::vector<VmmHandle> handles = created->TakeHandles();
    created = InvalidArgument("gone");
    std::vector<CUmemGenericAllocationHandle> raw;
    for (const VmmHandle& h : handles) raw.push_back(h.get());

    Result<ImportedArena> short_list =
        ImportedArena::MapCreated(fake.api(), kDevice, std::span(raw).first(2), kRounded);
    ASSERT_FALSE(short_list.ok());
    EXPECT_EQ(short_list.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(short_list.status().message(), HasSubstr("2 handles for 3 allocation sizes"));

    fake.FailCall("cuMemMap", fake.CallCount("cuMemMap") + 3,  // the last allocation
                  CUDA_ERROR_OUT_OF_MEMORY);
    Result<ImportedArena> failed = ImportedArena::MapCreated(fake.api(), kDevice, raw, kRounded);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), StatusCode::kCuda);
    EXPECT_THAT(failed.status().message(), HasSubstr("allocation 2 of 3"));
    EXPECT_EQ(fake.live_mappings(), 0);
    EXPECT_EQ(fake.live_reservations(), 0);
    EXPECT_EQ(fake.total_context_refs(), 0);
    EXPECT_EQ(fake.live_handles(), 3);
  }
  ExpectNothingLive(fake, fds_before);
}

// ---- ImportedArena: untrusted input -------------------------------------------------------------

// Import with `fds` and `sizes`, expect kInvalidArgument with `message`, no driver state left
// and every fd closed.
void ExpectRejected(FakeDriver& fake, int fds_before, std::vector<UniqueFd> fds,
                    const std::vector<uint64_t>& sizes, const std::string& message,
                    bool expect_no_driver_call) {
  Result<ImportedArena> arena = ImportedArena::Import(fake.api(), kDevice, std::move(fds), sizes);
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument) << arena.status().ToString();
  EXPECT_THAT(arena.status().message(), HasSubstr(message));
  if (expect_no_driver_call) {
    EXPECT_TRUE(fake.calls().empty()) << ::testing::PrintToString(fake.calls());
  }
  ExpectNothingLive(fake, fds_before);
}

TEST(ImportedArenaTest, RejectsFdCountDifferentFromSizeCount) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  ExpectRejected(fake, fds_before, std::move(fds), kRounded,
                 "received 1 fds for 3 allocation sizes", true);
}

TEST(ImportedArenaTest, RejectsTooManyAllocations) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds(kMaxImportedAllocations + 1);
  std::vector<uint64_t> sizes(kMaxImportedAllocations + 1, kGranularity);
  ExpectRejected(fake, fds_before, std::move(fds), sizes, "allocations exceed the limit of 4096",
                 true);
}

TEST(ImportedArenaTest, RejectsAMissingFdNamingTheAllocationAndClosesTheOthers) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  fds.emplace_back();
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  ExpectRejected(fake, fds_before, std::move(fds), kRounded,
                 "allocation 1 of 3: received fd is missing", true);
}

TEST(ImportedArenaTest, RejectsAClosedFdNumber) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  int stale = ::dup(0);
  ASSERT_GE(stale, 0);
  ::close(stale);
  std::vector<UniqueFd> fds;
  fds.emplace_back(stale);
  ExpectRejected(
      fake, fds_before, std::move(fds), {kGranularity},
      "allocation 0 of 1: received fd " + std::to_string(stale) + " is not an open file descriptor",
      true);
}

TEST(ImportedArenaTest, RejectsAPipeInsteadOfAVmmFd) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  fds.emplace_back(p[0]);
  UniqueFd write_end(p[1]);
  write_end.Reset();
  ExpectRejected(fake, fds_before, std::move(fds), {kGranularity, kGranularity},
                 "allocation 1 of 2: received fd", true);
}

TEST(ImportedArenaTest, RejectsASizeThatIsNotAGranularityMultiple) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  ExpectRejected(fake, fds_before, std::move(fds), {2 * kMiB, kMiB + 1},
                 "allocation 1 of 2 has size 1048577, not a non-zero multiple of the VMM "
                 "granularity 2097152",
                 false);
}

TEST(ImportedArenaTest, AnFdThatIsNotAVmmExportFailsInTheDriverAndRollsBack) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  fds.emplace_back(::memfd_create("not-a-vmm-export", MFD_CLOEXEC));
  Result<ImportedArena> arena = ImportedArena::Import(fake.api(), kDevice, std::move(fds),
                                                      std::vector<uint64_t>{2 * kMiB, 2 * kMiB});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kCuda);
  EXPECT_EQ(arena.status().driver_error(), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(arena.status().message(),
              HasSubstr("allocation 1 of 2: cuMemImportFromShareableHandle(fd "));
  ExpectNothingLive(fake, fds_before);
}

TEST(ImportedArenaTest, ASizeLargerThanTheAllocationFailsInCuMemMapAndRollsBack) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  std::vector<UniqueFd> fds;
  fds.push_back(fake.ForeignExport(2 * kMiB, kDevice));
  Result<ImportedArena> arena =
      ImportedArena::Import(fake.api(), kDevice, std::move(fds), std::vector<uint64_t>{4 * kMiB});
  ASSERT_FALSE(arena.ok());
  EXPECT_EQ(arena.status().code(), StatusCode::kCuda);
  EXPECT_THAT(arena.status().message(), HasSubstr("allocation 0 of 1: cuMemMap("));
  ExpectNothingLive(fake, fds_before);
}

// ---- ImportedArena: failure at every driver call, exact rollback -------------------------------

const std::vector<Step> kImportSteps = {
    {"cuCtxGetCurrent", 1, ""},  // remembering the caller's context: not a failure of Import
    {"cuDevicePrimaryCtxRetain", 1, "importing VMM arena on device 1"},
    {"cuCtxSetCurrent", 1, "importing VMM arena on device 1"},
    {"cuMemGetAllocationGranularity", 1, "importing VMM arena on device 1"},
    {"cuMemAddressReserve", 1, "importing VMM arena on device 1"},
    {"cuCtxGetCurrent", 2, ""},  // Map: the primary context is current already
    {"cuMemImportFromShareableHandle", 1, "allocation 0 of 3"},
    {"cuMemMap", 1, "allocation 0 of 3"},
    {"cuMemSetAccess", 1, "allocation 0 of 3"},
    {"cuMemRelease", 1, ""},  // releasing the imported handle: not a failure of Import
    {"cuMemImportFromShareableHandle", 2, "allocation 1 of 3"},
    {"cuMemMap", 2, "allocation 1 of 3"},
    {"cuMemSetAccess", 2, "allocation 1 of 3"},
    {"cuMemRelease", 2, ""},
    {"cuMemImportFromShareableHandle", 3, "allocation 2 of 3"},
    {"cuMemMap", 3, "allocation 2 of 3"},
    {"cuMemSetAccess", 3, "allocation 2 of 3"},
    {"cuMemRelease", 3, ""},
};

std::vector<UniqueFd> ForeignArena(FakeDriver& fake) {
  std::vector<UniqueFd> fds;
  for (uint64_t size : kRounded) fds.push_back(fake.ForeignExport(size, kDevice));
  return fds;
}

TEST(ImportedArenaRollbackTest, StepListIsEveryDriverCallOfASuccessfulImport) {
  FakeDriver fake(kGranularity);
  Result<ImportedArena> arena =
      ImportedArena::Import(fake.api(), kDevice, ForeignArena(fake), kRounded);
  ASSERT_TRUE(arena.ok());
  EXPECT_EQ(fake.calls(), Names(kImportSteps));
}

class ImportedArenaRollbackTest : public ::testing::TestWithParam<Step> {};

TEST_P(ImportedArenaRollbackTest, FailureAtThisCallReturnsItAndReleasesEverything) {
  const Step& step = GetParam();
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  fake.FailCall(step.function, step.nth, CUDA_ERROR_NOT_PERMITTED);

  Result<ImportedArena> arena =
      ImportedArena::Import(fake.api(), kDevice, ForeignArena(fake), kRounded);

  ASSERT_FALSE(arena.ok());
  const Status& s = arena.status();
  EXPECT_EQ(s.code(), StatusCode::kCuda);
  EXPECT_EQ(s.driver_error(), CUDA_ERROR_NOT_PERMITTED);
  EXPECT_THAT(s.message(), HasSubstr(std::string(step.function) + "("));
  EXPECT_THAT(s.message(), HasSubstr(step.context));
  ExpectNothingLive(fake, fds_before);
}

// Releasing an imported handle is cleanup, logged and ignored: Import still succeeds, and the
// one handle the driver refused to release is the only thing left once the arena is gone.
TEST(ImportedArenaRollbackTest, FailedReleaseOfAnImportedHandleIsNotAnImportFailure) {
  FakeDriver fake(kGranularity);
  const int fds_before = CountOpenFds();
  fake.FailCall("cuMemRelease", 2, CUDA_ERROR_NOT_PERMITTED);
  {
    Result<ImportedArena> arena =
        ImportedArena::Import(fake.api(), kDevice, ForeignArena(fake), kRounded);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  }
  EXPECT_EQ(fake.live_handles(), 1);
  EXPECT_EQ(fake.live_mappings(), 0);
  EXPECT_EQ(fake.live_reservations(), 0);
  EXPECT_EQ(fake.total_context_refs(), 0);
  EXPECT_EQ(CountOpenFds(), fds_before);
}

// An engine thread that had another context current gets it back; a thread that had none is
// left with the device's primary context current, so it can use the memory right away.
TEST(ImportedArenaTest, RestoresTheCallersContextAndOtherwiseLeavesThePrimaryCurrent) {
  FakeDriver fake(kGranularity);
  CUcontext engines = reinterpret_cast<CUcontext>(uintptr_t{0xe0e0});
  fake.set_current_context(engines);
  {
    Result<ImportedArena> arena =
        ImportedArena::Import(fake.api(), kDevice, ForeignArena(fake), kRounded);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    EXPECT_EQ(fake.current_context(), engines);
  }
  fake.set_current_context(nullptr);
  Result<ImportedArena> arena =
      ImportedArena::Import(fake.api(), kDevice, ForeignArena(fake), kRounded);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_NE(fake.current_context(), nullptr);
  EXPECT_NE(fake.current_context(), engines);
}

std::vector<Step> AcquisitionSteps(const std::vector<Step>& steps) {
  std::vector<Step> out;
  for (const Step& s : steps) {
    if (std::string(s.function) != "cuMemRelease" && std::string(s.function) != "cuCtxGetCurrent") {
      out.push_back(s);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(EveryCall, ImportedArenaRollbackTest,
                         ::testing::ValuesIn(AcquisitionSteps(kImportSteps)), StepName);

}  // namespace
}  // namespace weightcache::cuda
