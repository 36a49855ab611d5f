// The fleet's stand-ins in a build without it (fleet_not_built.h, WEIGHTCACHE_FLEET).
#include "fleet_not_built.h"

#include <string>

#include "cli_common.h"

namespace weightcache::cli {

Status FleetNotBuilt(std::string_view what) {
  return Status(StatusCode::kUnavailable,
                std::string(what) +
                    ": this build has no fleet support (it needs libcurl and UCX at build time: "
                    "libcurl4-openssl-dev, libucx-dev; WEIGHTCACHE_FLEET, docs/building.md)");
}

void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope /*scope*/) {
  sub->add_option("--registry", flags->url,
                  "etcd://HOST:PORT of the fleet registry (not in this build: docs/fleet.md)");
}

Result<std::unique_ptr<ServeRegistration>> ServeRegistration::Create(
    const RegistryFlags& flags, const identity::ResolvedIdentity& /*id*/) {
  if (flags.url.empty()) return std::unique_ptr<ServeRegistration>();
  return FleetNotBuilt("--registry " + flags.url);
}

void RegisterFleetCommand(CLI::App& root) {
  CLI::App* fleet =
      root.add_subcommand("fleet",
                          "The fleet registry: which node holds which cache (not in this build: "
                          "docs/fleet.md)");
  fleet->allow_extras();
  SetAction(fleet, [] { return Fail("fleet", FleetNotBuilt("fleet")); });
}

}  // namespace weightcache::cli
