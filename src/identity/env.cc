#include "identity/env.h"

#include <cstdlib>
#include <utility>

namespace weightcache::identity {

EnvLookup ProcessEnv() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvLookup MapEnv(std::map<std::string, std::string, std::less<>> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

const Env& Env::Default() {
  static const Env kEnv{.load_driver = [] { return cuda::LoadDriver(); },
                        .syscalls = &os::SysCalls::Default(),
                        .lookup = ProcessEnv()};
  return kEnv;
}

}  // namespace weightcache::identity
