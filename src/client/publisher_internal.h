// The library's internal constructor of weightcache::Publisher (include/weightcache/
// publisher.h): Publisher::Begin with every machine input from `env` (the CUDA driver, the
// socket syscalls, the environment variables). The public Begin passes identity::Env::Default();
// tests pass a fake driver and run a gpu-tier publish in process.
#pragma once

#include <span>

#include "identity/env.h"
#include "weightcache/publisher.h"
#include "weightcache/status.h"

namespace weightcache::client {

struct PublisherAccess {
  static Result<Publisher> Begin(const PublishOptions& options, std::span<const PublishTensor> plan,
                                 const identity::Env& env);
};

}  // namespace weightcache::client
