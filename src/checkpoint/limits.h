// The one set of bounds on a checkpoint's tensor table. A checkpoint is refused
// (kInvalidCheckpoint) when it is opened, before anything is loaded, if it breaks one of them;
// the attach manifest (protocol/manifest.h) is sized from the same constants, so a checkpoint
// that opens always fits the manifest and nothing is refused a second time after the load.
// Real checkpoints are far below them (DeepSeek-V3: ~91k tensors, rank <= 4, names < 100 bytes).
#pragma once

#include <cstdint>

namespace weightcache::checkpoint {

// Dimensions of one tensor (the manifest stores a shape and its strides per tensor).
inline constexpr uint32_t kMaxTensorRank = 8;
// Bytes of one tensor name.
inline constexpr uint32_t kMaxTensorNameBytes = 4096;
// Tensors of a whole checkpoint (every shard together).
inline constexpr uint64_t kMaxTensorCount = 1'000'000;
// Bytes of all tensor names of a checkpoint together.
inline constexpr uint64_t kMaxTensorNameBytesTotal = uint64_t{64} << 20;

}  // namespace weightcache::checkpoint
