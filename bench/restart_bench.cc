// restart_bench — issue 15's two numbers on one GPU, with real processes: the time until a
// `serve` restarted after `kill -9` is ready again on the memory its keeper held (no checkpoint
// byte read), and how long new attaches go unanswered while `weightcache upgrade` hands the
// cache to a successor. The checkpoint is the Llama-3-8B-shaped bf16 one of shard_bench (291
// tensors, 16.06 GB), written by `shard_bench --write-only`.
//
//   1. write the checkpoint (on /dev/shm when it has room), resolve the daemon's socket;
//   2. "floor": a process that only loads the CUDA driver and creates a context on the device
//      (this bench's `--probe-mem` child), timed from spawn to exit, --reps times: every
//      restarted daemon pays this before it can import an allocation;
//   3. "load": one `serve --tier gpu` loads the checkpoint (warm page cache): spawn to ready;
//   4. "crash" --reps times: SIGKILL the daemon (its keeper keeps the memory), spawn `serve`
//      again, time spawn to ready (Status over its socket, polled every millisecond), and read
//      the new daemon's ready line (it must say "adopted"), its own breakdown and its
//      /proc/PID/io rchar: the bytes it read, which must be the headers only (the identity
//      check reads them). The files are not made unreadable: their ctime is part of the cache's
//      identity (docs/integrity.md), so a chmod would make them another cache, and root (the
//      device machine's user) reads mode-000 files anyway; rchar is the proof;
//   5. "upgrade" --reps times: --clients threads of this process attach (C++ client API, no
//      fallback, the caller's deadline 10 s) and detach in a loop; after 300 ms, `weightcache
//      upgrade --socket S --json`; 300 ms after its reply the threads stop. Reported: the
//      attaches and failures, attach latency (p50, p99, max) before and during the upgrade,
//      and the unavailable window: the longest time in which no attach completed, during the
//      upgrade, beside the same figure before it;
//   6. a "result" line with the medians against the targets (ready ≤ 100 ms for 16 GB; window
//      ≤ 50 ms).
//
// Output: one JSON object per line on stdout ({"bench":"restart",...}); progress and errors on
// stderr. Without a driver or the device: one "skipped" line, exit 0. Exit 1 only on an error
// (a missed target is reported, not an error).
//
//   restart_bench [--work DIR] [--reps N] [--device I] [--clients K]
//                 [--adopt-verify sample|full|behind]
//                 [--layers L] [--vocab V] [--tier gpu|host]
//   restart_bench --probe-mem UUID                                       (internal)
//
// `--tier host` runs every phase with host-tier daemons and no device probe: a dry run of the
// bench's process handling on a machine without a GPU (with a small --layers/--vocab).
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "bench_process.h"
#include "cuda/driver_api.h"
#include "identity/resolve.h"
#include "weightcache/client.h"
#include "weightcache/identity_options.h"
#include "weightcache/tier.h"

namespace weightcache::bench {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr char kModelId[] = "llama3-8b-shape";
// Issue 15's targets.
constexpr double kReadyTargetMs = 100;
constexpr double kWindowTargetMs = 50;
constexpr auto kLoadTimeout = std::chrono::seconds(300);
constexpr auto kAdoptTimeout = std::chrono::seconds(60);
constexpr auto kPoll = std::chrono::milliseconds(1);
constexpr auto kAroundUpgrade = std::chrono::milliseconds(300);

void Emit(nlohmann::json j) { EmitRecord("restart", std::move(j)); }
void Note(const std::string& what) { NoteLine("restart_bench", what); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  return v[i];
}
double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

uint64_t FreeBytes(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// /proc/PID/io's rchar (every byte the process read through read-like calls); -1 when the
// file cannot be read.
int64_t ReadChars(pid_t pid) {
  std::ifstream io("/proc/" + std::to_string(pid) + "/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

struct Args {
  std::string work;
  int reps = 3;
  int device = 0;
  int clients = 8;
  std::string adopt_verify = "full";
  uint64_t layers = 0;  // 0: shard_bench's default (the 8B shape)
  uint64_t vocab = 0;
  Tier tier = Tier::kGpu;
};

struct Run {
  std::string self;
  std::string model;
  std::string runtime;
  std::string logs;
  Tier tier = Tier::kGpu;
  std::string uuid;
  std::string adopt_verify;
  IdentityOptions identity;  // what a client of the daemon resolves (fingerprint included)
  std::string socket;

  Result<WatchedDaemon> Spawn(const std::string& tag) const {
    WatchedDaemon d;
    d.socket = socket;
    d.log = logs + "/serve-" + tag + ".log";
    std::vector<std::string> argv = {
        WEIGHTCACHE_CLI_PATH, "serve",  "--model",        model,
        "--model-id",         kModelId, "--tier",         TierName(tier).data(),
        "--runtime-dir",      runtime,  "--adopt-verify", adopt_verify};
    if (tier == Tier::kGpu) argv.insert(argv.end(), {"--device", uuid});
    d.spawned = Clock::now();
    d.pid = SpawnLogged(argv, d.log, {});
    if (d.pid < 0) return InternalError("spawning `weightcache serve` (" + tag + ") failed");
    return d;
  }
};

// Waits until `d` is ready; the error names its log.
Status Ready(WatchedDaemon& d, std::chrono::milliseconds timeout) {
  std::vector<WatchedDaemon> one(1);
  one[0] = std::move(d);
  Status s = WaitReady(one, timeout, kPoll);
  d = std::move(one[0]);
  if (!s.ok()) s.Context("the daemon logging to " + d.log + " is not ready");
  return s;
}

void Kill9(WatchedDaemon& d) {
  if (d.pid <= 0) return;
  ::kill(d.pid, SIGKILL);
  int status = 0;
  while (::waitpid(d.pid, &status, 0) < 0 && errno == EINTR) {
  }
  d.pid = -1;
}

// ---- phases ----------------------------------------------------------------------------------

// A process that only creates a CUDA context on the device: spawn to exit.
nlohmann::json FloorPhase(const Run& run, int reps) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const Clock::time_point t0 = Clock::now();
    if (!ProbeDeviceMemory(run.self, run.uuid))
      return {{"phase", "floor"}, {"error", "probe failed"}};
    ms.push_back(Ms(Clock::now() - t0));
  }
  return {{"phase", "floor"}, {"context_process_ms", ms}, {"median_ms", Median(ms)}};
}

// The daemon's "ready: adopted …" line: the whole line, the seconds since its start and the
// breakdown in parentheses after "verified".
struct AdoptedLine {
  std::string line;
  std::optional<double> since_start_s;
};
AdoptedLine ParseAdopted(const std::string& log) {
  AdoptedLine a;
  const size_t at = log.rfind("ready: adopted");
  if (at == std::string::npos) return a;
  a.line = log.substr(at, log.find('\n', at) - at);
  static const std::regex since(R"(\(([0-9.e+-]+) s since serve started\))");
  a.since_start_s = LastMatch(a.line, since, 1);
  return a;
}

// --reps crashes and restarts. `d` is the running daemon (replaced by each restart).
Result<nlohmann::json> CrashPhase(const Run& run, int reps, WatchedDaemon& d,
                                  uint64_t tensor_bytes) {
  std::vector<double> ready_ms, since_start_ms;
  nlohmann::json each = nlohmann::json::array();
  for (int rep = 0; rep < reps; ++rep) {
    Note("crash: rep " + std::to_string(rep + 1) + " of " + std::to_string(reps));
    Kill9(d);
    WEIGHTCACHE_ASSIGN_OR_RETURN(d, run.Spawn("restart-" + std::to_string(rep)));
    WEIGHTCACHE_RETURN_IF_ERROR(Ready(d, kAdoptTimeout));
    const int64_t rchar = ReadChars(d.pid);  // -1: unknown
    const AdoptedLine adopted = ParseAdopted(ReadText(d.log));
    if (adopted.line.empty()) {
      return InternalError("the restarted daemon did not adopt the kept memory; log " + d.log +
                           ":\n" + ReadText(d.log));
    }
    const double ms = Ms(d.ready_at - d.spawned);
    ready_ms.push_back(ms);
    nlohmann::json rec = {
        {"rep", rep},
        {"spawn_to_ready_ms", ms},
        {"ready_line", adopted.line},
        {"read_chars", rchar},
        {"read_over_tensor_bytes",
         rchar < 0 ? -1.0 : static_cast<double>(rchar) / static_cast<double>(tensor_bytes)}};
    if (adopted.since_start_s) {
      since_start_ms.push_back(*adopted.since_start_s * 1000);
      rec["daemon_since_start_ms"] = *adopted.since_start_s * 1000;
    }
    each.push_back(rec);
  }
  return nlohmann::json{{"phase", "crash"},
                        {"reps", each},
                        {"median_spawn_to_ready_ms", Median(ready_ms)},
                        {"median_daemon_since_start_ms", Median(since_start_ms)}};
}

// One attach as the loop saw it.
struct Sample {
  Clock::time_point start;
  Clock::time_point end;
  bool ok = false;
};

// Attach/detach loops on `clients` threads until `stop`; every sample and the first error.
class AttachLoad {
 public:
  AttachLoad(const IdentityOptions& identity, int clients) {
    options_.identity = identity;
    options_.on_missing = OnMissing::kError;
    options_.wait_timeout = std::chrono::seconds(10);
    for (int i = 0; i < clients; ++i) threads_.emplace_back([this] { Loop(); });
  }
  AttachLoad(const AttachLoad&) = delete;
  AttachLoad& operator=(const AttachLoad&) = delete;
  ~AttachLoad() { Stop(); }
  void Stop() {
    stop_.store(true);
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  std::vector<Sample> samples() const {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }
  std::string first_error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return first_error_;
  }

 private:
  void Loop() {
    std::vector<Sample> mine;
    std::string error;
    while (!stop_.load()) {
      Sample s;
      s.start = Clock::now();
      Result<Attachment> a = Attachment::Attach(options_);
      s.end = Clock::now();
      s.ok = a.ok() && a->source() == AttachSource::kDaemon;
      if (!s.ok && error.empty()) {
        error = a.ok() ? "attached from " + std::string(AttachSourceName(a->source())) + ": " +
                             a->source_reason()
                       : a.status().ToString();
      }
      mine.push_back(s);
    }
    std::lock_guard<std::mutex> lock(mu_);
    samples_.insert(samples_.end(), mine.begin(), mine.end());
    if (first_error_.empty()) first_error_ = error;
  }

  AttachOptions options_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  mutable std::mutex mu_;
  std::vector<Sample> samples_;
  std::string first_error_;
};

// Over the samples whose attach ended in [from, to): latency p50/p99/max and the longest time
// without a successful attach ending (from `from` to the first, between them, to `to`).
nlohmann::json Window(const std::vector<Sample>& all, Clock::time_point from,
                      Clock::time_point to) {
  std::vector<double> latency;
  std::vector<Clock::time_point> ends;
  size_t failed = 0;
  for (const Sample& s : all) {
    if (s.end < from || s.end >= to) continue;
    latency.push_back(Ms(s.end - s.start));
    if (s.ok) {
      ends.push_back(s.end);
    } else {
      ++failed;
    }
  }
  std::sort(ends.begin(), ends.end());
  double gap = 0;
  Clock::time_point last = from;
  for (Clock::time_point e : ends) {
    gap = std::max(gap, Ms(e - last));
    last = e;
  }
  gap = std::max(gap, Ms(to - last));
  return {
      {"attaches", latency.size()},
      {"failed", failed},
      {"latency_p50_ms", Percentile(latency, 0.5)},
      {"latency_p99_ms", Percentile(latency, 0.99)},
      {"latency_max_ms", latency.empty() ? 0.0 : *std::max_element(latency.begin(), latency.end())},
      {"longest_without_attach_ms", gap}};
}

// --reps upgrades under the attach load. `d` is the running daemon; after each upgrade the
// successor (not a child of this process) serves, and the next upgrade goes to it.
Result<nlohmann::json> UpgradePhase(const Run& run, int reps, int clients, WatchedDaemon& d) {
  std::vector<double> windows, handover_ms;
  nlohmann::json each = nlohmann::json::array();
  pid_t serving = d.pid;
  for (int rep = 0; rep < reps; ++rep) {
    Note("upgrade: rep " + std::to_string(rep + 1) + " of " + std::to_string(reps) + ", " +
         std::to_string(clients) + " clients attaching");
    // One attachment held through the rep: the process's CUDA context then stays, and no
    // attach of the loop pays for creating it again.
    AttachOptions hold;
    hold.identity = run.identity;
    hold.on_missing = OnMissing::kError;
    Result<Attachment> anchor = Attachment::Attach(hold);
    if (!anchor.ok()) return anchor.status().Context("the anchor attach");
    AttachLoad load(run.identity, clients);
    const Clock::time_point begin = Clock::now();
    std::this_thread::sleep_for(kAroundUpgrade);
    const Clock::time_point up_start = Clock::now();
    int code = 0;
    nlohmann::json reply = CaptureJson(
        {WEIGHTCACHE_CLI_PATH, "upgrade", "--socket", run.socket, "--json", "--timeout", "60"},
        &code);
    const Clock::time_point up_end = Clock::now();
    std::this_thread::sleep_for(kAroundUpgrade);
    load.Stop();
    const Clock::time_point end = Clock::now();
    if (code != 0 || reply.is_discarded() || !reply.contains("successor_pid")) {
      return InternalError("`weightcache upgrade` exited " + std::to_string(code) +
                           "; the daemon's log " + d.log + ":\n" + ReadText(d.log));
    }
    const std::vector<Sample> samples = load.samples();
    // The old daemon (our child on the first rep) exits once its backlog is served.
    if (serving == d.pid && d.pid > 0) {
      int status = 0;
      while (::waitpid(d.pid, &status, 0) < 0 && errno == EINTR) {
      }
      d.pid = -1;
    }
    serving = reply["successor_pid"].get<pid_t>();
    const nlohmann::json before = Window(samples, begin, up_start);
    const nlohmann::json during = Window(samples, up_start, up_end + 50ms);
    const nlohmann::json after = Window(samples, up_end + 50ms, end);
    const double window = during["longest_without_attach_ms"].get<double>();
    windows.push_back(window);
    handover_ms.push_back(reply["handover_us"].get<double>() / 1000);
    each.push_back({{"rep", rep},
                    {"upgrade_command_ms", Ms(up_end - up_start)},
                    {"handover_ms", handover_ms.back()},
                    {"successor_pid", serving},
                    {"before", before},
                    {"during", during},
                    {"after", after},
                    {"first_error", load.first_error()}});
  }
  d.pid = -1;  // the last successor is not our child: stopped through its socket
  return nlohmann::json{{"phase", "upgrade"},
                        {"clients", clients},
                        {"reps", each},
                        {"serving_pid", serving},
                        {"median_window_ms", Median(windows)},
                        {"median_handover_ms", Median(handover_ms)}};
}

Status RunPhases(const Args& args, Run& run) {
  Note("writing the checkpoint to " + run.model);
  std::vector<std::string> write = {WEIGHTCACHE_SHARD_BENCH_PATH, "--write-only", run.model};
  if (args.layers != 0) write.insert(write.end(), {"--layers", std::to_string(args.layers)});
  if (args.vocab != 0) write.insert(write.end(), {"--vocab", std::to_string(args.vocab)});
  std::string written;
  if (int code = Capture(write, &written); code != 0) {
    return InternalError("`shard_bench --write-only` exited " + std::to_string(code));
  }
  run.identity.model_dir = run.model;
  run.identity.model_id = kModelId;
  run.identity.runtime_dir = run.runtime;
  run.identity.tier = run.tier;
  if (run.tier == Tier::kGpu) run.identity.device = run.uuid;
  WEIGHTCACHE_ASSIGN_OR_RETURN(identity::ResolvedIdentity id,
                               identity::ResolveIdentity(run.identity));
  run.identity.checkpoint_fingerprint = id.config.checkpoint_fingerprint;
  run.socket = id.paths.socket;

  if (run.tier == Tier::kGpu) Emit(FloorPhase(run, args.reps));

  Note("load: the first daemon reads the checkpoint");
  auto first = run.Spawn("load");
  if (!first.ok()) return first.status();
  WatchedDaemon d = std::move(*first);
  // However the phases end, no daemon of ours is left running, nor its keeper: a deliberate
  // stop (SIGTERM to our child, or `weightcache stop` to a successor) frees the kept memory.
  struct Reaper {
    WatchedDaemon& d;
    const Run& run;
    ~Reaper() {
      if (d.pid > 0) {
        Stop(d.pid);
        return;
      }
      std::string out;
      Capture({WEIGHTCACHE_CLI_PATH, "stop", "--socket", run.socket}, &out);
    }
  } reaper{d, run};
  WEIGHTCACHE_RETURN_IF_ERROR(Ready(d, kLoadTimeout));
  const uint64_t tensor_bytes = d.ready->bytes;
  const ReadyLine loaded = ParseReadyLine(ReadText(d.log));
  Emit(
      {{"phase", "load"},
       {"spawn_to_ready_s", Seconds(d.ready_at - d.spawned)},
       {"bytes", tensor_bytes},
       {"daemon_gb_per_s", loaded.gb_per_s ? nlohmann::json(*loaded.gb_per_s) : nlohmann::json()}});

  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json crash, CrashPhase(run, args.reps, d, tensor_bytes));
  Emit(crash);
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json upgrade,
                               UpgradePhase(run, args.reps, args.clients, d));
  Emit(upgrade);
  const double ready = crash["median_spawn_to_ready_ms"].get<double>();
  const double window = upgrade["median_window_ms"].get<double>();
  Emit({{"phase", "result"},
        {"tier", TierName(run.tier)},
        {"bytes", tensor_bytes},
        {"adopt_verify", run.adopt_verify},
        {"restart_ready_ms", ready},
        {"ready_target_ms", kReadyTargetMs},
        {"within_ready_target", ready <= kReadyTargetMs},
        {"upgrade_window_ms", window},
        {"window_target_ms", kWindowTargetMs},
        {"within_window_target", window <= kWindowTargetMs}});
  return Status::Ok();
}

int ParentMain(const Args& args, const std::string& self) {
  Run run;
  run.self = self;
  run.tier = args.tier;
  run.adopt_verify = args.adopt_verify;
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
  run.logs = args.work.empty() ? (fs::temp_directory_path() / "restart_bench").string() : args.work;
  std::error_code ec;
  fs::create_directories(run.logs, ec);
  if (ec) {
    Emit({{"error", "creating " + run.logs + ": " + ec.message()}});
    return 1;
  }
  const std::string tag = std::to_string(::getpid());
  // /dev/shm when it has room for the 16 GB checkpoint (writing is then memory-speed).
  run.model = FreeBytes("/dev/shm") > 18 * kGiB || args.layers != 0
                  ? "/dev/shm/restart_bench-" + tag
                  : run.logs + "/model-" + tag;
  // Short: the socket paths under it must fit the 107-byte sun_path.
  run.runtime = "/tmp/wcrt-restart-" + tag;
  Status result = RunPhases(args, run);
  fs::remove_all(run.model, ec);
  fs::remove_all(run.runtime, ec);
  if (!result.ok()) {
    Emit({{"error", result.ToString()}});
    return 1;
  }
  return 0;
}

constexpr char kUsage[] =
    "usage: restart_bench [--work DIR] [--reps N] [--device I] [--clients K] "
    "[--adopt-verify sample|full|behind] [--layers L] [--vocab V] [--tier gpu|host]\n";

int Main(const std::vector<std::string>& a) {
  if (a.size() == 2 && a[0] == "--probe-mem") return ProbeMemMain(a[1]);
  if (a.size() % 2 != 0) {
    std::fprintf(stderr, "restart_bench: flag %s needs a value\n%s", a.back().c_str(), kUsage);
    return 2;
  }
  Args args;
  for (size_t i = 0; i < a.size(); i += 2) {
    const std::string& k = a[i];
    const std::string& v = a[i + 1];
    if (k == "--work") {
      args.work = v;
    } else if (k == "--adopt-verify") {
      if (v != "sample" && v != "full" && v != "behind") {
        std::fprintf(stderr, "restart_bench: --adopt-verify: expected sample, full or behind\n");
        return 2;
      }
      args.adopt_verify = v;
    } else if (k == "--tier") {
      const std::optional<Tier> tier = ParseTier(v);
      if (!tier) {
        std::fprintf(stderr, "restart_bench: --tier: expected gpu or host, got \"%s\"\n",
                     v.c_str());
        return 2;
      }
      args.tier = *tier;
    } else if (k == "--reps" || k == "--device" || k == "--clients" || k == "--layers" ||
               k == "--vocab") {
      uint64_t n = 0;
      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
      const bool zero_ok = k == "--device";
      if (ec != std::errc() || end != v.data() + v.size() || (n == 0 && !zero_ok) ||
          n > (uint64_t{1} << 24)) {
        std::fprintf(stderr, "restart_bench: %s: expected a %s integer, got \"%s\"\n", k.c_str(),
                     zero_ok ? "non-negative" : "positive", v.c_str());
        return 2;
      }
      if (k == "--reps") args.reps = static_cast<int>(n);
      if (k == "--device") args.device = static_cast<int>(n);
      if (k == "--clients") args.clients = static_cast<int>(n);
      if (k == "--layers") args.layers = n;
      if (k == "--vocab") args.vocab = n;
    } else {
      std::fprintf(stderr, "restart_bench: unknown flag %s\n%s", k.c_str(), kUsage);
      return 2;
    }
  }
  return ParentMain(args, "/proc/self/exe");
}

}  // namespace
}  // namespace weightcache::bench

int main(int argc, char** argv) {
  // The edge: an exception is an error line and exit 1, never an abort.
  try {
    return weightcache::bench::Main(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    weightcache::bench::Emit({{"error", e.what()}});
    return 1;
  }
}
