// EnvLookup — how the identity layer reads environment variables.
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
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace weightcache::identity {

using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The real process environment.
EnvLookup ProcessEnv();

// A fixed environment (tests): names absent from `vars` are unset.
EnvLookup MapEnv(std::map<std::string, std::string, std::less<>> vars);

}  // namespace weightcache::identity
