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

void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope scope) {
  sub->add_option("--registry", flags->url,
                  "etcd://HOST:PORT of the fleet registry (not in this build: docs/fleet.md)");
  if (scope == RegistryFlagScope::kList) return;
  sub->add_option("--fill-from", flags->fill_from,
                  "fill from other nodes (not in this build: docs/fleet.md)");
  sub->add_option("--fill-serve", flags->fill_serve,
                  "serve the arena to other nodes (not in this build: docs/fleet.md)");
  sub->add_option("--fill-allow", flags->fill_allow,
                  "the peers of --fill-serve (not in this build: docs/fleet.md)");
  sub->add_option("--fill-trust", flags->fill_trust,
                  "what --fill-from's bytes are proven against (not in this build: docs/fleet.md)");
  sub->add_option("--fill-content-sha256", flags->fill_content_sha256,
                  "the checkpoint's pinned SHA-256s (not in this build: docs/fleet.md)");
}

namespace {

Status RefuseFleetFlags(const RegistryFlags& flags) {
  if (!flags.url.empty()) return FleetNotBuilt("--registry " + flags.url);
  if (!flags.fill_from.empty()) return FleetNotBuilt("--fill-from " + flags.fill_from);
  if (!flags.fill_serve.empty()) return FleetNotBuilt("--fill-serve " + flags.fill_serve);
  if (!flags.fill_allow.empty()) return FleetNotBuilt("--fill-allow " + flags.fill_allow);
  if (!flags.fill_trust.empty()) return FleetNotBuilt("--fill-trust " + flags.fill_trust);
  if (!flags.fill_content_sha256.empty()) {
    return FleetNotBuilt("--fill-content-sha256 " + flags.fill_content_sha256);
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::string>> RegistryServeArgs(const RegistryFlags& flags, int /*rank*/) {
  WEIGHTCACHE_RETURN_IF_ERROR(RefuseFleetFlags(flags));
  return std::vector<std::string>();
}

Result<std::unique_ptr<ServeRegistration>> ServeRegistration::Create(
    const RegistryFlags& flags, const identity::ResolvedIdentity& /*id*/,
    const std::string& /*model_dir*/) {
  WEIGHTCACHE_RETURN_IF_ERROR(RefuseFleetFlags(flags));
  return std::unique_ptr<ServeRegistration>();
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
