// demote_bench — demotion to host RAM and promotion back (`serve --demote host`,
// docs/budget.md), measured against the pinned H2D rate of the same run (issue 16 targets:
// promotion ≥ 0.9 × pinned H2D, demotion ≥ 20 GB/s).
//
//   demote_bench [--gib N] [--device I] [--reps R] [--alloc-gib A]
//
// An exported VMM arena of N GiB (default 16) in allocations of A GiB (default 2), as a gpu
// cache holds it, filled on the device; then R times (default 3): demotion (cuda::
// CopyDeviceToMemfds: import, copy into memfds through their registered mappings, seal), the
// device memory freed, promotion (cuda::CopyMemfdsToDevice: new arena, copy from the sealed
// memfds' read-only registered mappings), the host copy freed. Pinned H2D: one 1 GiB
// cuMemcpyHtoDAsync from cuMemHostAlloc'ed memory (best of 3). One JSON object per line.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/tier_copy.h"
#include "cuda/upload_resources.h"
#include "cuda/vmm.h"

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

// One 1 GiB pinned host → device copy, best of 3, GB/s (1e9 bytes).
double PinnedH2D(const cu::DriverApi* api) {
  const size_t bytes = kGiB;
  auto host = Check(cu::PinnedHostBuffer::Create(api, bytes), "pinned buffer");
  CUdeviceptr dev = 0;
  CheckCu(api, api->cuMemAlloc(&dev, bytes), "cuMemAlloc");
  auto stream = Check(cu::CudaStream::Create(api), "stream");
  CUevent start = nullptr, stop = nullptr;
  CheckCu(api, api->cuEventCreate(&start, CU_EVENT_DEFAULT), "cuEventCreate");
  CheckCu(api, api->cuEventCreate(&stop, CU_EVENT_DEFAULT), "cuEventCreate");
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    CheckCu(api, api->cuEventRecord(start, stream.get()), "cuEventRecord");
    CheckCu(api, api->cuMemcpyHtoDAsync(dev, host.data(), bytes, stream.get()), "H2D");
    CheckCu(api, api->cuEventRecord(stop, stream.get()), "cuEventRecord");
    CheckCu(api, api->cuEventSynchronize(stop), "cuEventSynchronize");
    float ms = 0;
    CheckCu(api, api->cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime");
    best = std::max(best, static_cast<double>(bytes) / 1e9 / (ms / 1e3));
  }
  api->cuEventDestroy(start);
  api->cuEventDestroy(stop);
  api->cuMemFree(dev);
  return best;
}

int Run(int argc, char** argv) {
  uint64_t gib = 16, alloc_gib = 2;
  int device_index = 0, reps = 3;
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
    } else {
      Die("unknown argument " + a);
    }
  }
  if (gib == 0 || alloc_gib == 0 || reps < 1) Die("--gib, --alloc-gib and --reps must be > 0");
  const cu::DriverApi* api = Check(cu::LoadDriver(), "loading the CUDA driver");
  CUdevice device = 0;
  CheckCu(api, api->cuDeviceGet(&device, device_index), "cuDeviceGet");
  std::vector<uint64_t> sizes;
  for (uint64_t left = gib * kGiB; left > 0;) {
    const uint64_t s = std::min(left, alloc_gib * kGiB);
    sizes.push_back(s);
    left -= s;
  }
  double pinned = 0;
  std::vector<wc::UniqueFd> device_fds;
  {
    // The source arena, filled on the device (a context is current while the arena lives).
    auto arena = Check(cu::ExportedArena::Create(api, device, sizes), "arena");
    CheckCu(api, api->cuMemsetD8(arena.base(), 0x5a, arena.total_bytes()), "cuMemsetD8");
    CheckCu(api, api->cuCtxSynchronize(), "cuCtxSynchronize");
    pinned = PinnedH2D(api);
    device_fds = std::move(arena).ReleaseToFds();
  }
  for (int r = 0; r < reps; ++r) {
    std::vector<int> borrowed;
    borrowed.reserve(device_fds.size());
    for (const auto& fd : device_fds) borrowed.push_back(fd.get());
    cu::TierCopyReport demote;
    auto memfds = Check(
        cu::CopyDeviceToMemfds(api, device, borrowed, sizes, "demote_bench", &demote), "demotion");
    device_fds.clear();  // the device memory is freed, as the daemon does
    std::vector<int> hosts;
    hosts.reserve(memfds.size());
    for (const auto& fd : memfds) hosts.push_back(fd.get());
    cu::TierCopyReport promote;
    device_fds = Check(cu::CopyMemfdsToDevice(api, device, hosts, sizes, &promote), "promotion");
    memfds.clear();
    Emit({{"rep", r},
          {"gib", gib},
          {"allocations", sizes.size()},
          {"pinned_h2d_gb_s", pinned},
          {"demote_gb_s", demote.gb_per_s},
          {"demote_s", demote.seconds},
          {"demote_unregistered_chunks", demote.unregistered},
          {"promote_gb_s", promote.gb_per_s},
          {"promote_s", promote.seconds},
          {"promote_unregistered_chunks", promote.unregistered},
          {"promote_vs_pinned", pinned > 0 ? promote.gb_per_s / pinned : 0},
          {"target_promote_vs_pinned", 0.9},
          {"target_demote_gb_s", 20}});
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
