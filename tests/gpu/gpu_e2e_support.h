// Support for the gpu tier's end-to-end tests (gpu_e2e_test, gpu_launch_test): which GPUs the
// driver shows, checkpoints with a reference manifest, real `weightcache serve --tier gpu`
// daemons (with their own CUDA_VISIBLE_DEVICES when a test needs it), and client processes
// driven line by line over pipes.
//
// CUDA rule: the test process calls cuInit (through ProbeGpus) but never creates a context,
// and every client is a posix_spawn'ed executable (gpu_client_helper or the CLI), never a
// fork of the test: a CUDA context must not cross a fork.
//
// Ownership: Daemon and PipedChild own their child process (a TestChild, support/
// child_process.h, which spawns and waits for every tier's children); destruction SIGKILLs
// and reaps a child that is still running, so no test leaks a daemon or a client holding GPU
// memory. Not thread-safe (one test thread).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "protocol/messages.h"
#include "support/child_process.h"
#include "weightcache/status.h"

namespace weightcache::testing {

// The GPUs of this process as the driver shows them (CUDA_VISIBLE_DEVICES applied), by local
// index. `skip_reason` is set when the gpu tier cannot run here at all (no driver, no device,
// no VMM / POSIX-fd export on device 0); tests GTEST_SKIP with it.
struct GpuSetup {
  std::vector<std::string> uuids;
  std::string skip_reason;
};
const GpuSetup& ProbeGpus();  // computed once per process

// The path of gpu_client_helper (tests/gpu/gpu_client_helper.cc).
std::string ClientHelperPath();

// A checkpoint written by tests/tools/make_checkpoint.py with its --manifest (per tensor
// sha256 and nbytes from the reference safetensors reader).
struct TestModel {
  std::string dir;
  std::string manifest_path;
  size_t tensor_count = 0;
  uint64_t total_bytes = 0;
};
Result<TestModel> MakeModel(const std::string& dir, int tensors, int shards, int seed,
                            int max_elems);

// One `weightcache serve` child (SpawnServe): stdout+stderr appended to `log`, at
// WEIGHTCACHE_LOG_LEVEL=info.
class Daemon {
 public:
  static Result<std::unique_ptr<Daemon>> Start(const std::vector<std::string>& serve_args,
                                               const std::vector<std::string>& env_overrides,
                                               const std::string& log);

  pid_t pid() const { return child_.pid(); }
  TestChild& child() { return child_; }
  std::string Log() const { return child_.Log(); }

  // Polls until this daemon's socket (the one under <runtime>/<namespace>/<device_uuid>/
  // whose Status reports our pid) answers `ready`. kTimeout with the log, or kInternal when
  // the daemon exits first. Returns the socket path; `status` gets the last Status reply.
  Result<std::string> WaitReady(const std::string& runtime_dir, const std::string& namespace_name,
                                const std::string& device_uuid, protocol::StatusReply* status,
                                std::chrono::milliseconds timeout = std::chrono::seconds(120));

  // SIGKILL, then wait for the exit (reaped).
  Status Kill9();
  // SIGTERM, then wait up to `timeout` for a clean exit; the exit code.
  Result<int> Terminate(std::chrono::milliseconds timeout = std::chrono::seconds(20));

 private:
  explicit Daemon(TestChild child) : child_(std::move(child)) {}
  TestChild child_;
};

// A child with stdin and stdout on pipes (stderr appended to a log file): the tests write
// lines to it and read its JSON lines back, e.g. a client that holds its attachment.
class PipedChild {
 public:
  static Result<std::unique_ptr<PipedChild>> Spawn(const std::vector<std::string>& argv,
                                                   const std::vector<std::string>& env_overrides,
                                                   const std::string& stderr_log);

  pid_t pid() const { return child_.pid(); }
  Status WriteLine(const std::string& line) { return child_.WriteLine(line); }
  // The next line of stdout (without '\n'); kTimeout, or kUnavailable at EOF.
  Result<std::string> ReadLine(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return child_.ReadLine(timeout);
  }
  // The next stdout line parsed as JSON.
  Result<nlohmann::json> ReadJson(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  void CloseStdin() { child_.CloseStdin(); }
  // Waits for the exit (128 + signal when killed); std::nullopt at the timeout.
  std::optional<int> Wait(std::chrono::milliseconds timeout) { return child_.WaitExit(timeout); }
  std::string StderrLog() const { return child_.Log(); }

 private:
  explicit PipedChild(TestChild child) : child_(std::move(child)) {}
  TestChild child_;
};

// Runs a command to completion (test_env RunCommand) and parses the LAST non-empty stdout
// line as JSON (discarded JSON when there is none).
struct JsonRun {
  int exit_code = -1;
  nlohmann::json json;
  std::string out;
  std::string err;
};
JsonRun RunJson(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});

// Every cache socket under <runtime>/<namespace>/<device_uuid>/.
std::vector<std::string> SocketsUnder(const std::string& runtime_dir,
                                      const std::string& namespace_name,
                                      const std::string& device_uuid);

// The Status reply of the daemon at `socket` (support/child_process.h QueryStatus).
inline Result<protocol::StatusReply> StatusOf(const std::string& socket) {
  return QueryStatus(socket);
}

// The CUDA_VISIBLE_DEVICES value that makes this process's local device `index` the only
// device of a child: the bare index when this process has no CUDA_VISIBLE_DEVICES (its local
// index then is the physical index), else the device's UUID.
std::string VisibleDevicesFor(int index);

}  // namespace weightcache::testing
