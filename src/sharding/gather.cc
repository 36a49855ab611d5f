#include "sharding/gather.h"

#include <algorithm>
#include <cstring>
#include <span>

namespace weightcache::sharding {
namespace {

// One pread of `length` bytes at `offset` of the tensor into `dest`.
Status Read(const checkpoint::Checkpoint& checkpoint, const checkpoint::TensorInfo& t,
            uint64_t offset, uint64_t length, void* dest) {
  const checkpoint::ReadRequest request{t.shard, t.offset + offset, length, dest};
  checkpoint::ReadOptions options;
  options.threads = 1;
  Status status = checkpoint::ReadRanges(
      checkpoint, std::span<const checkpoint::ReadRequest>(&request, 1), options);
  if (!status.ok()) return status.Context("tensor " + t.name);
  return status;
}

}  // namespace

Status ReadHeldBytes(const checkpoint::Checkpoint& checkpoint, const checkpoint::TensorInfo& tensor,
                     const CopyGeometry& copy, uint64_t at, uint64_t length, uint8_t* dest,
                     std::unique_ptr<uint8_t[]>& stage) {
  const CopyGeometry& g = copy;
  uint64_t pos = at;
  const uint64_t end = at + length;
  while (pos < end) {
    const uint64_t row = pos / g.row_bytes, in = pos % g.row_bytes;
    const uint64_t source = g.source_offset + row * g.source_pitch;
    if (g.row_bytes - in >= end - pos || g.source_pitch > kGatherStageBytes) {
      // The rest lies in this row, or rows are too far apart to stage: straight into dest.
      const uint64_t n = std::min(g.row_bytes - in, end - pos);
      WEIGHTCACHE_RETURN_IF_ERROR(Read(checkpoint, tensor, source + in, n, dest + (pos - at)));
      pos += n;
      continue;
    }
    // Rows [row, row + k): from this row's start to the end of the k-th piece, in one read.
    const uint64_t rows_needed = (in + (end - pos) + g.row_bytes - 1) / g.row_bytes;
    const uint64_t k = std::min(
        {rows_needed, g.rows - row, 1 + (kGatherStageBytes - g.row_bytes) / g.source_pitch});
    if (!stage) stage = std::make_unique<uint8_t[]>(kGatherStageBytes);
    WEIGHTCACHE_RETURN_IF_ERROR(
        Read(checkpoint, tensor, source, (k - 1) * g.source_pitch + g.row_bytes, stage.get()));
    for (uint64_t j = 0; j < k && pos < end; ++j) {
      const uint64_t from = j == 0 ? in : 0;
      const uint64_t n = std::min(g.row_bytes - from, end - pos);
      std::memcpy(dest + (pos - at), stage.get() + j * g.source_pitch + from, n);
      pos += n;
    }
  }
  return Status::Ok();
}

}  // namespace weightcache::sharding
