// shard_bench — issue 12's sharded load on one GPU, with real processes: a Llama-3-8B-shaped
// bf16 checkpoint (291 tensors, 16.06 GB) loaded by one `weightcache serve --tier gpu` whole,
// against TP=4 rank daemons (`--tp-size 4 --tp-rank r`) started together on the same device.
// The targets (issue 12): each rank daemon's GPU memory ≤ sharded/4 + replicated + 64 MiB, and
// the time until all 4 are ready ≤ 1.2 × one daemon loading the whole checkpoint, same run,
// warm page cache.
//
//   1. write the checkpoint with the safetensors library (4 shard files and
//      model.safetensors.index.json as Hugging Face lays it out, and a llama config.json;
//      zero-filled so the write is quick; on /dev/shm when it has room, else under --work),
//      then check its tensor count, bytes and every tensor's name, dtype and shape;
//   2. the bound, from the sharding planner in process (the built-in llama rules, PlanShard
//      for each rank): sharded bytes (the full bytes of every tensor that a rank holds a slice
//      of), replicated bytes (every tensor each rank holds whole), each rank's held bytes;
//   3. read every shard file once, timed (warms the page cache; its GB/s is this run's
//      file-read limit, reported beside the loads);
//   4. "whole": spawn one daemon of the whole checkpoint, time from spawn to `ready` (Status
//      over its socket), device memory it uses (cuMemGetInfo in a probe process before and
//      after), stop it and wait until its memory is back; --reps times;
//   5. "tp": spawn the --tp rank daemons at once; time from the first spawn until the last is
//      ready, and each rank's; stop them all, wait until their memory is back; --reps times;
//   6. "memory": start rank 0, 1, … one after the other, probing the device after each is
//      ready: the deltas are each daemon's own GPU memory, judged against the bound;
//   7. a "result" line: medians, all_ready_over_whole and within_time_bound, each rank's
//      used / held / bound bytes and within_bound.
//
// Output: one JSON object per line on stdout ({"bench":"shard_load","phase":...}); progress
// and errors on stderr. Without a driver or the device: one line with "skipped", exit 0.
// Exit 1 only on an error (a bound that is missed is reported, not an error).
//
//   shard_bench [--work DIR] [--reps N] [--device I] [--threads T] [--tp N] [--layers L]
//               [--vocab V] [--tier gpu|host]
//   shard_bench --write-only DIR [--tp N] [--layers L] [--vocab V] [--content zeros|random]
//               (no GPU: the checkpoint and its plan, e.g. `--layers 2 --vocab 1024` for a
//               small one; `--content random`: every tensor a different window of one random
//               buffer, for the scripts that check copied bytes, which zeros cannot prove)
//   shard_bench --probe-mem UUID                                     (internal)
//
// `--tier host` runs the same phases with host-tier daemons, no GPU and no device probe (each
// rank's "used" memory is then its resident bytes from Status): a dry run of the bench's own
// process handling on a machine without a GPU, with a small --layers/--vocab.
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "bench_process.h"
#include "checkpoint/checkpoint.h"
#include "cuda/driver_api.h"
#include "identity/resolve.h"
#include "os/strided_read.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"
#include "weightcache/identity_options.h"
#include "weightcache/tier.h"

namespace weightcache::bench {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr char kModelId[] = "llama3-8b-shape";
// Issue 12's allowance beyond a rank's share, and its time target.
constexpr uint64_t kBoundSlack = 64 * kMiB;
constexpr double kTimeBound = 1.2;
// Hugging Face's Meta-Llama-3-8B is 4 shard files.
constexpr int kShardFiles = 4;
constexpr auto kReadyTimeout = std::chrono::seconds(300);
// The same poll for every phase, so the whole and the sharded times have the same resolution.
constexpr auto kPoll = std::chrono::milliseconds(10);
// A stopped daemon's device memory is back when free is within this of the baseline.
constexpr uint64_t kMemoryReturnSlack = 64 * kMiB;
constexpr auto kMemoryReturnTimeout = std::chrono::seconds(60);

void Emit(nlohmann::json j) { EmitRecord("shard_load", std::move(j)); }
void Note(const std::string& what) { NoteLine("shard_bench", what); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// {"median","min","max","values"} of a non-empty sample.
nlohmann::json Stats(const std::vector<double>& v) {
  return {{"median", Median(v)},
          {"min", *std::min_element(v.begin(), v.end())},
          {"max", *std::max_element(v.begin(), v.end())},
          {"values", v}};
}

// A gpu load's phases from a daemon's debug log ("gpu tier: timeline ms: plan X, arena Y, ...",
// src/daemon/gpu_store.cc), and the ready line's spawn-relative seconds as "ready_line_s".
std::map<std::string, double> LoadPhases(const std::string& log_text) {
  std::map<std::string, double> out;
  static const std::regex kLine(R"(timeline ms: ([^\n]*))");
  static const std::regex kItem(R"(([a-z]+) ([0-9.eE+-]+))");
  std::smatch m;
  if (std::regex_search(log_text, m, kLine)) {
    const std::string rest = m[1].str();
    for (std::sregex_iterator it(rest.begin(), rest.end(), kItem), end; it != end; ++it) {
      out[(*it)[1].str() + "_ms"] = std::stod((*it)[2].str());
    }
  }
  // The loader thread's teardown after ready (src/daemon/daemon.cc, LoaderMain).
  static const std::regex kTeardown(R"(CUDA context released while serving \(([0-9.eE+-]+) ms\))");
  if (std::regex_search(log_text, m, kTeardown))
    out["teardown_after_ready_ms"] = std::stod(m[1].str());
  // What the keeper's deposit took at ready (src/daemon/daemon.cc, DepositLoaded).
  static const std::regex kDeposit(
      R"(keeps the memory for its successor \(([0-9.eE+-]+) ms at ready)");
  if (std::regex_search(log_text, m, kDeposit)) out["keeper_at_ready_ms"] = std::stod(m[1].str());
  if (auto s = ParseReadyLine(log_text).seconds) out["ready_line_s"] = *s;
  return out;
}

// Stats of each phase over the daemons' LoadPhases.
nlohmann::json PhaseStats(const std::vector<std::map<std::string, double>>& all) {
  std::map<std::string, std::vector<double>> by_phase;
  for (const auto& phases : all) {
    for (const auto& [name, value] : phases) by_phase[name].push_back(value);
  }
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, values] : by_phase) out[name] = Stats(values);
  return out;
}

// ---- the checkpoint ----------------------------------------------------------------------------

// Meta-Llama-3-8B's config.json values; --layers and --vocab make a smaller one of the same
// form.
struct LlamaShape {
  uint64_t hidden = 4096;
  uint64_t intermediate = 14336;
  uint64_t layers = 32;
  uint64_t heads = 32;
  uint64_t kv_heads = 8;
  uint64_t vocab = 128256;
  uint64_t head_dim() const { return hidden / heads; }
};

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> shape;
  uint64_t bytes = 0;  // bf16
};

// The tensors of transformers' LlamaForCausalLM with an untied lm_head, in its state_dict
// order: 9 per layer + 3.
std::vector<TensorSpec> LlamaTensors(const LlamaShape& s) {
  std::vector<TensorSpec> out;
  auto add = [&](std::string name, std::vector<uint64_t> shape) {
    uint64_t elements = 1;
    for (uint64_t d : shape) elements *= d;
    out.push_back({std::move(name), std::move(shape), elements * 2});
  };
  const uint64_t q = s.heads * s.head_dim(), kv = s.kv_heads * s.head_dim();
  add("model.embed_tokens.weight", {s.vocab, s.hidden});
  for (uint64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "self_attn.q_proj.weight", {q, s.hidden});
    add(p + "self_attn.k_proj.weight", {kv, s.hidden});
    add(p + "self_attn.v_proj.weight", {kv, s.hidden});
    add(p + "self_attn.o_proj.weight", {s.hidden, q});
    add(p + "mlp.gate_proj.weight", {s.intermediate, s.hidden});
    add(p + "mlp.up_proj.weight", {s.intermediate, s.hidden});
    add(p + "mlp.down_proj.weight", {s.hidden, s.intermediate});
    add(p + "input_layernorm.weight", {s.hidden});
    add(p + "post_attention_layernorm.weight", {s.hidden});
  }
  add("model.norm.weight", {s.hidden});
  add("lm_head.weight", {s.vocab, s.hidden});
  return out;
}

nlohmann::json LlamaConfig(const LlamaShape& s) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", s.hidden},
          {"intermediate_size", s.intermediate},
          {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads},
          {"num_key_value_heads", s.kv_heads},
          {"head_dim", s.head_dim()},
          {"vocab_size", s.vocab},
          {"tie_word_embeddings", false},
          {"hidden_act", "silu"},
          {"max_position_embeddings", 8192},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"bos_token_id", 128000},
          {"eos_token_id", 128001},
          {"torch_dtype", "bfloat16"}};
}

// Writes the tensors of the spec file (argv[2]) with the safetensors library into `shards`
// files of about equal bytes, in spec order, named and indexed as Hugging Face does, and the
// spec's config.json. Every tensor points into one buffer, so generation costs only the write:
// zeros, or (argv[4] "random") random bytes of which each tensor takes a window at its own
// offset, so that no two tensors of one size are equal and a misplaced one shows.
constexpr char kWriter[] = R"PY(
import json, math, os, sys, time
import numpy as np
import safetensors
out, spec_path, shards, content = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(spec_path) as f:
    spec = json.load(f)
tensors = spec["tensors"]
sizes = [2 * math.prod(t["shape"]) for t in tensors]
total = sum(sizes)
os.makedirs(out, exist_ok=True)
slack = 1 << 20
if content == "random":
    rng = np.random.default_rng(20261205)
    buf = np.frombuffer(rng.bytes(max(sizes) + slack), dtype=np.uint8)
else:
    buf = np.zeros(max(sizes) + slack, dtype=np.uint8)
def window(k):  # tensor k's offset into buf (even: whole bf16 values)
    return 0 if content != "random" else (k * 8198) % slack
groups = [[] for _ in range(shards)]
start = 0
for k, (t, n) in enumerate(zip(tensors, sizes)):
    groups[min(shards - 1, start * shards // total)].append((t, n, k))
    start += n
groups = [g for g in groups if g]
weight_map = {}
t0 = time.time()
for i, group in enumerate(groups):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    specs = {t["name"]: safetensors.TensorSpec(dtype="bfloat16", shape=t["shape"],
                                               data_ptr=buf.ctypes.data + window(k), data_len=n)
             for t, n, k in group}
    safetensors.serialize_file(specs, os.path.join(out, name), metadata={"format": "pt"})
    weight_map.update({t["name"]: name for t, _, _ in group})
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(spec["config"], f, indent=2)
print(json.dumps({"files": len(groups), "write_s": time.time() - t0,
                  "safetensors": safetensors.__version__, "content": content}))
)PY";

uint64_t TotalBytes(const std::vector<TensorSpec>& specs) {
  uint64_t total = 0;
  for (const TensorSpec& t : specs) total += t.bytes;
  return total;
}

// Writes the checkpoint of `shape` into `dir` and checks what Checkpoint::Open reads back:
// the tensor count, the total bytes, and each tensor's name, dtype (BF16) and shape. The
// "checkpoint" record.
Result<nlohmann::json> WriteCheckpoint(const std::string& dir, const LlamaShape& shape,
                                       bool random_content = false) {
  const std::vector<TensorSpec> specs = LlamaTensors(shape);
  nlohmann::json spec = {{"config", LlamaConfig(shape)}, {"tensors", nlohmann::json::array()}};
  for (const TensorSpec& t : specs) {
    spec["tensors"].push_back({{"name", t.name}, {"shape", t.shape}});
  }
  const std::string spec_path =
      (fs::temp_directory_path() / ("shard_bench-spec-" + std::to_string(::getpid()) + ".json"))
          .string();
  {
    std::ofstream f(spec_path);
    f << spec.dump();
    if (!f.flush()) return IoError("writing " + spec_path, errno);
  }
  Note("writing " + std::to_string(specs.size()) + " tensors, " +
       std::to_string(TotalBytes(specs) / kMiB) + " MiB, into " + dir);
  int code = 0;
  nlohmann::json wrote =
      CaptureJson({WEIGHTCACHE_PYTHON, "-c", kWriter, dir, spec_path, std::to_string(kShardFiles),
                   random_content ? "random" : "zeros"},
                  &code);
  fs::remove(spec_path);
  if (code != 0 || wrote.is_discarded()) {
    return InternalError("writing the checkpoint into " + dir +
                         " with the safetensors library failed (exit " + std::to_string(code) +
                         ")");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt, checkpoint::Checkpoint::Open(dir));
  if (ckpt.tensors().size() != specs.size()) {
    return InvalidCheckpoint(dir + ": " + std::to_string(ckpt.tensors().size()) +
                             " tensors written, want " + std::to_string(specs.size()));
  }
  if (ckpt.total_bytes() != TotalBytes(specs)) {
    return InvalidCheckpoint(dir + ": " + std::to_string(ckpt.total_bytes()) +
                             " bytes written, want " + std::to_string(TotalBytes(specs)));
  }
  for (const TensorSpec& t : specs) {
    const checkpoint::TensorInfo* got = ckpt.Find(t.name);
    if (got == nullptr) return InvalidCheckpoint(dir + ": tensor " + t.name + " missing");
    if (got->dtype != checkpoint::DType::kBF16 || got->shape != t.shape) {
      return InvalidCheckpoint(dir + ": tensor " + t.name + " has dtype " +
                               std::string(checkpoint::DTypeName(got->dtype)) + " shape " +
                               nlohmann::json(got->shape).dump() + ", want BF16 " +
                               nlohmann::json(t.shape).dump());
    }
  }
  return nlohmann::json{{"phase", "checkpoint"},
                        {"dir", dir},
                        {"tensors", ckpt.tensors().size()},
                        {"bytes", ckpt.total_bytes()},
                        {"files", ckpt.shards().size()},
                        {"write_s", wrote["write_s"]},
                        {"safetensors", wrote["safetensors"]},
                        {"content", wrote["content"]},
                        {"layers", shape.layers},
                        {"vocab", shape.vocab}};
}

// ---- the bound, from the planner ---------------------------------------------------------------

struct RankPlan {
  size_t tensors = 0;
  uint64_t held_bytes = 0;
  // Of the held bytes, those of dim>0 slices (many rows), and the file bytes from the first to
  // the last byte of each such slice: what a reader of whole source rows goes through for
  // them (docs/sharding.md: the strided reader reads blocks of whole rows).
  uint64_t strided_bytes = 0;
  uint64_t strided_span_bytes = 0;
};

struct Bound {
  uint32_t tp = 1;
  uint64_t sharded_bytes = 0;     // full bytes of every tensor some rank holds a slice of
  uint64_t replicated_bytes = 0;  // bytes of every tensor each rank holds whole
  size_t sharded_tensors = 0;
  size_t replicated_tensors = 0;
  uint64_t bound_bytes = 0;  // sharded / tp + replicated + kBoundSlack
  std::string rules;         // the rule set's name
  std::vector<RankPlan> ranks;
};

// Every rank's plan of the checkpoint at `dir` under the built-in rule set of its config.json
// (what `serve --tp-size tp --tp-rank r` plans with), and the bound from them.
Result<Bound> PlanBound(const std::string& dir, uint32_t tp) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt, checkpoint::Checkpoint::Open(dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(sharding::ModelConfig config, sharding::ReadModelConfig(dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(sharding::RuleSet rules,
                               sharding::SelectRuleSet("", config.model_type));
  Bound bound;
  bound.tp = tp;
  bound.rules = rules.name;
  struct Seen {
    uint64_t nbytes = 0;
    bool sliced = false;
    uint32_t whole = 0;  // ranks holding it whole
  };
  std::map<std::string, Seen, std::less<>> seen;
  for (uint32_t r = 0; r < tp; ++r) {
    auto plan = sharding::PlanShard(ckpt, rules, config, {.tp_size = tp, .tp_rank = r});
    if (!plan.ok()) {
      Status s = plan.status();
      return s.Context("planning tp rank " + std::to_string(r));
    }
    RankPlan& rank = bound.ranks.emplace_back();
    rank.tensors = plan->tensors.size();
    rank.held_bytes = plan->bytes;
    for (const sharding::PlannedTensor& p : plan->tensors) {
      if (p.copy.rows > 1) {
        rank.strided_bytes += p.bytes;
        rank.strided_span_bytes += (p.copy.rows - 1) * p.copy.source_pitch + p.copy.row_bytes;
      }
      Seen& s = seen[p.tensor->name];
      s.nbytes = p.tensor->nbytes;
      if (p.slice) {
        s.sliced = true;
      } else {
        ++s.whole;
      }
    }
  }
  for (const auto& [name, s] : seen) {
    if (s.sliced) {
      bound.sharded_bytes += s.nbytes;
      ++bound.sharded_tensors;
    } else if (s.whole == tp) {
      bound.replicated_bytes += s.nbytes;
      ++bound.replicated_tensors;
    } else {
      return InternalError("tensor " + name + " is held whole by " + std::to_string(s.whole) +
                           " of " + std::to_string(tp) +
                           " ranks: the bound assumes tensor parallelism only");
    }
  }
  bound.bound_bytes = bound.sharded_bytes / tp + bound.replicated_bytes + kBoundSlack;
  return bound;
}

nlohmann::json PlanRecord(const Bound& b) {
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < b.ranks.size(); ++r) {
    ranks.push_back({{"rank", r},
                     {"tensors", b.ranks[r].tensors},
                     {"held_bytes", b.ranks[r].held_bytes},
                     {"held_within_bound", b.ranks[r].held_bytes <= b.bound_bytes},
                     {"strided_bytes", b.ranks[r].strided_bytes},
                     {"strided_span_bytes", b.ranks[r].strided_span_bytes}});
  }
  return {{"phase", "plan"},
          {"rules", b.rules},
          {"tp", b.tp},
          {"sharded_bytes", b.sharded_bytes},
          {"sharded_tensors", b.sharded_tensors},
          {"replicated_bytes", b.replicated_bytes},
          {"replicated_tensors", b.replicated_tensors},
          {"slack_bytes", kBoundSlack},
          {"bound_bytes", b.bound_bytes},
          {"ranks", ranks}};
}

// ---- the warm read -----------------------------------------------------------------------------

// Reads every shard file once with `threads` threads, 32 MiB preads: warms the page cache, and
// its GB/s is this run's file-read limit. The "file_read" record.
Result<nlohmann::json> WarmRead(const checkpoint::Checkpoint& ckpt, int threads) {
  constexpr uint64_t kPiece = 32 * kMiB;
  struct Piece {
    uint32_t shard;
    uint64_t offset, length;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (uint32_t i = 0; i < ckpt.shards().size(); ++i) {
    const uint64_t size = ckpt.shards()[i].file_size;
    for (uint64_t off = 0; off < size; off += kPiece) {
      pieces.push_back({i, off, std::min(kPiece, size - off)});
    }
    total += size;
  }
  std::atomic<size_t> next{0};
  std::vector<Status> errors(threads);
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::unique_ptr<uint8_t[]> buffer(new uint8_t[kPiece]);
      for (size_t i; (i = next++) < pieces.size();) {
        const Piece& p = pieces[i];
        Status read = os::PreadExact(ckpt.shard_fd(p.shard), ckpt.shards()[p.shard].path, p.offset,
                                     p.length, buffer.get());
        if (!read.ok()) {
          errors[t] = std::move(read);
          next = pieces.size();
          return;
        }
      }
    });
  }
  for (std::thread& th : pool) th.join();
  const double s = Seconds(Clock::now() - t0);
  for (Status& e : errors) {
    if (!e.ok()) return std::move(e);
  }
  return nlohmann::json{{"phase", "file_read"},
                        {"bytes", total},
                        {"threads", threads},
                        {"seconds", s},
                        {"gb_per_s", total / s / 1e9}};
}

// ---- the daemons -------------------------------------------------------------------------------

uint64_t FreeBytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// The daemons of one step; those still running when it ends are stopped, however it ends.
struct DaemonGroup {
  std::vector<WatchedDaemon> daemons;
  DaemonGroup() = default;
  DaemonGroup(const DaemonGroup&) = delete;
  DaemonGroup& operator=(const DaemonGroup&) = delete;
  ~DaemonGroup() { StopAll(); }
  void StopAll() {
    for (WatchedDaemon& d : daemons) {
      Stop(d.pid);
      d.pid = -1;
    }
  }
};

struct Run {
  std::string self;
  std::string model;
  std::string runtime;
  std::string logs;  // directory of the daemons' logs
  Tier tier = Tier::kGpu;
  std::string uuid;  // the device (gpu tier)
  std::string fingerprint;
  int threads = 8;
  uint32_t tp = 4;
  uint64_t baseline_free = 0;  // the device's free memory with no daemon of ours

  // The socket of the whole checkpoint's daemon (rank < 0) or of tp rank `rank`: the identity
  // a client of that daemon resolves.
  Result<std::string> Socket(int rank) const {
    IdentityOptions o;
    o.model_dir = model;
    o.model_id = kModelId;
    o.runtime_dir = runtime;
    o.tier = tier;
    if (tier == Tier::kGpu) o.device = uuid;
    o.checkpoint_fingerprint = fingerprint;
    if (rank >= 0) {
      o.tp_size = static_cast<int>(tp);
      o.tp_rank = rank;
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(identity::ResolvedIdentity id, identity::ResolveIdentity(o));
    return id.paths.socket;
  }

  // Spawns the daemon of `rank` (< 0: the whole checkpoint) that serves on `socket` (Socket:
  // resolved before, so that resolving is not part of its time), its log named by `tag`.
  Result<WatchedDaemon> Spawn(int rank, const std::string& socket, const std::string& tag) const {
    WatchedDaemon d;
    d.socket = socket;
    d.log = logs + "/serve-" + tag + ".log";
    std::vector<std::string> argv = {WEIGHTCACHE_CLI_PATH, "serve", "--model", model};
    argv.insert(argv.end(), {"--model-id", kModelId, "--tier", std::string(TierName(tier))});
    argv.insert(argv.end(), {"--runtime-dir", runtime, "--threads", std::to_string(threads)});
    if (tier == Tier::kGpu) argv.insert(argv.end(), {"--device", uuid});
    if (rank >= 0) {
      argv.insert(argv.end(), {"--tp-size", std::to_string(tp), "--tp-rank", std::to_string(rank)});
    }
    d.spawned = Clock::now();
    // Debug: the log then has the load's timeline (LoadPhases).
    d.pid = SpawnLogged(argv, d.log, {"WEIGHTCACHE_LOG_LEVEL=debug"});
    if (d.pid < 0) return InternalError("spawning `weightcache serve` (" + tag + ") failed");
    return d;
  }

  // Waits until every daemon of `group` is ready; the error names the one that is not by its
  // log (whose name says the phase, repetition and rank).
  static Status Ready(DaemonGroup& group) {
    size_t failed = 0;
    Status s = WaitReady(group.daemons, kReadyTimeout, kPoll, &failed);
    if (!s.ok()) s.Context("the daemon logging to " + group.daemons[failed].log + " is not ready");
    return s;
  }

  // The memory the daemons of `group` use now: on the gpu tier the device's, against the
  // baseline (cuMemGetInfo in a probe process: the daemons' CUDA contexts are gone once their
  // loader threads have ended, so this is their arenas); on the host tier (a dry run without a GPU)
  // the resident bytes of their Status replies.
  Result<int64_t> UsedNow(const DaemonGroup& group) const {
    if (tier == Tier::kHost) {
      int64_t resident = 0;
      for (const WatchedDaemon& d : group.daemons) {
        if (d.ready) resident += static_cast<int64_t>(d.ready->bytes);
      }
      return resident;
    }
    std::optional<DeviceMemory> m = ProbeDeviceMemory(self, uuid);
    if (!m) return InternalError("the device-memory probe of " + uuid + " failed");
    return static_cast<int64_t>(baseline_free) - static_cast<int64_t>(m->free);
  }

  // Stops them all; on the gpu tier, waits until the device's free memory is back.
  Status StopAndWaitMemory(DaemonGroup& group) const {
    group.StopAll();
    if (tier == Tier::kHost) return Status::Ok();
    return WaitMemoryReturned(self, uuid, baseline_free, kMemoryReturnSlack, kMemoryReturnTimeout)
        .status();
  }
};

// --reps loads of the whole checkpoint by one daemon. The "whole" record.
Result<nlohmann::json> WholePhase(const Run& run, int reps) {
  std::vector<double> ready_s, used, daemon_load_s;
  std::vector<std::map<std::string, double>> phases;
  uint64_t resident = 0;
  for (int rep = 0; rep < reps; ++rep) {
    Note("whole: rep " + std::to_string(rep + 1) + " of " + std::to_string(reps));
    DaemonGroup group;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string socket, run.Socket(-1));
    WEIGHTCACHE_ASSIGN_OR_RETURN(WatchedDaemon d,
                                 run.Spawn(-1, socket, "whole-" + std::to_string(rep)));
    group.daemons.push_back(std::move(d));
    WEIGHTCACHE_RETURN_IF_ERROR(Run::Ready(group));
    const WatchedDaemon& w = group.daemons[0];
    ready_s.push_back(Seconds(w.ready_at - w.spawned));
    WEIGHTCACHE_ASSIGN_OR_RETURN(int64_t u, run.UsedNow(group));
    used.push_back(static_cast<double>(u));
    resident = w.ready->bytes;
    if (auto s = ParseReadyLine(ReadText(w.log)).seconds) daemon_load_s.push_back(*s);
    phases.push_back(LoadPhases(ReadText(w.log)));
    WEIGHTCACHE_RETURN_IF_ERROR(run.StopAndWaitMemory(group));
  }
  nlohmann::json rec = {{"phase", "whole"},           {"reps", reps},
                        {"ready_s", Stats(ready_s)},  {"used_bytes", Stats(used)},
                        {"resident_bytes", resident}, {"load_phases", PhaseStats(phases)}};
  if (daemon_load_s.size() == ready_s.size()) rec["daemon_load_s"] = Stats(daemon_load_s);
  return rec;
}

// --reps starts of every rank at once. The "tp" record.
Result<nlohmann::json> TpPhase(const Run& run, int reps) {
  std::vector<double> all_ready_s;
  std::vector<std::vector<double>> rank_ready_s(run.tp);
  std::vector<std::map<std::string, double>> phases;  // every rank of every repetition
  for (int rep = 0; rep < reps; ++rep) {
    Note("tp " + std::to_string(run.tp) + ": rep " + std::to_string(rep + 1) + " of " +
         std::to_string(reps));
    // The sockets first: resolving them is not part of the time.
    std::vector<std::string> sockets;
    for (uint32_t r = 0; r < run.tp; ++r) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(std::string socket, run.Socket(static_cast<int>(r)));
      sockets.push_back(std::move(socket));
    }
    DaemonGroup group;
    for (uint32_t r = 0; r < run.tp; ++r) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          WatchedDaemon d, run.Spawn(static_cast<int>(r), sockets[r],
                                     "tp-" + std::to_string(rep) + "-r" + std::to_string(r)));
      group.daemons.push_back(std::move(d));
    }
    WEIGHTCACHE_RETURN_IF_ERROR(Run::Ready(group));
    const Clock::time_point first = group.daemons[0].spawned;
    double last = 0;
    for (uint32_t r = 0; r < run.tp; ++r) {
      const double s = Seconds(group.daemons[r].ready_at - first);
      rank_ready_s[r].push_back(s);
      last = std::max(last, s);
      phases.push_back(LoadPhases(ReadText(group.daemons[r].log)));
    }
    all_ready_s.push_back(last);
    WEIGHTCACHE_RETURN_IF_ERROR(run.StopAndWaitMemory(group));
  }
  nlohmann::json ranks = nlohmann::json::array();
  for (uint32_t r = 0; r < run.tp; ++r) {
    ranks.push_back({{"rank", r}, {"ready_s", Stats(rank_ready_s[r])}});
  }
  return nlohmann::json{{"phase", "tp"},  {"tp", run.tp},
                        {"reps", reps},   {"all_ready_s", Stats(all_ready_s)},
                        {"ranks", ranks}, {"load_phases", PhaseStats(phases)}};
}

// The ranks started one after the other, the memory probed after each is ready (UsedNow). The
// "memory" record; *used gets each rank's own memory (judged against the bound in the result).
Result<nlohmann::json> MemoryPhase(const Run& run, const Bound& bound, std::vector<int64_t>* used) {
  Note("memory: starting the " + std::to_string(run.tp) + " ranks one after the other");
  DaemonGroup group;
  nlohmann::json ranks = nlohmann::json::array();
  int64_t before = 0;
  WEIGHTCACHE_ASSIGN_OR_RETURN(before, run.UsedNow(group));
  const int64_t start = before;
  for (uint32_t r = 0; r < run.tp; ++r) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string socket, run.Socket(static_cast<int>(r)));
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        WatchedDaemon d, run.Spawn(static_cast<int>(r), socket, "memory-r" + std::to_string(r)));
    group.daemons.push_back(std::move(d));
    // The earlier ranks are ready already: this waits for the newest, then for its loader
    // thread, which drops the load's pipeline, mappings and CUDA context after `ready`.
    WEIGHTCACHE_RETURN_IF_ERROR(Run::Ready(group));
    if (!WaitThreadGone(group.daemons.back().pid, "wc-loader", std::chrono::seconds(30))) {
      return InternalError("rank " + std::to_string(r) +
                           ": its loader thread still runs 30 s after ready");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(int64_t now, run.UsedNow(group));
    const int64_t own = now - before;
    before = now;
    used->push_back(own);
    const protocol::StatusReply& status = *group.daemons.back().ready;
    ranks.push_back({{"rank", r},
                     {"used_bytes", own},
                     {"resident_bytes", status.bytes},
                     {"tensors", status.tensor_count},
                     {"held_bytes", bound.ranks[r].held_bytes},
                     {"plan_tensors", bound.ranks[r].tensors}});
  }
  const int64_t total = before - start;
  WEIGHTCACHE_RETURN_IF_ERROR(run.StopAndWaitMemory(group));
  return nlohmann::json{{"phase", "memory"}, {"ranks", ranks}, {"used_bytes_all", total}};
}

struct Args {
  std::string work;
  std::string write_only;
  int reps = 3;
  int device = 0;
  int threads = 8;
  uint32_t tp = 4;
  Tier tier = Tier::kGpu;
  LlamaShape shape;
  bool random_content = false;  // --content random
};

// `--write-only DIR`: the checkpoint and its plan, no GPU.
int WriteOnlyMain(const Args& args) {
  auto wrote = WriteCheckpoint(args.write_only, args.shape, args.random_content);
  if (!wrote.ok()) {
    Emit({{"phase", "checkpoint"}, {"error", wrote.status().ToString()}});
    return 1;
  }
  Emit(*wrote);
  auto bound = PlanBound(args.write_only, args.tp);
  if (!bound.ok()) {
    Emit({{"phase", "plan"}, {"error", bound.status().ToString()}});
    return 1;
  }
  Emit(PlanRecord(*bound));
  return 0;
}

// The phases in order; the first error ends the run (the checkpoint and runtime dir are
// removed by the caller).
Status RunPhases(const Args& args, Run& run) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json wrote, WriteCheckpoint(run.model, args.shape));
  wrote["storage"] = run.model.rfind("/dev/shm/", 0) == 0 ? "tmpfs (/dev/shm)" : "disk";
  Emit(wrote);
  WEIGHTCACHE_ASSIGN_OR_RETURN(Bound bound, PlanBound(run.model, run.tp));
  Emit(PlanRecord(bound));
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt,
                               checkpoint::Checkpoint::Open(run.model));
  run.fingerprint = ckpt.fingerprint();
  Note("reading every file once (warm page cache)");
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json read, WarmRead(ckpt, run.threads));
  Emit(read);

  if (run.tier == Tier::kGpu) {
    std::optional<DeviceMemory> base = ProbeDeviceMemory(run.self, run.uuid);
    if (!base) return InternalError("the device-memory probe of " + run.uuid + " failed");
    run.baseline_free = base->free;
  }

  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json whole, WholePhase(run, args.reps));
  whole["tier"] = TierName(run.tier);
  if (run.tier == Tier::kGpu) whole["device"] = run.uuid;
  whole["threads"] = run.threads;
  Emit(whole);
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json tp, TpPhase(run, args.reps));
  tp["tier"] = TierName(run.tier);
  if (run.tier == Tier::kGpu) tp["device"] = run.uuid;
  tp["threads"] = run.threads;
  Emit(tp);
  std::vector<int64_t> used;
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json memory, MemoryPhase(run, bound, &used));
  Emit(memory);

  const double whole_s = whole["ready_s"]["median"].get<double>();
  const double tp_s = tp["all_ready_s"]["median"].get<double>();
  const double ratio = tp_s / whole_s;
  nlohmann::json ranks = nlohmann::json::array();
  bool within_memory = true;
  for (uint32_t r = 0; r < run.tp; ++r) {
    const bool within = used[r] <= static_cast<int64_t>(bound.bound_bytes);
    within_memory = within_memory && within;
    ranks.push_back({{"rank", r},
                     {"used_bytes", used[r]},
                     {"held_bytes", bound.ranks[r].held_bytes},
                     {"bound_bytes", bound.bound_bytes},
                     {"within_bound", within}});
  }
  Emit({{"phase", "result"},
        {"tier", TierName(run.tier)},
        // What used_bytes is: the device memory each daemon added, or (host tier) its
        // resident bytes.
        {"used_from", run.tier == Tier::kGpu ? "device" : "status"},
        {"tp", run.tp},
        {"tensors", ckpt.tensors().size()},
        {"checkpoint_bytes", ckpt.total_bytes()},
        {"file_read_gb_per_s", read["gb_per_s"]},
        {"whole_ready_s_median", whole_s},
        {"whole_load_gb_per_s", ckpt.total_bytes() / whole_s / 1e9},
        {"tp_all_ready_s_median", tp_s},
        {"all_ready_over_whole", ratio},
        {"time_bound", kTimeBound},
        {"within_time_bound", ratio <= kTimeBound},
        {"sharded_bytes", bound.sharded_bytes},
        {"replicated_bytes", bound.replicated_bytes},
        {"bound_bytes", bound.bound_bytes},
        {"ranks", ranks},
        {"within_memory_bound", within_memory}});
  return Status::Ok();
}

int ParentMain(const Args& args, const std::string& self) {
  Run run;
  run.self = self;
  run.tier = args.tier;
  run.threads = args.threads;
  run.tp = args.tp;
  if (run.tier == Tier::kGpu) {
    auto api = cuda::LoadDriver();
    if (!api.ok()) {
      Emit({{"skipped", api.status().ToString()}});
      return 0;
    }
    int count = 0;
    if ((*api)->cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= args.device) {
      Emit({{"skipped", "no CUDA device " + std::to_string(args.device)}});
      return 0;
    }
    // The device's UUID, as `serve --device I` resolves it.
    auto visible = identity::VisibleDevices({});
    if (!visible.ok()) {
      Emit({{"error", visible.status().ToString()}});
      return 1;
    }
    auto device = identity::ResolveDevice(std::to_string(args.device), *visible);
    if (!device.ok()) {
      Emit({{"error", device.status().ToString()}});
      return 1;
    }
    run.uuid = device->uuid;
  }
  run.logs = args.work.empty() ? (fs::temp_directory_path() / "shard_bench").string() : args.work;
  std::error_code ec;
  fs::create_directories(run.logs, ec);
  if (ec) {
    Emit({{"error", "creating " + run.logs + ": " + ec.message()}});
    return 1;
  }

  // /dev/shm when it holds the checkpoint with room to spare: writing is then memory-speed
  // (the device machine's disk is slow and virtual), and the daemons read from the page cache
  // either way (the files were just written, then read once).
  const uint64_t want = TotalBytes(LlamaTensors(args.shape)) + kGiB;
  const std::string tag = std::to_string(::getpid());
  if (FreeBytes("/dev/shm") > want) {
    run.model = "/dev/shm/shard_bench-" + tag;
  } else if (FreeBytes(run.logs) > want) {
    run.model = run.logs + "/model-" + tag;
  } else {
    Emit({{"error", "not enough space for a " + std::to_string(want / kMiB) +
                        " MiB checkpoint in /dev/shm or " + run.logs}});
    return 1;
  }
  // Short and outside the work dir: the socket paths under it must fit the 107-byte sun_path.
  run.runtime = "/tmp/wcrt-shard-" + tag;

  Status result = RunPhases(args, run);
  fs::remove_all(run.model, ec);
  fs::remove_all(run.runtime, ec);
  if (!result.ok()) {
    Emit({{"error", result.ToString()}});
    return 1;
  }
  return 0;
}

// A positive decimal integer, or nullopt.
std::optional<uint64_t> Positive(const std::string& v) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || end != v.data() + v.size() || n == 0) return std::nullopt;
  return n;
}

constexpr char kUsage[] =
    "usage: shard_bench [--work DIR] [--reps N] [--device I] [--threads T] [--tp N] "
    "[--layers L] [--vocab V] [--tier gpu|host]\n"
    "       shard_bench --write-only DIR [--tp N] [--layers L] [--vocab V] "
    "[--content zeros|random]\n";

int Main(const std::vector<std::string>& a) {
  if (a.size() == 2 && a[0] == "--probe-mem") return ProbeMemMain(a[1]);
  if (a.size() % 2 != 0) {
    std::fprintf(stderr, "shard_bench: flag %s needs a value\n%s", a.back().c_str(), kUsage);
    return 2;
  }
  Args args;
  for (size_t i = 0; i < a.size(); i += 2) {
    const std::string& k = a[i];
    const std::string& v = a[i + 1];
    if (k == "--work") {
      args.work = v;
      continue;
    }
    if (k == "--write-only") {
      args.write_only = v;
      continue;
    }
    if (k == "--content") {
      if (v != "zeros" && v != "random") {
        std::fprintf(stderr, "shard_bench: --content: expected zeros or random, got \"%s\"\n",
                     v.c_str());
        return 2;
      }
      args.random_content = v == "random";
      continue;
    }
    if (k == "--tier") {
      const std::optional<Tier> tier = ParseTier(v);
      if (!tier) {
        std::fprintf(stderr, "shard_bench: --tier: expected gpu or host, got \"%s\"\n", v.c_str());
        return 2;
      }
      args.tier = *tier;
      continue;
    }
    if (k == "--device") {
      // An index into the visible devices (0 is one).
      uint64_t n = 0;
      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
      if (ec != std::errc() || end != v.data() + v.size() || n > 1024) {
        std::fprintf(stderr, "shard_bench: --device: expected a device index, got \"%s\"\n",
                     v.c_str());
        return 2;
      }
      args.device = static_cast<int>(n);
      continue;
    }
    const std::optional<uint64_t> n = Positive(v);
    if (k != "--reps" && k != "--threads" && k != "--tp" && k != "--layers" && k != "--vocab") {
      std::fprintf(stderr, "shard_bench: unknown flag %s\n%s", k.c_str(), kUsage);
      return 2;
    }
    if (!n || *n > (uint64_t{1} << 24)) {
      std::fprintf(stderr, "shard_bench: %s: expected a positive integer, got \"%s\"\n", k.c_str(),
                   v.c_str());
      return 2;
    }
    if (k == "--reps") args.reps = static_cast<int>(*n);
    if (k == "--threads") args.threads = static_cast<int>(*n);
    if (k == "--tp") args.tp = static_cast<uint32_t>(*n);
    if (k == "--layers") args.shape.layers = *n;
    if (k == "--vocab") args.shape.vocab = *n;
  }
  if (!args.write_only.empty()) return WriteOnlyMain(args);
  return ParentMain(args, "/proc/self/exe");
}

}  // namespace
}  // namespace weightcache::bench

int main(int argc, char** argv) {
  // The edge: an exception (a JSON field of an unexpected type, a filesystem error) is an error
  // line and exit 1, never an abort.
  try {
    return weightcache::bench::Main(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    weightcache::bench::Emit({{"error", e.what()}});
    return 1;
  }
}
