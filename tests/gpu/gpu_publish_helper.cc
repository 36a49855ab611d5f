// The other processes of gpu_publish_test (a CUDA context must not cross a fork, so each is an
// executable of its own). One JSON line on stdout per mode:
//
//   publish RUNTIME TAG DEVICE N SEED [STALL_AFTER]
//       N tensors of pseudo-random bytes (SEED) in device memory of DEVICE (cuMemAlloc), then
//       weightcache::Publisher (gpu tier, source published:TAG) with CopyIn from those device
//       pointers and Commit: {"published": N, "bytes": B}. With STALL_AFTER: after that many
//       copies prints {"copying": K} and sleeps until killed.
//   attach RUNTIME TAG DEVICE N SEED
//       attaches published:TAG (on_missing=error), reads every tensor back (cuMemcpyDtoH) and
//       compares it with the bytes SEED makes: {"equal": N} or {"differ": "NAME"}
//   free DEVICE
//       {"free": F, "total": T} from cuMemGetInfo in a fresh primary context of DEVICE
#include <cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "weightcache/client.h"
#include "weightcache/publisher.h"

namespace {

using weightcache::Tier;

constexpr const char* kModelId = "gpu-publish-test";

[[noreturn]] void Fail(const std::string& why) {
  std::printf("{\"error\": \"%s\"}\n", why.c_str());
  std::fflush(stdout);
  std::exit(1);
}

std::vector<weightcache::PublishTensor> Plan(int n) {
  std::vector<weightcache::PublishTensor> plan;
  for (int i = 0; i < n; ++i) {
    // 1 MiB .. 64 MiB of BF16, a shape per tensor.
    const uint64_t rows = uint64_t{512} << (i % 7);
    plan.push_back({"layers." + std::to_string(i) + ".qkv_proj.weight",
                    "BF16",
                    {rows, 1024},
                    rows * 1024 * 2});
  }
  return plan;
}

std::vector<uint8_t> Bytes(uint64_t n, int seed, int index) {
  std::vector<uint8_t> b(n);
  std::mt19937_64 rng(static_cast<uint64_t>(seed) * 1000003 + static_cast<uint64_t>(index));
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    for (uint64_t k = 0; k < 8 && i + k < n; ++k) b[i + k] = static_cast<uint8_t>(v >> (8 * k));
  }
  return b;
}

weightcache::IdentityOptions Identity(const std::string& runtime, const std::string& tag,
                                      const std::string& device) {
  weightcache::IdentityOptions id;
  id.source = "published:" + tag;
  id.model_id = kModelId;
  id.tier = Tier::kGpu;
  id.device = device;
  id.runtime_dir = runtime;
  return id;
}

const weightcache::cuda::DriverApi* Driver() {
  auto api = weightcache::cuda::LoadDriver();
  if (!api.ok()) Fail(api.status().ToString());
  return *api;
}

int Publish(char** argv, int argc) {
  const int n = std::atoi(argv[5]);
  const int seed = std::atoi(argv[6]);
  const int stall_after = argc > 7 ? std::atoi(argv[7]) : -1;
  const auto* api = Driver();
  const auto plan = Plan(n);
  weightcache::PublishOptions o;
  o.identity = Identity(argv[2], argv[3], argv[4]);
  // Begin first: it resolves the device and retains its primary context, in which the source
  // buffers below are allocated.
  auto publisher = weightcache::Publisher::Begin(o, plan);
  if (!publisher.ok()) Fail(publisher.status().ToString());
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  if (api->cuDeviceGet(&device, 0) != CUDA_SUCCESS ||
      api->cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS ||
      api->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    Fail("no primary context on device 0");
  }
  uint64_t total = 0;
  for (int i = 0; i < n; ++i) {
    const std::vector<uint8_t> bytes = Bytes(plan[i].nbytes, seed, i);
    CUdeviceptr src = 0;
    if (api->cuMemAlloc(&src, bytes.size()) != CUDA_SUCCESS ||
        api->cuMemcpyHtoD(src, bytes.data(), bytes.size()) != CUDA_SUCCESS) {
      Fail("staging tensor " + std::to_string(i) + " in device memory");
    }
    // From a device pointer: the device-to-device path of CopyIn.
    weightcache::Status copied =
        publisher->CopyIn(i, reinterpret_cast<const void*>(src), bytes.size());
    api->cuMemFree(src);
    if (!copied.ok()) Fail(copied.ToString());
    total += bytes.size();
    if (i + 1 == stall_after) {
      std::printf("{\"copying\": %d}\n", i + 1);
      std::fflush(stdout);
      for (;;) ::pause();
    }
  }
  weightcache::Status committed = publisher->Commit();
  if (!committed.ok()) Fail(committed.ToString());
  std::printf("{\"published\": %d, \"bytes\": %llu}\n", n, static_cast<unsigned long long>(total));
  return 0;
}

int Attach(char** argv) {
  const int n = std::atoi(argv[5]);
  const int seed = std::atoi(argv[6]);
  const auto* api = Driver();
  weightcache::AttachOptions o;
  o.identity = Identity(argv[2], argv[3], argv[4]);
  o.on_missing = weightcache::OnMissing::kError;
  auto a = weightcache::Attachment::Attach(o);
  if (!a.ok()) Fail(a.status().ToString());
  const auto plan = Plan(n);
  if (a->tensors().size() != plan.size()) Fail("tensor count differs");
  for (int i = 0; i < n; ++i) {
    const weightcache::Tensor* t = a->Find(plan[i].name);
    if (t == nullptr) Fail("missing " + plan[i].name);
    std::vector<uint8_t> got(t->nbytes);
    if (api->cuMemcpyDtoH(got.data(), t->data, t->nbytes) != CUDA_SUCCESS) Fail("cuMemcpyDtoH");
    if (got != Bytes(plan[i].nbytes, seed, i)) {
      std::printf("{\"differ\": \"%s\"}\n", plan[i].name.c_str());
      return 1;
    }
  }
  std::printf("{\"equal\": %d}\n", n);
  return 0;
}

int Free(char** argv) {
  const auto* api = Driver();
  CUdevice device = 0;
  CUcontext ctx = nullptr;
  if (api->cuDeviceGet(&device, std::atoi(argv[2])) != CUDA_SUCCESS ||
      api->cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS ||
      api->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    Fail("no primary context");
  }
  size_t free_bytes = 0, total = 0;
  if (api->cuMemGetInfo(&free_bytes, &total) != CUDA_SUCCESS) Fail("cuMemGetInfo");
  std::printf("{\"free\": %zu, \"total\": %zu}\n", free_bytes, total);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "publish" && argc >= 7) return Publish(argv, argc);
  if (mode == "attach" && argc >= 7) return Attach(argv);
  if (mode == "free" && argc >= 3) return Free(argv);
  std::fprintf(stderr,
               "usage: gpu_publish_helper publish RUNTIME TAG DEVICE N SEED [STALL_AFTER] | "
               "attach RUNTIME TAG DEVICE N SEED | free DEVICE\n");
  return 2;
}
