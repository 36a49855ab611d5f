#include "daemon/served_device_memory.h"

#include <fcntl.h>

#include <cerrno>
#include <optional>

#include "common/logging.h"
#include "common/unique_fd.h"

namespace weightcache::daemon {

Result<ServedDeviceMemory> ServedDeviceMemory::Map(
    const identity::DeviceInfo& device, std::span<const int> fds,
    std::span<const CUmemGenericAllocationHandle> creating_handles,
    const std::vector<uint64_t>& sizes) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(const cuda::DriverApi* api, cuda::LoadDriver());
  WEIGHTCACHE_ASSIGN_OR_RETURN(CUdevice cu_device, identity::CudaDevice(api, device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::PrimaryContext context,
                               cuda::PrimaryContext::Retain(api, cu_device));
  std::optional<cuda::ImportedArena> mapped;
  if (creating_handles.size() == fds.size()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        mapped, cuda::ImportedArena::MapCreated(api, cu_device, creating_handles, sizes));
  } else {
    LOG_INFO << "fill source: serving an import of the cache's allocations (adopted from a "
                "keeper or an upgrade, or promoted back: this process holds no creating handle): "
                "UCX cannot export it, and a peer on this host reads it through host memory";
    std::vector<UniqueFd> owned;
    for (const int fd : fds) {
      UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (!dup.valid()) return IoError("duplicating an allocation's fd", errno);
      owned.push_back(std::move(dup));
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        mapped, cuda::ImportedArena::Import(api, cu_device, std::move(owned), sizes));
  }
  return ServedDeviceMemory(std::move(context), std::move(*mapped));
}

std::vector<std::span<const uint8_t>> ServedDeviceMemory::regions() const {
  std::vector<std::span<const uint8_t>> regions;
  for (const cuda::ImportedAllocation& a : arena_.allocations()) {
    regions.emplace_back(reinterpret_cast<const uint8_t*>(a.ptr), a.size);
  }
  return regions;
}

std::function<Status()> ServedDeviceMemory::OnThread() const {
  return [api = context_.api(), current = context_.get()]() -> Status {
    const CUresult rc = api->cuCtxSetCurrent(current);
    return rc == CUDA_SUCCESS ? Status::Ok()
                              : cuda::DriverError(api, rc, "cuCtxSetCurrent (fill source)");
  };
}

}  // namespace weightcache::daemon
