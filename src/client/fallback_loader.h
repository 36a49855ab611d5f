// The fallback loader: when no daemon serves this identity (or a mismatch is ignored), the
// client reads the checkpoint itself into memory it owns, and hands out the same tensor table
// an attachment to a daemon would.
//
//  * host tier: one private, 256-byte-aligned heap buffer; tensors read in parallel with
//    checkpoint::ReadRanges, then checksummed in parallel (the same content checksum the
//    daemon records, so `attach --verify` means the same thing for both sources).
//  * gpu tier: one cuMemAlloc buffer in the device's primary context; tensors go through a
//    pinned staging buffer (parallel reads, then a synchronous H2D copy), checksummed from the
//    staging buffer as they pass.
//
// Ownership: each result owns its memory (HostBuffer / DeviceBuffer); tensor addresses point
// into it and live as long as the result. Move-only. Thread-safety: the loaders may run
// concurrently; results are not synchronised.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "client/tensor_table.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::client {

// malloc'ed host memory, aligned to checkpoint::kTensorAlignment.
class HostBuffer {
 public:
  static Result<HostBuffer> Allocate(uint64_t bytes);
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  HostBuffer(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// cuMemAlloc / cuMemFree. The allocation belongs to the context current at Allocate, which
// must stay alive (retained) longer than the buffer.
class DeviceBuffer {
 public:
  // Allocates in the calling thread's current context; freed in that same context from
  // whichever thread destroys the buffer.
  static Result<DeviceBuffer> Allocate(const cuda::DriverApi* api, uint64_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  CUdeviceptr ptr() const { return ptr_; }
  uint64_t size() const { return size_; }

 private:
  DeviceBuffer(const cuda::DriverApi* api, CUcontext context, CUdeviceptr ptr, uint64_t size)
      : api_(api), context_(context), ptr_(ptr), size_(size) {}
  void Reset();
  const cuda::DriverApi* api_ = nullptr;  // null when empty
  CUcontext context_ = nullptr;           // the context the memory was allocated in
  CUdeviceptr ptr_ = 0;
  uint64_t size_ = 0;
};

// cuMemHostAlloc / cuMemFreeHost (the staging buffer of the gpu fallback).
class PinnedBuffer {
 public:
  static Result<PinnedBuffer> Allocate(const cuda::DriverApi* api, uint64_t bytes);
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  PinnedBuffer(const cuda::DriverApi* api, uint8_t* data, uint64_t size)
      : api_(api), data_(data), size_(size) {}
  void Reset();
  const cuda::DriverApi* api_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
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

Result<HostFallback> LoadHostFallback(const checkpoint::Checkpoint& checkpoint, int threads);

inline constexpr uint64_t kStagingBytes = uint64_t{64} << 20;

Result<GpuFallback> LoadGpuFallback(const cuda::DriverApi* api, CUdevice device,
                                    const checkpoint::Checkpoint& checkpoint, int threads,
                                    uint64_t staging_bytes = kStagingBytes);

}  // namespace weightcache::client
