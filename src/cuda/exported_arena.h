// ExportedArena — the daemon side of the gpu tier: a few large VMM allocations on one device,
// mapped contiguously into one VA range of this process, readable and writable by the device,
// each exported as a POSIX fd that the daemon sends to clients with SCM_RIGHTS.
//
// Contract:
//  * Create() either returns a complete arena or releases everything it acquired: no
//    allocation, reservation, mapping, fd or context reference survives a failed Create
//    (proved against a fault-injecting fake driver in tests/unit/cuda/).
//  * The arena owns its fds. allocations()[i].fd is borrowed: valid for the arena's lifetime;
//    sendmsg(SCM_RIGHTS) duplicates it into the peer, so nothing needs to be dup'ed here.
//  * Destruction closes the fds, unmaps, frees the VA and releases the handles and the
//    primary context reference. Memory already imported by a client stays alive in that client
//    (the driver refcounts it), so a daemon exiting never invalidates attached engines.
//  * ReleaseToFds() ends the arena but for its fds: once the weights are in place, the fds
//    alone keep the memory alive and importable — a VMM fd held by a process with NO CUDA
//    context stays importable by new processes, data intact (docs/design.md "VMM memory lifetime")
//    — so a daemon can serve from fds without a CUDA context of its own (no ~0.5 GiB of device
//    memory and no driver host memory for it).
//  * Retaining the primary context makes it current on the thread that calls Create.
//  * Not thread-safe to mutate; const accessors may be called from any thread. The DriverApi
//    must outlive the arena.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <span>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

struct ExportedAllocation {
  uint64_t size = 0;    // bytes, a multiple of the recommended granularity
  CUdeviceptr ptr = 0;  // where it is mapped in this process
  int fd = -1;          // borrowed POSIX fd (CLOEXEC), owned by the arena
};

class ExportedArena {
 public:
  // One allocation per entry of `requested_sizes` (each > 0), rounded up to the device's
  // recommended VMM granularity. Fails with kInvalidArgument on an empty list, a zero size or
  // a total that overflows; kUnavailable when the device lacks VMM or POSIX-fd export; kCuda
  // naming the failed call and the allocation index otherwise.
  static Result<ExportedArena> Create(const DriverApi* api, CUdevice device,
                                      std::span<const uint64_t> requested_sizes);

  ExportedArena(ExportedArena&&) noexcept = default;
  // Hand-written, not a UniqueHandle: the arena owns several resources (context, handles, VA,
  // mappings, fds) whose release order matters. It releases the old arena in destruction order
  // first (a defaulted member-wise assignment would release the old context before unmapping
  // the old mappings).
  ExportedArena& operator=(ExportedArena&& other) noexcept;
  ExportedArena(const ExportedArena&) = delete;
  ExportedArena& operator=(const ExportedArena&) = delete;
  ~ExportedArena() = default;

  CUdevice device() const { return context_.device(); }
  // The retained primary context: current on whichever thread uses the mappings.
  CUcontext context() const { return context_.get(); }
  const DriverApi* api() const { return context_.api(); }
  CUdeviceptr base() const { return va_.base(); }
  uint64_t total_bytes() const { return va_.size(); }
  uint64_t granularity() const { return granularity_; }
  std::span<const ExportedAllocation> allocations() const { return table_; }

  // Unmaps, frees the VA, releases the handles and the primary context reference (the context
  // goes when nobody else retains it), and returns the exported fds, one per allocation in
  // order. Every write to the memory must be complete (streams synchronized). The arena is
  // empty afterwards.
  std::vector<UniqueFd> ReleaseToFds() &&;
  // Moves the exported fds out and keeps the rest (mappings, VA, handles, the context
  // reference) until the arena is destroyed: for a loader that serves from the fds at once and
  // tears the arena down later, off its `ready` path. allocations() is empty afterwards.
  std::vector<UniqueFd> TakeFds();
  // Moves the allocations' creating handles out, one per allocation in order; the rest is
  // released as usual. The handles keep the memory alive on their own (no context needed) and,
  // unlike an import of the fds, map as memory that CUDA exports again (a mapping's
  // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES comes from the handle it was mapped with: POSIX
  // fd for a created handle, none for an imported one, measured on an H200, 2026-12-05). A
  // fill source maps them so that UCX's cuda_ipc can hand its memory to a peer on the same host
  // (ImportedArena::MapCreated).
  std::vector<VmmHandle> TakeHandles();

 private:
  ExportedArena(PrimaryContext context, uint64_t granularity, std::vector<VmmHandle> handles,
                VaRange va, std::vector<MappedRange> mappings, std::vector<UniqueFd> fds);

  // Declared in acquisition order: destroyed in reverse (fds, mappings, VA, handles, context).
  PrimaryContext context_;
  uint64_t granularity_ = 0;
  std::vector<VmmHandle> handles_;
  VaRange va_;
  std::vector<MappedRange> mappings_;
  std::vector<UniqueFd> fds_;
  std::vector<ExportedAllocation> table_;
};

// Fails with kUnavailable unless `device` supports VMM and POSIX-fd shareable handles.
Status CheckVmmSupport(const DriverApi* api, CUdevice device);

}  // namespace weightcache::cuda
