#include "fleet/arena_transfer.h"

#include <algorithm>

#include "fleet/arena_transfer_hello.h"
#include "fleet/arena_transfer_internal.h"

namespace weightcache::fleet {

std::string_view RegionMemoryName(RegionMemory memory) {
  return memory == RegionMemory::kCuda ? "cuda" : "host";
}

Result<std::unique_ptr<ArenaServer>> ArenaServer::Start(ArenaServerOptions options) {
  if (options.regions.empty()) return InvalidArgument("arena server: no region to serve");
  for (const ServedRegion& region : options.regions) {
    if (region.data == nullptr || region.bytes == 0 || region.bytes > kMaxRegionBytes) {
      return InvalidArgument("arena server: a region of " + std::to_string(region.bytes) +
                             " bytes at " + (region.data == nullptr ? "null" : "an address"));
    }
  }
  if (options.regions.size() > kMaxHelloRegions) {
    return InvalidArgument("arena server: " + std::to_string(options.regions.size()) +
                           " regions (at most " + std::to_string(kMaxHelloRegions) + ")");
  }
  if (options.max_peers == 0) return InvalidArgument("arena server: max_peers is 0");
  const bool cuda =
      std::any_of(options.regions.begin(), options.regions.end(),
                  [](const ServedRegion& r) { return r.memory == RegionMemory::kCuda; });
  std::unique_ptr<Impl> impl;
  if (cuda || options.ucx_for_host_for_test) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(impl, StartUcxServer(std::move(options)));
  } else {
    WEIGHTCACHE_ASSIGN_OR_RETURN(impl, StartTcpServer(std::move(options)));
  }
  return std::unique_ptr<ArenaServer>(new ArenaServer(std::move(impl)));
}

ArenaServer::ArenaServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ArenaServer::~ArenaServer() { Stop(); }
const std::string& ArenaServer::endpoint() const { return impl_->endpoint_name(); }
uint64_t ArenaServer::peers_accepted() const { return impl_->peers_accepted(); }
uint64_t ArenaServer::peers_refused() const { return impl_->peers_refused(); }
void ArenaServer::Stop() { impl_->Stop(); }

Result<FetchResult> FetchArena(const FetchOptions& options) {
  if (options.sources.empty()) return InvalidArgument("arena fetch: no source");
  if (options.sources.size() > kMaxFetchSources) {
    return InvalidArgument("arena fetch: " + std::to_string(options.sources.size()) +
                           " sources (at most " + std::to_string(kMaxFetchSources) + ")");
  }
  if (options.destination.empty()) return InvalidArgument("arena fetch: no destination region");
  if (options.stripe_bytes == 0) return InvalidArgument("arena fetch: a stripe size of 0");
  if (options.max_in_flight_per_source == 0) {
    return InvalidArgument("arena fetch: max_in_flight_per_source is 0");
  }
  for (const DestinationRegion& region : options.destination) {
    if (region.data == nullptr || region.bytes == 0 || region.bytes > kMaxRegionBytes) {
      return InvalidArgument("arena fetch: a destination region of " +
                             std::to_string(region.bytes) + " bytes");
    }
  }
  const bool cuda =
      std::any_of(options.destination.begin(), options.destination.end(),
                  [](const DestinationRegion& r) { return r.memory == RegionMemory::kCuda; });
  return cuda || options.ucx_for_host_for_test ? FetchOverUcx(options) : FetchOverTcp(options);
}

}  // namespace weightcache::fleet
