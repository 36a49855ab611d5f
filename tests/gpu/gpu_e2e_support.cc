#include "gpu/gpu_e2e_support.h"

#include <signal.h>

#include <cstdlib>

#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "identity/device_inventory.h"
#include "identity/paths.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

GpuSetup Probe() {
  GpuSetup setup;
  Result<const cuda::DriverApi*> api = cuda::LoadDriver();
  if (!api.ok()) {
    setup.skip_reason = "no usable CUDA driver: " + api.status().ToString();
    return setup;
  }
  int count = 0;
  if (CUresult rc = (*api)->cuDeviceGetCount(&count); rc != CUDA_SUCCESS) {
    setup.skip_reason = cuda::DriverError(*api, rc, "cuDeviceGetCount").ToString();
    return setup;
  }
  if (count == 0) {
    setup.skip_reason = "CUDA driver present but no GPU visible";
    return setup;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUuuid raw{};
    if ((*api)->cuDeviceGet(&dev, i) != CUDA_SUCCESS ||
        (*api)->cuDeviceGetUuid(&raw, dev) != CUDA_SUCCESS) {
      setup.skip_reason = "cannot read the UUID of device " + std::to_string(i);
      return setup;
    }
    if (i == 0) {
      // The gpu tier needs VMM with POSIX-fd export; without it every test here would fail
      // for a reason that is not the code's.
      if (Status s = cuda::CheckVmmSupport(*api, dev); !s.ok()) {
        setup.skip_reason = s.ToString();
        return setup;
      }
    }
    setup.uuids.push_back(identity::FormatGpuUuid(raw));
  }
  return setup;
}

}  // namespace

const GpuSetup& ProbeGpus() {
  static const GpuSetup* setup = new GpuSetup(Probe());
  return *setup;
}

std::string ClientHelperPath() { return WEIGHTCACHE_GPU_CLIENT_HELPER; }

Result<TestModel> MakeModel(const std::string& dir, int tensors, int shards, int seed,
                            int max_elems) {
  TestModel model;
  model.dir = dir;
  model.manifest_path = dir + ".manifest.json";
  const CommandResult r =
      RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out", dir,
                  "--tensors", std::to_string(tensors), "--shards", std::to_string(shards),
                  "--seed", std::to_string(seed), "--dtypes", "f32,bf16,f16,i64,u8,f8_e4m3",
                  "--max-elems", std::to_string(max_elems), "--manifest", model.manifest_path});
  if (r.exit_code != 0) {
    return InternalError("make_checkpoint.py exited " + std::to_string(r.exit_code) + ": " + r.err);
  }
  nlohmann::json summary = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  if (summary.is_discarded()) return InternalError("make_checkpoint.py printed " + r.out);
  model.tensor_count = summary["tensors"].get<size_t>();
  model.total_bytes = summary["total_bytes"].get<uint64_t>();
  return model;
}

// ---- Daemon ---------------------------------------------------------------------------------

Result<std::unique_ptr<Daemon>> Daemon::Start(const std::vector<std::string>& serve_args,
                                              const std::vector<std::string>& env_overrides,
                                              const std::string& log) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(TestChild child, SpawnServe(serve_args, env_overrides, log));
  return std::unique_ptr<Daemon>(new Daemon(std::move(child)));
}

Result<std::string> Daemon::WaitReady(const std::string& runtime_dir,
                                      const std::string& namespace_name,
                                      const std::string& device_uuid, protocol::StatusReply* status,
                                      std::chrono::milliseconds timeout) {
  StatusWait wait;
  wait.sockets = [&] { return SocketsUnder(runtime_dir, namespace_name, device_uuid); };
  // Another test daemon may serve on the same device dir: only ours counts.
  wait.reached = [&](const protocol::StatusReply& st) {
    return st.pid == child_.pid() && st.state == protocol::CacheState::kReady;
  };
  wait.what = "ready, on a socket under " + runtime_dir + "/" + namespace_name + "/" + device_uuid;
  wait.timeout = timeout;
  WEIGHTCACHE_ASSIGN_OR_RETURN(FoundStatus found, WaitForStatus(child_, wait));
  if (status != nullptr) *status = found.status;
  return found.socket;
}

Status Daemon::Kill9() {
  if (child_.Kill() != 128 + SIGKILL) {
    return InternalError("daemon ended with " + child_.DescribeExit());
  }
  return Status::Ok();
}

Result<int> Daemon::Terminate(std::chrono::milliseconds timeout) {
  WEIGHTCACHE_RETURN_IF_ERROR(child_.Signal(SIGTERM));
  if (std::optional<int> code = child_.WaitExit(timeout)) return *code;
  return Status(StatusCode::kTimeout, "daemon pid " + std::to_string(child_.pid()) +
                                          " still running after SIGTERM; log:\n" + Log());
}

// ---- PipedChild -----------------------------------------------------------------------------

Result<std::unique_ptr<PipedChild>> PipedChild::Spawn(const std::vector<std::string>& argv,
                                                      const std::vector<std::string>& env_overrides,
                                                      const std::string& stderr_log) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(TestChild child, TestChild::Spawn({.argv = argv,
                                                                  .env_overrides = env_overrides,
                                                                  .log_path = stderr_log,
                                                                  .in = Stdio::kPipe,
                                                                  .out = Stdio::kPipe,
                                                                  .err = Stdio::kLog}));
  return std::unique_ptr<PipedChild>(new PipedChild(std::move(child)));
}

Result<nlohmann::json> PipedChild::ReadJson(std::chrono::milliseconds timeout) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string line, ReadLine(timeout));
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return InternalError("pid " + std::to_string(pid()) + " printed a non-JSON line: " + line);
  }
  return j;
}

// ---- one-shot commands and sockets ----------------------------------------------------------

JsonRun RunJson(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  CommandResult r = RunCommand(argv, env);
  JsonRun out;
  out.exit_code = r.exit_code;
  out.out = r.out;
  out.err = r.err;
  std::string last;
  size_t start = 0;
  while (start < r.out.size()) {
    size_t end = r.out.find('\n', start);
    if (end == std::string::npos) end = r.out.size();
    if (end > start) last = r.out.substr(start, end - start);
    start = end + 1;
  }
  out.json = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  return out;
}

std::vector<std::string> SocketsUnder(const std::string& runtime_dir,
                                      const std::string& namespace_name,
                                      const std::string& device_uuid) {
  auto sockets = identity::ListCacheSockets(runtime_dir + "/" + namespace_name + "/" + device_uuid);
  return sockets.ok() ? *sockets : std::vector<std::string>{};
}

std::string VisibleDevicesFor(int index) {
  const char* own = std::getenv("CUDA_VISIBLE_DEVICES");
  if (own == nullptr) return std::to_string(index);
  return ProbeGpus().uuids.at(static_cast<size_t>(index));
}

}  // namespace weightcache::testing
