// CacheConfig — every field that decides whether cached bytes are right for a consumer
// (docs/design.md "CacheConfig"), its canonical serialization and the config digest.
//
// Canonical form (docs/identity.md): the JSON object of ToJson() — every field, keys sorted
// bytewise, no whitespace, integers in decimal, strings JSON-escaped with non-ASCII as \uXXXX
// — e.g.
// {"checkpoint_files":"…","checkpoint_fingerprint":"…","dp_size":1,…,"tier":"gpu","tp_rank":0,"tp_size":2}.
// Digest() is the lowercase hex SHA-256 of exactly those bytes. Two configs match iff every
// field is equal, iff their canonical forms are equal. The same JSON object is the wire form
// (FromJson parses it back strictly), so the daemon and the client never disagree about what
// a field means.
//
// dp_rank is deliberately absent: data-parallel replicas hold identical weights and share a
// cache. The tier is present: the same weights in host memory and in a VMM arena are
// different caches (it was added before any deployment, so format_version stayed 1).
// format_version changes whenever the meaning of any field or the arena layout contract
// changes, so an old daemon is reported as a mismatch rather than misread.
//
// Values, not resources: copyable, no internal synchronisation.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::identity {

// 2: checkpoint_files added (the canonical form changed).
inline constexpr uint32_t kCacheFormatVersion = 2;

struct CacheConfig {
  uint32_t format_version = kCacheFormatVersion;
  std::string model_id;                // e.g. "Llama-3.1-8B-Instruct"; non-empty
  std::string revision;                // e.g. a commit hash or "main"; may be empty
  std::string checkpoint_fingerprint;  // 64 lowercase hex (checkpoint::Checkpoint)
  // 64 lowercase hex: the shards' stat identity (Checkpoint::files_digest(): name, device,
  // inode, size, mtime, ctime), so two checkpoints with equal headers but different values,
  // or a file rewritten since the daemon loaded it, never share a config.
  std::string checkpoint_files;
  std::string dtype = "auto";              // "auto" = as stored in the checkpoint
  std::string quantization = "none";       // method name, "none" when unquantized
  std::string quantization_config_sha256;  // QuantizationConfigDigest(); "" when none
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint32_t pp_size = 1;
  uint32_t pp_rank = 0;
  uint32_t ep_size = 1;
  uint32_t ep_rank = 0;
  uint32_t dp_size = 1;
  std::string shard_rules_digest;      // 64 lowercase hex of the sharding rules; "" = unsharded
  std::string source = "disk";         // "disk" or "published:<producer tag>"
  std::string layout_tag = "default";  // the arena layout / packing variant
  // Tier::kGpu (VMM arena) or Tier::kHost (sealed memfds), spelt "gpu"/"host" in the canonical
  // form (TierName). Part of the identity because a host-tier
  // cache with a GPU affinity and a gpu-tier cache of the same weights share a device key:
  // without the tier they would resolve to one socket, and the second daemon would be
  // refused (or a client would map memory of the wrong kind).
  Tier tier = Tier::kGpu;

  // Every field name, in canonical (sorted) order.
  static const std::vector<std::string_view>& FieldNames();

  // The canonical serialization (see above) and its SHA-256 hex.
  std::string Canonical() const;
  std::string Digest() const;
  // The first 16 hex characters of Digest(): the file name stem of the socket and lock.
  std::string ShortDigest() const;
  // The fleet key (docs/identity.md, "Fleet key"; docs/fleet.md): the SHA-256 hex of the
  // canonical form without the node-local fields `checkpoint_files` (the shards' stat identity,
  // different on every node) and `tier` (a host cache can fill a gpu one), with
  // "content_sha256": `content_anchor` added when it is non-empty (the content anchor's digest,
  // checkpoint::ContentAnchor::Digest: the SHA-256 of every shard file as the checkpoint
  // records it). Two nodes serving the same model files with the same ranks, dtype, rules,
  // source and layout have the same fleet key; with an anchor, files with other bytes under
  // equal headers have another. It names what to look for in the registry; it proves nothing
  // about content (a filler proves the bytes it receives against its own anchor).
  std::string FleetDigest(std::string_view content_anchor = {}) const;
  // The fields FleetDigest() leaves out, in canonical order.
  static const std::vector<std::string_view>& NodeLocalFieldNames();

  // ranks < sizes, sizes >= 1, model_id non-empty, hex fields well-formed, source, tier and
  // format_version recognised, strings printable ASCII. kInvalidArgument naming the field.
  Status Validate() const;

  nlohmann::json ToJson() const;
  // Strict: a non-object, an unknown, missing or ill-typed field is kProtocol naming the
  // field; the result is also Validate()d (errors keep the kProtocol code).
  static Result<CacheConfig> FromJson(const nlohmann::json& json);

  // One field's value as text (strings quoted), for reports. Empty for an unknown field.
  std::string FieldText(std::string_view field) const;

  bool operator==(const CacheConfig&) const = default;
};

struct FieldDiff {
  std::string field;
  std::string ours;    // FieldText of our config
  std::string theirs;  // FieldText of the other config
  bool operator==(const FieldDiff&) const = default;
};

// The differing fields, in canonical order; empty iff the configs are equal.
std::vector<FieldDiff> Diff(const CacheConfig& ours, const CacheConfig& theirs);

// Why a difference in `field` matters, when the field name alone does not say it ("" else):
// checkpoint_files explains that the files are not the ones the daemon loaded.
std::string_view FieldNote(std::string_view field);

// "tp_rank: ours=0 theirs=1; revision: ours=\"a\" theirs=\"b\"" (empty for no diffs), each
// field followed by its FieldNote in parentheses when it has one.
std::string FormatDiffOneLine(const std::vector<FieldDiff>& diffs);
// One field per line, aligned: "  tp_rank   ours=0   theirs=1\n…".
std::string FormatDiffMultiLine(const std::vector<FieldDiff>& diffs);

// SHA-256 hex of the canonical form of a quantization config: parsed as JSON (duplicate keys
// rejected), re-serialized with sorted keys, no whitespace, non-ASCII as \uXXXX. Independent
// of key order and formatting; 1 and 1.0 stay different values. kInvalidArgument on bad JSON.
Result<std::string> QuantizationConfigDigest(std::string_view json_text);

}  // namespace weightcache::identity
