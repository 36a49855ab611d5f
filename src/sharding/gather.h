// Reading the bytes a rank holds of one tensor (its plan's CopyGeometry) out of the
// checkpoint: the one implementation the daemon's host tier and the client's fallback share.
//
// The held bytes are the geometry's `rows` pieces of `row_bytes`, one after the other; piece r
// lies `source_offset + r * source_pitch` bytes into the tensor. A whole tensor or a dim-0
// slice is one piece: one pread. Pieces of a dim>0 slice are gathered by reading blocks of
// whole source rows with one pread each into a staging buffer (kGatherStageBytes, allocated
// on first need and reused by the caller) and copying the pieces out, so small rows cost no
// syscall each; a row whose pitch exceeds the staging buffer is read on its own.
//
// Thread-safety: reentrant; concurrent calls need their own `stage`.
#pragma once

#include <cstdint>
#include <memory>

#include "checkpoint/checkpoint.h"
#include "sharding/planner.h"
#include "weightcache/status.h"

namespace weightcache::sharding {

inline constexpr uint64_t kGatherStageBytes = uint64_t{8} << 20;

// Reads the held bytes [at, at + length) of `tensor` (laid out by `copy`) into `dest`.
// `stage` is the caller's staging buffer (empty, or kGatherStageBytes from an earlier call).
// The read's error in the context of the tensor.
Status ReadHeldBytes(const checkpoint::Checkpoint& checkpoint, const checkpoint::TensorInfo& tensor,
                     const CopyGeometry& copy, uint64_t at, uint64_t length, uint8_t* dest,
                     std::unique_ptr<uint8_t[]>& stage);

}  // namespace weightcache::sharding
