// Reading the bytes a rank holds of one tensor (its plan's CopyGeometry) out of the
// checkpoint: the geometry checked against the tensor, then read as a strided run of the
// shard file (os/strided_read.h, the one gather implementation: one pread for a whole tensor
// or a dim-0 slice, blocks of whole source rows through a staging buffer for a dim>0 slice).
//
// Thread-safety: reentrant; concurrent calls need their own `stage`.
#pragma once

#include <cstdint>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "os/strided_read.h"
#include "sharding/planner.h"
#include "weightcache/status.h"

namespace weightcache::sharding {

// The strided run of the shard file that holds `copy` of `tensor`; kInvalidArgument naming
// the tensor when the geometry reaches outside the tensor's bytes.
Result<os::StridedRun> HeldRun(const checkpoint::TensorInfo& tensor, const CopyGeometry& copy);

// Reads the held bytes [at, at + length) of `tensor` (laid out by `copy`) into `dest`.
// `stage` is the caller's staging buffer (empty, or os::kStridedStageBytes from an earlier
// call). Errors in the context of the tensor.
Status ReadHeldBytes(const checkpoint::Checkpoint& checkpoint, const checkpoint::TensorInfo& tensor,
                     const CopyGeometry& copy, uint64_t at, uint64_t length, uint8_t* dest,
                     std::unique_ptr<uint8_t[]>& stage);

}  // namespace weightcache::sharding
