#include "client/fallback_loader.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "checkpoint/arena_plan.h"
#include "client/parallel.h"
#include "client/tensor_table.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "cuda/pinned_host_buffer.h"
#include "sharding/gather.h"

namespace weightcache::client {
namespace {

// The table of `infos` with data[i] = base + offsets[i]: its exact reservation, then one Add
// per tensor (the checkpoint's order is already by name).
Result<TensorTable> MakeTable(const std::vector<checkpoint::TensorInfo>& infos, uint64_t base,
                              const std::vector<uint64_t>& offsets,
                              const std::vector<uint64_t>& checksums) {
  size_t name_bytes = 0, dims = 0;
  for (const auto& t : infos) {
    name_bytes += t.name.size();
    dims += t.shape.size();
  }
  TensorTable table;
  table.Reserve(infos.size(), name_bytes, dims);
  for (size_t i = 0; i < infos.size(); ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(table.Add(infos[i].name, infos[i].dtype, infos[i].shape,
                                          base + offsets[i], infos[i].nbytes, checksums[i]));
  }
  table.Finish();
  return table;
}

}  // namespace

// ---- HostBuffer, DeviceBuffer ---------------------------------------------------------------

Result<HostBuffer> HostBuffer::Allocate(uint64_t bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment, and never zero.
  uint64_t size = AlignUp(std::max<uint64_t>(bytes, 1), checkpoint::kTensorAlignment);
  void* p = std::aligned_alloc(checkpoint::kTensorAlignment, size);
  if (p == nullptr) {
    return Status(StatusCode::kOutOfMemory, "allocating " + std::to_string(bytes) +
                                                " bytes of host memory for the "
                                                "fallback load");
  }
  return HostBuffer({static_cast<uint8_t*>(p), bytes});
}

Result<DeviceBuffer> DeviceBuffer::Allocate(const cuda::DriverApi* api, uint64_t bytes) {
  CUcontext context = nullptr;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxGetCurrent(&context), "cuCtxGetCurrent");
  CUdeviceptr ptr = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(
      api, cuMemAlloc(&ptr, std::max<uint64_t>(bytes, 1)),
      "cuMemAlloc of " + std::to_string(bytes) + " bytes for the fallback load");
  return DeviceBuffer(api, {context, ptr, bytes});
}

void DeviceBufferTraits::Close(const cuda::DriverApi* api, const Handle& h) noexcept {
  const cuda::ScopedCurrentContext in_context(api, h.context);
  if (CUresult rc = api->cuMemFree(h.ptr); rc != CUDA_SUCCESS) {
    cuda::LogReleaseFailure(api, rc, "cuMemFree of the fallback buffer");
  }
}

// ---- loaders ------------------------------------------------------------------------------

std::vector<uint64_t> PackedOffsets(const checkpoint::Checkpoint& checkpoint) {
  std::vector<uint64_t> offsets;
  offsets.reserve(checkpoint.tensors().size() + 1);
  uint64_t at = 0;
  for (const auto& t : checkpoint.tensors()) {
    offsets.push_back(at);
    at = AlignUp(at + t.nbytes, checkpoint::kTensorAlignment);
  }
  offsets.push_back(at);
  return offsets;
}

namespace {

// Where each planned tensor's held bytes go in one packed buffer (as PackedOffsets packs whole
// tensors); the last element is the buffer size.
std::vector<uint64_t> PlannedOffsets(const sharding::ShardPlan& plan) {
  std::vector<uint64_t> offsets;
  offsets.reserve(plan.tensors.size() + 1);
  uint64_t at = 0;
  for (const sharding::PlannedTensor& p : plan.tensors) {
    offsets.push_back(at);
    at = AlignUp(at + p.bytes, checkpoint::kTensorAlignment);
  }
  offsets.push_back(at);
  return offsets;
}

// The table of a sharded load: each planned tensor at base + offsets[i], with its held shape
// and slice and the checksum of its held bytes.
Result<TensorTable> MakePlannedTable(const sharding::ShardPlan& plan, uint64_t base,
                                     const std::vector<uint64_t>& offsets,
                                     const std::vector<uint64_t>& checksums) {
  size_t name_bytes = 0, dims = 0;
  for (const sharding::PlannedTensor& p : plan.tensors) {
    name_bytes += p.tensor->name.size();
    dims += p.shape.size();
  }
  TensorTable table;
  table.Reserve(plan.tensors.size(), name_bytes, dims);
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const sharding::PlannedTensor& p = plan.tensors[i];
    std::optional<TensorSlice> slice;
    if (p.slice) {
      slice = TensorSlice{p.slice->dim, p.slice->offset, p.slice->length,
                          p.tensor->shape[p.slice->dim]};
    }
    WEIGHTCACHE_RETURN_IF_ERROR(table.Add(p.tensor->name, p.tensor->dtype, p.shape,
                                          base + offsets[i], p.bytes, checksums[i], slice));
  }
  table.Finish();  // the plan is in file order; the table is kept by name
  return table;
}

// The fallback of a sharded identity: the held bytes of each planned tensor, packed like
// PackedOffsets packs whole ones; dim>0 slices gathered through a staging buffer per thread.
Result<HostFallback> LoadShardFallback(const checkpoint::Checkpoint& checkpoint, int threads,
                                       const sharding::ShardPlan& plan) {
  const size_t n = plan.tensors.size();
  const std::vector<uint64_t> offsets = PlannedOffsets(plan);
  WEIGHTCACHE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(offsets.back()));

  std::vector<Status> read(n);
  std::vector<uint64_t> checksums(n);
  ParallelFor(n, threads, [&](size_t i) {
    const sharding::PlannedTensor& p = plan.tensors[i];
    std::unique_ptr<uint8_t[]> stage;
    read[i] = sharding::ReadHeldBytes(checkpoint, *p.tensor, p.copy, 0, p.bytes,
                                      buffer.data() + offsets[i], stage);
    if (read[i].ok()) checksums[i] = TensorChecksum(buffer.data() + offsets[i], p.bytes);
  });
  for (size_t i = 0; i < n; ++i) {
    if (!read[i].ok()) {
      return read[i].Context("fallback load of " + checkpoint.path() + ": tensor " +
                             plan.tensors[i].tensor->name);
    }
  }
  HostFallback out{std::move(buffer), {}};
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      out.tensors,
      MakePlannedTable(plan, reinterpret_cast<uint64_t>(out.buffer.data()), offsets, checksums));
  return out;
}

}  // namespace

Result<HostFallback> LoadHostFallback(const checkpoint::Checkpoint& checkpoint, int threads,
                                      const sharding::ShardPlan* plan) {
  if (plan != nullptr) return LoadShardFallback(checkpoint, threads, *plan);
  const auto& infos = checkpoint.tensors();
  std::vector<uint64_t> offsets = PackedOffsets(checkpoint);
  WEIGHTCACHE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(offsets.back()));

  std::vector<checkpoint::ReadRequest> requests;
  requests.reserve(infos.size());
  for (size_t i = 0; i < infos.size(); ++i) {
    if (infos[i].nbytes == 0) continue;
    requests.push_back(
        {infos[i].shard, infos[i].offset, infos[i].nbytes, buffer.data() + offsets[i]});
  }
  checkpoint::ReadOptions read_options;
  read_options.threads = std::clamp(threads, 1, 256);
  Status read = checkpoint::ReadRanges(checkpoint, requests, read_options);
  if (!read.ok()) return read.Context("fallback load of " + checkpoint.path());

  std::vector<uint64_t> checksums(infos.size());
  ParallelFor(infos.size(), threads, [&](size_t i) {
    checksums[i] = TensorChecksum(buffer.data() + offsets[i], infos[i].nbytes);
  });

  HostFallback out{std::move(buffer), {}};
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      out.tensors,
      MakeTable(infos, reinterpret_cast<uint64_t>(out.buffer.data()), offsets, checksums));
  return out;
}

Result<GpuFallback> LoadGpuFallback(const cuda::DriverApi* api, CUdevice device,
                                    const checkpoint::Checkpoint& checkpoint, int threads,
                                    const sharding::ShardPlan* plan, uint64_t staging_bytes) {
  const auto& infos = checkpoint.tensors();
  // What is loaded, per entry: which tensor, how many bytes, from where in it (a whole
  // tensor is one run at its start), and where in the buffer.
  const size_t n = plan != nullptr ? plan->tensors.size() : infos.size();
  const std::vector<uint64_t> offsets =
      plan != nullptr ? PlannedOffsets(*plan) : PackedOffsets(checkpoint);
  const auto info_of = [&](size_t i) -> const checkpoint::TensorInfo& {
    return plan != nullptr ? *plan->tensors[i].tensor : infos[i];
  };
  const auto bytes_of = [&](size_t i) {
    return plan != nullptr ? plan->tensors[i].bytes : infos[i].nbytes;
  };
  const auto copy_of = [&](size_t i) {
    return plan != nullptr ? plan->tensors[i].copy
                           : sharding::CopyGeometry{.rows = 1,
                                                    .row_bytes = infos[i].nbytes,
                                                    .source_pitch = 0,
                                                    .source_offset = 0};
  };

  const cuda::CallerContextGuard caller_context(api);
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::PrimaryContext context,
                               cuda::PrimaryContext::Retain(api, device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(api, offsets.back()));
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::PinnedHostBuffer staging,
                               cuda::PinnedHostBuffer::Create(api, staging_bytes));
  auto* const staging_data = reinterpret_cast<uint8_t*>(staging.data());

  // Pieces of at most one staging buffer each, batched until the staging buffer is full.
  // An entry's pieces are consumed in order, so its ChecksumBuilder sees its bytes in order.
  struct Piece {
    size_t entry;
    uint64_t begin;  // within the entry's held bytes
    uint64_t length;
    uint64_t staging_offset;
  };
  std::vector<ChecksumBuilder> builders(n);
  std::vector<Piece> batch;
  uint64_t batch_bytes = 0;
  checkpoint::ReadOptions read_options;
  read_options.threads = std::clamp(threads, 1, 256);
  std::unique_ptr<uint8_t[]> stage;  // the gather stage of dim>0 slices, on first need

  auto flush = [&]() -> Status {
    if (batch.empty()) return Status::Ok();
    // Runs of the file (whole tensors, dim-0 slices) read in parallel; dim>0 slices gathered.
    std::vector<checkpoint::ReadRequest> requests;
    requests.reserve(batch.size());
    for (const Piece& p : batch) {
      const sharding::CopyGeometry g = copy_of(p.entry);
      if (g.rows > 1) continue;
      WEIGHTCACHE_ASSIGN_OR_RETURN(os::StridedRun run, sharding::HeldRun(info_of(p.entry), g));
      requests.push_back({info_of(p.entry).shard, run.file_offset + p.begin, p.length,
                          staging_data + p.staging_offset});
    }
    Status read = checkpoint::ReadRanges(checkpoint, requests, read_options);
    for (size_t k = 0; k < batch.size() && read.ok(); ++k) {
      const Piece& p = batch[k];
      const sharding::CopyGeometry g = copy_of(p.entry);
      if (g.rows <= 1) continue;
      read = sharding::ReadHeldBytes(checkpoint, info_of(p.entry), g, p.begin, p.length,
                                     staging_data + p.staging_offset, stage);
    }
    if (!read.ok()) return read.Context("fallback load of " + checkpoint.path());
    for (const Piece& p : batch) {
      builders[p.entry].Update(staging_data + p.staging_offset, p.length);
      WEIGHTCACHE_CU_RETURN_IF_ERROR(api,
                                     cuMemcpyHtoD(buffer.ptr() + offsets[p.entry] + p.begin,
                                                  staging_data + p.staging_offset, p.length),
                                     "cuMemcpyHtoD of tensor " + info_of(p.entry).name);
    }
    batch.clear();
    batch_bytes = 0;
    return Status::Ok();
  };

  for (size_t i = 0; i < n; ++i) {
    for (uint64_t begin = 0; begin < bytes_of(i);) {
      if (batch_bytes == staging.size()) WEIGHTCACHE_RETURN_IF_ERROR(flush());
      uint64_t length = std::min(bytes_of(i) - begin, staging.size() - batch_bytes);
      batch.push_back({i, begin, length, batch_bytes});
      batch_bytes += length;
      begin += length;
    }
  }
  WEIGHTCACHE_RETURN_IF_ERROR(flush());

  std::vector<uint64_t> checksums(n);
  for (size_t i = 0; i < n; ++i) checksums[i] = builders[i].Finish();
  GpuFallback out{std::move(context), std::move(buffer), {}};
  if (plan != nullptr) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(out.tensors,
                                 MakePlannedTable(*plan, out.buffer.ptr(), offsets, checksums));
  } else {
    WEIGHTCACHE_ASSIGN_OR_RETURN(out.tensors,
                                 MakeTable(infos, out.buffer.ptr(), offsets, checksums));
  }
  return out;
}

}  // namespace weightcache::client
