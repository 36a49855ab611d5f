// The fallback loader: when no daemon serves this identity (or a mismatch is ignored), the
// client reads the checkpoint itself into memory it owns, and hands out the same tensor table
// an attachment to a daemon would.
//
//  * host tier: one private, 256-byte-aligned heap buffer; tensors read in parallel with
//    checkpoint::ReadRanges, then checksummed in parallel (the same content checksum the
//    daemon records, so `attach --verify` means the same thing for both sources).
//  * gpu tier: one cuMemAlloc buffer in the device's primary context; tensors go through a
//    pinned staging buffer (cuda::PinnedHostBuffer, the upload pipeline's kind: parallel reads,
//    then a synchronous H2D copy), checksummed from the staging buffer as they pass.
//  * a sharded identity (a shard plan): either tier loads only the rank's held bytes, dim>0
//    slices gathered with sharding::ReadHeldBytes; the table has the held shapes and slices.
//
// Ownership: each result owns its memory (HostBuffer / DeviceBuffer); tensor addresses point
// into it and live as long as the result. Move-only. Thread-safety: the loaders may run
// concurrently; results are not synchronised.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "client/tensor_table.h"
#include "common/unique_handle.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "sharding/planner.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::client {

// The release rules of the fallback's own buffers, for UniqueHandle. The size travels in the
// handle so that a moved-from buffer reports 0 bytes.
struct HostBufferTraits {
  struct Handle {
    uint8_t* data = nullptr;
    uint64_t size = 0;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = NoContext;
  static constexpr Handle Null() { return {}; }
  static void Close(NoContext /*unused*/, const Handle& h) noexcept { std::free(h.data); }
};
struct DeviceBufferTraits {
  struct Handle {
    CUcontext context = nullptr;  // the context the memory was allocated in
    CUdeviceptr ptr = 0;
    uint64_t size = 0;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = const cuda::DriverApi*;
  static constexpr Handle Null() { return {}; }
  // cuMemFree with the allocation's context current (the destroying thread may have none).
  static void Close(const cuda::DriverApi* api, const Handle& h) noexcept;
};

// malloc'ed host memory, aligned to checkpoint::kTensorAlignment. Move-only.
class HostBuffer {
 public:
  static Result<HostBuffer> Allocate(uint64_t bytes);
  HostBuffer() = default;

  uint8_t* data() const { return owned_.get().data; }
  uint64_t size() const { return owned_.get().size; }

 private:
  explicit HostBuffer(HostBufferTraits::Handle h) : owned_(h) {}
  UniqueHandle<HostBufferTraits> owned_;
};

// cuMemAlloc / cuMemFree. The allocation belongs to the context current at Allocate, which
// must stay alive (retained) longer than the buffer. Move-only.
class DeviceBuffer {
 public:
  // Allocates in the calling thread's current context; freed in that same context from
  // whichever thread destroys the buffer.
  static Result<DeviceBuffer> Allocate(const cuda::DriverApi* api, uint64_t bytes);

  CUdeviceptr ptr() const { return owned_.get().ptr; }
  uint64_t size() const { return owned_.get().size; }

 private:
  DeviceBuffer(const cuda::DriverApi* api, DeviceBufferTraits::Handle h) : owned_(api, h) {}
  UniqueHandle<DeviceBufferTraits> owned_;
};

struct HostFallback {
  HostBuffer buffer;
  TensorTable tensors;  // sorted by name; data = host addresses inside `buffer`
};

struct GpuFallback {
  // Acquisition order: the context outlives the buffer.
  cuda::PrimaryContext context;
  DeviceBuffer buffer;
  TensorTable tensors;  // sorted by name; data = device addresses inside `buffer`
};

// Byte offset of every tensor (in checkpoint.tensors() order) inside one packed buffer, each
// aligned to checkpoint::kTensorAlignment; the last element is the buffer size.
std::vector<uint64_t> PackedOffsets(const checkpoint::Checkpoint& checkpoint);

// `plan` (may be null: every tensor whole) is a sharded identity's plan of `checkpoint`: only
// the tensors it lists are loaded, each its held bytes (sharding::ReadHeldBytes), with its held
// shape and slice in the table and the checksum of the held bytes.
Result<HostFallback> LoadHostFallback(const checkpoint::Checkpoint& checkpoint, int threads,
                                      const sharding::ShardPlan* plan = nullptr);

inline constexpr uint64_t kStagingBytes = uint64_t{64} << 20;

// `plan`: as for LoadHostFallback; a dim>0 slice's pieces are gathered into the staging
// buffer (sharding::ReadHeldBytes) on the way to the device.
Result<GpuFallback> LoadGpuFallback(const cuda::DriverApi* api, CUdevice device,
                                    const checkpoint::Checkpoint& checkpoint, int threads,
                                    const sharding::ShardPlan* plan = nullptr,
                                    uint64_t staging_bytes = kStagingBytes);

}  // namespace weightcache::client
