// host_attach_bench — the host tier, measured end to end with real processes:
//   * attach latency, client side (connect + Hello + Attach + map every memfd + build the
//     tensor table), median and p90 of --iters attaches, for checkpoints of 10, 1,000 and
//     10,000 tensors — with the fingerprint given (the engine knows it) and computed (reads
//     every shard header);
//   * the daemon's load GB/s — its own figure (the `ready: ... in S s` line of its log: loader
//     thread start to sealed memfds and a ready socket) and end to end (spawn of
//     `weightcache serve --tier host` until the first successful attach, polled every 0.5 ms
//     with a zero wait timeout so the client's 50 ms loading poll does not quantise it) —
//     against three file-read limits of the same files with the same number of threads
//     (checkpoint::ReadRanges), measured in the same run:
//       prefaulted  into private memory touched before the clock starts: the copy alone;
//       fresh       into a fresh private anonymous mapping: the copy plus first-touch page
//                   allocation, what any loader that allocates its destination pays;
//       memfd       into a fresh memfd mapping: the same with shmem pages, the floor for the
//                   host tier, which must hand out memfd (shmem) memory.
//   * the daemon's host memory serving the load checkpoint (< 100 MB RSS: docs/design.md
//     "Performance targets"), as bench/proc_memory.h breaks it down: its own "load memory:" log
//     line (after the load, before ready), at ready, and after 20 attaches and detaches; plus
//     the growth of the system's Shmem (/proc/meminfo) across the load, which is where the
//     memfd pages count — the daemon never maps them, so they are in none of its RSS figures.
// Checkpoints are written by tests/tools/make_checkpoint.py (the real safetensors writer).
// Output: one JSON object per line on stdout.
//
//   host_attach_bench WORK_DIR [--iters N] [--threads T] [--load-mib M] [--counts 10,1000,10000]
//                     [--rounds R] [--cli PATH]   (--cli: another weightcache binary, e.g. an
//                     older build, for before/after comparisons)
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "proc_memory.h"
#include "weightcache/client.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using weightcache::Attachment;
using weightcache::AttachOptions;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Die(const std::string& what) {
  std::fprintf(stderr, "host_attach_bench: %s\n", what.c_str());
  std::exit(1);
}

// The bench's client identity for the daemon serving `model` under `runtime` (host tier, an
// error rather than a fallback when the daemon is missing).
AttachOptions BenchOptions(const std::string& model, const std::string& runtime) {
  AttachOptions o;
  o.identity.model_dir = model;
  o.identity.model_id = "bench";
  o.identity.runtime_dir = runtime;
  o.identity.tier = weightcache::Tier::kHost;
  o.on_missing = weightcache::OnMissing::kError;
  return o;
}

int Run(const std::vector<std::string>& argv) {
  std::vector<std::string> args = argv;
  std::vector<char*> c;
  for (auto& s : args) c.push_back(s.data());
  c.push_back(nullptr);
  pid_t pid;
  if (posix_spawnp(&pid, c[0], nullptr, nullptr, c.data(), environ) != 0) return -1;
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<std::string> args = argv;
  std::vector<char*> c;
  for (auto& s : args) c.push_back(s.data());
  c.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT, 0600);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  if (posix_spawn(&pid, c[0], &fa, nullptr, c.data(), environ) != 0) Die("spawn " + argv[0]);
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

void Stop(pid_t pid) {
  kill(pid, SIGTERM);
  int st;
  waitpid(pid, &st, 0);
}

std::string MakeCheckpoint(const std::string& dir, int tensors, int max_elems, int shards) {
  int rc = Run({WEIGHTCACHE_PYTHON,
                std::string(WEIGHTCACHE_SOURCE_DIR) + "/tests/tools/make_checkpoint.py", "--out",
                dir, "--tensors", std::to_string(tensors), "--dtypes", "bf16", "--min-elems",
                std::to_string(max_elems / 2), "--max-elems", std::to_string(max_elems), "--shards",
                std::to_string(shards), "--seed", "5"});
  if (rc != 0) Die("make_checkpoint.py failed for " + dir);
  return dir;
}

std::string g_cli = WEIGHTCACHE_CLI_PATH;

struct Daemon {
  pid_t pid;
  double ready_ms;  // spawn → first successful attach
};

// Spawns a host-tier daemon and attaches until it succeeds. `options.wait_timeout` should be 0:
// a daemon still loading is then kTimeout at once and the loop retries after 0.5 ms, instead
// of the client sleeping its 50 ms loading poll interval inside Attach.
Daemon StartAndWait(const std::string& model, const std::string& runtime, int threads,
                    const AttachOptions& options, const std::string& log) {
  auto start = Clock::now();
  pid_t pid = Spawn({g_cli, "serve", "--model", model, "--model-id", "bench", "--tier", "host",
                     "--runtime-dir", runtime, "--threads", std::to_string(threads)},
                    log);
  for (;;) {
    auto a = Attachment::Attach(options);
    if (a.ok()) return {pid, Ms(Clock::now() - start)};
    if (a.status().code() != weightcache::StatusCode::kNoDaemon &&
        a.status().code() != weightcache::StatusCode::kTimeout) {
      Die("attach: " + a.status().ToString());
    }
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid) Die("serve exited; see " + log);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// The daemon's own load time: "ready: ... in S s" in its log (tools/cmd_serve.cc), or -1.
double DaemonReadySeconds(const std::string& log) {
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("ready: ");
    if (at == std::string::npos) continue;
    const auto in_at = line.find(" in ", at);
    if (in_at != std::string::npos) return std::atof(line.c_str() + in_at + 4);
  }
  return -1;
}

enum class Destination { kPrefaulted, kFresh, kMemfd };

// GB/s of reading every tensor of `ckpt` with `threads` threads into one buffer of the given
// kind. The destination is allocated inside the timed region for kFresh and kMemfd.
double FileReadGbps(const weightcache::checkpoint::Checkpoint& ckpt, int threads,
                    Destination where) {
  const uint64_t bytes = ckpt.total_bytes();
  std::vector<uint8_t> prefaulted;
  if (where == Destination::kPrefaulted) prefaulted.assign(bytes, 1);
  const auto t0 = Clock::now();
  uint8_t* buffer = prefaulted.data();
  int memfd = -1;
  if (where == Destination::kFresh) {
    buffer = static_cast<uint8_t*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  } else if (where == Destination::kMemfd) {
    memfd = memfd_create("host_attach_bench", MFD_CLOEXEC);
    if (memfd < 0 || ftruncate(memfd, static_cast<off_t>(bytes)) != 0) Die("memfd");
    buffer =
        static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0));
  }
  if (buffer == MAP_FAILED) Die("mmap");
  std::vector<weightcache::checkpoint::ReadRequest> reqs;
  uint64_t at = 0;
  for (const auto& t : ckpt.tensors()) {
    reqs.push_back({t.shard, t.offset, t.nbytes, buffer + at});
    at += t.nbytes;
  }
  weightcache::checkpoint::ReadOptions ro;
  ro.threads = threads;
  auto st = weightcache::checkpoint::ReadRanges(ckpt, reqs, ro);
  const double s = Ms(Clock::now() - t0) / 1000;
  if (!st.ok()) Die(st.ToString());
  if (where != Destination::kPrefaulted) munmap(buffer, bytes);
  if (memfd >= 0) close(memfd);
  return bytes / s / 1e9;
}

nlohmann::json Percentiles(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {{"median_ms", v[v.size() / 2]},
          {"p90_ms", v[std::min(v.size() - 1, v.size() * 9 / 10)]},
          {"min_ms", v.front()}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) Die("usage: host_attach_bench WORK_DIR [--iters N] [--threads T] ...");
  std::string work = argv[1];
  int iters = 200, threads = 2, load_mib = 512, rounds = 3;
  std::vector<int> counts = {10, 1000, 10000};
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--iters")
      iters = std::stoi(v);
    else if (k == "--threads")
      threads = std::stoi(v);
    else if (k == "--load-mib")
      load_mib = std::stoi(v);
    else if (k == "--rounds")
      rounds = std::max(1, std::stoi(v));
    else if (k == "--cli")
      g_cli = v;
    else if (k == "--counts") {
      counts.clear();
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');) counts.push_back(std::stoi(p));
    } else
      Die("unknown flag " + k);
  }
  Run({"mkdir", "-p", work});

  // ---- attach latency vs tensor count ------------------------------------------------------
  for (int n : counts) {
    const std::string model = MakeCheckpoint(work + "/attach-" + std::to_string(n), n, 256, 1);
    const std::string runtime = work + "/run-attach-" + std::to_string(n);
    auto ckpt = weightcache::checkpoint::Checkpoint::Open(model);
    if (!ckpt.ok()) Die(ckpt.status().ToString());
    AttachOptions o = BenchOptions(model, runtime);
    AttachOptions startup = o;
    startup.wait_timeout = std::chrono::milliseconds(0);
    Daemon d = StartAndWait(model, runtime, threads, startup, runtime + ".log");

    std::vector<double> full, known;
    // The library's phases (weightcache::AttachTimings) of the fingerprint-given attaches.
    std::vector<double> discover, map, table;
    AttachOptions fast = o;
    fast.identity.checkpoint_fingerprint = ckpt->fingerprint();
    for (int i = 0; i < iters; ++i) {
      auto t0 = Clock::now();
      auto a = Attachment::Attach(fast);
      auto t1 = Clock::now();
      if (!a.ok() || a->source() != weightcache::AttachSource::kDaemon) Die("attach failed");
      known.push_back(Ms(t1 - t0));
      discover.push_back(a->timings().discover_ms);
      map.push_back(a->timings().map_ms);
      table.push_back(a->timings().table_ms);
      auto t2 = Clock::now();
      auto b = Attachment::Attach(o);
      auto t3 = Clock::now();
      if (!b.ok()) Die("attach failed");
      full.push_back(Ms(t3 - t2));
    }
    Stop(d.pid);
    std::printf("%s\n", nlohmann::json{{"bench", "host_attach"},
                                       {"tensors", n},
                                       {"bytes", ckpt->total_bytes()},
                                       {"iters", iters},
                                       {"fingerprint_given", Percentiles(known)},
                                       {"fingerprint_computed", Percentiles(full)},
                                       {"phases_ms",
                                        {{"discover", Percentiles(discover)},
                                         {"map", Percentiles(map)},
                                         {"table", Percentiles(table)}}}}
                            .dump()
                            .c_str());
    std::fflush(stdout);
  }

  // ---- daemon load GB/s vs plain file read GB/s --------------------------------------------
  const int tensors = 64;
  const int elems = static_cast<int>((static_cast<int64_t>(load_mib) << 20) / tensors / 2);
  const std::string model = MakeCheckpoint(work + "/load", tensors, elems, 4);
  auto ckpt = weightcache::checkpoint::Checkpoint::Open(model);
  if (!ckpt.ok()) Die(ckpt.status().ToString());
  const uint64_t bytes = ckpt->total_bytes();

  std::vector<double> prefaulted_gbps, fresh_gbps, memfd_gbps, e2e_gbps, own_gbps;
  for (int round = 0; round < rounds; ++round) {
    prefaulted_gbps.push_back(FileReadGbps(*ckpt, threads, Destination::kPrefaulted));
    fresh_gbps.push_back(FileReadGbps(*ckpt, threads, Destination::kFresh));
    memfd_gbps.push_back(FileReadGbps(*ckpt, threads, Destination::kMemfd));
    const std::string runtime = work + "/run-load-" + std::to_string(round);
    Run({"rm", "-rf", runtime, runtime + ".log"});
    AttachOptions o = BenchOptions(model, runtime);
    o.identity.checkpoint_fingerprint = ckpt->fingerprint();
    o.wait_timeout = std::chrono::milliseconds(0);
    Daemon d = StartAndWait(model, runtime, threads, o, runtime + ".log");
    e2e_gbps.push_back(bytes / (d.ready_ms / 1000) / 1e9);
    Stop(d.pid);
    const double own = DaemonReadySeconds(runtime + ".log");
    own_gbps.push_back(own > 0 ? bytes / own / 1e9 : 0);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double own = median(own_gbps), e2e = median(e2e_gbps);
  std::printf(
      "%s\n",
      nlohmann::json{
          {"bench", "host_load"},
          {"bytes", bytes},
          {"threads", threads},
          {"rounds", rounds},
          {"cli", g_cli},
          {"page_cache", "warm (files just written)"},
          {"file_read_gbps",
           {{"prefaulted", median(prefaulted_gbps)},
            {"fresh", median(fresh_gbps)},
            {"memfd", median(memfd_gbps)}}},
          {"daemon_load_gbps", {{"own", own}, {"end_to_end", e2e}}},
          {"ratio_own",
           {{"prefaulted", own / median(prefaulted_gbps)},
            {"fresh", own / median(fresh_gbps)},
            {"memfd", own / median(memfd_gbps)}}},
          {"ratio_end_to_end",
           {{"fresh", e2e / median(fresh_gbps)}, {"memfd", e2e / median(memfd_gbps)}}},
          {"note",
           "own = the daemon's ready line (loader start to ready); end_to_end = spawn of serve "
           "until the first attach"}}
          .dump()
          .c_str());
  std::fflush(stdout);

  // ---- the daemon's host memory ------------------------------------------------------------
  {
    const std::string runtime = work + "/run-memory";
    Run({"rm", "-rf", runtime, runtime + ".log"});
    AttachOptions o = BenchOptions(model, runtime);
    o.identity.checkpoint_fingerprint = ckpt->fingerprint();
    o.wait_timeout = std::chrono::milliseconds(0);
    auto shmem = [] {
      return weightcache::bench::ProcKeyValues("/proc/meminfo", {"Shmem"}).value("Shmem", 0ull);
    };
    const uint64_t shmem_before = shmem();
    Daemon d = StartAndWait(model, runtime, threads, o, runtime + ".log");
    nlohmann::json at_ready = weightcache::bench::ProcMemory(d.pid);
    const uint64_t shmem_ready = shmem();
    for (int i = 0; i < 20; ++i) {
      auto a = Attachment::Attach(o);
      if (!a.ok()) Die("attach: " + a.status().ToString());
    }
    nlohmann::json steady = weightcache::bench::ProcMemory(d.pid);
    Stop(d.pid);
    std::ifstream log(runtime + ".log");
    std::stringstream text;
    text << log.rdbuf();
    std::printf(
        "%s\n",
        nlohmann::json{
            {"bench", "host_memory"},
            {"bytes", bytes},
            {"load_memory", weightcache::bench::ParseLoadMemory(text.str())},
            {"at_ready", at_ready},
            {"steady", steady},
            {"system_shmem_growth_bytes", static_cast<int64_t>(shmem_ready - shmem_before)},
            {"note",
             "load_memory: the daemon's own figures after the load (loaded) and after "
             "malloc_trim (released); steady: after 20 attaches; the memfds are shmem the "
             "daemon does not map: system Shmem grows by about the bytes, RssShmem stays 0"}}
            .dump()
            .c_str());
  }
  return 0;
}
