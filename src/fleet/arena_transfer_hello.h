// The frames of the arena transport (docs/fleet.md "Transport"), in one place.
//
// The hello a source sends each accepted peer: what the source holds (an opaque manifest blob,
// the daemon's encoded manifest), which protocol its regions are read with, and the regions.
// Wire format, little-endian; on the TCP connection (protocol tcp) or the UCP stream of the
// endpoint (protocol ucx):
//
//   header (16 bytes)  u32 magic 'WCAT' (0x54414357) · u32 version (2) · u64 body_bytes
//   body               u64 manifest_bytes · u32 region_count · u32 protocol (1 tcp, 2 ucx)
//                      manifest bytes
//                      region_count × { u64 remote_address · u64 bytes · u32 rkey_bytes ·
//                                       rkey bytes }
//                      protocol ucx only: u32 worker_address_bytes · worker address bytes
//   protocol tcp: remote_address 0 and rkey_bytes 0 (the regions are read with read requests);
//   protocol ucx: the registered address and the packed UCX rkey (1..kMaxRkeyBytes), and the
//   source's UCP worker address (1..kMaxWorkerAddressBytes), which the peer connects its UCX
//   endpoint to (no UCX listener: the hello's TCP connection is the only way in).
//
// In place of the hello, a source that turns an allowed peer away sends the refusal:
//
//   refusal (16 bytes) u32 magic 'WCAN' (0x4e414357) · u32 reason (1 full, 2 stopping) · u64 0
//
// (A peer off the allow-list gets no byte at all: its connection is closed at accept.) Both
// protocols send the hello on a TCP connection to the source's one listening socket.
//
// Protocol tcp, after the hello: the peer sends read requests, the source answers each, in
// order, with exactly `length` bytes of the region (nothing else: no header, no status):
//
//   read request (24 bytes)  u32 opcode (1 read) · u32 region · u64 offset · u64 length
//
// with region < region_count, 1 <= length <= kMaxReadBytes and offset + length <= the region's
// bytes (no wrap). There is no other opcode: nothing writes to a source. A request that breaks
// a rule is not answered: the source closes that connection (and logs the peer and why).
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
inline constexpr uint32_t kHelloVersion = 2;
inline constexpr uint32_t kRefusalMagic = 0x4e414357;  // "WCAN"
inline constexpr size_t kHelloHeaderBytes = 16;
// Bounds on what a peer may make us allocate or iterate over.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;
inline constexpr uint32_t kMaxHelloRegions = 4096;
inline constexpr uint32_t kMaxRkeyBytes = 4096;
inline constexpr uint32_t kMaxWorkerAddressBytes = 64 << 10;
inline constexpr uint64_t kMaxHelloBodyBytes = 16 + kMaxManifestBytes +
                                               uint64_t{kMaxHelloRegions} * (20 + kMaxRkeyBytes) +
                                               4 + kMaxWorkerAddressBytes;
// A region (and an arena) is at most 2^50 bytes (1 PiB): far past any GPU or host, and small
// enough that offsets + sizes can never overflow.
inline constexpr uint64_t kMaxRegionBytes = uint64_t{1} << 50;

// How a source's regions are read: read requests over the hello's TCP connection (host
// memory), or UCX RMA reads with the rkeys (CUDA memory).
enum class HelloProtocol : uint32_t { kTcp = 1, kUcx = 2 };

enum class RefusalReason : uint32_t { kFull = 1, kStopping = 2 };

struct HelloRegion {
  uint64_t remote_address = 0;
  uint64_t bytes = 0;
  std::vector<uint8_t> rkey;  // as ucp_rkey_pack produced it (protocol ucx); empty for tcp
};

struct Hello {
  uint32_t version = kHelloVersion;
  HelloProtocol protocol = HelloProtocol::kTcp;
  std::vector<uint8_t> manifest;
  std::vector<HelloRegion> regions;
  std::vector<uint8_t> worker_address;  // protocol ucx: ucp_worker_get_address's; tcp: empty
};

// Header and body in one buffer. kInvalidArgument if `hello` breaks a bound above.
Result<std::vector<uint8_t>> EncodeHello(const Hello& hello);

// The body size the header announces (bounded by kMaxHelloBodyBytes). `header` must be
// kHelloHeaderBytes long. A refusal in its place is kUnavailable: "the source is full (...)"
// or "the source is stopping".
Result<uint64_t> DecodeHelloHeader(std::span<const uint8_t> header);

// The refusal frame (kHelloHeaderBytes long).
std::vector<uint8_t> EncodeRefusal(RefusalReason reason);

inline constexpr size_t kReadRequestBytes = 24;
inline constexpr uint32_t kOpRead = 1;
// The most one read request may ask for (a fetch's stripes are at most this long).
inline constexpr uint64_t kMaxReadBytes = uint64_t{64} << 20;

struct ReadRequest {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

std::vector<uint8_t> EncodeReadRequest(const ReadRequest& request);
// Checks the opcode and the bounds against the served regions' sizes; kProtocol naming what is
// wrong ("opcode 2 (not a read)", "region 5 of 2", "offset 10 + length 4096 past region 0's
// 4096 bytes", "a length of 0"). `frame` must be kReadRequestBytes long.
Result<ReadRequest> DecodeReadRequest(std::span<const uint8_t> frame,
                                      std::span<const uint64_t> region_bytes);

// The body (the bytes after the header, exactly body_bytes of them).
Result<Hello> DecodeHelloBody(std::span<const uint8_t> body);

}  // namespace weightcache::fleet
