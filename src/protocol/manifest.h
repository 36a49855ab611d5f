// The attach manifest: a compact binary table of allocations and tensors (docs/protocol.md §4).
//
// Why binary: attaching must cost O(allocations), and parsing 10,000 tensors must take
// microseconds (SPEC §8: attach <= 2 ms flat in tensor count). Fixed-size little-endian
// records are validated in one pass with no per-tensor allocation: names and dtypes are views
// into one string table owned by the Manifest.
//
//   header (24 bytes): magic "WCMF" | u8 tier | 3 reserved (0) | u32 allocation_count |
//                      u32 tensor_count | u32 string_table_size | u32 reserved (0)
//   allocations:       allocation_count x { u64 size }
//   tensors:           tensor_count x 112-byte records (layout in docs/protocol.md)
//   string table:      string_table_size bytes; tensor names and dtype names (the
//                      safetensors spelling, "BF16", "F8_E4M3", ...) as offset/length pairs
//
// Contract:
//  * Decode validates everything against bounds and returns kProtocol with a message naming
//    the tensor and field: sizes add up exactly, every string lies in the table, names are
//    non-empty, at most kMaxTensorNameLength bytes and unique, dtypes are 1-16 bytes of
//    [A-Z0-9_], ndim <= kMaxTensorDims with unused dims 0, the element count does not overflow,
//    allocation indices are in range, offset + nbytes lies inside its allocation without
//    overflow, reserved bytes are 0. Dtype semantics (known names, nbytes = elements x size)
//    are checked by the consumer, which owns the dtype table.
//  * EncodeManifest applies the same validation (kInvalidArgument), so a daemon cannot emit a
//    manifest its clients would reject.
//  * Manifest is move-only; TensorEntry views stay valid while the Manifest lives (moves
//    included). Thread-safe for concurrent reads.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::protocol {

enum class Tier : uint8_t { kGpu = 1, kHost = 2 };
std::string_view TierName(Tier tier);  // "gpu", "host"
Result<Tier> ParseTier(std::string_view name);

inline constexpr uint32_t kMaxTensorDims = 8;
inline constexpr uint32_t kMaxTensorNameLength = 4096;
inline constexpr uint32_t kMaxDTypeNameLength = 16;
inline constexpr size_t kManifestHeaderSize = 24;
inline constexpr size_t kManifestAllocationSize = 8;
inline constexpr size_t kManifestTensorSize = 112;

struct TensorEntry {
  std::string_view name;
  std::string_view dtype;  // safetensors spelling
  uint32_t ndim = 0;
  std::array<uint64_t, kMaxTensorDims> shape{};  // shape[ndim..] are 0
  uint32_t allocation = 0;                       // index into the allocations (and the fds)
  uint64_t offset = 0;                           // byte offset inside that allocation
  uint64_t nbytes = 0;
  // The content checksum of the tensor's bytes for --verify: XXH64 of the XXH64s of its
  // 256 KiB chunks (cuda/checksum.h, docs/integrity.md), not a plain XXH64 of the bytes.
  uint64_t checksum = 0;

  std::span<const uint64_t> dims() const { return {shape.data(), ndim}; }
};

class Manifest {
 public:
  Manifest() = default;
  Manifest(Manifest&&) noexcept = default;
  Manifest& operator=(Manifest&&) noexcept = default;

  static Result<Manifest> Decode(std::span<const uint8_t> payload);

  Tier tier() const { return tier_; }
  const std::vector<uint64_t>& allocation_sizes() const { return allocation_sizes_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }

 private:
  Tier tier_ = Tier::kHost;
  std::vector<uint64_t> allocation_sizes_;
  std::vector<TensorEntry> tensors_;
  std::unique_ptr<char[]> strings_;  // the string table the entries' views point into
};

// Builds the manifest bytes (the AttachReply payload). Dtype strings are interned in the table.
Result<std::vector<uint8_t>> EncodeManifest(Tier tier, std::span<const uint64_t> allocation_sizes,
                                            std::span<const TensorEntry> tensors);

}  // namespace weightcache::protocol
