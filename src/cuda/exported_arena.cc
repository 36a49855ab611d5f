#include "cuda/exported_arena.h"

#include <limits>
#include <string>
#include <utility>

#include "common/align.h"

namespace weightcache::cuda {

Status CheckVmmSupport(const DriverApi* api, CUdevice device) {
  struct Needed {
    CUdevice_attribute attribute;
    const char* what;
  };
  static constexpr Needed kNeeded[] = {
      {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"},
      {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
       "POSIX file descriptor export of VMM allocations"},
  };
  for (const Needed& needed : kNeeded) {
    int value = 0;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetAttribute(&value, needed.attribute, device),
                                   "cuDeviceGetAttribute(" +
                                       std::to_string(static_cast<int>(needed.attribute)) +
                                       ", device " + std::to_string(device) + ")");
    if (value == 0) {
      return Status(StatusCode::kUnavailable, "device " + std::to_string(device) +
                                                  " does not support " + needed.what +
                                                  ", which the gpu tier needs");
    }
  }
  return Status::Ok();
}

ExportedArena::ExportedArena(PrimaryContext context, uint64_t granularity,
                             std::vector<VmmHandle> handles, VaRange va,
                             std::vector<MappedRange> mappings, std::vector<UniqueFd> fds)
    : context_(std::move(context)),
      granularity_(granularity),
      handles_(std::move(handles)),
      va_(std::move(va)),
      mappings_(std::move(mappings)),
      fds_(std::move(fds)) {
  table_.reserve(handles_.size());
  for (size_t i = 0; i < handles_.size(); ++i) {
    table_.push_back(ExportedAllocation{
        .size = mappings_[i].size(), .ptr = mappings_[i].ptr(), .fd = fds_[i].get()});
  }
}

std::vector<UniqueFd> ExportedArena::TakeFds() {
  std::vector<UniqueFd> fds = std::move(fds_);
  fds_.clear();
  table_.clear();
  return fds;
}

std::vector<VmmHandle> ExportedArena::TakeHandles() {
  std::vector<VmmHandle> handles = std::move(handles_);
  handles_.clear();
  return handles;
}

std::vector<UniqueFd> ExportedArena::ReleaseToFds() && {
  std::vector<UniqueFd> fds = TakeFds();
  ExportedArena gone(std::move(*this));  // mappings, VA, handles, context: in that order
  return fds;
}

ExportedArena& ExportedArena::operator=(ExportedArena&& other) noexcept {
  if (this != &other) {
    ExportedArena old(std::move(*this));  // destroyed at the end of this scope, in order
    context_ = std::move(other.context_);
    granularity_ = other.granularity_;
    handles_ = std::move(other.handles_);
    va_ = std::move(other.va_);
    mappings_ = std::move(other.mappings_);
    fds_ = std::move(other.fds_);
    table_ = std::move(other.table_);
  }
  return *this;
}

Result<ExportedArena> ExportedArena::Create(const DriverApi* api, CUdevice device,
                                            std::span<const uint64_t> requested_sizes) {
  const size_t n = requested_sizes.size();
  const std::string where = "creating VMM arena on device " + std::to_string(device);
  if (n == 0) return InvalidArgument(where + ": no allocations requested");
  for (size_t i = 0; i < n; ++i) {
    if (requested_sizes[i] == 0)
      return InvalidArgument(where + ": " + AllocationName(i, n) + " is empty");
  }

  // Acquisition order below is the declaration order of the members; each local unwinds
  // itself if a later step returns early.
  Result<PrimaryContext> context = PrimaryContext::Retain(api, device);
  if (!context.ok()) return context.status().Context(where);
  if (Status s = CheckVmmSupport(api, device); !s.ok()) return s.Context(where);
  Result<uint64_t> granularity =
      AllocationGranularity(api, device, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (!granularity.ok()) return granularity.status().Context(where);

  std::vector<uint64_t> sizes;
  sizes.reserve(n);
  uint64_t total = 0;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max() / 2;
  for (size_t i = 0; i < n; ++i) {
    if (requested_sizes[i] > kMax || total > kMax - AlignUp(requested_sizes[i], *granularity)) {
      return InvalidArgument(where + ": total size overflows at " + AllocationName(i, n));
    }
    sizes.push_back(AlignUp(requested_sizes[i], *granularity));
    total += sizes.back();
  }

  const CUmemAllocationProp prop = ArenaAllocationProp(device);
  std::vector<VmmHandle> handles;
  handles.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Result<VmmHandle> handle = VmmHandle::Create(api, sizes[i], prop);
    if (!handle.ok()) return handle.status().Context(where + ": " + AllocationName(i, n));
    handles.push_back(*std::move(handle));
  }

  Result<VaRange> va = VaRange::Reserve(api, total, *granularity);
  if (!va.ok()) return va.status().Context(where);

  std::vector<MappedRange> mappings;
  mappings.reserve(n);
  CUdeviceptr next = va->base();
  for (size_t i = 0; i < n; ++i) {
    Result<MappedRange> mapping = MappedRange::Map(api, next, handles[i]);
    if (!mapping.ok()) return mapping.status().Context(where + ": " + AllocationName(i, n));
    mappings.push_back(*std::move(mapping));
    next += sizes[i];
  }
  // The daemon itself writes the weights (cold load) and checksums them, so read-write.
  for (size_t i = 0; i < n; ++i) {
    if (Status s = mappings[i].SetAccess(device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE); !s.ok()) {
      return s.Context(where + ": " + AllocationName(i, n));
    }
  }

  std::vector<UniqueFd> fds;
  fds.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Result<UniqueFd> fd = handles[i].ExportPosixFd();
    if (!fd.ok()) return fd.status().Context(where + ": " + AllocationName(i, n));
    fds.push_back(*std::move(fd));
  }

  return ExportedArena(*std::move(context), *granularity, std::move(handles), *std::move(va),
                       std::move(mappings), std::move(fds));
}

}  // namespace weightcache::cuda
