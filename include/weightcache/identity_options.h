// weightcache/identity_options.h — what names one cache: the CacheConfig fields (docs/design.md
// "CacheConfig"), the device and where to look for the daemon. Embedded as AttachOptions::identity
// (client.h); the CLI binds its identity flags (serve, stop, paths, attach, verify, launch) to the
// same struct, so a daemon and an engine given the same values compute the same CacheConfig, device
// key and socket path by construction.
//
// A plain value type: no I/O, no resources, safe to copy between threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightcache/tier.h"

namespace weightcache {

struct IdentityOptions {
  // ---- the CacheConfig (docs/design.md "CacheConfig"); every field must equal the daemon's ----
  std::string model_dir;  // checkpoint dir or .safetensors file: fingerprint + fallback source
  std::string model_id;   // default: the model dir's basename
  std::string revision;
  std::string dtype;                // "" = as stored in the checkpoint
  std::string quantization;         // method name, "" = none
  std::string quantization_config;  // path of the method's JSON config ("" = none)
  int tp_size = 1, tp_rank = 0;
  int pp_size = 1, pp_rank = 0;
  int ep_size = 1, ep_rank = 0;
  int dp_size = 1;  // never a dp rank: replicas share weights
  // The sharding rules of a sharded job (any of tp/pp/ep size > 1, or this set): a built-in
  // set's name, else a rules file. "" = the built-in set of config.json's model_type. A
  // sharded cache holds only this rank's slices; its config's shard_rules_digest covers the
  // rules and the config.json values they read.
  std::string shard_rules;
  std::string layout_tag;
  std::string source = "disk";  // "disk" or "published:<producer tag>"
  // The checkpoint fingerprint when the caller already knows it (skips reading the shard
  // headers on the attach path); "" = computed from model_dir. model_dir is required either
  // way: its shards are stat-ed for the config's checkpoint_files. A fallback load always
  // opens model_dir.
  std::string checkpoint_fingerprint;

  // ---- where to look ----
  Tier tier = Tier::kGpu;
  // A local index ("0") into the devices this process can see, or a (prefix of a) UUID.
  // Empty: gpu tier → the calling thread's current CUDA device, else visible index 0; host
  // tier → no GPU affinity (device key "host"). Always resolved to the physical UUID.
  std::string device;
  std::string namespace_name;    // "" = "default"
  std::string runtime_dir;       // "" = WEIGHTCACHE_RUNTIME_DIR > XDG_RUNTIME_DIR/… > /tmp/…
  std::string socket;            // "" = WEIGHTCACHE_SOCKET, else the digest-keyed path
  std::string device_inventory;  // "" = WEIGHTCACHE_DEVICE_INVENTORY, else the CUDA driver
  // The uids a daemon may run as (its socket's owner and its SO_PEERCRED uid) for this client
  // to use it, besides our own euid, which is always trusted. Empty: WEIGHTCACHE_TRUSTED_UIDS
  // (comma-separated uids), else our uid only. For a daemon run by a service user
  // (`serve --allow-uid <ours>`), list that user's uid here.
  std::vector<uint32_t> trusted_uids;
};

}  // namespace weightcache
