#include "cuda/imported_arena.h"

#include <sys/stat.h>

#include <cerrno>
#include <limits>
#include <string>
#include <utility>

namespace weightcache::cuda {
namespace {

// What can be checked about a received fd without the driver. A VMM export is an fd on the
// NVIDIA driver; it is never a directory, a pipe or a socket.
Status CheckReceivedFd(const UniqueFd& fd) {
  if (!fd.valid()) return InvalidArgument("received fd is missing (-1)");
  struct stat st = {};
  if (::fstat(fd.get(), &st) != 0) {
    int err = errno;
    return InvalidArgument("received fd " + std::to_string(fd.get()) +
                           " is not an open file descriptor")
        .WithErrno(err);
  }
  if (S_ISDIR(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)) {
    return InvalidArgument("received fd " + std::to_string(fd.get()) +
                           " is a directory, pipe or socket, not a VMM allocation");
  }
  return Status::Ok();
}

Status CheckCount(size_t n, const std::string& where) {
  if (n == 0) return InvalidArgument(where + ": no allocations received");
  if (n > kMaxImportedAllocations) {
    return InvalidArgument(where + ": " + std::to_string(n) + " allocations exceed the limit of " +
                           std::to_string(kMaxImportedAllocations));
  }
  return Status::Ok();
}

Status CheckReceivedFds(const std::vector<UniqueFd>& fds, const std::string& where) {
  for (size_t i = 0; i < fds.size(); ++i) {
    if (Status s = CheckReceivedFd(fds[i]); !s.ok()) {
      return s.Context(where + ": " + AllocationName(i, fds.size()));
    }
  }
  return Status::Ok();
}

// cuMemMap of `handle` (`size` bytes) at `ptr`, then read-write access for `device`: read-write,
// see the header for why not read-only.
Result<MappedRange> MapReadWrite(const DriverApi* api, CUdevice device, CUdeviceptr ptr,
                                 CUmemGenericAllocationHandle handle, uint64_t size) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(MappedRange mapping, MappedRange::Map(api, ptr, handle, size));
  WEIGHTCACHE_RETURN_IF_ERROR(mapping.SetAccess(device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
  return mapping;
}

}  // namespace

ImportedArena::ImportedArena(PrimaryContext context, VaRange va, std::span<const uint64_t> sizes)
    : context_(std::move(context)), va_(std::move(va)) {
  table_.reserve(sizes.size());
  CUdeviceptr next = va_.base();
  for (uint64_t size : sizes) {
    table_.push_back(ImportedAllocation{.size = size, .ptr = next});
    next += size;
  }
}

ImportedArena& ImportedArena::operator=(ImportedArena&& other) noexcept {
  if (this != &other) {
    ImportedArena old(std::move(*this));  // destroyed at the end of this scope, in order
    context_ = std::move(other.context_);
    va_ = std::move(other.va_);
    mappings_ = std::move(other.mappings_);
    table_ = std::move(other.table_);
  }
  return *this;
}

Result<ImportedArena> ImportedArena::Import(const DriverApi* api, CUdevice device,
                                            std::vector<UniqueFd> fds,
                                            std::span<const uint64_t> sizes) {
  // `fds` is a by-value parameter: every return path below closes all of them. They are
  // checked before any driver call.
  const std::string where = "importing VMM arena on device " + std::to_string(device);
  if (fds.size() != sizes.size()) {
    return InvalidArgument(where + ": received " + std::to_string(fds.size()) + " fds for " +
                           std::to_string(sizes.size()) + " allocation sizes");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckCount(sizes.size(), where));
  WEIGHTCACHE_RETURN_IF_ERROR(CheckReceivedFds(fds, where));
  WEIGHTCACHE_ASSIGN_OR_RETURN(ImportedArena arena, Reserve(api, device, sizes));
  WEIGHTCACHE_RETURN_IF_ERROR(arena.MapChecked(std::move(fds), where));  // checked above
  return arena;
}

Result<ImportedArena> ImportedArena::MapCreated(
    const DriverApi* api, CUdevice device, std::span<const CUmemGenericAllocationHandle> handles,
    std::span<const uint64_t> sizes) {
  const size_t n = sizes.size();
  const std::string where = "mapping the created VMM arena on device " + std::to_string(device);
  if (handles.size() != n) {
    return InvalidArgument(where + ": " + std::to_string(handles.size()) + " handles for " +
                           std::to_string(n) + " allocation sizes");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(ImportedArena arena, Reserve(api, device, sizes));
  const ScopedCurrentContext current(api, arena.context_.get());
  std::vector<MappedRange> mappings;
  mappings.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Result<MappedRange> mapping =
        MapReadWrite(api, device, arena.table_[i].ptr, handles[i], sizes[i]);
    if (!mapping.ok()) return mapping.status().Context(where + ": " + AllocationName(i, n));
    mappings.push_back(*std::move(mapping));
  }
  arena.mappings_ = std::move(mappings);
  return arena;
}

Result<ImportedArena> ImportedArena::Reserve(const DriverApi* api, CUdevice device,
                                             std::span<const uint64_t> sizes) {
  const size_t n = sizes.size();
  const std::string where = "importing VMM arena on device " + std::to_string(device);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckCount(n, where));

  const CallerContextGuard caller_context(api);
  Result<PrimaryContext> context = PrimaryContext::Retain(api, device);
  if (!context.ok()) return context.status().Context(where);
  // The minimum granularity is the hard requirement of cuMemMap; the daemon rounds to the
  // recommended one, which is a multiple of it.
  Result<uint64_t> granularity =
      AllocationGranularity(api, device, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (!granularity.ok()) return granularity.status().Context(where);
  uint64_t total = 0;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max() / 2;
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] == 0 || sizes[i] % *granularity != 0) {
      return InvalidArgument(
          where + ": " + AllocationName(i, n) + " has size " + std::to_string(sizes[i]) +
          ", not a non-zero multiple of the VMM granularity " + std::to_string(*granularity));
    }
    if (sizes[i] > kMax - total) {
      return InvalidArgument(where + ": total size overflows at " + AllocationName(i, n));
    }
    total += sizes[i];
  }
  Result<VaRange> va = VaRange::Reserve(api, total, *granularity);
  if (!va.ok()) return va.status().Context(where);
  return ImportedArena(*std::move(context), *std::move(va), sizes);
}

Status ImportedArena::Map(std::vector<UniqueFd> fds) {
  // `fds` is a by-value parameter: every return path below closes all of them.
  const size_t n = table_.size();
  const std::string where = "importing VMM arena on device " + std::to_string(device());
  if (!mappings_.empty()) return InternalError(where + ": the arena is already mapped");
  if (fds.size() != n) {
    return InvalidArgument(where + ": received " + std::to_string(fds.size()) + " fds for " +
                           std::to_string(n) + " allocation sizes");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckReceivedFds(fds, where));
  return MapChecked(std::move(fds), where);
}

Status ImportedArena::MapChecked(std::vector<UniqueFd> fds, const std::string& where) {
  const size_t n = table_.size();
  // The primary context for the driver calls; Reserve() already made it current when this
  // runs on the same thread, and then this costs one cuCtxGetCurrent.
  const ScopedCurrentContext current(context_.api(), context_.get());
  std::vector<MappedRange> mappings;
  mappings.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Result<VmmHandle> handle =
        VmmHandle::ImportPosixFd(context_.api(), fds[i].get(), table_[i].size);
    if (!handle.ok()) return handle.status().Context(where + ": " + AllocationName(i, n));
    Result<MappedRange> mapping =
        MapReadWrite(context_.api(), device(), table_[i].ptr, handle->get(), handle->size());
    if (!mapping.ok()) return mapping.status().Context(where + ": " + AllocationName(i, n));
    mappings.push_back(*std::move(mapping));
    // `handle` is released here: the mapping keeps the memory alive, and an unreleased
    // imported handle would pin it after the client unmaps.
  }
  fds.clear();  // closed now rather than whenever the caller's full-expression ends
  mappings_ = std::move(mappings);
  return Status::Ok();
}

}  // namespace weightcache::cuda
