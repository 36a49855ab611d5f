// ImportedArena — the client side of the gpu tier: the daemon's allocations, received as POSIX
// fds, mapped contiguously into one VA range of this process on the client's own device.
//
// Contract:
//  * Import() takes ownership of the received fds and closes all of them before it returns,
//    on success and on every error: once mapped, the mapping alone keeps the memory alive, so
//    holding fds would only pin memory after the client unmaps.
//  * The received fds are untrusted: each is checked (open, and not a directory, pipe or
//    socket) and every size must be a non-zero multiple of this device's VMM granularity
//    before any driver call that uses them (Import checks the fds before it touches the driver
//    at all; split, Reserve sees only the sizes and Map checks the fds before importing); the
//    driver validates the rest (that the fd is a VMM export, that
//    the size fits the allocation).
//  * Import() either returns a complete arena or releases everything it acquired: no imported
//    handle, reservation, mapping or context reference survives a failed Import (proved
//    against a fault-injecting fake driver in tests/unit/cuda/).
//  * Import() is Reserve() then Map(). A caller may split them: Reserve() fixes every
//    allocation's address (they are mapped back to back from base()), so the caller can
//    compute tensor addresses on another thread while Map() talks to the driver. A failed
//    Map() leaves nothing imported or mapped; the reservation and the context reference go
//    with the arena.
//  * The mapping is read-write for the client's device. Read-only device mappings are not
//    something to rely on (cuMemSetAccess with PROT_READ on device memory is rejected by the
//    drivers we target), and engines legitimately write in place (e.g. load_state_dict with
//    assign=True then a fused post-processing step). Writes are visible to every process that
//    mapped the same allocation: the daemon and other clients
//    (docs/design.md "VMM memory lifetime").
//  * The arena keeps working if the daemon exits: the driver refcounts the memory.
//  * Destruction unmaps, frees the VA and releases the primary context reference.
//  * Not thread-safe to mutate; const accessors may be called from any thread. The DriverApi
//    must outlive the arena.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

// More allocations than any sane arena has; bounds the work a hostile peer can cause.
inline constexpr size_t kMaxImportedAllocations = 4096;

struct ImportedAllocation {
  uint64_t size = 0;
  CUdeviceptr ptr = 0;  // where it is mapped in this process
};

class ImportedArena {
 public:
  // `fds[i]` is the allocation of `sizes[i]` bytes; they are mapped back to back in that order.
  // kInvalidArgument for bad fds or sizes (naming the allocation index), kCuda naming the
  // failed call and the allocation index otherwise.
  static Result<ImportedArena> Import(const DriverApi* api, CUdevice device,
                                      std::vector<UniqueFd> fds, std::span<const uint64_t> sizes);

  // Step 1: checks `sizes` (kInvalidArgument), retains the primary context and reserves one VA
  // range for all of them. allocations() then holds every final address; nothing is mapped.
  static Result<ImportedArena> Reserve(const DriverApi* api, CUdevice device,
                                       std::span<const uint64_t> sizes);
  // Step 2: checks, imports, maps (read-write for the device) and closes `fds`, one per size
  // given to Reserve, in order. Once only (kInternal on a second call).
  Status Map(std::vector<UniqueFd> fds);
  bool mapped() const { return !mappings_.empty(); }

  // Like Import, for allocations whose creating handles this process holds
  // (ExportedArena::TakeHandles), borrowed for the call: `handles[i]` is `sizes[i]` bytes. The
  // mapping stays exportable, where an import of their fds would not be: CUDA exports a mapping
  // of a created handle again, never one of an imported handle (a fill source needs that for
  // UCX's cuda_ipc to hand its memory to a peer on the same host: docs/fleet.md). Errors as
  // Import's; a failure leaves nothing mapped or reserved, and the handles as they were.
  static Result<ImportedArena> MapCreated(const DriverApi* api, CUdevice device,
                                          std::span<const CUmemGenericAllocationHandle> handles,
                                          std::span<const uint64_t> sizes);

  ImportedArena(ImportedArena&&) noexcept = default;
  // Hand-written, not a UniqueHandle: the arena owns several resources (context, VA,
  // mappings) whose release order matters. It releases the old arena in destruction order
  // first (a defaulted member-wise assignment would release the old context before unmapping
  // the old mappings).
  ImportedArena& operator=(ImportedArena&& other) noexcept;
  ImportedArena(const ImportedArena&) = delete;
  ImportedArena& operator=(const ImportedArena&) = delete;
  ~ImportedArena() = default;

  CUdevice device() const { return context_.device(); }
  // The retained primary context: current on whichever thread uses the mappings.
  CUcontext context() const { return context_.get(); }
  const DriverApi* api() const { return context_.api(); }
  CUdeviceptr base() const { return va_.base(); }
  uint64_t total_bytes() const { return va_.size(); }
  std::span<const ImportedAllocation> allocations() const { return table_; }

 private:
  ImportedArena(PrimaryContext context, VaRange va, std::span<const uint64_t> sizes);
  // Map's driver part, for fds already checked (one per allocation, open, not a directory,
  // pipe or socket). Closes them.
  Status MapChecked(std::vector<UniqueFd> fds, const std::string& where);

  // Declared in acquisition order: destroyed in reverse (mappings, VA, context).
  PrimaryContext context_;
  VaRange va_;
  std::vector<MappedRange> mappings_;
  std::vector<ImportedAllocation> table_;
};

}  // namespace weightcache::cuda
