// RegistryEntry — what the fleet registry (docs/fleet.md, "Registry") records for one cache on
// one node, its etcd key and its JSON value; and LookupEntries / LookupSources, which read
// them back.
//
//   key:   <prefix>/v1/caches/<fleet key>/<node>/<short digest>
//   value: {"format":1,"fleet_key":…,"digest":…,"node":…,"endpoint":…,"tier":…,"device":…,
//           "bytes":…,"tensors":…,"state":…,"pid":…,"model_id":…,"revision":…,
//           "tp_rank":…,"tp_size":…,"pp_rank":…,"pp_size":…,"ep_rank":…,"ep_size":…,
//           "manifest_digest":…}
//
// The fleet key (identity::CacheConfig::FleetDigest) groups every node's cache of the same
// weights; the short digest keeps two caches of one node (a gpu and a host tier) apart.
// Entries are untrusted input: FromJson is strict (every field present, of its type, within
// its range, no other field), and an entry names a source to ask, never proves its bytes.
//
// Values, not resources: copyable, no internal synchronisation.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fleet/etcd_client.h"
#include "weightcache/enum_names.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::fleet {

inline constexpr uint32_t kRegistryEntryFormat = 1;
inline constexpr std::string_view kDefaultRegistryPrefix = "/weightcache";
// A value larger than this is not an entry (real ones are well under 2 KiB).
inline constexpr size_t kMaxEntryBytes = size_t{16} << 10;

enum class EntryState { kLoading, kReady, kDemoted, kDraining };
inline constexpr std::array<EnumName<EntryState>, 4> kEntryStateNames{{
    {EntryState::kLoading, "loading"},
    {EntryState::kReady, "ready"},
    {EntryState::kDemoted, "demoted"},
    {EntryState::kDraining, "draining"},
}};
static_assert(IsDenseEnumTable(kEntryStateNames));
std::string_view EntryStateName(EntryState state);  // "unknown" outside the table
std::optional<EntryState> ParseEntryState(std::string_view name);

struct RegistryEntry {
  uint32_t format = kRegistryEntryFormat;
  std::string fleet_key;   // 64 lowercase hex: CacheConfig::FleetDigest()
  std::string digest;      // 64 lowercase hex: CacheConfig::Digest() on the node
  std::string node;        // the node's name (hostname or --node-name): [A-Za-z0-9._-], 1-253
  std::string endpoint;    // the transport's "host:port", "" until a transport serves it
  Tier tier = Tier::kGpu;  // where the bytes are now; "tier" in the JSON is its TierName()
  std::string device;      // GPU UUID (GPU-…, MIG-…) or "host"
  uint64_t bytes = 0;
  uint64_t tensors = 0;
  EntryState state = EntryState::kReady;
  int64_t pid = 0;
  std::string model_id;
  std::string revision;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;
  uint32_t pp_rank = 0;
  uint32_t pp_size = 1;
  uint32_t ep_rank = 0;
  uint32_t ep_size = 1;
  std::string manifest_digest;  // "" (not yet given by the daemon) or 64 lowercase hex

  // The first 16 hex characters of digest.
  std::string ShortDigest() const { return digest.substr(0, 16); }

  // kInvalidArgument naming the field whose value is out of its range.
  Status Validate() const;
  nlohmann::json ToJson() const;
  std::string ToJsonText() const;
  // Strict (see above); kProtocol naming the field.
  static Result<RegistryEntry> FromJson(const nlohmann::json& json);
  static Result<RegistryEntry> FromJsonText(std::string_view text);

  bool operator==(const RegistryEntry&) const = default;
};

// A registry prefix: starts with '/', no trailing '/', printable ASCII without spaces, at most
// 256 bytes. kInvalidArgument naming it.
Status ValidatePrefix(std::string_view prefix);
// A node name: 1-253 characters of [A-Za-z0-9._-] (a hostname's). kInvalidArgument.
Status ValidateNodeName(std::string_view node);
// A transport endpoint "HOST:PORT": a port 1-65535, a host of printable characters without
// spaces or '/' (an entry's `endpoint`, serve's --advertise and --fill-from lists).
bool IsEndpoint(std::string_view endpoint);
// An endpoint whose host is the "any" address (0.0.0.0:7400, [::]:7400): a bind address, never
// one to publish or connect to (Validate refuses it in an entry).
bool IsWildcardEndpoint(const std::string& endpoint);

// "<prefix>/v1/caches/" and "<prefix>/v1/caches/<fleet key>/".
std::string CachesPrefix(std::string_view prefix);
std::string FleetKeyPrefix(std::string_view prefix, std::string_view fleet_key);
// The entry's key: "<prefix>/v1/caches/<fleet key>/<node>/<short digest>".
std::string EntryKey(std::string_view prefix, const RegistryEntry& entry);

// Every entry under the prefix (fleet_key set: only that fleet key's), in key order. A value
// that is not a valid entry, or whose key does not match its fields, is skipped with a
// warning naming the key: one bad writer cannot hide the others. Errors are etcd's.
Result<std::vector<RegistryEntry>> LookupEntries(const EtcdClient& client, std::string_view prefix,
                                                 const std::optional<std::string>& fleet_key);
// The entries that hold `fleet_key` (what a filler asks: docs/fleet.md).
Result<std::vector<RegistryEntry>> LookupSources(const EtcdClient& client, std::string_view prefix,
                                                 std::string_view fleet_key);

}  // namespace weightcache::fleet
