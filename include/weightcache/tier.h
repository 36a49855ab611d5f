// weightcache/tier.h — where a cache's weights live. The one representation of a tier in
// C++: the client options, the CacheConfig, the daemon, the weight stores, the manifest, the
// budget ledger's entries, the metrics' identity and the fleet registry's entry all hold this
// enum. Its text spelling ("gpu", "host": the table kTierNames, which TierName and ParseTier
// read, nowhere else) is the CacheConfig's canonical JSON, the Status reply's field, the CLI's
// --tier, the budget ledger file, the registry entry's JSON, the metrics' tier label and the
// Python strings; its one wire byte is mapped in the manifest codec (src/protocol/manifest.cc),
// and the C ABI's wc_tier in c_api.cc.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "weightcache/enum_names.h"

namespace weightcache {

// Device memory of one GPU (a VMM arena), or shared host memory (sealed memfds).
enum class Tier : uint8_t { kGpu, kHost };

inline constexpr std::array<EnumName<Tier>, 2> kTierNames{{
    {Tier::kGpu, "gpu"},
    {Tier::kHost, "host"},
}};
static_assert(IsDenseEnumTable(kTierNames));

// "gpu" | "host" ("unknown" for a value outside the enum, e.g. one cast from bad bytes).
constexpr std::string_view TierName(Tier tier) { return NameIn(kTierNames, tier, "unknown"); }

// The inverse of TierName: "gpu" or "host" exactly, else nullopt (the caller reports the
// error in its own terms: a CLI flag, a config field, a protocol field).
constexpr std::optional<Tier> ParseTier(std::string_view name) { return ParseIn(kTierNames, name); }

}  // namespace weightcache
