"""An independent NumPy reference of rank sharding (issue 12): which part of which tensor each
(TP, PP, EP) rank of vLLM / SGLang holds.

Written from the engines' parallel layers, not from weightcache's planner or its rule files:
each architecture's tensors are classified here by name (`placement`), then cut by the
engines' semantics:

- `split` (ColumnParallelLinear / RowParallelLinear / MergedColumnParallelLinear,
  vllm/model_executor/layers/linear.py, `weight_loader`: `narrow(dim, tp_rank * shard_size,
  shard_size)` with `shard_size = divide(n, tp_size)`): rank r holds [r*n/tp, (r+1)*n/tp).
  Attention projections also need num_heads % tp == 0 (vLLM's `divide(num_heads, tp_size)` in
  models/llama.py, qwen2.py, qwen3.py, deepseek_v2.py).
- `vocab` (VocabParallelEmbedding / ParallelLMHead, vllm/model_executor/layers/
  vocab_parallel_embedding.py: `pad_vocab_size` to DEFAULT_VOCAB_PADDING_SIZE = 64,
  `vocab_range_from_global_vocab_size`): per = round_up(V, 64) / tp, rank r holds rows
  [r*per, min((r+1)*per, V)), possibly none.
- `kv_heads` (QKVParallelLinear, linear.py: tp >= total_num_kv_heads gives
  num_kv_head_replicas = tp / n_kv and rank r loads head r // replicas; otherwise n_kv / tp
  heads per rank).
- `expert` (FusedMoE, vllm/model_executor/layers/fused_moe/layer.py `determine_expert_map`,
  linear placement: rank ep_rank holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep)); inside an
  expert, SGLang's moe_tp_size = tp // moe_ep_size (python/sglang/srt/distributed/
  parallel_state.py `initialize_model_parallel`: MoE-EP groups are the TP ranks strided by
  moe_tp_size, so ep_rank = tp_rank // moe_tp and moe_tp_rank = tp_rank % moe_tp) splits
  w1/w3 (gate/up) on dim 0 and w2 (down) on dim 1; vLLM's EP = TP x DP when ep > tp
  (experts whole).
- PP layers (vllm/distributed/utils.py `get_pp_indices`: L // pp per stage, the remainder one
  each to partitions[-2], [-3], ...; SGLang python/sglang/srt/distributed/utils.py
  `get_pp_indices`: the remainder to the last stages); embeddings on the first stage, final
  norm and lm_head on the last (vllm/model_executor/models/utils.py PPMissingLayer use in
  llama.py); a tied embedding without lm_head on both.
- fp8 block scales (vllm/model_executor/layers/quantization/fp8.py, block-wise
  `weight_scale_inv` of shape ceil(rows/128) x ceil(cols/128)): the scale follows its weight in
  block units, rows [o/128, ceil((o+l)/128)). The per-rank size must be whole blocks on every
  rank: vLLM's `validate_fp8_block_shape` (quantization/utils/fp8_utils.py) raises when
  input_size_per_partition % block_k or an output partition size % block_n != 0, and
  Fp8MoEMethod.create_weights (quantization/fp8.py, vLLM and SGLang) when the experts'
  intermediate_size_per_partition % block_n != 0: sizes that are the same on every rank, so
  rank 0 (offset 0) refuses too.
- DeepSeek-V3 MTP layers (index >= num_hidden_layers) are skipped by vLLM's main model
  (models/deepseek_v2.py `load_weights` / `get_spec_layer_idx_from_weight_name`).

Every check is made for the whole job (all ranks), so a refused configuration is refused on
every rank: `PlanError` (the CLI's exit 5) lists every offending tensor; `RankError` (exit 2)
is an inconsistent rank tuple.

Arrays are the tensors' raw bytes viewed as unsigned integers of the element size (F8 -> u1,
BF16/F16 -> u2, F32 -> u4): comparisons are exact and NaN patterns compare equal.

    ckpt = read_checkpoint(model_dir)
    expected_rank_tensors(model_dir, Ranks(tp_size=2, tp_rank=1)) -> {name: np.ndarray}
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE
FP8_BLOCK = 128  # DeepSeek-V3 weight_block_size

# safetensors header dtype -> bytes per element (the dtypes the synthetic models use, and the
# other byte-sized ones a real checkpoint may have).
_ELEMENT_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                  "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                  "I64": 8, "U64": 8, "F64": 8}
_RAW = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

# config.json key holding the routed expert count, per model_type.
EXPERT_COUNT_KEY = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts",
                    "deepseek_v3": "n_routed_experts"}


class PlanError(Exception):
    """The checkpoint cannot be sharded this way (CLI exit 5). `errors`: [(tensor, reason)]."""

    def __init__(self, errors: list):
        self.errors = errors
        super().__init__("; ".join(f"{t}: {why}" for t, why in errors))

    @property
    def tensors(self) -> set:
        return {t for t, _ in self.errors}


class RankError(Exception):
    """Inconsistent ranks (CLI exit 2)."""


@dataclass(frozen=True)
class Ranks:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def cli_args(self) -> list:
        return ["--tp-size", str(self.tp_size), "--tp-rank", str(self.tp_rank),
                "--pp-size", str(self.pp_size), "--pp-rank", str(self.pp_rank),
                "--ep-size", str(self.ep_size), "--ep-rank", str(self.ep_rank)]


def job_ranks(tp: int, pp: int, ep: int) -> list:
    """Every rank tuple of a job. ep <= tp: the EP group lives inside the TP group
    (ep_rank = tp_rank / (tp/ep), SGLang); ep > tp: ep/tp data-parallel replicas of the TP
    group (vLLM EP = TP x DP, ep_rank % tp == tp_rank)."""
    out = []
    for pp_rank in range(pp):
        if ep <= tp:
            for t in range(tp):
                out.append(Ranks(tp, t, pp, pp_rank, ep, t // (tp // ep)))
        else:
            for e in range(ep):
                out.append(Ranks(tp, e % tp, pp, pp_rank, ep, e))
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple
    file: str  # shard file name
    begin: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class Slice:
    """A contiguous range of one dim; the rank holds full[..., offset:offset+length, ...]."""
    dim: int
    offset: int
    length: int


@dataclass(frozen=True)
class Placement:
    """How the engines place one tensor (see the module docstring)."""
    mode: str  # split | replicate | vocab | kv_heads | expert | skip
    stage: str = "all"  # layer | first | last | embed | all
    dim: int | None = None
    heads: str | None = None  # config key whose value must divide by tp
    block: int | None = None  # a block-scale tensor: follows `weight_of` in block units
    weight_of: str | None = None
    layer: int | None = None
    expert: int | None = None


class Checkpoint:
    """config.json and the tensors of a safetensors checkpoint, in checkpoint order (shards in
    index order, tensors in header offset order). The header is parsed here, independently of
    weightcache's parser."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        self.config = json.loads((self.dir / "config.json").read_text())
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.tensors: list = []
        for f in files:
            with open(self.dir / f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            rows = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
            for name, h in rows:
                b, e = h["data_offsets"]
                self.tensors.append(TensorInfo(name, h["dtype"], tuple(h["shape"]), f,
                                               8 + n + b, e - b))
        self.by_name = {t.name: t for t in self.tensors}

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def full_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def array(self, name: str) -> np.ndarray:
        """The tensor's bytes as unsigned integers of its element size, in its shape."""
        return self._array(name).copy()

    @functools.lru_cache(maxsize=None)
    def _array(self, name: str) -> np.ndarray:
        t = self.by_name[name]
        with open(self.dir / t.file, "rb") as fh:
            fh.seek(t.begin)
            data = fh.read(t.nbytes)
        a = np.frombuffer(data, dtype=_RAW[_ELEMENT_BYTES[t.dtype]]).reshape(t.shape)
        a.flags.writeable = False
        return a


@functools.lru_cache(maxsize=32)
def read_checkpoint(model_dir) -> Checkpoint:
    return Checkpoint(str(model_dir))


# ---- PP layer placement -----------------------------------------------------------------


def pp_layers(num_layers: int, pp_rank: int, pp_size: int, partition: str = "vllm") -> range:
    """Layers [start, end) of one PP stage.

    vllm: vllm/distributed/utils.py get_pp_indices (no VLLM_PP_LAYER_PARTITION): L // pp each,
    `for i in range(2, remaining + 2): partitions[-i] += 1`.
    sglang: python/sglang/srt/distributed/utils.py get_pp_indices (no
    SGLANG_PP_LAYER_PARTITION): the last `remainder` stages get base + 1."""
    base, rem = divmod(num_layers, pp_size)
    if partition == "vllm":
        parts = [base] * pp_size
        for i in range(2, rem + 2):
            parts[-i] += 1
        start = sum(parts[:pp_rank])
        return range(start, start + parts[pp_rank])
    if partition == "sglang":
        if pp_rank >= pp_size - rem:
            start = pp_rank * (base + 1) - (pp_size - rem)
            return range(start, start + base + 1)
        return range(pp_rank * base, (pp_rank + 1) * base)
    raise ValueError(f"unknown pp_partition {partition!r}")


# ---- what each architecture's tensors are (from the engines' model files) --------------

_LAYER = r"model\.layers\.(\d+)\."


def _llama_family(name: str, c: dict, names) -> Placement | None:
    """vLLM models/llama.py (LlamaAttention: QKVParallelLinear + RowParallelLinear o_proj;
    LlamaMLP: MergedColumnParallelLinear gate_up + RowParallelLinear down), qwen2.py (q/k/v
    bias), qwen3.py (q_norm/k_norm RMSNorm over head_dim, replicated)."""
    if name == "model.embed_tokens.weight":
        tied = c.get("tie_word_embeddings", False) and "lm_head.weight" not in names
        return Placement("vocab", "embed" if tied else "first")
    if name == "lm_head.weight":
        return Placement("vocab", "last")
    if name == "model.norm.weight":
        return Placement("replicate", "last")
    m = re.fullmatch(_LAYER + r"(.*)", name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    table = [
        (r"self_attn\.q_proj\.(weight|bias)", dict(mode="split", dim=0,
                                                  heads="num_attention_heads")),
        (r"self_attn\.[kv]_proj\.(weight|bias)", dict(mode="kv_heads")),
        (r"self_attn\.o_proj\.weight", dict(mode="split", dim=1, heads="num_attention_heads")),
        (r"self_attn\.[qk]_norm\.weight", dict(mode="replicate")),
        (r"(input|post_attention)_layernorm\.weight", dict(mode="replicate")),
        (r"mlp\.(gate|up)_proj\.weight", dict(mode="split", dim=0)),
        (r"mlp\.down_proj\.weight", dict(mode="split", dim=1)),
    ]
    for pat, kw in table:
        if re.fullmatch(pat, rest):
            return Placement(stage="layer", layer=layer, **kw)
    return None


def _moe(name: str, c: dict, names) -> Placement | None:
    """vLLM models/mixtral.py (MixtralMoE: FusedMoE, expert_params_mapping w1/w3 -> w13,
    w2 -> w2; gate ReplicatedLinear), qwen3_moe.py (gate_proj/up_proj/down_proj, mlp.gate
    ReplicatedLinear). FusedMoE's weight_loader: w13 narrow on the intermediate dim (dim 0 of
    the checkpoint's [inter, hidden]), w2 on its dim 1."""
    m = re.fullmatch(_LAYER + r"(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", name)
    if m:
        proj = m.group(4)
        dim = {"w1": 0, "w3": 0, "gate_proj": 0, "up_proj": 0, "w2": 1, "down_proj": 1}[proj]
        return Placement("expert", "layer", dim=dim, layer=int(m.group(1)),
                         expert=int(m.group(3)))
    m = re.fullmatch(_LAYER + r"(block_sparse_moe|mlp)\.gate\.weight", name)
    if m:
        return Placement("replicate", "layer", layer=int(m.group(1)))
    return _llama_family(name, c, names)


def _deepseek_v3(name: str, c: dict, names) -> Placement | None:
    """vLLM models/deepseek_v2.py: DeepseekV2MLAAttention (q_a_proj / kv_a_proj_with_mqa
    ReplicatedLinear, q_b_proj / kv_b_proj ColumnParallelLinear, o_proj RowParallelLinear,
    num_heads % tp asserted through divide), DeepseekV2MLP for dense layers
    (< first_k_dense_replace) and shared_experts, DeepseekV2MoE (gate ReplicatedLinear,
    e_score_correction_bias replicated, FusedMoE experts). MTP layers are skipped."""
    if name.endswith(".weight_scale_inv"):
        weight = name[: -len("_scale_inv")]
        p = _deepseek_v3(weight, c, names)
        if p is None:
            return None
        return Placement(p.mode, p.stage, p.dim, p.heads, FP8_BLOCK, weight, p.layer, p.expert)
    m = re.fullmatch(_LAYER + r"(.*)", name)
    if m and int(m.group(1)) >= c["num_hidden_layers"]:
        return Placement("skip", layer=int(m.group(1)))
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        heads = "num_attention_heads"
        table = [
            (r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", dict(mode="replicate")),
            (r"self_attn\.(q_a|kv_a)_layernorm\.weight", dict(mode="replicate")),
            (r"self_attn\.(q_b_proj|kv_b_proj)\.weight", dict(mode="split", dim=0, heads=heads)),
            (r"self_attn\.o_proj\.weight", dict(mode="split", dim=1, heads=heads)),
            (r"(input|post_attention)_layernorm\.weight", dict(mode="replicate")),
            (r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", dict(mode="split", dim=0)),
            (r"mlp\.(shared_experts\.)?down_proj\.weight", dict(mode="split", dim=1)),
            (r"mlp\.gate\.(weight|e_score_correction_bias)", dict(mode="replicate")),
        ]
        for pat, kw in table:
            if re.fullmatch(pat, rest):
                return Placement(stage="layer", layer=layer, **kw)
    return _moe(name, c, names)


_ARCHITECTURES = {"llama": _llama_family, "mistral": _llama_family, "qwen2": _llama_family,
                  "qwen3": _llama_family, "mixtral": _moe, "qwen3_moe": _moe,
                  "deepseek_v3": _deepseek_v3}


def placement(ckpt: Checkpoint, name: str) -> Placement | None:
    """How the engines place tensor `name` of `ckpt` (None: the engines load no such tensor)."""
    return _ARCHITECTURES[ckpt.model_type](name, ckpt.config, ckpt.by_name)


# ---- cutting --------------------------------------------------------------------------


def check_ranks(r: Ranks) -> None:
    for size, rank, what in ((r.tp_size, r.tp_rank, "tp"), (r.pp_size, r.pp_rank, "pp"),
                             (r.ep_size, r.ep_rank, "ep")):
        if size < 1 or not 0 <= rank < size:
            raise RankError(f"--{what}-rank {rank} outside --{what}-size {size}")


def moe_layout(r: Ranks) -> tuple:
    """(moe_tp, moe_tp_rank) of an expert's inside split; RankError if ep_rank is not the one
    tp_rank implies."""
    if r.ep_size <= r.tp_size:
        if r.tp_size % r.ep_size:
            raise RankError(f"ep {r.ep_size} does not divide tp {r.tp_size}")
        moe_tp = r.tp_size // r.ep_size
        if r.ep_rank != r.tp_rank // moe_tp:
            raise RankError(f"ep_rank {r.ep_rank} != tp_rank {r.tp_rank} / {moe_tp}")
        return moe_tp, r.tp_rank % moe_tp
    if r.ep_size % r.tp_size:
        raise RankError(f"tp {r.tp_size} does not divide ep {r.ep_size}")
    if r.ep_rank % r.tp_size != r.tp_rank:
        raise RankError(f"ep_rank {r.ep_rank} % tp {r.tp_size} != tp_rank {r.tp_rank}")
    return 1, 0


class _Cutter:
    """The per-tensor decision for one rank; every check is done for all ranks of the job."""

    def __init__(self, ckpt: Checkpoint, r: Ranks, partition: str):
        self.ckpt, self.r, self.c = ckpt, r, ckpt.config
        self.layers = pp_layers(self.c["num_hidden_layers"], r.pp_rank, r.pp_size, partition)
        self.errors: list = []

    def fail(self, t: TensorInfo, why: str) -> str:
        self.errors.append((t.name, why))
        return "fail"

    def holds_stage(self, p: Placement) -> bool:
        first, last = self.r.pp_rank == 0, self.r.pp_rank == self.r.pp_size - 1
        return {"all": True, "first": first, "last": last, "embed": first or last,
                "layer": p.layer in self.layers if p.layer is not None else True}[p.stage]

    def split(self, t: TensorInfo, dim: int, parts: int, rank: int):
        n = t.shape[dim]
        if n % parts:
            return self.fail(t, f"dim {dim} ({n}) not divisible by {parts}")
        per = n // parts
        return (dim, rank * per, per)

    def weight_range(self, t: TensorInfo, p: Placement):
        """(dim, offset, length) of the rank's part of `t` placed by `p` (None: whole; the
        string "fail" after an error; "none" when an expert is not on this rank)."""
        r, c = self.r, self.c
        if p.mode == "replicate":
            return None
        if p.heads is not None and c[p.heads] % r.tp_size:
            return self.fail(t, f"{p.heads} {c[p.heads]} not divisible by tp {r.tp_size}")
        if p.mode == "split":
            return self.split(t, p.dim, r.tp_size, r.tp_rank)
        if p.mode == "vocab":
            v = t.shape[0]
            padded = -(-v // VOCAB_PADDING) * VOCAB_PADDING
            if padded % r.tp_size:
                return self.fail(t, f"padded vocab {padded} not divisible by tp {r.tp_size}")
            per = padded // r.tp_size
            lo = r.tp_rank * per
            hi = min(lo + per, v)
            return (0, min(lo, v), max(hi - lo, 0))
        if p.mode == "kv_heads":
            n_kv = c.get("num_key_value_heads", c["num_attention_heads"])
            rows = t.shape[0]
            if rows % n_kv:
                return self.fail(t, f"{rows} rows not divisible by {n_kv} kv heads")
            head_dim = rows // n_kv
            if r.tp_size <= n_kv:
                if n_kv % r.tp_size:
                    return self.fail(t, f"{n_kv} kv heads not divisible by tp {r.tp_size}")
                per = n_kv // r.tp_size
                return (0, r.tp_rank * per * head_dim, per * head_dim)
            if r.tp_size % n_kv:
                return self.fail(t, f"tp {r.tp_size} not divisible by {n_kv} kv heads")
            head = r.tp_rank // (r.tp_size // n_kv)
            return (0, head * head_dim, head_dim)
        if p.mode == "expert":
            E = c[EXPERT_COUNT_KEY[self.ckpt.model_type]]
            if E % r.ep_size:
                return self.fail(t, f"{E} experts not divisible by ep {r.ep_size}")
            if p.expert >= E:
                return self.fail(t, f"expert {p.expert} >= {E} experts")
            moe_tp, moe_rank = moe_layout(r)
            if p.expert // (E // r.ep_size) != r.ep_rank:
                return "none"
            if moe_tp > 1 and p.dim is not None:
                return self.split(t, p.dim, moe_tp, moe_rank)
            return None
        raise AssertionError(p.mode)

    def parts_of(self, p: Placement) -> int:
        """How many pieces a split of this placement cuts (for the job-wide block check)."""
        if p.mode == "expert":
            try:
                return moe_layout(self.r)[0]
            except RankError:
                return 1
        return self.r.tp_size

    def cut(self, t: TensorInfo):
        """"none" (not held), None (whole) or a Slice."""
        p = placement(self.ckpt, t.name)
        if p is None:
            self.fail(t, "matched by no rule")
            return "none"
        if p.mode == "skip":
            return "none"
        if p.block is None:
            held_stage = self.holds_stage(p)
            got = self.weight_range(t, p)
            if got in ("fail", "none") or not held_stage:
                return "none"
            if got is None or got[2] == t.shape[got[0]]:
                return None  # the whole tensor (e.g. tp 1) is held whole, not as a slice
            # A weight with a block-scale partner is cut on whole blocks: every rank's offset
            # (multiples of the per-rank size) a multiple of the block.
            if t.name + "_scale_inv" in self.ckpt.by_name:
                step = t.shape[got[0]] // self.parts_of(p)
                if step % FP8_BLOCK:  # reported on the weight and on its scale
                    why = f"per-rank {step} of dim {got[0]} is not whole {FP8_BLOCK}-blocks"
                    self.fail(t, why)
                    self.errors.append((t.name + "_scale_inv", why))
                    return "none"
            return Slice(*got)
        # a block scale: the weight's range in block units
        w = self.ckpt.by_name.get(p.weight_of)
        if w is None:
            self.fail(t, f"no weight {p.weight_of} for the scale")
            return "none"
        errors_before = len(self.errors)
        got = self.weight_range(w, p)
        del self.errors[errors_before:]  # reported on the weight itself
        if got in ("fail", "none") or not self.holds_stage(p):
            return "none"
        if got is None or got[2] == w.shape[got[0]]:
            return None
        dim, o, length = got
        lo, hi = o // p.block, -(-(o + length) // p.block)
        return Slice(dim, lo, hi - lo)


@functools.lru_cache(maxsize=256)
def _job_errors(ckpt: Checkpoint, tp: int, ep: int) -> list:
    """Every tensor the job (tp, ep) cannot cut, checked by cutting for each of its TP/EP
    ranks (PP stages do not change a cut), in checkpoint order."""
    errors: dict = {}
    for other in job_ranks(tp, 1, ep):
        cutter = _Cutter(ckpt, other, "vllm")
        for t in ckpt.tensors:
            cutter.cut(t)
        for name, why in cutter.errors:
            errors.setdefault(name, why)
    order = {t.name: i for i, t in enumerate(ckpt.tensors)}
    return sorted(errors.items(), key=lambda kv: order[kv[0]])


def plan_rank(model_dir, r: Ranks, partition: str = "vllm") -> list:
    """[(TensorInfo, Slice | None)] the rank holds, in checkpoint order (None: the whole
    tensor, also when a split leaves one rank the whole dim; a vocab rank past the vocabulary
    holds a 0-row Slice). Raises RankError, or PlanError naming every offending tensor of
    the job (all ranks checked)."""
    check_ranks(r)
    ckpt = read_checkpoint(model_dir)
    if any(placement(ckpt, t.name) is not None and placement(ckpt, t.name).mode == "expert"
           for t in ckpt.tensors):
        moe_layout(r)
    errors = _job_errors(ckpt, r.tp_size, r.ep_size)
    if errors:
        raise PlanError(errors)
    cutter = _Cutter(ckpt, r, partition)
    held = []
    for t in ckpt.tensors:
        s = cutter.cut(t)
        if s != "none":
            held.append((t, s))
    assert not cutter.errors, cutter.errors
    return held


def apply_slice(full: np.ndarray, s: Slice | None) -> np.ndarray:
    if s is None:
        return full
    index = [slice(None)] * full.ndim
    index[s.dim] = slice(s.offset, s.offset + s.length)
    return full[tuple(index)]


def expected_rank_tensors(model_dir, r: Ranks, partition: str = "vllm") -> dict:
    """{name: raw array} of what rank `r` holds, in checkpoint order (see plan_rank)."""
    ckpt = read_checkpoint(model_dir)
    return {t.name: apply_slice(ckpt._array(t.name), s)
            for t, s in plan_rank(model_dir, r, partition)}


def assert_rebuilds(ckpt: Checkpoint, per_rank: dict) -> None:
    """Every tensor the engines load is rebuilt exactly from the ranks' pieces, each element
    covered, overlapping pieces (replicas) identical; skipped tensors are held by no rank.

    per_rank: {ranks: {name: (Slice | None, array)}}, the arrays from any source (a plan's
    slices cut from the file, a daemon's attached tensors, the fallback loader's), as raw
    unsigned integers of the element size (see Checkpoint.array)."""
    for info in ckpt.tensors:
        full = ckpt._array(info.name)
        out = np.zeros_like(full)
        seen = np.zeros(full.shape, dtype=bool)
        holders = 0
        for ranks, held in per_rank.items():
            if info.name not in held:
                continue
            holders += 1
            s, piece = held[info.name]
            index = [slice(None)] * full.ndim
            if s is not None:
                index[s.dim] = slice(s.offset, s.offset + s.length)
            index = tuple(index)
            overlap = seen[index]
            assert np.array_equal(out[index][overlap], piece[overlap]), \
                f"{info.name}: replicas differ on {ranks}"
            out[index] = piece
            seen[index] = True
        if placement(ckpt, info.name).mode == "skip":
            assert holders == 0, f"{info.name} is skipped by the engines but held"
            continue
        assert seen.all(), f"{info.name}: {int((~seen).sum())} elements held by no rank"
        assert out.tobytes() == full.tobytes(), info.name


def slice_nbytes(t: TensorInfo, s: Slice | None) -> int:
    if s is None:
        return t.nbytes
    return t.nbytes // t.shape[s.dim] * s.length if t.shape[s.dim] else 0


def canonical_digest(rules: dict) -> str:
    """sha256 hex of the rules' canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(rules, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
