// attach_bench — what a client pays to attach to a 16 GiB shard, measured across two processes
// like real use: this process exports, a fork+exec'ed copy of itself (--child, channel on fd 3)
// imports. One JSON line per measurement on stdout.
//
//   kind=context     cuInit and primary-context retain in a fresh process (the floor of any
//                    client start, excluded from the attach target: docs/design.md
//                    "Performance targets")
//   kind=vmm         ImportedArena::Import (reserve + import + map + access) plus computing every
//                    tensor's pointer, for 10 / 1,000 / 10,000 tensors packed by PlanArena into a
//                    few allocations: should be flat in the tensor count
//                    — and, with raw driver calls on the same fds, where the import's time
//                    goes ("steps_ms": every cuMemImportFromShareableHandle, the reserve and
//                    every cuMemMap, cuMemSetAccess per allocation, or once over the range)
//   kind=legacy_ipc  the baseline: one cuMemAlloc + cuIpcGetMemHandle per tensor, and one
//                    cuIpcOpenMemHandle per tensor in the child (1,000 and 10,000 tensors)
//
// Usage: attach_bench [--gib N] [--reps R] [--max-alloc-gib G] [--vmm-only]
//   --max-alloc-gib: the arena's largest allocation (default 4 = kDefaultMaxAllocationBytes),
//   to see how the import scales with the allocation count.
#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/arena_plan.h"
#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/imported_arena.h"
#include "cuda/vmm.h"
#include "gpu/peer_channel.h"

namespace weightcache::bench {
namespace {

using cuda::DriverApi;
using testing::Child;
using testing::ReceiveMessage;
using testing::SendMessage;
using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string Hex(const void* data, size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kDigits[p[i] >> 4]);
    out.push_back(kDigits[p[i] & 15]);
  }
  return out;
}

bool Unhex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* p = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i)
    p[i] = static_cast<unsigned char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return true;
}

// ---- child side ------------------------------------------------------------------------------

// "vmm <tensors> <tensor_bytes> <granularity> <reps> <size>..." + fds.
Status ChildVmm(const DriverApi* api, CUdevice dev, std::istringstream& in,
                std::vector<UniqueFd> fds, nlohmann::json* out) {
  uint64_t tensors = 0, tensor_bytes = 0, granularity = 0, max_alloc = 0;
  int reps = 0;
  in >> tensors >> tensor_bytes >> granularity >> max_alloc >> reps;
  std::vector<uint64_t> sizes;
  for (uint64_t s; in >> s;) sizes.push_back(s);
  std::vector<double> import_ms, tensors_ms;
  for (int r = 0; r < reps; ++r) {
    std::vector<UniqueFd> copies;  // Import consumes its fds; keep the originals for the next rep
    for (const UniqueFd& fd : fds) copies.emplace_back(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
    Clock::time_point t0 = Clock::now();
    WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::ImportedArena arena,
                                 cuda::ImportedArena::Import(api, dev, std::move(copies), sizes));
    import_ms.push_back(MsSince(t0));
    // What a client does next: one pointer per tensor from the daemon's placement table.
    Clock::time_point t1 = Clock::now();
    std::vector<uint64_t> tensor_sizes(tensors, tensor_bytes);
    checkpoint::ArenaPlan plan = checkpoint::PlanArena(tensor_sizes, granularity, max_alloc);
    std::vector<CUdeviceptr> ptrs(tensors);
    for (size_t i = 0; i < tensors; ++i) {
      ptrs[i] = arena.allocations()[plan.placements[i].allocation].ptr + plan.placements[i].offset;
    }
    tensors_ms.push_back(MsSince(t1));
    uint32_t probe = 0;  // touch the last tensor: the mapping must really work
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemcpyDtoH(&probe, ptrs.back(), sizeof(probe)),
                                   "cuMemcpyDtoH probe");
  }
  // The same import, step by step with raw driver calls (no rollback: a failure ends the
  // bench), each step's total over all allocations; access once per allocation, then again
  // once over the whole range on a second mapping of the same memory.
  std::vector<double> step_import, step_map, step_access_each, step_access_once;
  for (int r = 0; r < reps; ++r) {
    uint64_t total = 0;
    for (uint64_t s : sizes) total += s;
    std::vector<CUmemGenericAllocationHandle> handles(sizes.size());
    Clock::time_point t0 = Clock::now();
    for (size_t a = 0; a < sizes.size(); ++a) {
      void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fds[a].get()));
      WEIGHTCACHE_CU_RETURN_IF_ERROR(
          api,
          cuMemImportFromShareableHandle(&handles[a], os_handle,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    }
    step_import.push_back(MsSince(t0));
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int pass = 0; pass < 2; ++pass) {
      CUdeviceptr base = 0;
      Clock::time_point t1 = Clock::now();
      WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemAddressReserve(&base, total, granularity, 0, 0),
                                     "cuMemAddressReserve");
      CUdeviceptr at = base;
      for (size_t a = 0; a < sizes.size(); ++a) {
        WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemMap(at, sizes[a], 0, handles[a], 0), "cuMemMap");
        at += sizes[a];
      }
      step_map.push_back(MsSince(t1));
      Clock::time_point t2 = Clock::now();
      if (pass == 0) {
        at = base;
        for (uint64_t size : sizes) {
          WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemSetAccess(at, size, &access, 1),
                                         "cuMemSetAccess");
          at += size;
        }
        step_access_each.push_back(MsSince(t2));
      } else {
        WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemSetAccess(base, total, &access, 1),
                                       "cuMemSetAccess (whole range)");
        step_access_once.push_back(MsSince(t2));
      }
      at = base;
      for (uint64_t size : sizes) {
        api->cuMemUnmap(at, size);
        at += size;
      }
      api->cuMemAddressFree(base, total);
    }
    for (CUmemGenericAllocationHandle h : handles) api->cuMemRelease(h);
  }
  (*out)["steps_ms"] = {{"import_all", Median(step_import)},
                        {"reserve_and_map_all", Median(step_map)},
                        {"set_access_per_allocation", Median(step_access_each)},
                        {"set_access_once", Median(step_access_once)}};
  (*out)["import_ms_min"] = *std::min_element(import_ms.begin(), import_ms.end());
  (*out)["import_ms_median"] = Median(import_ms);
  (*out)["tensor_table_ms_median"] = Median(tensors_ms);
  (*out)["allocations"] = sizes.size();
  (*out)["reps"] = reps;
  return Status::Ok();
}

// "ipc <handle hex>..."
Status ChildIpc(const DriverApi* api, std::istringstream& in, nlohmann::json* out) {
  std::vector<CUipcMemHandle> handles;
  for (std::string h; in >> h;) {
    CUipcMemHandle handle;
    if (!Unhex(h, &handle, sizeof(handle))) return InvalidArgument("bad handle hex");
    handles.push_back(handle);
  }
  std::vector<CUdeviceptr> ptrs(handles.size());
  Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < handles.size(); ++i) {
    WEIGHTCACHE_CU_RETURN_IF_ERROR(
        api, cuIpcOpenMemHandle(&ptrs[i], handles[i], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle");
  }
  double open_ms = MsSince(t0);
  for (CUdeviceptr p : ptrs) api->cuIpcCloseMemHandle(p);
  (*out)["open_ms"] = open_ms;
  (*out)["open_us_per_handle"] = handles.empty() ? 0 : open_ms * 1000 / handles.size();
  return Status::Ok();
}

int ChildMain() {
  const int channel = testing::kChildChannelFd;
  std::string request;
  std::vector<UniqueFd> fds;
  nlohmann::json out;
  Status status = ReceiveMessage(channel, &request, &fds);
  if (status.ok()) {
    Clock::time_point t0 = Clock::now();
    Result<const DriverApi*> api = cuda::LoadDriver();
    out["cuinit_ms"] = MsSince(t0);
    if (!api.ok()) {
      status = api.status();
    } else {
      CUdevice dev = 0;
      (*api)->cuDeviceGet(&dev, 0);
      Clock::time_point t1 = Clock::now();
      Result<cuda::PrimaryContext> ctx = cuda::PrimaryContext::Retain(*api, dev);
      out["primary_ctx_ms"] = MsSince(t1);
      std::istringstream in(request);
      std::string verb;
      in >> verb;
      if (!ctx.ok()) {
        status = ctx.status();
      } else if (verb == "vmm") {
        status = ChildVmm(*api, dev, in, std::move(fds), &out);
      } else if (verb == "ipc") {
        status = ChildIpc(*api, in, &out);
      } else if (verb != "context") {
        status = InvalidArgument("unknown request " + verb);
      }
    }
  }
  if (!status.ok()) out["error"] = status.ToString();
  (void)SendMessage(channel, out.dump());
  return status.ok() ? 0 : 1;
}

// ---- parent side -----------------------------------------------------------------------------

std::string g_self;

Result<nlohmann::json> Ask(const std::string& request, const std::vector<int>& fds) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(Child child, testing::SpawnWithChannel({g_self, "--child"}));
  std::string reply;
  std::vector<UniqueFd> none;
  Status s = SendMessage(child.channel.get(), request, fds);
  if (s.ok()) s = ReceiveMessage(child.channel.get(), &reply, &none);
  testing::WaitChild(child.pid);
  WEIGHTCACHE_RETURN_IF_ERROR(s);
  nlohmann::json j = nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return ProtocolError("child replied non-JSON: " + reply);
  if (j.contains("error")) return InternalError("child: " + j["error"].get<std::string>());
  return j;
}

void Emit(nlohmann::json j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

uint64_t g_max_alloc = checkpoint::kDefaultMaxAllocationBytes;
bool g_vmm_only = false;

Status BenchVmm(const DriverApi* api, CUdevice dev, uint64_t total_bytes, uint64_t tensors,
                int reps) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      uint64_t granularity,
      cuda::AllocationGranularity(api, dev, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const uint64_t tensor_bytes = total_bytes / tensors;
  const uint64_t max_alloc = g_max_alloc;
  std::vector<uint64_t> tensor_sizes(tensors, tensor_bytes);
  checkpoint::ArenaPlan plan = checkpoint::PlanArena(tensor_sizes, granularity, max_alloc);
  Clock::time_point t0 = Clock::now();
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::ExportedArena arena,
                               cuda::ExportedArena::Create(api, dev, plan.allocation_bytes));
  double create_ms = MsSince(t0);
  std::string request = "vmm " + std::to_string(tensors) + " " + std::to_string(tensor_bytes) +
                        " " + std::to_string(granularity) + " " + std::to_string(max_alloc) + " " +
                        std::to_string(reps);
  std::vector<int> fds;
  for (const cuda::ExportedAllocation& a : arena.allocations()) {
    request += " " + std::to_string(a.size);
    fds.push_back(a.fd);
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(nlohmann::json j, Ask(request, fds));
  j["bench"] = "attach";
  j["kind"] = "vmm";
  j["tensors"] = tensors;
  j["bytes"] = arena.total_bytes();
  j["create_export_ms"] = create_ms;
  Emit(j);
  return Status::Ok();
}

Status BenchLegacyIpc(const DriverApi* api, uint64_t total_bytes, uint64_t tensors) {
  const uint64_t tensor_bytes = AlignUp(total_bytes / tensors, checkpoint::kTensorAlignment);
  std::vector<CUdeviceptr> ptrs;
  ptrs.reserve(tensors);
  Status status;
  std::string request = "ipc";
  request.reserve(tensors * 130 + 8);
  double alloc_ms = 0, export_ms = 0;
  for (uint64_t i = 0; i < tensors && status.ok(); ++i) {
    CUdeviceptr p = 0;
    Clock::time_point t0 = Clock::now();
    CUresult rc = api->cuMemAlloc(&p, tensor_bytes);
    alloc_ms += MsSince(t0);
    if (rc != CUDA_SUCCESS) {
      status = cuda::DriverError(api, rc, "cuMemAlloc");
      break;
    }
    ptrs.push_back(p);
    CUipcMemHandle handle;
    Clock::time_point t1 = Clock::now();
    rc = api->cuIpcGetMemHandle(&handle, p);
    export_ms += MsSince(t1);
    if (rc != CUDA_SUCCESS) status = cuda::DriverError(api, rc, "cuIpcGetMemHandle");
    request += " " + Hex(&handle, sizeof(handle));
  }
  Result<nlohmann::json> j = status.ok() ? Ask(request, {}) : Result<nlohmann::json>(status);
  for (CUdeviceptr p : ptrs) api->cuMemFree(p);
  if (!j.ok()) return j.status();
  (*j)["bench"] = "attach";
  (*j)["kind"] = "legacy_ipc";
  (*j)["tensors"] = tensors;
  (*j)["bytes"] = tensor_bytes * tensors;
  (*j)["alloc_ms"] = alloc_ms;
  (*j)["export_ms"] = export_ms;
  Emit(*j);
  return Status::Ok();
}

int ParentMain(uint64_t gib, int reps) {
  Result<const DriverApi*> api = cuda::LoadDriver();
  if (!api.ok()) {
    Emit({{"bench", "attach"}, {"skipped", api.status().ToString()}});
    return 0;
  }
  CUdevice dev = 0;
  if ((*api)->cuDeviceGet(&dev, 0) != CUDA_SUCCESS) {
    Emit({{"bench", "attach"}, {"skipped", "no CUDA device"}});
    return 0;
  }
  // The exporter's own context, so that its creation is not inside any measurement.
  Result<cuda::PrimaryContext> ctx = cuda::PrimaryContext::Retain(*api, dev);
  if (!ctx.ok()) {
    Emit({{"bench", "attach"}, {"error", ctx.status().ToString()}});
    return 1;
  }
  const uint64_t total = gib << 30;
  int failures = 0;
  auto run = [&](const char* what, Status s) {
    if (!s.ok()) {
      Emit({{"bench", "attach"}, {"kind", what}, {"error", s.ToString()}});
      ++failures;
    }
  };
  Result<nlohmann::json> context = Ask("context", {});
  if (context.ok()) {
    (*context)["bench"] = "attach";
    (*context)["kind"] = "context";
    Emit(*context);
  } else {
    run("context", context.status());
  }
  for (uint64_t tensors : {uint64_t{10}, uint64_t{1000}, uint64_t{10000}}) {
    run("vmm", BenchVmm(*api, dev, total, tensors, reps));
  }
  if (!g_vmm_only) {
    for (uint64_t tensors : {uint64_t{1000}, uint64_t{10000}}) {
      run("legacy_ipc", BenchLegacyIpc(*api, total, tensors));
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace weightcache::bench

int main(int argc, char** argv) {
  using namespace weightcache::bench;
  g_self = "/proc/self/exe";
  uint64_t gib = 16;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--child") return ChildMain();
    if (a == "--gib" && i + 1 < argc) {
      gib = std::stoull(argv[++i]);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::stoi(argv[++i]);
    } else if (a == "--max-alloc-gib" && i + 1 < argc) {
      g_max_alloc = std::stoull(argv[++i]) << 30;
    } else if (a == "--vmm-only") {
      g_vmm_only = true;
    } else {
      std::fprintf(stderr,
                   "usage: attach_bench [--gib N] [--reps R] [--max-alloc-gib G] [--vmm-only]\n");
      return 2;
    }
  }
  return ParentMain(gib, reps);
}
