#include "sharding/gather.h"

#include <string>

namespace weightcache::sharding {

Result<os::StridedRun> HeldRun(const checkpoint::TensorInfo& tensor, const CopyGeometry& copy) {
  const CopyGeometry& g = copy;
  uint64_t end = 0;  // one past the last held byte, within the tensor
  const bool fits = g.rows > 0 && g.row_bytes > 0 &&
                    (g.rows == 1 || g.source_pitch >= g.row_bytes) &&
                    !__builtin_mul_overflow(g.rows - 1, g.source_pitch, &end) &&
                    !__builtin_add_overflow(end, g.row_bytes, &end) &&
                    !__builtin_add_overflow(end, g.source_offset, &end) && end <= tensor.nbytes;
  if (!fits) {
    return InvalidArgument("tensor " + tensor.name + ": copy geometry of " +
                           std::to_string(g.rows) + " row(s) of " + std::to_string(g.row_bytes) +
                           " bytes, " + std::to_string(g.source_pitch) + " apart from byte " +
                           std::to_string(g.source_offset) + ", is outside its " +
                           std::to_string(tensor.nbytes) + " bytes");
  }
  return os::StridedRun{.file_offset = tensor.offset + g.source_offset,
                        .rows = g.rows,
                        .row_bytes = g.row_bytes,
                        .pitch = g.source_pitch};
}

Status ReadHeldBytes(const checkpoint::Checkpoint& checkpoint, const checkpoint::TensorInfo& tensor,
                     const CopyGeometry& copy, uint64_t at, uint64_t length, uint8_t* dest,
                     std::unique_ptr<uint8_t[]>& stage) {
  if (length == 0) return Status::Ok();
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::StridedRun run, HeldRun(tensor, copy));
  Status status =
      os::ReadStrided(checkpoint.shard_fd(tensor.shard), checkpoint.shards()[tensor.shard].path,
                      run, at, length, dest, stage);
  if (!status.ok()) return status.Context("tensor " + tensor.name);
  return status;
}

}  // namespace weightcache::sharding
