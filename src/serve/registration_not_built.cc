// serve/registration.h in a build without the fleet (WEIGHTCACHE_FLEET=OFF: no libcurl or UCX):
// every fleet option that is set is refused before anything starts, naming the option and what
// the build lacked (kUnavailable: exit 1), and there is never a registration.
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "serve/registration.h"

namespace weightcache::serve {
Status FleetNotBuilt(std::string_view what) {
  return Status(StatusCode::kUnavailable,
                std::string(what) +
                    ": this build has no fleet support (it needs libcurl and UCX at build time: "
                    "libcurl4-openssl-dev, libucx-dev; WEIGHTCACHE_FLEET, docs/building.md)");
}

namespace {

// The first option that differs from its default, as "--flag value"; none when none does.
std::optional<std::string> FirstSet(const FleetOptions& options) {
  const FleetOptions defaults;
  const std::pair<const char*, const std::string*> texts[] = {
      {"--registry", &options.url},
      {"--registry-ca", &options.ca_file},
      {"--registry-cert", &options.cert_file},
      {"--registry-key", &options.key_file},
      {"--advertise", &options.advertise},
      {"--node-name", &options.node_name},
      {"--fill-from", &options.fill_from},
      {"--fill-serve", &options.fill_serve},
      {"--fill-allow", &options.fill_allow},
      {"--fill-content-sha256", &options.fill_content_sha256},
  };
  for (const auto& [flag, value] : texts) {
    if (!value->empty()) return std::string(flag) + " " + *value;
  }
  if (options.fill_trust != defaults.fill_trust) return "--fill-trust " + options.fill_trust;
  if (options.prefix != defaults.prefix) return "--registry-prefix " + options.prefix;
  if (options.timeout_s != defaults.timeout_s) return std::string("--registry-timeout");
  if (options.ttl_s != defaults.ttl_s) return std::string("--registry-ttl");
  return std::nullopt;
}

}  // namespace

bool FleetBuilt() { return false; }

Status CheckFleetOptions(const FleetOptions& options) {
  if (std::optional<std::string> set = FirstSet(options)) return FleetNotBuilt(*set);
  return Status::Ok();
}

Result<FleetOptions> FleetOptionsForRank(const FleetOptions& options, int /*rank*/) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFleetOptions(options));
  return options;
}

// Registration's members: never called, as Create never makes one.
class Registration::Impl {};

Result<std::unique_ptr<Registration>> Registration::Create(const FleetOptions& options,
                                                           const identity::ResolvedIdentity& /*id*/,
                                                           const std::string& /*model_dir*/) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFleetOptions(options));
  return std::unique_ptr<Registration>();
}

Registration::Registration(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Registration::~Registration() = default;
daemon::PeerFill Registration::Filler() const { return {}; }
bool Registration::ServesFill() const { return false; }
void Registration::Ready(const daemon::StoreSummary& /*summary*/, std::span<const int> /*fds*/,
                         std::span<const CUmemGenericAllocationHandle> /*creating_handles*/) {}
void Registration::Moved(Tier /*tier*/, std::span<const int> /*fds*/) {}
void Registration::Draining() {}
void Registration::HandingOver() {}
void Registration::HandoverFailed(
    std::span<const int> /*fds*/,
    std::span<const CUmemGenericAllocationHandle> /*creating_handles*/) {}

}  // namespace weightcache::serve
