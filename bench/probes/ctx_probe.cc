// ctx_probe — what a fresh process pays for CUDA before it can touch device memory: cuInit and
// the primary context, the floor of a restarted daemon's time to ready.
//
//   g++ -O2 -std=c++20 -I/usr/local/cuda/include bench/probes/ctx_probe.cc \
//       -L/usr/local/cuda/lib64/stubs -lcuda -o ctx_probe
//   ./ctx_probe time        # one JSON line: ms for cuInit, device lookup, primary context
//   ./ctx_probe hold-dev    # holds /dev/nvidiactl and /dev/nvidia0 open (no CUDA) until killed
//   ./ctx_probe hold-ctx    # holds a primary context until killed
#include <cuda.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int Check(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return 0;
  const char* name = nullptr;
  cuGetErrorName(rc, &name);
  std::fprintf(stderr, "%s: %s\n", what, name != nullptr ? name : "?");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "time";
  if (std::strcmp(mode, "hold-dev") == 0) {
    int ctl = ::open("/dev/nvidiactl", O_RDWR | O_CLOEXEC);
    int dev = ::open("/dev/nvidia0", O_RDWR | O_CLOEXEC);
    std::printf("{\"probe\": \"hold-dev\", \"ctl_fd\": %d, \"dev_fd\": %d}\n", ctl, dev);
    std::fflush(stdout);
    for (;;) ::pause();
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (Check(cuInit(0), "cuInit") != 0) return 1;
  const auto t1 = std::chrono::steady_clock::now();
  CUdevice device = 0;
  if (Check(cuDeviceGet(&device, 0), "cuDeviceGet") != 0) return 1;
  CUuuid uuid{};
  if (Check(cuDeviceGetUuid(&uuid, device), "cuDeviceGetUuid") != 0) return 1;
  const auto t2 = std::chrono::steady_clock::now();
  CUcontext ctx = nullptr;
  if (Check(cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain") != 0) return 1;
  if (Check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") != 0) return 1;
  const auto t3 = std::chrono::steady_clock::now();
  CUdeviceptr p = 0;
  if (Check(cuMemAlloc(&p, 1 << 20), "cuMemAlloc") != 0) return 1;
  const auto t4 = std::chrono::steady_clock::now();
  if (std::strcmp(mode, "hold-ctx") == 0) {
    std::printf("{\"probe\": \"hold-ctx\"}\n");
    std::fflush(stdout);
    for (;;) ::pause();
  }
  std::printf(
      "{\"probe\": \"ctx\", \"cuinit_ms\": %.1f, \"device_ms\": %.1f, \"primary_ctx_ms\": %.1f, "
      "\"first_alloc_ms\": %.1f}\n",
      Ms(t0, t1), Ms(t1, t2), Ms(t2, t3), Ms(t3, t4));
  return 0;
}
