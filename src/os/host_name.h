// HostName — this host's name (gethostname(2)), e.g. the fleet registry's default node name
// (docs/fleet.md). Thread-safe.
#pragma once

#include <string>

#include "weightcache/status.h"

namespace weightcache::os {

// kIo with errno when gethostname fails.
Result<std::string> HostName();

}  // namespace weightcache::os
