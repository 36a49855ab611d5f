#include "sharding/planner.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "checkpoint/dtype.h"

namespace weightcache::sharding {
namespace {

using checkpoint::TensorInfo;

// vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py).
constexpr uint64_t kVocabPadding = 64;
constexpr std::string_view kScaleSuffix = "_scale_inv";
constexpr std::string_view kLmHeadName = "lm_head.weight";

// What matching a tensor name found.
struct Matched {
  const Rule* rule = nullptr;
  std::optional<uint64_t> layer;   // capture group 1, for stage "layer"
  std::optional<uint64_t> expert;  // capture group 2, for mode "expert"
  size_t expert_pos = 0;           // where group 2 is in the name
  size_t expert_len = 0;
};

std::optional<uint64_t> ParseIndex(const std::ssub_match& group) {
  if (!group.matched || group.length() == 0 || group.length() > 18) return std::nullopt;
  uint64_t v = 0;
  for (auto it = group.first; it != group.second; ++it) {
    if (*it < '0' || *it > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(*it - '0');
  }
  return v;
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

class Planner {
 public:
  Planner(const checkpoint::Checkpoint& checkpoint, const RuleSet& rules, const ModelConfig& config,
          const Ranks& ranks)
      : checkpoint_(checkpoint), rules_(rules), config_(config), ranks_(ranks) {
    num_layers_ = config_.Integer("num_hidden_layers");
    if (num_layers_) {
      layers_ = PpLayerRange(rules_.pp_partition, *num_layers_, ranks_.pp_rank, ranks_.pp_size);
    }
    last_stage_holds_embedding_ =
        config_.tie_word_embeddings && checkpoint_.Find(kLmHeadName) == nullptr;
  }

  Result<Matched> Match(const TensorInfo& t) {
    for (const Rule& rule : rules_.rules) {
      if (rule.mode == Mode::kSkip && rule.stage == Stage::kLayer && num_layers_ &&
          rule.group1_follows_prefix && !SkipCanApply(rule, t.name)) {
        continue;
      }
      if (!rule.Matches(t.name, groups_)) continue;
      Matched m;
      m.rule = &rule;
      if (rule.stage == Stage::kLayer) {
        m.layer = ParseIndex(groups_[1]);
        if (!m.layer) {
          return Error(t, rule, "capture group 1 (the layer index) is not a decimal number");
        }
        if (!num_layers_ && (rule.mode == Mode::kSkip || ranks_.pp_size > 1)) {
          return Error(t, rule, "placing a layer needs num_hidden_layers, which config.json lacks");
        }
        if (rule.mode == Mode::kSkip) {
          // A skip rule by layer applies past the model's layers only (DeepSeek's MTP layers):
          // a layer of the model goes on to the next rules.
          if (*m.layer < *num_layers_) continue;
        } else if (num_layers_ && *m.layer >= *num_layers_) {
          return Error(t, rule,
                       "layer " + std::to_string(*m.layer) + " is past num_hidden_layers " +
                           std::to_string(*num_layers_));
        }
      }
      if (rule.mode == Mode::kExpert) {
        m.expert = ParseIndex(groups_[2]);
        if (!m.expert) {
          return Error(t, rule, "capture group 2 (the expert index) is not a decimal number");
        }
        m.expert_pos = static_cast<size_t>(groups_.position(2));
        m.expert_len = static_cast<size_t>(groups_.length(2));
      }
      return m;
    }
    return InvalidCheckpoint("tensor " + t.name + " matches no rule of shard rule set \"" +
                             rules_.name + "\"");
  }

  // Matches every tensor first, so that a block scale finds its weight's match.
  Status MatchAll(const std::vector<const TensorInfo*>& order) {
    matches_.resize(checkpoint_.tensors().size());
    for (const TensorInfo* t : order) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(matches_[IndexOf(*t)], Match(*t));
    }
    return Status::Ok();
  }
  const Matched& MatchOf(const TensorInfo& t) const { return matches_[IndexOf(t)]; }

  // Two tensors may not claim one expert slot: the same name but for how the expert index is
  // written ("01" and "1"). Names are unique, so a clash needs an index with a leading zero:
  // only those are looked at (the canonical spelling is found with Find, other zero-led
  // spellings in `seen`).
  Status CheckExpertSlot(const TensorInfo& t, const Matched& m,
                         std::unordered_set<std::string>& seen) const {
    if (m.expert_len < 2 || t.name[m.expert_pos] != '0') return Status::Ok();
    std::string canonical = t.name.substr(0, m.expert_pos) + std::to_string(*m.expert) +
                            t.name.substr(m.expert_pos + m.expert_len);
    const TensorInfo* other = checkpoint_.Find(canonical);
    if ((other != nullptr && MatchOf(*other).rule == m.rule) ||
        !seen.insert(std::to_string(m.rule->index) + ":" + canonical).second) {
      return Error(t, *m.rule,
                   "another tensor already claims expert " + std::to_string(*m.expert) +
                       " at this position (" + canonical + ")");
    }
    return Status::Ok();
  }

  // The part of `t` this rank's tp (and, for experts, ep) position selects, whether or not
  // its stage or expert range holds it: nullopt for the whole tensor. Checks every rule.
  Result<std::optional<Slice>> SliceOf(const TensorInfo& t, const Matched& m) {
    const Rule& r = *m.rule;
    const uint64_t tp = ranks_.tp_size;
    const uint64_t rank = ranks_.tp_rank;
    switch (r.mode) {
      case Mode::kReplicate:
      case Mode::kSkip:
        return std::optional<Slice>();
      case Mode::kSplit: {
        WEIGHTCACHE_RETURN_IF_ERROR(CheckHeads(t, r));
        if (r.block != 0) return BlockSlice(t, m);
        const uint32_t d = *r.dim;
        WEIGHTCACHE_RETURN_IF_ERROR(CheckDim(t, r, d));
        const uint64_t n = t.shape[d];
        if (n % tp != 0) {
          return Error(t, r,
                       "dim " + std::to_string(d) + " of shape " + ShapeText(t.shape) +
                           " is not divisible by tp " + std::to_string(tp));
        }
        return MakeSlice(d, rank * (n / tp), n / tp, n);
      }
      case Mode::kVocab: {
        WEIGHTCACHE_RETURN_IF_ERROR(CheckDim(t, r, 0));
        const uint64_t vocab = t.shape[0];
        const uint64_t padded = (vocab + kVocabPadding - 1) / kVocabPadding * kVocabPadding;
        if (padded % tp != 0) {
          return Error(t, r,
                       "the padded vocabulary " + std::to_string(padded) + " (" +
                           std::to_string(vocab) + " rounded up to a multiple of " +
                           std::to_string(kVocabPadding) + ") is not divisible by tp " +
                           std::to_string(tp));
        }
        const uint64_t per = padded / tp;
        const uint64_t begin = std::min(rank * per, vocab);
        const uint64_t end = std::min((rank + 1) * per, vocab);
        return MakeSlice(0, begin, end - begin, vocab);
      }
      case Mode::kKvHeads: {
        WEIGHTCACHE_RETURN_IF_ERROR(CheckDim(t, r, 0));
        const std::optional<uint64_t> kv = config_.NumKvHeads();
        if (!kv || *kv == 0) {
          return Error(t, r,
                       "needs num_key_value_heads or num_attention_heads (> 0) in "
                       "config.json");
        }
        const uint64_t rows = t.shape[0];
        if (rows % *kv != 0) {
          return Error(t, r,
                       "dim 0 (" + std::to_string(rows) + ") is not a whole number of " +
                           std::to_string(*kv) + " kv heads");
        }
        const uint64_t head_dim = rows / *kv;
        if (tp <= *kv) {
          if (*kv % tp != 0) {
            return Error(
                t, r,
                std::to_string(*kv) + " kv heads are not divisible by tp " + std::to_string(tp));
          }
          const uint64_t per = *kv / tp;
          return MakeSlice(0, rank * per * head_dim, per * head_dim, rows);
        }
        if (tp % *kv != 0) {
          return Error(t, r,
                       "tp " + std::to_string(tp) + " is neither a divisor nor a multiple of " +
                           std::to_string(*kv) + " kv heads");
        }
        const uint64_t head = rank / (tp / *kv);
        return MakeSlice(0, head * head_dim, head_dim, rows);
      }
      case Mode::kExpert: {
        std::string key;
        const std::optional<uint64_t> experts = config_.NumExperts(&key);
        if (!experts || *experts == 0) {
          return Error(t, r,
                       "needs the expert count (num_local_experts, num_experts or "
                       "n_routed_experts, > 0) in config.json");
        }
        if (*experts % ranks_.ep_size != 0) {
          return Error(t, r,
                       key + " " + std::to_string(*experts) + " is not divisible by ep " +
                           std::to_string(ranks_.ep_size));
        }
        if (*m.expert >= *experts) {
          return Error(t, r,
                       "expert " + std::to_string(*m.expert) + " is not below " + key + " " +
                           std::to_string(*experts));
        }
        if (r.block != 0) return BlockSlice(t, m);
        const uint64_t moe_tp = MoeTp();
        if (moe_tp == 1 || !r.dim) return std::optional<Slice>();
        const uint32_t d = *r.dim;
        WEIGHTCACHE_RETURN_IF_ERROR(CheckDim(t, r, d));
        const uint64_t n = t.shape[d];
        if (n % moe_tp != 0) {
          return Error(t, r,
                       "dim " + std::to_string(d) + " of shape " + ShapeText(t.shape) +
                           " is not divisible by the experts' tp " + std::to_string(moe_tp));
        }
        const uint64_t moe_rank = rank % moe_tp;
        return MakeSlice(d, moe_rank * (n / moe_tp), n / moe_tp, n);
      }
    }
    return InternalError("unknown mode");
  }

  // Whether this rank's pipeline stage and expert range hold the tensor.
  Result<bool> Holds(const TensorInfo& t, const Matched& m) const {
    const Rule& r = *m.rule;
    if (r.mode == Mode::kSkip) return false;
    const bool first = ranks_.pp_rank == 0;
    const bool last = ranks_.pp_rank + 1 == ranks_.pp_size;
    bool stage = true;
    switch (r.stage) {
      case Stage::kAll:
        break;
      case Stage::kFirst:
        stage = first;
        break;
      case Stage::kLast:
        stage = last;
        break;
      case Stage::kEmbed:
        stage = first || (last && last_stage_holds_embedding_);
        break;
      case Stage::kLayer:
        if (ranks_.pp_size > 1) stage = *m.layer >= layers_.start && *m.layer < layers_.end;
        break;
    }
    if (!stage) return false;
    if (r.mode == Mode::kExpert) {
      const uint64_t per = *config_.NumExperts() / ranks_.ep_size;
      const uint64_t begin = ranks_.ep_rank * per;
      return *m.expert >= begin && *m.expert < begin + per;
    }
    (void)t;
    return true;
  }

  static Status Error(const TensorInfo& t, const Rule& r, const std::string& what) {
    return InvalidCheckpoint("tensor " + t.name + " (" + r.Describe() + "): " + what);
  }

 private:
  size_t IndexOf(const TensorInfo& t) const {
    return static_cast<size_t>(&t - checkpoint_.tensors().data());
  }

  // A skip-by-layer rule applies past num_hidden_layers only; when its group 1 is the digit
  // run after a literal prefix, that is decided here without the regex.
  bool SkipCanApply(const Rule& rule, const std::string& name) const {
    if (!name.starts_with(rule.literal_prefix)) return false;
    uint64_t layer = 0;
    size_t i = rule.literal_prefix.size();
    const size_t start = i;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i - start < 18; ++i) {
      layer = layer * 10 + static_cast<uint64_t>(name[i] - '0');
    }
    if (i == start) return false;      // no digits: the regex cannot match
    if (i - start >= 18) return true;  // let the regex and ParseIndex decide
    return layer >= *num_layers_;
  }

  // `name`, a prefix of t's name: tensors() is sorted by name, so it is usually just before
  // t; a few steps back are tried before a search.
  const TensorInfo* FindNear(const TensorInfo& t, std::string_view name) const {
    const size_t i = IndexOf(t);
    for (size_t back = 1; back <= 4 && back <= i; ++back) {
      const TensorInfo& candidate = checkpoint_.tensors()[i - back];
      if (candidate.name == name) return &candidate;
    }
    return checkpoint_.Find(name);
  }

  uint64_t MoeTp() const {
    return ranks_.ep_size <= ranks_.tp_size ? ranks_.tp_size / ranks_.ep_size : 1;
  }

  static std::optional<Slice> MakeSlice(uint32_t dim, uint64_t offset, uint64_t length,
                                        uint64_t size) {
    if (offset == 0 && length == size) return std::nullopt;
    return Slice{dim, offset, length};
  }

  static Status CheckDim(const TensorInfo& t, const Rule& r, uint32_t d) {
    if (d >= t.shape.size()) {
      return Error(
          t, r,
          "splits dim " + std::to_string(d) + " but the tensor has shape " + ShapeText(t.shape));
    }
    return Status::Ok();
  }

  Status CheckHeads(const TensorInfo& t, const Rule& r) const {
    if (r.heads.empty()) return Status::Ok();
    const std::optional<uint64_t> heads = config_.Integer(r.heads);
    if (!heads) return Error(t, r, "needs \"" + r.heads + "\" in config.json");
    if (*heads % ranks_.tp_size != 0) {
      return Error(t, r,
                   r.heads + " " + std::to_string(*heads) + " is not divisible by tp " +
                       std::to_string(ranks_.tp_size));
    }
    return Status::Ok();
  }

  // A block-quantization scale: the slice of its weight, in block units.
  Result<std::optional<Slice>> BlockSlice(const TensorInfo& t, const Matched& m) {
    const Rule& r = *m.rule;
    if (!t.name.ends_with(kScaleSuffix)) {
      return Error(t, r, "a rule with \"block\" matched a name without the _scale_inv suffix");
    }
    const std::string_view weight_name =
        std::string_view(t.name).substr(0, t.name.size() - kScaleSuffix.size());
    const TensorInfo* weight = FindNear(t, weight_name);
    if (weight == nullptr) {
      return Error(t, r, "its weight " + std::string(weight_name) + " is not in the checkpoint");
    }
    const Matched& wm = MatchOf(*weight);
    if (wm.rule->block != 0) {
      return Error(t, r,
                   "its weight " + std::string(weight_name) + " matches " + wm.rule->Describe() +
                       ", another block-scale rule");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(const std::optional<Slice> ws, SliceOf(*weight, wm));
    if (!ws) return std::optional<Slice>();
    if (r.dim && *r.dim != ws->dim) {
      return Error(t, r,
                   "its weight is split along dim " + std::to_string(ws->dim) +
                       ", the rule says dim " + std::to_string(*r.dim));
    }
    WEIGHTCACHE_RETURN_IF_ERROR(CheckDim(t, r, ws->dim));
    // Every rank's slice of a split has the same length, so this refuses the job on every
    // rank alike, as the engines do: vLLM's validate_fp8_block_shape and Fp8MoEMethod (vLLM
    // and SGLang) raise when the per-partition size is not a multiple of the block.
    if (ws->offset % r.block != 0 || ws->length % r.block != 0) {
      return Error(t, r,
                   "its weight's per-rank slice is " + std::to_string(ws->length) +
                       " rows along dim " + std::to_string(ws->dim) +
                       ", not a multiple of the "
                       "block " +
                       std::to_string(r.block) + " (the engines refuse this split)");
    }
    const uint64_t begin = ws->offset / r.block;
    const uint64_t end = (ws->offset + ws->length + r.block - 1) / r.block;
    const uint64_t n = t.shape[ws->dim];
    if (end > n) {
      return Error(t, r,
                   "has " + std::to_string(n) + " blocks along dim " + std::to_string(ws->dim) +
                       " but its weight's slice needs blocks up to " + std::to_string(end));
    }
    return MakeSlice(ws->dim, begin, end - begin, n);
  }

  const checkpoint::Checkpoint& checkpoint_;
  const RuleSet& rules_;
  const ModelConfig& config_;
  const Ranks ranks_;
  std::optional<uint64_t> num_layers_;
  LayerRange layers_;
  bool last_stage_holds_embedding_ = false;
  std::smatch groups_;            // reused: no allocation per tensor once grown
  std::vector<Matched> matches_;  // by index in checkpoint_.tensors()
};

Result<CopyGeometry> Geometry(const TensorInfo& t, const std::optional<Slice>& slice,
                              const Rule& rule) {
  CopyGeometry g;
  if (!slice) {
    g.row_bytes = t.nbytes;
    g.source_pitch = t.nbytes;
    return g;
  }
  const uint64_t bits = checkpoint::DTypeBits(t.dtype);
  uint64_t outer = 1;
  uint64_t inner = 1;
  bool overflow = false;
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i < slice->dim) overflow |= MulOverflows(outer, t.shape[i], &outer);
    if (i > slice->dim) overflow |= MulOverflows(inner, t.shape[i], &inner);
  }
  uint64_t inner_bits = 0;
  uint64_t row_bits = 0;
  uint64_t pitch_bits = 0;
  uint64_t offset_bits = 0;
  overflow |= MulOverflows(inner, bits, &inner_bits);
  overflow |= MulOverflows(inner_bits, slice->length, &row_bits);
  overflow |= MulOverflows(inner_bits, t.shape[slice->dim], &pitch_bits);
  overflow |= MulOverflows(inner_bits, slice->offset, &offset_bits);
  if (overflow) return Planner::Error(t, rule, "its size overflows 64 bits");
  if (row_bits % 8 != 0 || pitch_bits % 8 != 0 || offset_bits % 8 != 0) {
    return Planner::Error(t, rule,
                          "the slice of this " + std::string(checkpoint::DTypeName(t.dtype)) +
                              " tensor is not a whole number of bytes");
  }
  g.row_bytes = row_bits / 8;
  g.source_offset = offset_bits / 8;
  if (outer == 1) {
    g.source_pitch = g.row_bytes;
  } else {
    g.rows = outer;
    g.source_pitch = pitch_bits / 8;
  }
  return g;
}

}  // namespace

Status ValidateRanks(const Ranks& r) {
  if (r.tp_size == 0 || r.pp_size == 0 || r.ep_size == 0) {
    return InvalidArgument("tp, pp and ep sizes must be at least 1");
  }
  if (r.tp_rank >= r.tp_size) {
    return InvalidArgument("tp rank " + std::to_string(r.tp_rank) + " is not below tp size " +
                           std::to_string(r.tp_size));
  }
  if (r.pp_rank >= r.pp_size) {
    return InvalidArgument("pp rank " + std::to_string(r.pp_rank) + " is not below pp size " +
                           std::to_string(r.pp_size));
  }
  if (r.ep_rank >= r.ep_size) {
    return InvalidArgument("ep rank " + std::to_string(r.ep_rank) + " is not below ep size " +
                           std::to_string(r.ep_size));
  }
  const std::string shape = " (tp " + std::to_string(r.tp_size) + " rank " +
                            std::to_string(r.tp_rank) + ", ep " + std::to_string(r.ep_size) +
                            " rank " + std::to_string(r.ep_rank) + ")";
  if (r.ep_size <= r.tp_size) {
    // SGLang: the experts' TP group is tp/ep ranks, ep_rank = tp_rank / (tp/ep).
    if (r.tp_size % r.ep_size != 0) {
      return InvalidArgument("ep size must divide tp size when it is not larger" + shape);
    }
    const uint32_t moe_tp = r.tp_size / r.ep_size;
    if (r.ep_rank != r.tp_rank / moe_tp) {
      return InvalidArgument(
          "ep rank must be tp rank / (tp/ep) = " + std::to_string(r.tp_rank / moe_tp) + shape);
    }
  } else {
    // vLLM: EP spans TP x DP; this rank's tp position within its ep group.
    if (r.ep_size % r.tp_size != 0) {
      return InvalidArgument("tp size must divide ep size when ep is larger" + shape);
    }
    if (r.ep_rank % r.tp_size != r.tp_rank) {
      return InvalidArgument("ep rank % tp size must equal tp rank" + shape);
    }
  }
  return Status::Ok();
}

LayerRange PpLayerRange(PpPartition partition, uint64_t num_layers, uint32_t pp_rank,
                        uint32_t pp_size) {
  const uint64_t base = num_layers / pp_size;
  const uint64_t rem = num_layers % pp_size;
  if (partition == PpPartition::kSglang) {
    // sglang/srt/distributed/utils.py: the last `rem` partitions get one extra layer.
    if (pp_rank >= pp_size - rem) {
      const uint64_t start = pp_rank * (base + 1) - (pp_size - rem);
      return {start, start + base + 1};
    }
    return {pp_rank * base, pp_rank * base + base};
  }
  // vllm/distributed/utils.py: the remaining layers go one each to partitions[-2], [-3], ...
  uint64_t start = 0;
  uint64_t count = 0;
  for (uint32_t p = 0; p <= pp_rank; ++p) {
    const uint64_t from_end = pp_size - p;  // partitions[-from_end]
    count = base + ((from_end >= 2 && from_end < rem + 2) ? 1 : 0);
    if (p < pp_rank) start += count;
  }
  return {start, start + count};
}

Result<ShardPlan> PlanShard(const checkpoint::Checkpoint& checkpoint, const RuleSet& rules,
                            const ModelConfig& config, const Ranks& ranks) {
  WEIGHTCACHE_RETURN_IF_ERROR(ValidateRanks(ranks));
  std::vector<const TensorInfo*> order;
  order.reserve(checkpoint.tensors().size());
  for (const TensorInfo& t : checkpoint.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->shard != b->shard ? a->shard < b->shard : a->offset < b->offset;
  });

  Planner planner(checkpoint, rules, config, ranks);
  std::vector<bool> used(rules.rules.size(), false);
  std::unordered_set<std::string> expert_slots;  // only names with a zero-led expert index
  ShardPlan plan;
  plan.full_bytes = checkpoint.total_bytes();
  WEIGHTCACHE_RETURN_IF_ERROR(planner.MatchAll(order));
  for (const TensorInfo* t : order) {
    const Matched& m = planner.MatchOf(*t);
    const Rule& rule = *m.rule;
    used[rule.index] = true;
    if (rule.mode == Mode::kExpert) {
      WEIGHTCACHE_RETURN_IF_ERROR(planner.CheckExpertSlot(*t, m, expert_slots));
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<Slice> slice, planner.SliceOf(*t, m));
    WEIGHTCACHE_ASSIGN_OR_RETURN(const bool held, planner.Holds(*t, m));
    if (!held) continue;
    WEIGHTCACHE_ASSIGN_OR_RETURN(CopyGeometry copy, Geometry(*t, slice, rule));
    PlannedTensor p;
    p.tensor = t;
    p.shape = t->shape;
    if (slice) p.shape[slice->dim] = slice->length;
    p.slice = slice;
    p.rule = rule.index;
    p.mode = rule.mode;
    p.copy = copy;
    p.bytes = copy.rows * copy.row_bytes;
    plan.bytes += p.bytes;
    plan.tensors.push_back(std::move(p));
  }
  for (const Rule& rule : rules.rules) {
    if (!rule.optional && !used[rule.index]) {
      return InvalidArgument(rule.Describe() + " of shard rule set \"" + rules.name +
                             "\" matches no tensor of the checkpoint (a rule for a variant "
                             "some checkpoints lack is marked \"optional\": true)");
    }
  }
  return plan;
}

}  // namespace weightcache::sharding
