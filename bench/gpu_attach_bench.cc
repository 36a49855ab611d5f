// gpu_attach_bench — the gpu tier end to end, with real processes, against the docs/design.md
// "Performance targets": attach ≤ 2 ms flat in tensor count (client side, CUDA context excluded),
// daemon overhead < 1 % GPU memory beyond the weights and < 100 MB host RSS, and the cold-load GB/s
// the daemon reports. For each tensor count (default 10, 1,000 and 10,000, each a 16 GiB
// checkpoint):
//
//   1. write the checkpoint with the safetensors library (one shard, bf16, zero-filled so the
//      write is quick; on /dev/shm when it has room, else under the work dir), timed;
//   2. free device memory before (cuMemGetInfo in a short-lived probe process);
//   3. spawn `weightcache serve --tier gpu` and wait for `ready` (Status over the socket);
//      parse the daemon's own figures from its log: the ready line (spawn-relative load
//      seconds and GB/s) and the upload pipeline's line (LOG_DEBUG: bytes, seconds, GB/s);
//   4. free device memory after (probe again): the daemon's device footprint minus the
//      tensor bytes is its overhead (its CUDA context, arena padding, anything else); host
//      VmRSS / VmHWM from /proc/<pid>/status; nvidia-smi's per-process figure where visible;
//      what the host memory is made of (bench/proc_memory.h: RssAnon/RssFile/RssShmem,
//      smaps_rollup, the mappings with the most Rss — libcuda, [heap], unnamed) at three
//      points: "load_memory" (the daemon's own log line: at the end of the upload with the
//      pipeline alive, after freeing it, after malloc_trim, i.e. after the load and before
//      ready), "memory.at_ready" (once Status says ready and the daemon's loader thread, which
//      releases the load's pipeline, mappings and context after ready, has ended;
//      "ready_loader_s" says how long after ready that was) and "memory.steady" (after the
//      client's attaches, detaches and verify, just before the daemon is stopped);
//   5. a client process (this binary, --client): cuInit (dlopen + cuInit) and primary context
//      creation timed separately, then Attachment::Attach — connect, Hello, Attach, import
//      and map every allocation, build the tensor table — timed over --iters attaches with
//      the checkpoint fingerprint given (an engine's steady state) and a few with it computed
//      (reads the shard header), plus detach time and one GPU-kernel verify of every tensor;
//   6. stop the daemon, delete the checkpoint.
//
// Output: one JSON object per line on stdout ({"bench":"gpu_attach", ...}); progress and
// errors on stderr. Skips (a JSON line with "skipped") without a driver or a device.
//
//   gpu_attach_bench [--work DIR] [--gib G] [--counts 10,1000,10000] [--iters N] [--device I]
//                    [--threads T]
//   gpu_attach_bench --client MODEL RUNTIME UUID FINGERPRINT TENSORS ITERS   (internal)
//   gpu_attach_bench --probe-mem UUID                                        (internal)
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "bench_process.h"
#include "checkpoint/checkpoint.h"
#include "client/attachment_impl.h"
#include "client/discovery.h"
#include "client/verify.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "identity/resolve.h"
#include "proc_memory.h"
#include "weightcache/client.h"

namespace weightcache::bench {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr char kModelId[] = "bench";

void Emit(nlohmann::json j) { EmitRecord("gpu_attach", std::move(j)); }
void Note(const std::string& what) { NoteLine("gpu_attach_bench", what); }

nlohmann::json Percentiles(std::vector<double> v) {
  if (v.empty()) return nullptr;
  std::sort(v.begin(), v.end());
  return {{"median", v[v.size() / 2]},
          {"p90", v[std::min(v.size() - 1, v.size() * 9 / 10)]},
          {"min", v.front()},
          {"n", v.size()}};
}

// ---- the daemon's host memory -----------------------------------------------------------------

// VmRSS / VmHWM of `pid` in bytes (0 when unreadable).
std::pair<uint64_t, uint64_t> HostMemory(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  uint64_t rss = 0, hwm = 0;
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    std::string key;
    uint64_t kb = 0;
    in >> key >> kb;
    if (key == "VmRSS:") rss = kb * 1024;
    if (key == "VmHWM:") hwm = kb * 1024;
  }
  return {rss, hwm};
}

// nvidia-smi's used memory of `pid` in MiB, or null where it does not list the pid (no
// nvidia-smi, or a pid namespace that hides it).
nlohmann::json NvidiaSmiMib(pid_t pid) {
  std::string out;
  if (Capture(
          {"nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"},
          &out) != 0) {
    return nullptr;
  }
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    const size_t comma = line.find(',');
    if (comma == std::string::npos) continue;
    if (std::atol(line.substr(0, comma).c_str()) == pid) {
      return std::atoll(line.substr(comma + 1).c_str());
    }
  }
  return nullptr;
}

// ---- the child modes -------------------------------------------------------------------------

int ClientMain(const std::string& model, const std::string& runtime, const std::string& uuid,
               const std::string& fingerprint, size_t tensors, int iters) {
  nlohmann::json out;
  auto fail = [&](const std::string& what) {
    out["error"] = what;
    std::printf("%s\n", out.dump().c_str());
    return 1;
  };
  auto t0 = Clock::now();
  auto api = cuda::LoadDriver();  // dlopen + cuGetProcAddress + cuInit
  out["cuinit_ms"] = Ms(Clock::now() - t0);
  if (!api.ok()) return fail(api.status().ToString());
  auto dev = DeviceOf(*api, uuid);
  if (!dev.ok()) return fail(dev.status().ToString());
  // The engine's own context (torch creates it before it loads weights); held for the whole
  // run so that no attach pays for it.
  auto t1 = Clock::now();
  auto ctx = cuda::PrimaryContext::Retain(*api, *dev);
  out["primary_ctx_ms"] = Ms(Clock::now() - t1);
  if (!ctx.ok()) return fail(ctx.status().ToString());

  AttachOptions o;
  o.identity.model_dir = model;
  o.identity.model_id = kModelId;
  o.identity.runtime_dir = runtime;
  o.identity.device = uuid;
  o.identity.tier = Tier::kGpu;
  o.on_missing = OnMissing::kError;
  AttachOptions given = o;
  given.identity.checkpoint_fingerprint = fingerprint;

  auto attach = [&](const AttachOptions& options, double* ms) -> Result<Attachment> {
    auto start = Clock::now();
    Result<Attachment> a = Attachment::Attach(options);
    *ms = Ms(Clock::now() - start);
    if (!a.ok()) return a;
    if (a->source() != AttachSource::kDaemon) {
      return InternalError("attached from " + std::string(AttachSourceName(a->source())) + ": " +
                           a->source_reason());
    }
    if (a->tensors().size() != tensors) {
      return InternalError("attached " + std::to_string(a->tensors().size()) + " tensors, want " +
                           std::to_string(tensors));
    }
    return a;
  };

  double first_ms = 0;
  {
    auto a = attach(given, &first_ms);
    if (!a.ok()) return fail("first attach: " + a.status().ToString());
    // One full verify with the GPU checksum kernel: the bench's load was correct, and what
    // `attach --verify` costs at this size.
    auto v = client::VerifyChecksums(*a, 8);
    if (!v.ok()) return fail("verify: " + v.status().ToString());
    out["verify_ok"] = v->ok();
    out["verify_s"] = v->seconds;
    out["verify_gb_per_s"] = v->seconds > 0 ? v->bytes_checked / v->seconds / 1e9 : 0;
  }
  out["first_attach_ms"] = first_ms;
  std::vector<double> given_ms, computed_ms, detach_ms, internal_ms;
  // The library's own phases (weightcache::AttachTimings) of the fingerprint-given attaches.
  std::vector<double> resolve_ms, discover_ms, map_ms, table_ms;
  bool table_concurrent = false;
  for (int i = 0; i < iters; ++i) {
    double ms = 0;
    auto a = attach(given, &ms);
    if (!a.ok()) return fail("attach: " + a.status().ToString());
    given_ms.push_back(ms);
    internal_ms.push_back(a->attach_ms());
    const weightcache::AttachTimings& t = a->timings();
    resolve_ms.push_back(t.resolve_ms);
    discover_ms.push_back(t.discover_ms);
    map_ms.push_back(t.map_ms);
    table_ms.push_back(t.table_ms);
    table_concurrent = t.table_concurrent;
    auto d0 = Clock::now();
    { Attachment gone = std::move(a).value(); }
    detach_ms.push_back(Ms(Clock::now() - d0));
  }
  for (int i = 0; i < std::max(3, iters / 5); ++i) {
    double ms = 0;
    auto a = attach(o, &ms);
    if (!a.ok()) return fail("attach (fingerprint computed): " + a.status().ToString());
    computed_ms.push_back(ms);
  }
  out["attach_ms"] = Percentiles(given_ms);
  out["attach_ms_library"] = Percentiles(internal_ms);
  out["phases_ms"] = {{"resolve", Percentiles(resolve_ms)},
                      {"discover", Percentiles(discover_ms)},
                      {"map", Percentiles(map_ms)},
                      {"table", Percentiles(table_ms)},
                      {"table_concurrent", table_concurrent}};
  out["attach_ms_fingerprint_computed"] = Percentiles(computed_ms);
  out["detach_ms"] = Percentiles(detach_ms);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

// ---- the parent -----------------------------------------------------------------------------

// Writes a `tensors`-tensor bf16 checkpoint of about `bytes` bytes with the safetensors library
// (all tensors share one zero buffer: generation costs only the write).
constexpr char kWriter[] = R"PY(
import json, os, sys, time
import numpy as np
import safetensors
out, n, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
per = (total // n) // 2 * 2
os.makedirs(out, exist_ok=True)
buf = np.zeros(per, dtype=np.uint8)
specs = {f"model.layers.{i}.weight": safetensors.TensorSpec(
    dtype="bfloat16", shape=[per // 2], data_ptr=buf.ctypes.data, data_len=per)
    for i in range(n)}
t = time.time()
safetensors.serialize_file(specs, os.path.join(out, "model.safetensors"),
                           metadata={"format": "pt"})
print(json.dumps({"bytes": per * n, "write_s": time.time() - t,
                  "safetensors": safetensors.__version__}))
)PY";

uint64_t FreeBytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

struct ParentArgs {
  std::string work;
  uint64_t gib = 16;
  std::vector<int> counts = {10, 1000, 10000};
  int iters = 20;
  int device = 0;
  int threads = 8;
};

int ParentMain(const ParentArgs& args, const std::string& self) {
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
  const std::string work =
      args.work.empty() ? (fs::temp_directory_path() / "gpu_attach_bench").string() : args.work;
  fs::create_directories(work);
  int failures = 0;

  for (int n : args.counts) {
    nlohmann::json rec = {{"tensors", n}};
    auto error = [&](const std::string& what) {
      rec["error"] = what;
      Emit(rec);
      ++failures;
    };
    // /dev/shm when it holds the checkpoint with room to spare: writing is then memory-speed
    // (the device machine's disk is slow and virtual), and the daemon's read is the warm page
    // cache case either way since the file was just written.
    const uint64_t want = args.gib * kGiB + kGiB;
    const bool shm = FreeBytes("/dev/shm") > want;
    if (!shm && FreeBytes(work) < want) {
      error("not enough space for a " + std::to_string(args.gib) +
            " GiB checkpoint in /dev/shm or " + work);
      continue;
    }
    const std::string tag = "n" + std::to_string(n) + "-" + std::to_string(::getpid());
    const std::string model = shm ? "/dev/shm/gpu_attach_bench-" + tag : work + "/model-" + tag;
    // Short and outside `work`: the socket path under it must fit the 107-byte sun_path limit.
    const std::string runtime = "/tmp/wcrt-" + tag;
    const std::string log = work + "/serve-" + tag + ".log";
    rec["storage"] = shm ? "tmpfs (/dev/shm)" : "disk (" + work + ")";

    Note("writing " + std::to_string(n) + " tensors, " + std::to_string(args.gib) + " GiB");
    int code = 0;
    nlohmann::json wrote = CaptureJson({WEIGHTCACHE_PYTHON, "-c", kWriter, model, std::to_string(n),
                                        std::to_string(args.gib * kGiB)},
                                       &code);
    if (code != 0 || wrote.is_discarded()) {
      fs::remove_all(model);
      error("writing the checkpoint with safetensors failed (exit " + std::to_string(code) + ")");
      continue;
    }
    rec["write_s"] = wrote["write_s"];
    auto ckpt = checkpoint::Checkpoint::Open(model);
    if (!ckpt.ok()) {
      fs::remove_all(model);
      error(ckpt.status().ToString());
      continue;
    }
    rec["bytes"] = ckpt->total_bytes();

    AttachOptions o;
    o.identity.model_dir = model;
    o.identity.model_id = kModelId;
    o.identity.runtime_dir = runtime;
    o.identity.device = std::to_string(args.device);
    o.identity.tier = Tier::kGpu;
    o.identity.checkpoint_fingerprint = ckpt->fingerprint();
    auto id = identity::ResolveIdentity(o.identity);
    if (!id.ok()) {
      fs::remove_all(model);
      error(id.status().ToString());
      continue;
    }
    const std::string uuid = id->device_key;
    rec["device"] = uuid;

    const std::optional<DeviceMemory> before = ProbeDeviceMemory(self, uuid);
    std::vector<WatchedDaemon> watched(1);
    WatchedDaemon& d = watched[0];
    d.socket = id->paths.socket;
    d.log = log;
    d.spawned = Clock::now();
    d.pid = SpawnLogged(
        {WEIGHTCACHE_CLI_PATH, "serve", "--model", model, "--model-id", kModelId, "--tier", "gpu",
         "--device", uuid, "--runtime-dir", runtime, "--threads", std::to_string(args.threads)},
        log, {"WEIGHTCACHE_LOG_LEVEL=debug"});
    if (d.pid < 0) {
      fs::remove_all(model);
      error("spawning serve failed");
      continue;
    }
    const Status waited =
        WaitReady(watched, std::chrono::seconds(300), std::chrono::milliseconds(20));
    const pid_t daemon = d.pid;
    if (!waited.ok()) {
      Stop(daemon);
      fs::remove_all(model);
      error("daemon not ready: " + waited.message());
      continue;
    }
    const std::optional<protocol::StatusReply>& ready = d.ready;
    rec["daemon_ready_s"] = Ms(d.ready_at - d.spawned) / 1000;
    // "at_ready": once its loader thread has ended, i.e. released the load's pipeline,
    // mappings and CUDA context, which it does after announcing `ready` (tens to hundreds of
    // ms); "ready_loader_s" is how long after the ready reply that was.
    const bool loader_gone = WaitThreadGone(daemon, "wc-loader", std::chrono::seconds(30));
    rec["ready_loader_s"] = Ms(Clock::now() - d.ready_at) / 1000;
    if (!loader_gone) {
      Stop(daemon);
      fs::remove_all(model);
      error("the daemon's loader thread still runs 30 s after ready");
      continue;
    }
    nlohmann::json memory = {{"at_ready", ProcMemory(daemon)}};
    rec["resident_bytes"] = ready->bytes;
    const std::string text = ReadText(log);
    // "ready: N tensors, … in S s, G GB/s" (info) and "gpu tier: uploaded B bytes in S s (G
    // GB/s), …" (debug): the daemon's own figures.
    const ReadyLine ready_line = ParseReadyLine(text);
    if (ready_line.gb_per_s) rec["gb_per_s"] = *ready_line.gb_per_s;
    if (ready_line.seconds) rec["daemon_load_s"] = *ready_line.seconds;
    if (auto v = LastMatch(
            text, std::regex(R"(uploaded [0-9]+ bytes in [0-9.eE+-]+ s \(([0-9.eE+-]+) GB/s\))"),
            1)) {
      rec["pipeline_gb_per_s"] = *v;
    }
    rec["load_memory"] = ParseLoadMemory(text);

    const std::optional<DeviceMemory> after = ProbeDeviceMemory(self, uuid);
    if (before && after) {
      const int64_t used = static_cast<int64_t>(before->free) - static_cast<int64_t>(after->free);
      const int64_t overhead = used - static_cast<int64_t>(ckpt->total_bytes());
      rec["gpu_used_by_daemon_bytes"] = used;
      rec["overhead_bytes"] = overhead;
      rec["overhead_vs_weights"] = static_cast<double>(overhead) / ckpt->total_bytes();
      rec["overhead_vs_device"] = static_cast<double>(overhead) / static_cast<double>(after->total);
    }
    const auto [rss, hwm] = HostMemory(daemon);
    rec["rss_bytes"] = rss;
    rec["hwm_bytes"] = hwm;
    rec["nvidia_smi_daemon_mib"] = NvidiaSmiMib(daemon);

    nlohmann::json client =
        CaptureJson({self, "--client", model, runtime, uuid, ckpt->fingerprint(), std::to_string(n),
                     std::to_string(args.iters)},
                    &code);
    if (client.is_discarded() || code != 0) {
      rec["client_error"] = client.is_discarded() ? "client exited " + std::to_string(code)
                                                  : client.value("error", "?");
      ++failures;
    } else {
      for (auto& [k, v] : client.items()) rec[k] = v;
    }
    memory["steady"] = ProcMemory(daemon);
    rec["memory"] = memory;
    Stop(daemon);
    fs::remove_all(model);
    fs::remove_all(runtime);
    Emit(rec);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace weightcache::bench

int main(int argc, char** argv) {
  using namespace weightcache::bench;
  std::vector<std::string> a(argv + 1, argv + argc);
  if (!a.empty() && a[0] == "--probe-mem" && a.size() == 2) return ProbeMemMain(a[1]);
  if (!a.empty() && a[0] == "--client" && a.size() == 7) {
    return ClientMain(a[1], a[2], a[3], a[4], std::stoul(a[5]), std::stoi(a[6]));
  }
  ParentArgs args;
  for (size_t i = 0; i + 1 < a.size(); i += 2) {
    const std::string& k = a[i];
    const std::string& v = a[i + 1];
    if (k == "--work") {
      args.work = v;
    } else if (k == "--gib") {
      args.gib = std::stoull(v);
    } else if (k == "--iters") {
      args.iters = std::stoi(v);
    } else if (k == "--device") {
      args.device = std::stoi(v);
    } else if (k == "--threads") {
      args.threads = std::stoi(v);
    } else if (k == "--counts") {
      args.counts.clear();
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');) args.counts.push_back(std::stoi(p));
    } else {
      std::fprintf(stderr,
                   "usage: gpu_attach_bench [--work DIR] [--gib G] [--counts 10,1000,10000] "
                   "[--iters N] [--device I] [--threads T]\n");
      return 2;
    }
  }
  if (a.size() % 2 != 0) {
    std::fprintf(stderr, "gpu_attach_bench: flag %s needs a value\n", a.back().c_str());
    return 2;
  }
  return ParentMain(args, "/proc/self/exe");
}
