// Identity resolution (docs/design.md "Identity"): from IdentityOptions (flags,
// AttachOptions::identity) to the CacheConfig, the device {uuid, CUDA ordinal} and the paths of one
// cache. The daemon's `serve`, `stop`, `paths` and every client attach resolve through
// ResolveIdentity, so a daemon and an engine given the same options compute the same config, device
// key and socket by construction.
//
// Also the one home of the trusted-uid rule: the uids a daemon may run as for a client to use
// it (our euid, then IdentityOptions::trusted_uids, else WEIGHTCACHE_TRUSTED_UIDS).
//
// Thread-safety: reentrant. Nothing here holds resources.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "identity/cache_config.h"
#include "identity/device_inventory.h"
#include "identity/env.h"
#include "identity/paths.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"
#include "weightcache/identity_options.h"
#include "weightcache/status.h"

namespace weightcache::identity {

inline constexpr std::string_view kTrustedUidsEnv = "WEIGHTCACHE_TRUSTED_UIDS";

// What a sharded cache loads by (docs/sharding.md): the rule set, the config.json values it
// reads, the validated ranks, and the digest over the first two that the CacheConfig carries
// as shard_rules_digest.
struct ShardSpec {
  sharding::RuleSet rules;
  sharding::ModelConfig model_config;
  sharding::Ranks ranks;
  std::string digest;
};

// A job is sharded when any of tp/pp/ep size is > 1 or shard_rules is set.
bool IsSharded(const IdentityOptions& options);

// The shard spec of `options`: nullopt when the job is not sharded. Otherwise the ranks are
// validated (sharding::ValidateRanks), config.json is read beside model_dir and the rule set
// chosen (sharding::SelectRuleSet: options.shard_rules, else config.json's model_type). The
// digest is the SHA-256 hex of the canonical JSON (keys sorted, compact, non-ASCII escaped:
// Python's json.dumps(obj, sort_keys=True, separators=(",", ":"))) of
//   {"model_config": {"integers": {<every top-level non-negative integer of config.json>},
//                     "model_type": "...", "tie_word_embeddings": bool},
//    "rules": <the rules document>}
// so a changed rules document or config.json (e.g. its head counts) is another cache.
// kInvalidArgument for bad ranks or no rule set; kInvalidCheckpoint for a bad config.json.
Result<std::optional<ShardSpec>> ResolveShardSpec(const IdentityOptions& options);

// A published cache (source "published:<tag>", docs/publish.md) has no checkpoint: its
// checkpoint_fingerprint and checkpoint_files are both PublishedSourceDigest(source), the
// SHA-256 hex of "weightcache published source\n" + source, so the tag alone names the
// producer's weights; model_dir is not read and no shard rules apply.
bool IsPublishedSource(std::string_view source);
std::string PublishedSourceDigest(std::string_view source);

struct ResolvedIdentity {
  CacheConfig config;
  std::optional<ShardSpec> shard;    // set when the job is sharded (config.shard_rules_digest)
  std::string device_key;            // the GPU UUID, or "host"
  std::optional<DeviceInfo> device;  // the GPU (with its cuda_ordinal): gpu tier, or host tier
                                     // with affinity
  CachePaths paths;
  // The uids a daemon may run as for us to use it: TrustedUids().
  std::vector<uid_t> trusted_uids;
};

// The CacheConfig of `options` (fingerprint from options.checkpoint_fingerprint, else from the
// model dir's headers, through the verified cache of fingerprint_cache.h; checkpoint_files from a
// stat of the model dir's shards), the device (CUDA_VISIBLE_DEVICES applied; an empty gpu-tier
// device is the calling thread's current CUDA device, else visible index 0; its CUDA ordinal looked
// up once, here) and the paths. Every machine input comes from `env`. kInvalidArgument for bad
// options, kInvalidCheckpoint for the model, kNotFound for a device that is not visible, the
// driver's own error for a gpu tier without a driver (unless an inventory file names the devices).
Result<ResolvedIdentity> ResolveIdentity(const IdentityOptions& options,
                                         const Env& env = Env::Default());

// The CacheConfig fields of `options` over a known fingerprint and files digest
// (checkpoint::Checkpoint::files_digest) (no I/O but the quantization config file and, for a
// sharded job, config.json and the rules file: ResolveShardSpec).
Result<CacheConfig> BuildCacheConfig(const IdentityOptions& options, const std::string& fingerprint,
                                     const std::string& files_digest);

// The trusted-uid rule: our euid first, then `configured`, else the uids of
// WEIGHTCACHE_TRUSTED_UIDS ("1001,1002"). kInvalidArgument naming the variable when it is not
// a comma-separated list of numeric uids.
Result<std::vector<uid_t>> TrustedUids(const std::vector<uint32_t>& configured,
                                       const EnvLookup& env);

}  // namespace weightcache::identity
