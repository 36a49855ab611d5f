"""`weightcache shard-plan` (issue 12) against the independent NumPy reference (reference.py) on
synthetic checkpoints of every built-in rule set's architecture (synthetic.py).

For TP in {1,2,4,8}, PP in {1,2}, EP in {1,2,4} (MoE models): every rank of the job is planned
with `--json`; held names, dtypes, shapes and slices must equal the reference's, the plan's
slice applied to the full tensor must equal the reference's bytes, and the ranks together must
rebuild every tensor exactly (replicas identical). Configurations the engines refuse must exit
5 on every rank, naming an offending tensor and its rule. Then the rules digest, a user's rules
file, and bad rules / checkpoints / ranks with their exit codes (2 or 5) and messages.

The CLI: $WEIGHTCACHE_CLI, else the package's / PATH's `weightcache`, else
build/tools/weightcache. Without one that has `shard-plan`, the module is skipped (so this
tier passes before the planner lands); with one, every test runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from . import reference as ref
from . import synthetic

ROOT = Path(__file__).resolve().parents[3]


def _find_cli() -> str | None:
    candidates = [os.environ.get("WEIGHTCACHE_CLI")]
    try:
        import weightcache

        candidates.append(weightcache.cli_path())
    except (ImportError, FileNotFoundError):
        pass
    candidates += [shutil.which("weightcache"), str(ROOT / "build" / "tools" / "weightcache")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    return None


CLI = _find_cli()
if CLI is None:
    pytest.skip("no weightcache CLI (set WEIGHTCACHE_CLI or build build/tools/weightcache)",
                allow_module_level=True)
_probe = subprocess.run([CLI, "shard-plan", "--list-rules"], capture_output=True, text=True)
if _probe.returncode != 0:
    pytest.skip(f"{CLI} has no working `shard-plan --list-rules` (exit {_probe.returncode}: "
                f"{(_probe.stderr or _probe.stdout).strip()[:200]})", allow_module_level=True)

TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2)
EP_SIZES = (1, 2, 4)
MOE = tuple(ref.EXPERT_COUNT_KEY)


def shard_plan(*args) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "shard-plan", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def plan_json(model_dir, ranks: ref.Ranks, *extra) -> dict:
    p = shard_plan("--model", model_dir, *ranks.cli_args(), "--json", *extra)
    assert p.returncode == 0, f"{ranks}: exit {p.returncode}: {p.stderr}"
    return json.loads(p.stdout)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shard-models")
    return {m: synthetic.write_model(m, root / m) for m in synthetic.MODEL_TYPES}


@pytest.fixture(scope="session")
def builtin_rules() -> dict:
    """{name: the built-in set's JSON as `--print-rules` prints it}."""
    out = {}
    for m in synthetic.MODEL_TYPES:
        p = shard_plan("--print-rules", m)
        assert p.returncode == 0, f"--print-rules {m}: exit {p.returncode}: {p.stderr}"
        out[m] = json.loads(p.stdout)
    return out


def rule_of(rules: dict, name: str, config: dict | None = None) -> tuple:
    """(index, rule) of the first rule whose `match` fully matches tensor `name`. A `skip` rule
    with stage `layer` applies only to layers >= num_hidden_layers (DeepSeek-V3's MTP layer,
    which a regex cannot tell from the model's own layers): other layers fall through."""
    for i, r in enumerate(rules["rules"]):
        m = re.fullmatch(r["match"], name)
        if m and r["mode"] == "skip" and r.get("stage") == "layer" and config is not None:
            if int(m.group(1)) < config["num_hidden_layers"]:
                continue
        if m:
            return i, r
    raise AssertionError(f"no rule of {rules['name']} matches {name}")


def run_rules(tmp_path, model_dir, rules, ranks=ref.Ranks(tp_size=2)):
    """shard-plan --json with `rules` (a dict, or raw text) written to a file."""
    path = tmp_path / "rules.json"
    path.write_text(rules if isinstance(rules, str) else json.dumps(rules))
    return shard_plan("--model", model_dir, *ranks.cli_args(), "--json", "--shard-rules", path)


def _rule_index(rules: dict, tensor: str) -> int:
    return rule_of(rules, tensor)[0]


def _rule_and_match(rules: dict, tensor: str) -> tuple:
    index, rule = rule_of(rules, tensor)
    return index, rule["match"]


def assert_names_rule(message: str, index: int, match: str) -> None:
    """The message names the rule by index ('rule N') and by its match string."""
    assert re.search(rf"\brule\s*#?{index}\b", message), f"no 'rule {index}': {message}"
    assert match in message, f"rule {index}'s match {match!r} not in: {message}"


def job_params():
    for m in synthetic.MODEL_TYPES:
        for tp in TP_SIZES:
            for pp in PP_SIZES:
                for ep in EP_SIZES if m in MOE else (1,):
                    refused = "-refused" if (m, tp, ep) in synthetic.REFUSED else ""
                    yield pytest.param(m, tp, pp, ep, id=f"{m}-tp{tp}-pp{pp}-ep{ep}{refused}")


def check_refused(model_dir, rules: dict, job: list, err: ref.PlanError) -> None:
    """Every rank of a refused job exits 5 naming an offending tensor and its rule. (The
    engines refuse the job, not single ranks: e.g. vLLM's validate_fp8_block_shape checks the
    per-rank size, the same on every rank, so rank 0 is refused too.)"""
    accepted = []
    for ranks in job:
        p = shard_plan("--model", model_dir, *ranks.cli_args(), "--json")
        if p.returncode == 0:
            accepted.append(ranks)
            continue
        assert p.returncode == 5, f"{ranks}: expected exit 5 ({err}), got {p.returncode}"
        named = [t for t in err.tensors if re.search(rf"{re.escape(t)}(?![\w.])", p.stderr)]
        assert named, f"{ranks}: message names none of {sorted(err.tensors)}: {p.stderr}"
        index, rule = rule_of(rules, named[0], ref.read_checkpoint(model_dir).config)
        assert_names_rule(p.stderr, index, rule["match"])
    assert not accepted, (f"{len(accepted)} of {len(job)} ranks accepted a job the engines "
                          f"refuse ({err.errors[0]}): {accepted}")


def check_rank(ckpt: ref.Checkpoint, rules: dict, ranks: ref.Ranks, got: dict,
               partition: str = "vllm", rules_name: str | None = None) -> dict:
    """Compares one rank's --json plan with the reference; returns {name: (Slice|None, bytes
    array)} of what the plan holds, cut from the full tensors by the plan's own slices."""
    expected = ref.plan_rank(ckpt.dir, ranks, partition)
    for key in ("tp_size", "tp_rank", "pp_size", "pp_rank", "ep_size", "ep_rank"):
        assert got[key] == getattr(ranks, key), key
    assert got["model_type"] == ckpt.model_type
    assert got["rules"]["name"] == (rules_name or ckpt.model_type)
    assert re.fullmatch(r"[0-9a-f]{64}", got["rules"]["digest"])
    # A vocab rank past the vocabulary holds 0 rows: the plan may list it empty or omit it.
    listed = {t["name"] for t in got["tensors"]}
    expected = [(t, s) for t, s in expected
                if not (s is not None and s.length == 0 and t.name not in listed)]
    assert [t["name"] for t in got["tensors"]] == [t.name for t, _ in expected], ranks
    held, total = {}, 0
    for entry, (info, s) in zip(got["tensors"], expected):
        where = f"{ranks} {info.name}"
        assert entry["dtype"] == info.dtype, where
        assert tuple(entry["full_shape"]) == info.shape, where
        if s is None:
            assert entry["slice"] is None, f"{where}: {entry['slice']}"
            shape = info.shape
        else:
            if s.length == 0:  # past the vocabulary: the offset of an empty range is moot
                assert entry["slice"]["dim"] == s.dim and entry["slice"]["length"] == 0, where
            else:
                assert entry["slice"] == {"dim": s.dim, "offset": s.offset,
                                          "length": s.length}, f"{where}: {entry['slice']} != {s}"
            shape = info.shape[:s.dim] + (s.length,) + info.shape[s.dim + 1:]
        assert tuple(entry["shape"]) == shape, where
        index, rule = rule_of(rules, info.name, ckpt.config)
        assert entry["rule"] == index, f"{where}: rule {entry['rule']} != {index}"
        assert entry["mode"] == rule["mode"] == ref.placement(ckpt, info.name).mode, where
        # The plan's slice applied to the full tensor is the reference's array, byte for byte.
        plan_slice = None if entry["slice"] is None else ref.Slice(**entry["slice"])
        piece = ref.apply_slice(ckpt._array(info.name), plan_slice)
        want = ref.apply_slice(ckpt._array(info.name), s)
        assert piece.shape == want.shape and piece.tobytes() == want.tobytes(), where
        held[info.name] = (plan_slice, piece)
        total += piece.nbytes
    assert got["bytes"] == total
    assert got["full_bytes"] == ckpt.full_bytes
    return held


def test_list_rules():
    p = shard_plan("--list-rules")
    assert p.returncode == 0, p.stderr
    for m in synthetic.MODEL_TYPES:
        assert re.search(rf"(?<![\w]){m}(?![\w])", p.stdout), f"{m} not listed: {p.stdout}"


@pytest.mark.parametrize("model, tp, pp, ep", list(job_params()))
def test_plan_matches_reference(models, builtin_rules, model, tp, pp, ep):
    model_dir = models[model]
    try:
        ref.plan_rank(model_dir, ref.job_ranks(tp, pp, ep)[0])
    except ref.PlanError as err:
        assert (model, tp, ep) in synthetic.REFUSED, err
    else:
        assert (model, tp, ep) not in synthetic.REFUSED
    check_job(model_dir, builtin_rules[model], tp, pp, ep)


def check_job(model_dir, rules: dict, tp: int, pp: int, ep: int) -> None:
    """Plans every rank of the job with the built-in rules and compares with the reference:
    a refused job exits 5 on every rank; an accepted one matches rank by rank and rebuilds."""
    ckpt = ref.read_checkpoint(model_dir)
    job = ref.job_ranks(tp, pp, ep)
    try:
        ref.plan_rank(model_dir, job[0])
    except ref.PlanError as err:
        check_refused(model_dir, rules, job, err)
        return
    per_rank = {}
    digests = set()
    for ranks in job:
        got = plan_json(model_dir, ranks)
        assert got["rules"]["source"] == "builtin"
        digests.add(got["rules"]["digest"])
        per_rank[ranks] = check_rank(ckpt, rules, ranks, got)
    assert digests == {ref.canonical_digest(rules)}
    ref.assert_rebuilds(ckpt, per_rank)


@pytest.mark.parametrize("variant, tp, pp, ep", [
    ("qwen3-tied-with-lm-head", 2, 2, 1),
    ("qwen3_moe-mlp-only-layer", 4, 2, 2),
    ("qwen3_moe-mlp-only-layer", 2, 1, 4),
    ("llama-7-layers", 2, 3, 1),
    ("llama-7-layers", 1, 4, 1),
])
def test_variants_match_reference(builtin_rules, tmp_path, variant, tp, pp, ep):
    model_dir = synthetic.write_variant(variant, tmp_path / variant)
    check_job(model_dir, builtin_rules[synthetic.VARIANTS[variant][0]], tp, pp, ep)
    ckpt = ref.read_checkpoint(model_dir)
    if variant == "qwen3-tied-with-lm-head":
        last = ref.plan_rank(model_dir, ref.Ranks(tp, 0, pp, pp - 1))
        assert "model.embed_tokens.weight" not in [t.name for t, _ in last]
    if variant == "llama-7-layers":
        assert ckpt.config["num_hidden_layers"] == 7


@pytest.mark.parametrize("model", synthetic.MODEL_TYPES)
def test_digest_and_rules_file(models, builtin_rules, model, tmp_path):
    """The built-in set's --print-rules JSON, written to a file (and reformatted), gives the
    same digest and the same plan as the built-in set."""
    rules = builtin_rules[model]
    assert rules["format"] == 1 and rules["name"] == model
    ranks = ref.Ranks(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    builtin = plan_json(models[model], ranks)
    named = plan_json(models[model], ranks, "--shard-rules", model)
    assert builtin["rules"]["digest"] == ref.canonical_digest(rules)
    assert named == builtin
    compact = tmp_path / "rules.json"
    compact.write_text(json.dumps(rules))
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(dict(reversed(list(rules.items()))), indent=4))
    for path in (compact, pretty):
        from_file = plan_json(models[model], ranks, "--shard-rules", path)
        assert from_file["rules"]["digest"] == builtin["rules"]["digest"], path
        assert from_file["rules"]["source"] != "builtin"
        assert from_file["tensors"] == builtin["tensors"]
        assert from_file["bytes"] == builtin["bytes"]


def test_sglang_partition(models, builtin_rules, tmp_path):
    """pp_partition "sglang": the remainder layers go to the last stages (qwen2: 5 layers,
    pp 2 -> [2, 3] instead of vLLM's [3, 2]); the digest differs from the built-in set's."""
    model_dir = models["qwen2"]
    ckpt = ref.read_checkpoint(model_dir)
    rules = dict(builtin_rules["qwen2"], pp_partition="sglang", name="qwen2-sglang")
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps(rules))
    per_rank = {}
    for ranks in ref.job_ranks(2, 2, 1):
        got = plan_json(model_dir, ranks, "--shard-rules", path)
        assert got["rules"]["digest"] == ref.canonical_digest(rules)
        assert got["rules"]["digest"] != ref.canonical_digest(builtin_rules["qwen2"])
        per_rank[ranks] = check_rank(ckpt, rules, ranks, got, "sglang", "qwen2-sglang")
    last = per_rank[ref.Ranks(2, 0, 2, 1)]
    assert "model.layers.2.input_layernorm.weight" in last
    ref.assert_rebuilds(ckpt, per_rank)


def test_user_rules_replicate_everything(models, tmp_path):
    """A one-rule file: every rank holds every tensor whole, the rule index 0, mode replicate,
    whatever the TP/PP ranks."""
    ckpt = ref.read_checkpoint(models["qwen3"])
    rules = {"format": 1, "name": "all", "rules": [{"match": ".*", "mode": "replicate"}]}
    for ranks in (ref.Ranks(), ref.Ranks(tp_size=4, tp_rank=3, pp_size=2, pp_rank=1)):
        p = run_rules(tmp_path, models["qwen3"], rules, ranks)
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
        assert [t["name"] for t in got["tensors"]] == [t.name for t in ckpt.tensors]
        assert all(t["slice"] is None and t["rule"] == 0 and t["mode"] == "replicate"
                   and t["shape"] == t["full_shape"] for t in got["tensors"])
        assert got["bytes"] == got["full_bytes"] == ckpt.full_bytes
        assert got["rules"]["digest"] == ref.canonical_digest(rules)


# ---- bad rules: exit 2, the message names the rule ----------------------------------------


@pytest.mark.parametrize("case", ["unknown_mode", "bad_regex", "unknown_rule_key",
                                  "unknown_top_key", "missing_match", "missing_mode",
                                  "matches_nothing"])
def test_bad_rules_exit_2(models, builtin_rules, tmp_path, case):
    rules = copy.deepcopy(builtin_rules["llama"])
    i = _rule_index(rules, "model.norm.weight")
    rule = rules["rules"][i]
    match = rule["match"]
    if case == "unknown_mode":
        rule["mode"] = "shard"
    elif case == "bad_regex":
        rule["match"] = match = r"model\.norm\.(weight"
    elif case == "unknown_rule_key":
        rule["dims"] = 0
    elif case == "unknown_top_key":
        rules["tp_default"] = 2
    elif case == "missing_match":
        del rule["match"]
    elif case == "missing_mode":
        del rule["mode"]
    elif case == "matches_nothing":
        i, match = len(rules["rules"]), r"model\.final_norm\.weight"
        rules["rules"].append({"match": match, "mode": "replicate", "stage": "last"})
    p = run_rules(tmp_path, models["llama"], rules)
    assert p.returncode == 2, f"{case}: exit {p.returncode}: {p.stdout} {p.stderr}"
    assert p.stdout == ""
    if case == "unknown_top_key":
        assert "tp_default" in p.stderr, p.stderr
    elif case == "missing_match":
        assert re.search(rf"\brule\s*#?{i}\b", p.stderr), p.stderr
        assert "match" in p.stderr, p.stderr
    else:
        assert_names_rule(p.stderr, i, match)
        if case == "unknown_rule_key":
            assert "dims" in p.stderr, p.stderr
        if case == "unknown_mode":
            assert "shard" in p.stderr, p.stderr


def test_rules_not_json_exit_2(models, tmp_path):
    p = run_rules(tmp_path, models["llama"], '{"format": 1, "rules": [')
    assert p.returncode == 2, p.stderr
    assert "rules.json" in p.stderr, p.stderr


# ---- checkpoint vs rules: exit 5, the message names the tensor and the rule ---------------


def test_tensor_matched_by_no_rule_exit_5(models, builtin_rules, tmp_path):
    rules = copy.deepcopy(builtin_rules["llama"])
    del rules["rules"][_rule_index(rules, "model.norm.weight")]
    p = run_rules(tmp_path, models["llama"], rules)
    assert p.returncode == 5, p.stderr
    assert "model.norm.weight" in p.stderr, p.stderr


def test_split_not_dividing_exit_5(models, builtin_rules, tmp_path):
    """mistral's vocab 130 split plainly (not as vocab) over tp 4: 130 % 4 != 0."""
    rules = copy.deepcopy(builtin_rules["mistral"])
    i = _rule_index(rules, "model.embed_tokens.weight")
    rules["rules"][i] = {"match": rules["rules"][i]["match"], "mode": "split", "dim": 0,
                         "stage": rules["rules"][i].get("stage", "all")}
    p = run_rules(tmp_path, models["mistral"], rules, ref.Ranks(tp_size=4, tp_rank=1))
    assert p.returncode == 5, p.stderr
    assert "model.embed_tokens.weight" in p.stderr, p.stderr
    assert_names_rule(p.stderr, i, rules["rules"][i]["match"])
    p = run_rules(tmp_path, models["mistral"], rules, ref.Ranks(tp_size=2, tp_rank=1))
    assert p.returncode == 0, p.stderr  # 130 % 2 == 0
    got = json.loads(p.stdout)
    emb = next(t for t in got["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert emb["slice"] == {"dim": 0, "offset": 65, "length": 65}


def test_padded_vocab_not_dividing_exit_5(models, builtin_rules, tmp_path):
    """tp 3: llama's padded vocab 1024 % 3 != 0 (and so are its heads)."""
    p = shard_plan("--model", models["llama"], *ref.Ranks(tp_size=3, tp_rank=0).cli_args())
    assert p.returncode == 5, p.stderr
    err = pytest.raises(ref.PlanError, ref.plan_rank, models["llama"], ref.Ranks(tp_size=3))
    assert "lm_head.weight" in err.value.tensors
    named = [t for t in err.value.tensors if re.search(rf"{re.escape(t)}(?![\w.])", p.stderr)]
    assert named, p.stderr
    assert_names_rule(p.stderr, *_rule_and_match(builtin_rules["llama"], named[0]))


def _variant(tmp_path, model_type, name, config_changes, rename=None):
    config = dict(synthetic.CONFIGS[model_type], **config_changes)
    specs = synthetic.tensor_specs(model_type, config)
    if rename:
        specs = rename(specs)
    return synthetic.write_checkpoint(tmp_path / name, model_type, config, specs)


def test_kv_heads_not_dividing_exit_5(builtin_rules, tmp_path):
    """qwen2 with 3 KV heads (6 query heads): tp 2 neither divides 3 nor is divided by it."""
    d = _variant(tmp_path, "qwen2", "kv3", {"num_key_value_heads": 3})
    p = shard_plan("--model", d, *ref.Ranks(tp_size=2, tp_rank=0).cli_args())
    assert p.returncode == 5, p.stderr
    bad = pytest.raises(ref.PlanError, ref.plan_rank, d, ref.Ranks(tp_size=2)).value.tensors
    assert bad and all(re.search(r"\.[kv]_proj\.", t) for t in bad), bad
    named = [t for t in bad if t in p.stderr]
    assert named, p.stderr
    index, rule = rule_of(builtin_rules["qwen2"], named[0])
    assert_names_rule(p.stderr, index, rule["match"])


def test_experts_not_dividing_ep_exit_5(builtin_rules, tmp_path):
    """mixtral with 6 experts over ep 4."""
    d = _variant(tmp_path, "mixtral", "e6", {"num_local_experts": 6})
    p = shard_plan("--model", d, *ref.Ranks(tp_size=4, tp_rank=0, ep_size=4).cli_args())
    assert p.returncode == 5, p.stderr
    m = re.search(r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
                  p.stderr)
    assert m, p.stderr
    assert_names_rule(p.stderr, *_rule_and_match(builtin_rules["mixtral"], m.group(0)))
    assert re.search(r"\b6\b", p.stderr) and re.search(r"\b4\b", p.stderr), p.stderr


def test_expert_index_out_of_range_exit_5(builtin_rules, tmp_path):
    """A checkpoint with experts 0..3 whose config says 3 experts: expert 3 is out of range."""
    config = dict(synthetic.CONFIGS["mixtral"], num_local_experts=3)
    specs = synthetic.tensor_specs("mixtral")  # 4 experts' tensors
    d = synthetic.write_checkpoint(tmp_path / "e3", "mixtral", config, specs)
    p = shard_plan("--model", d, *ref.Ranks().cli_args())
    assert p.returncode == 5, p.stderr
    assert re.search(r"block_sparse_moe\.experts\.3\.w[123]\.weight", p.stderr), p.stderr
    i, rule = rule_of(builtin_rules["mixtral"], re.search(
        r"model\.layers\.\d+\.block_sparse_moe\.experts\.3\.w[123]\.weight", p.stderr).group(0))
    assert_names_rule(p.stderr, i, rule["match"])


def test_expert_slot_claimed_twice_exit_5(builtin_rules, tmp_path):
    """`experts.01.w1` next to `experts.1.w1`: both claim layer 0's expert 1 w1 slot."""
    specs = synthetic.tensor_specs("mixtral")
    dup = next(s for s in specs if s[0] == "model.layers.0.block_sparse_moe.experts.1.w1.weight")
    specs.append((dup[0].replace("experts.1.", "experts.01."), dup[1], dup[2]))
    d = synthetic.write_checkpoint(tmp_path / "dup", "mixtral", synthetic.CONFIGS["mixtral"],
                                   specs)
    p = shard_plan("--model", d, *ref.Ranks().cli_args())
    assert p.returncode == 5, p.stderr
    m = re.search(r"model\.layers\.0\.block_sparse_moe\.experts\.0?1\.w1\.weight", p.stderr)
    assert m, p.stderr
    assert_names_rule(p.stderr, *_rule_and_match(builtin_rules["mixtral"], m.group(0)))


# ---- ranks and model types ----------------------------------------------------------------


@pytest.mark.parametrize("ranks", [
    ref.Ranks(tp_size=2, tp_rank=2),  # rank outside size
    ref.Ranks(pp_size=2, pp_rank=2),
    ref.Ranks(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1),  # ep <= tp: ep_rank = tp_rank / 1
    ref.Ranks(tp_size=4, tp_rank=1, ep_size=2, ep_rank=1),  # tp_rank 1 / moe_tp 2 = ep_rank 0
    ref.Ranks(tp_size=2, tp_rank=1, ep_size=4, ep_rank=2),  # ep > tp: 2 % 2 != tp_rank 1
], ids=["tp-rank-ge-size", "pp-rank-ge-size", "ep-rank-vs-tp-rank", "ep-rank-vs-moe-tp",
        "ep-gt-tp-rank-mismatch"])
def test_inconsistent_ranks_exit_2(models, ranks):
    with pytest.raises(ref.RankError):
        ref.plan_rank(models["mixtral"], ranks)
    p = shard_plan("--model", models["mixtral"], *ranks.cli_args(), "--json")
    assert p.returncode == 2, f"{ranks}: exit {p.returncode}: {p.stdout}"
    assert "rank" in p.stderr, p.stderr


def test_unknown_model_type_needs_rules(tmp_path):
    d = _variant(tmp_path, "llama", "gptx", {"model_type": "gptx_custom"})
    p = shard_plan("--model", d, *ref.Ranks(tp_size=2).cli_args())
    assert p.returncode == 2, f"exit {p.returncode}: {p.stdout} {p.stderr}"
    assert "gptx_custom" in p.stderr and "rules" in p.stderr, p.stderr


def test_unknown_model_type_with_rules_file(models, builtin_rules, tmp_path):
    d = _variant(tmp_path, "llama", "gptx", {"model_type": "gptx_custom"})
    p = run_rules(tmp_path, d, builtin_rules["llama"], ref.Ranks(tp_size=2, tp_rank=1))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model_type"] == "gptx_custom"
    p = shard_plan("--model", d, *ref.Ranks(tp_size=2).cli_args(), "--shard-rules", "llama")
    assert p.returncode == 0, p.stderr


def test_table_output_lists_held_tensors(models):
    ranks = ref.Ranks(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0)
    p = shard_plan("--model", models["llama"], *ranks.cli_args())
    assert p.returncode == 0, p.stderr
    for t, _ in ref.plan_rank(models["llama"], ranks):
        assert t.name in p.stdout, t.name
    assert "lm_head.weight" not in p.stdout  # last stage only
