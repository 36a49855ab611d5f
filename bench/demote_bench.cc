// demote_bench — demotion to host RAM and promotion back (`serve --demote host`,
// docs/budget.md), measured against the pinned H2D rate of the same run (issue 16 targets:
// promotion ≥ 0.9 × pinned H2D, demotion ≥ 20 GB/s).
//
//   demote_bench [--gib N] [--device I] [--reps R] [--alloc-gib A]
//                [--strategy staged|registered|kept|both] [--threads T] [--staging-mib M]
//                [--settle-ms S] [--host-write-passes P] [--host-write-only]
//
// An exported VMM arena of N GiB (default 16) in allocations of A GiB (default 2), as a gpu
// cache holds it, filled on the device; then for each strategy (default both), R times
// (default 3): demotion (cuda::CopyDeviceToMemfds: import, copy into memfds, seal), the device
// memory freed, promotion (cuda::CopyMemfdsToDevice: new arena, copy from the sealed memfds),
// the host copy freed. Strategies (cuda/tier_copy.h): staged (T workers, default the
// library's: the cores, 4 to 16; each with two pinned buffers of M MiB, default 16; the host
// copy in memfd segments of at most 512 MiB) and registered (the segments' mappings pinned
// chunk by chunk by T workers as they are copied); then (kept, and with both) the path of
// `serve --demote host-pinned`: a staged demotion, the segments pinned whole by T workers
// (cuda::PinnedHostCopy, timed apart) and the promotion by DMA alone from them.
// Pinned H2D and D2H: one 1 GiB cuMemcpy{HtoD,DtoH}Async with pinned host memory (best of 3),
// the links' rates the targets are measured against. The host half of a staged demotion alone,
// its limit on this machine: T threads pwrite()ing a private buffer of M MiB into new memfd
// segments of the demotion's size, no GPU (`--host-write-passes P` passes, default 2, each
// pass's memfds closed before the next; `host_write_gb_s` is the best, `host_write_passes_gb_s`
// each in order: the first pass takes host memory this machine may never have touched, which
// costs more in a VM whose memory is backed as it is first used). Each line also carries the
// kernel's /sys/kernel/mm/transparent_hugepage/shmem_enabled (whether a memfd can get huge
// pages). One JSON object per line. --settle-ms: a pause of S ms before each demotion (default
// 0), to see whether what the previous repetition released (an unpinned host copy, freed
// memfds) still costs the next demotion. --host-write-only: the host write passes alone (no
// GPU, no driver), one line per pass with MemTotal and MemFree before it, --settle-ms apart.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/tier_copy.h"
#include "cuda/upload_resources.h"
#include "cuda/vmm.h"
#include "os/memfd.h"

namespace wc = weightcache;
namespace cu = weightcache::cuda;

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

void Emit(nlohmann::json j) {
  j["bench"] = "demote_bench";
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

[[noreturn]] void Die(const std::string& what) {
  Emit({{"error", what}});
  std::exit(1);
}

template <typename T>
T Check(wc::Result<T> r, const char* what) {
  if (!r.ok()) Die(std::string(what) + ": " + r.status().ToString());
  return std::move(r).value();
}

void CheckCu(const cu::DriverApi* api, CUresult rc, const char* what) {
  if (rc != CUDA_SUCCESS) Die(cu::DriverError(api, rc, what).ToString());
}

std::string ShmemEnabled() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string line;
  if (!std::getline(in, line)) return "unknown";
  return line;
}

struct PinnedRates {
  double h2d = 0;
  double d2h = 0;
};

// One 1 GiB pinned host → device and device → host copy, best of 3 each, GB/s (1e9 bytes).
PinnedRates Pinned(const cu::DriverApi* api) {
  const size_t bytes = kGiB;
  auto host = Check(cu::PinnedHostBuffer::Create(api, bytes), "pinned buffer");
  CUdeviceptr dev = 0;
  CheckCu(api, api->cuMemAlloc(&dev, bytes), "cuMemAlloc");
  auto stream = Check(cu::CudaStream::Create(api), "stream");
  CUevent start = nullptr, stop = nullptr;
  CheckCu(api, api->cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate");
  CheckCu(api, api->cuEventCreate(&stop, CU_EVENT_DEFAULT), "cuEventCreate");
  PinnedRates rates;
  for (const bool h2d : {true, false}) {
    double& best = h2d ? rates.h2d : rates.d2h;
    for (int i = 0; i < 3; ++i) {
      CheckCu(api, api->cuEventRecord(start, stream.get()), "cuEventRecord");
      CheckCu(api,
              h2d ? api->cuMemcpyHtoDAsync(dev, host.data(), bytes, stream.get())
                  : api->cuMemcpyDtoHAsync(host.data(), dev, bytes, stream.get()),
              h2d ? "H2D" : "D2H");
      CheckCu(api, api->cuEventRecord(stop, stream.get()), "cuEventRecord");
      CheckCu(api, api->cuEventSynchronize(stop), "cuEventSynchronize");
      float ms = 0;
      CheckCu(api, api->cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
      best = std::max(best, static_cast<double>(bytes) / 1e9 / (ms / 1e3));
    }
  }
  api->cuEventDestroy(start);
  api->cuEventDestroy(stop);
  api->cuMemFree(dev);
  return rates;
}

// /proc/meminfo's MemTotal and MemFree, GB (1e9 bytes); 0 where unreadable.
struct MemInfo {
  double total_gb = 0;
  double free_gb = 0;
};
MemInfo ReadMemInfo() {
  std::ifstream in("/proc/meminfo");
  MemInfo info;
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:") info.total_gb = static_cast<double>(kib) * 1024 / 1e9;
    if (key == "MemFree:") info.free_gb = static_cast<double>(kib) * 1024 / 1e9;
  }
  return info;
}

// The host half of a staged demotion, without the GPU: `threads` workers, each taking whole
// segments of `segment_bytes` in turn, making each a memfd and pwrite()ing a private buffer of
// `buffer_bytes` (resident, as a staging buffer is) into it until it is full. GB/s of one
// pass; every memfd is closed before it returns.
double HostWritePass(uint64_t total, uint64_t segment_bytes, size_t threads,
                     uint64_t buffer_bytes) {
  const size_t count = static_cast<size_t>((total + segment_bytes - 1) / segment_bytes);
  std::vector<wc::UniqueFd> memfds(count);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      std::vector<std::byte> buffer(buffer_bytes, std::byte{0x5a});
      for (size_t i = next++; i < count; i = next++) {
        const uint64_t bytes = std::min(segment_bytes, total - i * segment_bytes);
        auto fd = wc::os::CreateMemfd("demote_bench-limit", bytes);
        if (!fd.ok()) {
          failed = true;
          return;
        }
        for (uint64_t at = 0; at < bytes; at += buffer_bytes) {
          const uint64_t n = std::min(buffer_bytes, bytes - at);
          if (!wc::os::PwriteAll(fd->get(), buffer.data(), n, at).ok()) {
            failed = true;
            return;
          }
        }
        memfds[i] = std::move(fd).value();
      }
    });
  }
  for (std::thread& w : workers) w.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (failed) Die("the host write limit: a memfd could not be made or written");
  return static_cast<double>(total) / 1e9 / s;
}

int Run(int argc, char** argv) {
  const cu::TierCopyOptions defaults;
  uint64_t gib = 16, alloc_gib = 2, staging_mib = defaults.staging_bytes >> 20;
  int device_index = 0, reps = 3, settle_ms = 0, host_write_passes = 2;
  size_t threads = defaults.threads;
  std::string strategy = "both";
  bool host_write_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--gib") {
      gib = std::stoull(next());
    } else if (a == "--alloc-gib") {
      alloc_gib = std::stoull(next());
    } else if (a == "--device") {
      device_index = std::stoi(next());
    } else if (a == "--reps") {
      reps = std::stoi(next());
    } else if (a == "--strategy") {
      strategy = next();
    } else if (a == "--threads") {
      threads = std::stoull(next());
    } else if (a == "--staging-mib") {
      staging_mib = std::stoull(next());
    } else if (a == "--settle-ms") {
      settle_ms = std::stoi(next());
    } else if (a == "--host-write-passes") {
      host_write_passes = std::stoi(next());
    } else if (a == "--host-write-only") {
      host_write_only = true;
    } else {
      Die("unknown argument " + a);
    }
  }
  if (gib == 0 || alloc_gib == 0 || reps < 1 || threads == 0 || staging_mib == 0 ||
      host_write_passes < 1) {
    Die("--gib, --alloc-gib, --reps, --threads, --staging-mib and --host-write-passes must be > 0");
  }
  const auto settle = [settle_ms] {
    if (settle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
  };
  if (host_write_only) {
    for (int pass = 0; pass < host_write_passes; ++pass) {
      if (pass > 0) settle();
      const MemInfo before = ReadMemInfo();
      const double gb_s =
          HostWritePass(gib * kGiB, defaults.segment_bytes, threads, staging_mib << 20);
      Emit({{"mode", "host_write_only"},
            {"pass", pass},
            {"gib", gib},
            {"threads", threads},
            {"buffer_mib", staging_mib},
            {"host_write_gb_s", gb_s},
            {"mem_total_gb_before", before.total_gb},
            {"mem_free_gb_before", before.free_gb},
            {"settle_ms", settle_ms}});
    }
    return 0;
  }
  std::vector<std::pair<std::string, cu::TierCopyStrategy>> strategies;
  if (strategy == "staged" || strategy == "both") {
    strategies.emplace_back("staged", cu::TierCopyStrategy::kStaged);
  }
  if (strategy == "registered" || strategy == "both") {
    strategies.emplace_back("registered", cu::TierCopyStrategy::kRegistered);
  }
  const bool kept = strategy == "kept" || strategy == "both";
  if (strategies.empty() && !kept) Die("--strategy must be staged, registered, kept or both");
  const std::string shmem_enabled = ShmemEnabled();
  const cu::DriverApi* api = Check(cu::LoadDriver(), "loading the CUDA driver");
  CUdevice device = 0;
  CheckCu(api, api->cuDeviceGet(&device, device_index), "cuDeviceGet");
  std::vector<uint64_t> sizes;
  for (uint64_t left = gib * kGiB; left > 0;) {
    const uint64_t s = std::min(left, alloc_gib * kGiB);
    sizes.push_back(s);
    left -= s;
  }
  PinnedRates pinned;
  std::vector<wc::UniqueFd> device_fds;
  {
    // The source arena, filled on the device (a context is current while the arena lives).
    auto arena = Check(cu::ExportedArena::Create(api, device, sizes), "arena");
    CheckCu(api, api->cuMemsetD8(arena.base(), 0x5a, arena.total_bytes()), "cuMemsetD8");
    CheckCu(api, api->cuCtxSynchronize(), "cuCtxSynchronize");
    pinned = Pinned(api);
    device_fds = std::move(arena).ReleaseToFds();
  }
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0; };
  std::vector<double> host_write_passes_gb_s;
  for (int pass = 0; pass < host_write_passes; ++pass) {
    host_write_passes_gb_s.push_back(
        HostWritePass(gib * kGiB, defaults.segment_bytes, threads, staging_mib << 20));
  }
  const double host_write =
      *std::max_element(host_write_passes_gb_s.begin(), host_write_passes_gb_s.end());
  for (const auto& [label, kind] : strategies) {
    cu::TierCopyOptions options;
    options.strategy = kind;
    options.threads = threads;
    options.staging_bytes = staging_mib << 20;
    for (int r = 0; r < reps; ++r) {
      std::vector<int> borrowed;
      borrowed.reserve(device_fds.size());
      for (const auto& fd : device_fds) borrowed.push_back(fd.get());
      settle();
      cu::TierCopyReport demote;
      auto memfds = Check(
          cu::CopyDeviceToMemfds(api, device, borrowed, sizes, "demote_bench", &demote, options),
          "demotion");
      device_fds.clear();  // the device memory is freed, as the daemon does
      std::vector<int> hosts;
      hosts.reserve(memfds.size());
      for (const auto& fd : memfds) hosts.push_back(fd.get());
      cu::TierCopyReport promote;
      device_fds =
          Check(cu::CopyMemfdsToDevice(api, device, hosts, sizes, &promote, options), "promotion");
      memfds.clear();
      Emit({{"rep", r},
            {"strategy", label},
            {"threads", threads},
            {"staging_mib", kind == cu::TierCopyStrategy::kStaged ? staging_mib : 0},
            {"gib", gib},
            {"allocations", sizes.size()},
            {"shmem_enabled", shmem_enabled},
            {"pinned_h2d_gb_s", pinned.h2d},
            {"pinned_d2h_gb_s", pinned.d2h},
            {"demote_gb_s", demote.gb_per_s},
            {"demote_s", demote.seconds},
            {"segments", demote.segments},
            {"demote_unregistered_chunks", demote.unregistered},
            {"promote_gb_s", promote.gb_per_s},
            {"promote_s", promote.seconds},
            {"promote_unregistered_chunks", promote.unregistered},
            {"promote_vs_pinned_h2d", ratio(promote.gb_per_s, pinned.h2d)},
            {"demote_vs_pinned_d2h", ratio(demote.gb_per_s, pinned.d2h)},
            {"host_write_gb_s", host_write},
            {"host_write_passes_gb_s", host_write_passes_gb_s},
            {"demote_vs_host_write", ratio(demote.gb_per_s, host_write)},
            {"settle_ms", settle_ms},
            {"target_promote_vs_pinned", 0.9},
            {"target_demote_gb_s", 20}});
    }
  }
  // kept (`serve --demote host-pinned`): a staged demotion, then the daemon's own path: the
  // segments pinned whole (cuda::PinnedHostCopy, timed apart: it runs behind the demotion) and
  // the promotion by DMA alone from them.
  for (int r = 0; kept && r < reps; ++r) {
    std::vector<int> borrowed;
    for (const auto& fd : device_fds) borrowed.push_back(fd.get());
    cu::TierCopyOptions options;
    options.threads = threads;
    options.staging_bytes = staging_mib << 20;
    settle();
    cu::TierCopyReport demote;
    auto memfds = Check(
        cu::CopyDeviceToMemfds(api, device, borrowed, sizes, "demote_bench", &demote, options),
        "demotion");
    device_fds.clear();
    std::vector<int> hosts;
    for (const auto& fd : memfds) hosts.push_back(fd.get());
    const auto pin_start = std::chrono::steady_clock::now();
    std::optional<cu::PinnedHostCopy> pinned_copy =
        Check(cu::PinnedHostCopy::Pin(api, device, hosts, threads), "pinning");
    const double pin_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - pin_start).count();
    const uint64_t pinned_bytes = pinned_copy->bytes();
    options.pinned = &*pinned_copy;
    cu::TierCopyReport promote;
    device_fds =
        Check(cu::CopyMemfdsToDevice(api, device, hosts, sizes, &promote, options), "promotion");
    // The daemon unpins at promotion and closes the host copy: timed, as the next demotion
    // may run right after it.
    const auto unpin_start = std::chrono::steady_clock::now();
    pinned_copy.reset();
    memfds.clear();
    const double unpin_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - unpin_start).count();
    Emit({{"rep", r},
          {"strategy", "kept"},
          {"threads", threads},
          {"gib", gib},
          {"segments", demote.segments},
          {"pinned_h2d_gb_s", pinned.h2d},
          {"demote_gb_s", demote.gb_per_s},
          {"host_write_gb_s", host_write},
          {"demote_vs_host_write", ratio(demote.gb_per_s, host_write)},
          {"kept_register_s", pin_s},
          {"kept_register_gb_s", static_cast<double>(pinned_bytes) / 1e9 / pin_s},
          {"kept_unpin_and_close_s", unpin_s},
          {"settle_ms", settle_ms},
          {"promote_s", promote.seconds},
          {"promote_gb_s", promote.gb_per_s},
          {"promote_vs_pinned_h2d", ratio(promote.gb_per_s, pinned.h2d)},
          {"target_promote_vs_pinned", 0.9}});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The edge: an exception (a bad number in an argument) is an error line and exit 1.
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    Emit({{"error", e.what()}});
    return 1;
  }
}
