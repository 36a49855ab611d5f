#include "cuda/driver_api.h"

#include <dlfcn.h>

#include <mutex>

#include "common/logging.h"

namespace weightcache::cuda {
namespace {

// Oldest driver ABI we ask for. The prototypes in DriverApi come from the CUDA 12+ headers;
// asking cuGetProcAddress for version 12000 returns exactly those variants.
constexpr int kRequestedCudaVersion = 12000;

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult*);

#if WEIGHTCACHE_NO_GPU_TIER
// A build without the CUDA toolkit headers (CMakeLists.txt, WEIGHTCACHE_GPU): the types come
// from the stand-in no_toolkit/cuda.h, so no driver may be called through them. Every gpu-tier
// path starts here and fails with this status.
Result<const DriverApi*> LoadOnce() {
  return Status(StatusCode::kUnavailable,
                "gpu tier not built: this build had no CUDA toolkit headers (cuda.h); rebuild "
                "with the CUDA toolkit (docs/building.md); the host tier works");
}
#else
Result<const DriverApi*> LoadOnce() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = ::dlerror();
    return Status(StatusCode::kUnavailable,
                  std::string("CUDA driver not available (dlopen libcuda.so.1: ") +
                      (err != nullptr ? err : "unknown error") +
                      "); the gpu tier needs the NVIDIA driver (the host tier does not)");
  }
  auto get_proc = reinterpret_cast<GetProcAddressFn>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    return Status(StatusCode::kUnavailable,
                  "CUDA driver too old: libcuda.so.1 has no cuGetProcAddress_v2 (need CUDA 12+)");
  }
  // Intentionally leaked: the table lives for the whole process, like the driver itself.
  auto* api = new DriverApi();
  std::string missing;
#define WEIGHTCACHE_LOAD_MEMBER_(name)                                                          \
  {                                                                                             \
    void* fn = nullptr;                                                                         \
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;                    \
    CUresult rc = get_proc(#name, &fn, kRequestedCudaVersion, CU_GET_PROC_ADDRESS_DEFAULT, &q); \
    if (rc != CUDA_SUCCESS || fn == nullptr) {                                                  \
      missing += missing.empty() ? #name : ", " #name;                                          \
    } else {                                                                                    \
      api->name = reinterpret_cast<decltype(api->name)>(fn);                                    \
    }                                                                                           \
  }
  WEIGHTCACHE_CUDA_DRIVER_FUNCTIONS(WEIGHTCACHE_LOAD_MEMBER_)
#undef WEIGHTCACHE_LOAD_MEMBER_
  if (!missing.empty()) {
    delete api;
    return Status(StatusCode::kUnavailable, "CUDA driver lacks required entry points: " + missing);
  }
  CUresult rc = api->cuInit(0);
  if (rc != CUDA_SUCCESS) {
    Status s = DriverError(api, rc, "cuInit");
    delete api;
    return s;
  }
  return static_cast<const DriverApi*>(api);
}
#endif  // WEIGHTCACHE_NO_GPU_TIER

}  // namespace

Result<const DriverApi*> LoadDriver() {
  static std::once_flag once;
  static Result<const DriverApi*>* loaded = nullptr;
  std::call_once(once, [] { loaded = new Result<const DriverApi*>(LoadOnce()); });
  return *loaded;
}

Status DriverError(const DriverApi* api, CUresult rc, std::string_view what) {
  const char* name = nullptr;
  const char* desc = nullptr;
  if (api != nullptr && api->cuGetErrorName != nullptr) api->cuGetErrorName(rc, &name);
  if (api != nullptr && api->cuGetErrorString != nullptr) api->cuGetErrorString(rc, &desc);
  std::string msg(what);
  msg += ": ";
  msg += name != nullptr ? name : ("CUresult " + std::to_string(static_cast<int>(rc)));
  if (desc != nullptr) {
    msg += " (";
    msg += desc;
    msg += ")";
  }
  Status s(StatusCode::kCuda, std::move(msg));
  s.WithDriverError(static_cast<int>(rc));
  return s;
}

void LogReleaseFailure(const DriverApi* api, CUresult rc, std::string_view what) {
  LOG_WARN << "releasing CUDA resource failed, continuing: "
           << DriverError(api, rc, what).message();
}

}  // namespace weightcache::cuda
