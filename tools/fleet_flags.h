// The fleet's flags as serve and launch see them: registry_flags.h in a build with the fleet,
// else fleet_not_built.h, which declares the same names and refuses every fleet flag
// (WEIGHTCACHE_FLEET, tools/CMakeLists.txt). The one place that chooses.
#pragma once

#if WEIGHTCACHE_HAVE_FLEET
#include "registry_flags.h"
#else
#include "fleet_not_built.h"
#endif
