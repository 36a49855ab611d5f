// What serve and main see of the fleet in a build without it (WEIGHTCACHE_FLEET, docs/fleet.md):
// the names registry_flags.h declares, with the same meaning where a user can reach them —
// `serve --registry …` and `launch --registry …` fail before anything starts, saying the
// build has no fleet support and what it needs — and nothing else. Only fleet_flags.h picks
// this over registry_flags.h.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::cli {

// The one message of a fleet feature asked of a build without it (kUnavailable: exit 1).
Status FleetNotBuilt(std::string_view what);

struct RegistryFlags {
  std::string url;  // --registry: accepted by the parser, refused by ServeRegistration::Create
  std::string fill_from;  // --fill-from, --fill-serve, --fill-allow: likewise
  std::string fill_serve;
  std::string fill_allow;
  std::string fill_trust;  // --fill-trust, --fill-content-sha256: likewise
  std::string fill_content_sha256;
};

enum class RegistryFlagScope { kServe, kLaunch, kList };
void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope scope);
// Empty without any fleet flag; FleetNotBuilt with one.
Result<std::vector<std::string>> RegistryServeArgs(const RegistryFlags& flags, int rank);

class ServeRegistration {
 public:
  // nullptr without --registry and --fill-*; FleetNotBuilt with any of them.
  static Result<std::unique_ptr<ServeRegistration>> Create(const RegistryFlags& flags,
                                                           const identity::ResolvedIdentity& id,
                                                           const std::string& model_dir);
  daemon::PeerFill Filler() const { return {}; }
  bool ServesFill() const { return false; }
  void Ready(const daemon::StoreSummary& /*summary*/, std::span<const int> /*fds*/,
             std::span<const CUmemGenericAllocationHandle> /*creating_handles*/ = {}) {}
  void Moved(Tier /*tier*/, std::span<const int> /*fds*/) {}
  void Draining() {}
  void HandingOver() {}
  void HandoverFailed(std::span<const int> /*fds*/,
                      std::span<const CUmemGenericAllocationHandle> /*creating_handles*/ = {}) {}

 private:
  ServeRegistration() = default;
};

}  // namespace weightcache::cli
