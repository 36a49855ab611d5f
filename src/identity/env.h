// EnvLookup — how the identity layer reads environment variables; Env — everything the
// daemon and the client take from the machine, in one value.
//
// Contract: every environment variable that decides an identity (CUDA_VISIBLE_DEVICES,
// CUDA_DEVICE_ORDER, WEIGHTCACHE_RUNTIME_DIR, XDG_RUNTIME_DIR, WEIGHTCACHE_SOCKET,
// WEIGHTCACHE_DEVICE_INVENTORY) is read through an EnvLookup, never through getenv() directly,
// so tests can model any host without mutating the process environment (which is not
// thread-safe). std::nullopt means "unset", which is different from "set to the empty string"
// (CUDA_VISIBLE_DEVICES="" hides every device).
//
// Thread-safety: ProcessEnv() reads the live environment on every call; it is as safe as
// getenv(), i.e. safe while nothing calls setenv() concurrently. MapEnv() is immutable.
//
// Env (LevelDB's Options::env): the CUDA driver table loader, the socket syscalls and the
// environment variables, passed through DaemonOptions and the client's attach so that the
// daemon's event loop, its gpu store load and the client's GPU mapping run in-process in a test
// over a fake driver or faulty syscalls. Env::Default() is the real machine: cuda::LoadDriver(),
// os::SysCalls::Default(), ProcessEnv(); it is the only place that names cuda::LoadDriver()
// outside src/cuda. An Env borrows its SysCalls: the caller keeps it alive while the Env is in
// use. Copying an Env is cheap; a const Env is safe to share between threads when its parts are.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "cuda/driver_api.h"
#include "os/syscalls.h"
#include "weightcache/status.h"

namespace weightcache::identity {

using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The real process environment.
EnvLookup ProcessEnv();

// A fixed environment (tests): names absent from `vars` are unset.
EnvLookup MapEnv(std::map<std::string, std::string, std::less<>> vars);

struct Env {
  // The CUDA driver table: a process-wide table, or kUnavailable on a driverless host.
  std::function<Result<const cuda::DriverApi*>()> load_driver;
  os::SysCalls* syscalls = nullptr;  // borrowed; never null in an Env in use
  EnvLookup lookup;

  // The real machine (a process-wide instance).
  static const Env& Default();
};

}  // namespace weightcache::identity
