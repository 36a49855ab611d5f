// The hello a source sends each accepted peer on its arena transport (docs/fleet.md
// "Transport"): what the source holds (an opaque manifest blob, the daemon's encoded manifest)
// and where (its registered regions: remote address, size, packed UCX rkey).
//
// Wire format, little-endian, sent on the UCP stream of the endpoint:
//
//   header (16 bytes)  u32 magic 'WCAT' (0x54414357) · u32 version (1) · u64 body_bytes
//   body               u64 manifest_bytes · u32 region_count · u32 reserved (0)
//                      manifest bytes
//                      region_count × { u64 remote_address · u64 bytes · u32 rkey_bytes ·
//                                       rkey bytes }
//
// Contract:
//  * Everything a peer sends is untrusted: DecodeHelloHeader and DecodeHelloBody check the
//    magic, the version, every count and size against the bounds below (before anything is
//    allocated from them), that the body is consumed exactly, that no region is empty and
//    that the total does not overflow. Errors are kProtocol naming the field.
//  * Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::fleet {

inline constexpr uint32_t kHelloMagic = 0x54414357;  // "WCAT" in little-endian bytes
inline constexpr uint32_t kHelloVersion = 1;
inline constexpr size_t kHelloHeaderBytes = 16;
// Bounds on what a peer may make us allocate or iterate over.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;
inline constexpr uint32_t kMaxHelloRegions = 4096;
inline constexpr uint32_t kMaxRkeyBytes = 4096;
inline constexpr uint64_t kMaxHelloBodyBytes =
    16 + kMaxManifestBytes + uint64_t{kMaxHelloRegions} * (20 + kMaxRkeyBytes);
// A region (and an arena) is at most 2^50 bytes (1 PiB): far past any GPU or host, and small
// enough that offsets + sizes can never overflow.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 50;

struct HelloRegion {
  uint64_t remote_address = 0;
  uint64_t bytes = 0;
  std::vector<uint8_t> rkey;  // as ucp_rkey_pack produced it
};

struct Hello {
  uint32_t version = kHelloVersion;
  std::vector<uint8_t> manifest;
  std::vector<HelloRegion> regions;
};

// Header and body in one buffer. kInvalidArgument if `hello` breaks a bound above.
Result<std::vector<uint8_t>> EncodeHello(const Hello& hello);

// The body size the header announces (bounded by kMaxHelloBodyBytes). `header` must be
// kHelloHeaderBytes long.
Result<uint64_t> DecodeHelloHeader(std::span<const uint8_t> header);

// The body (the bytes after the header, exactly body_bytes of them).
Result<Hello> DecodeHelloBody(std::span<const uint8_t> body);

}  // namespace weightcache::fleet
