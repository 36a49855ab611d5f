// A scripted in-process daemon: the real protocol over a real socket with the real identity
// lock, answering each request with whatever the test scripts. It shows on demand what a
// well-behaved daemon rarely does — `loading` past a deadline, `failed` with a given code, a
// peer that speaks garbage, a hostile manifest, a daemon that lies about its config.
//
// Ownership: owns its lock, its listening socket and one thread that serves one connection at
// a time; the destructor stops and joins the thread. Not copyable.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "identity/paths.h"
#include "os/lock_file.h"
#include "protocol/frame.h"

namespace weightcache::testing {

// Answers each request frame with the bytes `reply` returns (empty = close the connection),
// and the fds `FdScript` returns with them (borrowed: SCM_RIGHTS duplicates them).
using Script = std::function<std::vector<uint8_t>(const protocol::Frame&)>;
using FdScript = std::function<std::vector<int>(const protocol::Frame&)>;
// Whether to close the connection right after answering this request (a daemon that dies
// having sent part of a frame).
using CloseAfter = std::function<bool(const protocol::Frame&)>;

class ScriptedDaemon {
 public:
  ScriptedDaemon(const identity::CachePaths& paths, Script script, FdScript fds = {},
                 CloseAfter close_after = {});
  ~ScriptedDaemon();
  ScriptedDaemon(const ScriptedDaemon&) = delete;
  ScriptedDaemon& operator=(const ScriptedDaemon&) = delete;

 private:
  void Loop();

  Script script_;
  FdScript fds_;
  CloseAfter close_after_;
  std::optional<os::LockFile> lock_;
  UniqueFd listener_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace weightcache::testing
