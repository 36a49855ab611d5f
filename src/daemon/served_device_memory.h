// The gpu tier's store memory mapped for a reader in this process other than the store: the
// fill source of `serve --fill-serve` (docs/fleet.md "Fill"), whose transport (UCX) copies
// from device addresses on a thread of its own.
//
// Contract: Map() retains the device's primary context and maps the store's allocations into
// it; both are held for as long as the ServedDeviceMemory (or what it is moved into) lives,
// and released in reverse order (the mappings, then the context). The store keeps its own
// allocations; nothing here writes them. Thread-safe once made: regions() and OnThread() only
// read.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/imported_arena.h"
#include "cuda/vmm.h"
#include "identity/device_inventory.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

class ServedDeviceMemory {
 public:
  // `device`'s primary context retained (the process's driver, cuda::LoadDriver) and the
  // store's allocations mapped into it: from its `creating_handles` when it kept them (one per
  // fd: daemon::LoadOptions::keep_creating_handles), else an import of duplicates of `fds`
  // (borrowed for the call). Only the first is exportable: with the second, UCX's cuda_ipc
  // cannot hand the memory to a peer on this host, which then reads it through host memory
  // (docs/fleet.md "Two daemons on one GPU"; logged). `sizes`: each allocation's bytes (the
  // manifest's).
  static Result<ServedDeviceMemory> Map(
      const identity::DeviceInfo& device, std::span<const int> fds,
      std::span<const CUmemGenericAllocationHandle> creating_handles,
      const std::vector<uint64_t>& sizes);

  ServedDeviceMemory(ServedDeviceMemory&&) noexcept = default;
  // No assignment: a member-wise one would release the old context before the old mappings.
  ServedDeviceMemory& operator=(ServedDeviceMemory&&) = delete;

  // Each allocation's device addresses in this process, in allocation order.
  std::vector<std::span<const uint8_t>> regions() const;

  // Makes the context current on the calling thread (the transport's progress thread, where
  // it copies from). By value: it stays valid while the context is retained, wherever this
  // object is moved.
  std::function<Status()> OnThread() const;

 private:
  ServedDeviceMemory(cuda::PrimaryContext context, cuda::ImportedArena arena)
      : context_(std::move(context)), arena_(std::move(arena)) {}

  // In acquisition order: destroyed in reverse, the mappings go before the context.
  cuda::PrimaryContext context_;
  cuda::ImportedArena arena_;
};

}  // namespace weightcache::daemon
