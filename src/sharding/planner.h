// PlanShard: which bytes of each checkpoint tensor one (tp, pp, ep) rank holds, under a rule
// set (sharding/rules.h) and the model's config.json (sharding/model_config.h). The
// semantics are vLLM's and SGLang's default parallel layers; docs/sharding.md states each
// mode and cites the engine sources.
//
// Contract:
//  * ValidateRanks: sizes >= 1, ranks < sizes, and the expert-parallel rank consistent with
//    the tensor-parallel one (ep <= tp: ep divides tp and ep_rank == tp_rank / (tp/ep);
//    ep > tp: tp divides ep and ep_rank % tp == tp_rank). kInvalidArgument (exit 2).
//  * PlanShard matches every tensor (first matching rule wins) and checks every rule of the
//    contract whether or not this rank holds the tensor, so every rank of a job accepts or
//    refuses the same checkpoint (except a block scale's alignment, which the contract checks
//    at this rank's own offset). A rules problem (a non-optional rule that matches nothing)
//    is kInvalidArgument (exit 2); a checkpoint that the rules cannot shard (an unmatched
//    tensor, a dim not divisible, heads not divisible...) is kInvalidCheckpoint (exit 5).
//    Both name the tensor (when there is one) and the rule by index and pattern.
//  * The plan lists the tensors this rank holds in checkpoint order (shards in order, then
//    tensors by their offset in the shard), with the copy geometry a loader needs.
//  * Pure: reads nothing but its arguments; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "sharding/model_config.h"
#include "sharding/rules.h"
#include "weightcache/status.h"

namespace weightcache::sharding {

struct Ranks {
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint32_t pp_size = 1;
  uint32_t pp_rank = 0;
  uint32_t ep_size = 1;
  uint32_t ep_rank = 0;
};

Status ValidateRanks(const Ranks& ranks);

// [start, end) of the layers pipeline stage `pp_rank` runs, as the engine assigns them.
struct LayerRange {
  uint64_t start = 0;
  uint64_t end = 0;
};
LayerRange PpLayerRange(PpPartition partition, uint64_t num_layers, uint32_t pp_rank,
                        uint32_t pp_size);

// The part of a tensor a rank holds along one dim: [offset, offset + length).
struct Slice {
  uint32_t dim = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// How to copy the held part out of the tensor's bytes: `rows` runs of `row_bytes` bytes,
// the first at `source_offset` bytes from the tensor's start, each next one `source_pitch`
// further. A whole tensor or a dim-0 slice is one run (rows == 1): one contiguous range.
struct CopyGeometry {
  uint64_t rows = 1;
  uint64_t row_bytes = 0;
  uint64_t source_pitch = 0;
  uint64_t source_offset = 0;
};

struct PlannedTensor {
  const checkpoint::TensorInfo* tensor = nullptr;  // into the Checkpoint planned
  std::vector<uint64_t> shape;                     // the held shape
  std::optional<Slice> slice;                      // nullopt: the whole tensor
  size_t rule = 0;                                 // index of the rule that matched
  Mode mode = Mode::kReplicate;
  CopyGeometry copy;
  uint64_t bytes = 0;  // held bytes (copy.rows * copy.row_bytes)
};

struct ShardPlan {
  std::vector<PlannedTensor> tensors;  // held by this rank, in checkpoint order
  uint64_t bytes = 0;                  // sum of tensors[i].bytes
  uint64_t full_bytes = 0;             // the whole checkpoint
};

// The plan of one rank. `ranks` is validated first (ValidateRanks). The returned pointers
// live as long as `checkpoint`.
Result<ShardPlan> PlanShard(const checkpoint::Checkpoint& checkpoint, const RuleSet& rules,
                            const ModelConfig& config, const Ranks& ranks);

}  // namespace weightcache::sharding
