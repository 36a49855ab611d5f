// Test support for the daemon's integration tests: a real `weightcache serve` process, real
// checkpoints written by tests/tools/make_checkpoint.py, and a raw protocol client.
//
// Ownership: a ServeProcess owns its child (a TestChild, support/child_process.h, which
// spawns and waits for every tier's children); destroying it SIGKILLs and reaps a child that
// is still running, so no test leaks a daemon. Not thread-safe (one test thread).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "identity/cache_config.h"
#include "protocol/messages.h"
#include "support/child_process.h"
#include "weightcache/status.h"

namespace weightcache::testing {

// One `weightcache serve` child (SpawnServe), its stdout and stderr appended to its log.
class ServeProcess {
 public:
  // Spawns CliPath() with {"serve", args...}; stdout and stderr go to `log_path`. nullptr
  // (and a test failure with the reason) when it cannot be spawned.
  static std::unique_ptr<ServeProcess> Start(const std::vector<std::string>& args,
                                             const std::string& log_path);

  pid_t pid() const { return child_.pid(); }
  TestChild& child() { return child_; }
  bool Running() { return child_.Running(); }
  // A signal that cannot be sent (the child is already reaped) fails the test.
  void Signal(int signo);
  // The exit code (128 + signal when killed), or std::nullopt if still running at the timeout.
  std::optional<int> WaitExit(std::chrono::milliseconds timeout) {
    return child_.WaitExit(timeout);
  }
  std::string Log() const { return child_.Log(); }

 private:
  explicit ServeProcess(TestChild child) : child_(std::move(child)) {}
  TestChild child_;
};

// `serve` flags of a small host-tier cache of `model_dir` (model id "tiny", 2 reader threads)
// under `runtime_dir`, then `extra`.
std::vector<std::string> HostServeArgs(const std::string& model_dir, const std::string& runtime_dir,
                                       std::vector<std::string> extra = {});

// Drops every keeper under `runtime_dir` (a test's leftovers: their memory is freed).
void DropAllKeepers(const std::string& runtime_dir, std::chrono::milliseconds timeout);

// Writes a checkpoint with the real safetensors library into `dir`; returns `dir`.
std::string MakeCheckpoint(const std::string& dir, int tensors, int shards = 1, int seed = 1,
                           int max_elems = 65536);

// An inventory file (`--device-inventory`) of `gpus` fake H200s, index i with the UUID
// FakeGpuUuid(i), written at `path`; returns `path`.
std::string FakeGpuUuid(int index);
std::string WriteFakeInventory(const std::string& path, int gpus);

// The CacheConfig `serve --model dir --model-id id` computes (the client's derivation).
identity::CacheConfig ConfigFor(const std::string& model_dir, const std::string& model_id);

// Every *.sock under a runtime dir (layout paths), of one namespace unless it is empty.
std::vector<std::string> FindSockets(const std::string& runtime_dir,
                                     const std::string& namespace_name = "");

// Polls (WaitForStatus) until exactly one socket exists under runtime_dir (in
// `namespace_name`, if given) and answers Status with `state` (or any state but loading when
// `state` is empty). Fails (returns an error) if `process` exits first or the timeout passes.
// QueryStatus (one Status reply) comes from support/child_process.h.
Result<std::string> WaitForState(ServeProcess& process, const std::string& runtime_dir,
                                 std::optional<protocol::CacheState> state,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                 const std::string& namespace_name = "");

// Raw socket helpers.
Result<int> ConnectRaw(const std::string& socket);  // blocking fd, caller closes
// Reads until EOF or `timeout`; returns the bytes (EOF reached iff `eof`).
std::string ReadUntilEof(int fd, std::chrono::milliseconds timeout, bool* eof);
// A frame header with arbitrary fields (for malformed frames).
std::vector<uint8_t> RawHeader(uint16_t version, uint16_t type, uint32_t flags, uint32_t fds,
                               uint64_t payload_length, const char* magic = "WCPF");
// Decodes the first frame of `bytes` as an Error frame.
Result<protocol::ErrorReply> DecodeErrorFrame(const std::string& bytes);

}  // namespace weightcache::testing
