// The registry side of serve::FleetOptions, for the fleet's own commands and tests (`fleet ls`
// computes the fleet key serve registers under). Only in a build with the fleet: its callers
// are compiled only then (tools/CMakeLists.txt); serve itself goes through registration.h.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/content_anchor.h"
#include "fleet/etcd_client.h"
#include "fleet/registry_entry.h"
#include "identity/cache_config.h"
#include "serve/fleet_options.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::serve {

// The etcd client the options describe. kInvalidArgument for a bad URL or TLS combination,
// kIoError for a TLS file we cannot read.
Result<fleet::EtcdClient> RegistryClient(const FleetOptions& options);

// The content anchor the fleet key holds and a fill proves against
// (checkpoint/content_anchor.h): --fill-content-sha256 when given, else what the checkpoint at
// `model_dir` records; none for a published cache (no checkpoint is read). `why_none` says why
// there is none. kInvalidArgument for a bad --fill-content-sha256 (or one given for a
// published cache).
struct FleetAnchor {
  std::shared_ptr<const checkpoint::ContentAnchor> anchor;  // null: none
  std::string why_none;
};
Result<FleetAnchor> LookUpFleetAnchor(const FleetOptions& options, const std::string& model_dir,
                                      const identity::CacheConfig& config);
// The fleet key of `config` with `anchor` (CacheConfig::FleetDigest of the anchor's digest).
std::string FleetKey(const identity::CacheConfig& config, const FleetAnchor& anchor);

// The registry's entries that a fill of `tier` on node `node` pulls from: the ready entries of
// that tier with an endpoint, other than the node's own, in the registry's order; when more
// than fleet::kMaxFetchSources are, that many chosen at random with `rng`, so that the joining
// nodes spread over the sources and no writer of the registry makes a filler connect to all of
// its entries. Empty when none is.
std::vector<fleet::RegistryEntry> ChooseFillSources(std::vector<fleet::RegistryEntry> entries,
                                                    Tier tier, std::string_view node,
                                                    std::mt19937_64& rng);

}  // namespace weightcache::serve
