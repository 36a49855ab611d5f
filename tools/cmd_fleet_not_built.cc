// `weightcache fleet` in a build without the fleet (WEIGHTCACHE_FLEET=OFF): CMake compiles this
// instead of cmd_fleet.cc, and the command says what the build lacks (exit 1).
#include "cli_common.h"
#include "serve/registration.h"

namespace weightcache::cli {

void RegisterFleetCommand(CLI::App& root) {
  CLI::App* fleet =
      root.add_subcommand("fleet",
                          "The fleet registry: which node holds which cache (not in this build: "
                          "docs/fleet.md)");
  fleet->allow_extras();
  SetAction(fleet, [] { return Fail("fleet", serve::FleetNotBuilt("fleet")); });
}

}  // namespace weightcache::cli
