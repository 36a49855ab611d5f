// bench_process.h — the process plumbing the gpu-tier benches share (gpu_attach_bench,
// shard_bench): run a command and capture its stdout (as text or as its last JSON line), spawn
// a daemon with its output in a log, wait over its socket until it is ready, stop it, and
// read the device's free memory from a short-lived probe process (the bench's own binary in
// its `--probe-mem UUID` mode, so the bench itself never holds a CUDA context that would count
// against the daemon's figures).
//
// Every function reports what it could do; none exits the process. Not thread-safe where it
// says so (Stop and WaitReady reap children: call them from the thread that spawned them).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "protocol/messages.h"
#include "weightcache/status.h"

namespace weightcache::bench {

using Clock = std::chrono::steady_clock;

inline double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Runs argv (looked up in PATH) to completion with stdout captured into *out; stderr is
// inherited. The exit code, 128 + signal for a killed child, -1 when it could not run.
int Capture(std::vector<std::string> argv, std::string* out,
            const std::vector<std::string>& extra_env = {});

// The last stdout line of a command as JSON (is_discarded() when absent or not JSON); *code
// is Capture's exit code.
nlohmann::json CaptureJson(const std::vector<std::string>& argv, int* code);

// One JSON record on stdout, tagged {"bench": bench}, flushed; progress lines on stderr,
// prefixed by the program's name, flushed.
void EmitRecord(const char* bench, nlohmann::json j);
void NoteLine(const char* program, const std::string& what);

// Spawns argv[0] (a path) with stdout and stderr into `log` (truncated), this process's
// environment without WEIGHTCACHE_LOG_LEVEL, plus `extra_env` ("KEY=value"). -1 on failure.
pid_t SpawnLogged(std::vector<std::string> argv, const std::string& log,
                  const std::vector<std::string>& extra_env);

// SIGTERM, then SIGKILL after 20 s; reaps. A pid <= 0 is ignored.
void Stop(pid_t pid);

// The whole file as text ("" when unreadable).
std::string ReadText(const std::string& path);

// Waits until no thread of `pid` is named `name` (/proc/<pid>/task/*/comm), polling every
// 5 ms: for the daemon's loader thread ("wc-loader"), which releases the load's pipeline,
// mappings and CUDA context after `ready`. False when one still runs after `timeout`.
bool WaitThreadGone(pid_t pid, const std::string& name, Clock::duration timeout);

// The number in capture group `group` of the last match of `re` in `text`.
std::optional<double> LastMatch(const std::string& text, const std::regex& re, int group);

// The daemon's own "ready: N tensors, … in S s, G GB/s" log line (info level; S counts from
// the daemon's start): the last one's S and G.
struct ReadyLine {
  std::optional<double> seconds;
  std::optional<double> gb_per_s;
};
ReadyLine ParseReadyLine(const std::string& log_text);

// A spawned daemon being waited for.
struct WatchedDaemon {
  pid_t pid = -1;      // -1 once it has exited (reaped by WaitReady)
  std::string socket;  // its socket path (ResolvedIdentity::paths.socket)
  std::string log;     // where SpawnLogged sent its output
  Clock::time_point spawned;
  std::optional<protocol::StatusReply> ready;  // its Status reply once `ready`
  Clock::time_point ready_at;                  // when this process saw that reply
  std::string last = "no socket";              // what the last poll saw
};

// Polls every daemon of `daemons` that is not ready yet (connect + Status over its socket),
// all of them in each round, then sleeps `poll`, until all are ready. The error, naming the
// first daemon that cannot become ready by its `last` text ("serve exited; log:\n<log>" for a
// daemon that exited, "failed" for a failed cache, or the last state or connect error when
// `timeout` since the earliest spawn of those not ready has passed), is kUnavailable;
// *failed_index (when given) is that daemon's index. The daemons are left running.
Status WaitReady(std::vector<WatchedDaemon>& daemons, std::chrono::milliseconds timeout,
                 std::chrono::milliseconds poll, size_t* failed_index = nullptr);

// ---- device memory -----------------------------------------------------------------------------

// The CUdevice of `uuid`, through the identity layer's one lookup and its ordinal → CUdevice
// step, as the client resolves it.
Result<CUdevice> DeviceOf(const cuda::DriverApi* api, const std::string& uuid);

// The child side of the probe (`<bench> --probe-mem UUID`): prints {"free","total"} of the
// device (cuMemGetInfo in the primary context) as one JSON line; exit 0, or 1 on any error.
int ProbeMemMain(const std::string& uuid);

struct DeviceMemory {
  uint64_t free = 0;
  uint64_t total = 0;
};

// The parent side: runs `self --probe-mem uuid`; nullopt when the probe failed.
std::optional<DeviceMemory> ProbeDeviceMemory(const std::string& self, const std::string& uuid);

// Probes until the device's free memory is back within `slack` of `baseline_free` (the memory
// of stopped daemons is returned by the driver asynchronously), for up to `timeout`. The last
// probe; kTimeout naming how far it still was when the time ran out (or that the probe
// failed).
Result<DeviceMemory> WaitMemoryReturned(const std::string& self, const std::string& uuid,
                                        uint64_t baseline_free, uint64_t slack,
                                        std::chrono::milliseconds timeout);

}  // namespace weightcache::bench
