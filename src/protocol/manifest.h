// The attach manifest: a compact binary table of allocations and tensors (docs/protocol.md §4).
//
// Why binary, and why out of the socket: attaching must cost O(allocations), flat in tensor
// count (docs/design.md "Performance targets"). The daemon writes the manifest ONCE, at ready, into
// a sealed read-only memfd that rides in the AttachReply as one more fd; a client maps it instead
// of copying it through the socket per attach. Since protocol version 3 the client's tensor table
// points INTO the mapped manifest: names are stored NUL-terminated and shapes and strides as
// little-endian int64 arrays, so building the table copies no name and no dimension — per tensor, a
// client validates one 64-byte record and writes one table entry.
//
//   header (32 bytes): magic "WCMF" | u8 tier | 3 reserved (0) | u32 allocation_count |
//                      u32 tensor_count | u32 dim_count | u32 string_table_size |
//                      u32 metadata_size | u32 reserved (0)
//   allocations:       allocation_count x { u64 size }
//   tensors:           tensor_count x 64-byte records (layout in docs/protocol.md), each
//                      with the slice of the full tensor it holds (sharded caches)
//   dims:              dim_count x i64: each tensor's shape, then its contiguous strides
//   string table:      string_table_size bytes; tensor names, each followed by a NUL, and
//                      dtype names (the safetensors spelling, "BF16", "F8_E4M3", ...)
//   metadata:          metadata_size (<= kMaxManifestMetadataSize) opaque bytes: the blob a
//                      publisher sent (docs/publish.md); empty for a loaded cache
//
// Every section starts at a multiple of 8 bytes, so the dims can be read in place as int64_t
// from a mapping (page-aligned) or an owned copy (operator new alignment).
//
// Contract:
//  * Decode validates everything against bounds and returns kProtocol with a message naming
//    the tensor and field: sizes add up exactly, every string lies in the table, names are
//    non-empty, at most kMaxTensorNameLength bytes, followed by a NUL and strictly ascending
//    (hence unique), dtypes are 1-16 bytes of [A-Z0-9_], ndim <= kMaxTensorDims, the dims lie
//    in the dims section, every dimension is >= 0, the element count does not overflow 64
//    bits, the strides are exactly the contiguous row-major ones, allocation indices are in
//    range, offset + nbytes lies inside its allocation without overflow, reserved bytes are 0,
//    a slice's dim is < ndim and offset + shape[dim] <= full_length (a whole tensor's slice
//    fields are 0).
//    Dtype semantics (known names, nbytes = elements x size) are checked by the consumer,
//    which owns the dtype table.
//  * The bytes are validated once; record(i) then reads record i from them without checking
//    again. The attach path may split the validation (RecordCheck::kDeferred): the header and
//    allocations when the reply arrives, the records on the thread that builds the tensor
//    table while the driver maps (ValidateRecords). Records are never readable unchecked:
//    record() and tensor() need ValidateRecords() to have succeeded (checked in debug builds). A
//    Manifest owns its bytes: a copy (Decode) or a read-only mapping of a sealed memfd
//    (DecodeMapped), which nobody can change after the checks.
//  * EncodeManifest applies the same validation (kInvalidArgument) and orders the records by
//    name itself, so a daemon cannot emit a manifest its clients would reject.
//  * Manifest is move-only; the views of a TensorRecord or TensorEntry stay valid while the
//    Manifest lives (moves included: the bytes do not move). Thread-safe for concurrent reads.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/limits.h"
#include "common/unique_fd.h"
#include "os/memfd.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::protocol {

// The tier is weightcache::Tier (weightcache/tier.h); its manifest byte (1 = gpu, 2 = host)
// is mapped in manifest.cc only.

// The tensor bounds are the checkpoint's (checkpoint/limits.h): one set of limits, so a
// checkpoint that opens always fits a manifest.
inline constexpr uint32_t kMaxTensorDims = checkpoint::kMaxTensorRank;
inline constexpr uint32_t kMaxTensorNameLength = checkpoint::kMaxTensorNameBytes;
inline constexpr uint64_t kMaxTensorCount = checkpoint::kMaxTensorCount;
inline constexpr uint32_t kMaxDTypeNameLength = 16;
// Distinct dtype names a manifest's string table can hold (the safetensors dtypes are ~20).
inline constexpr uint32_t kMaxDTypeNames = 64;
inline constexpr size_t kManifestHeaderSize = 32;
inline constexpr size_t kManifestAllocationSize = 8;
inline constexpr size_t kManifestTensorSize = 64;
inline constexpr size_t kManifestDimSize = 8;
// One fd of an AttachReply is the manifest's memfd, the others are the allocations.
inline constexpr uint32_t kMaxAllocations = 252;
// The metadata section's bound (a publisher's blob, protocol::kMaxPublishMetadataBytes).
inline constexpr uint32_t kMaxManifestMetadataSize = uint32_t{64} << 10;
// The manifest memfd's size bound, checked before it is mapped: the largest manifest the
// checkpoint limits allow (every tensor at the maximal rank, shape + strides, its name's NUL,
// all names at their total bound, every dtype name).
inline constexpr uint64_t kMaxManifestSize =
    kManifestHeaderSize + uint64_t{kMaxAllocations} * kManifestAllocationSize +
    kMaxTensorCount * (kManifestTensorSize + 2 * uint64_t{kMaxTensorDims} * kManifestDimSize + 1) +
    checkpoint::kMaxTensorNameBytesTotal + uint64_t{kMaxDTypeNames} * (kMaxDTypeNameLength + 1) +
    kMaxManifestMetadataSize;
static_assert(kMaxManifestSize <= UINT32_MAX, "manifest section sizes are u32 on the wire");

// The part of the full tensor a record holds along one dim (a sharded cache): elements
// [offset, offset + shape[dim]) of a dim whose full size is full_length. The record's shape
// is the held shape, so its length is shape[dim].
struct SliceEntry {
  uint32_t dim = 0;
  uint64_t offset = 0;
  uint64_t full_length = 0;

  friend bool operator==(const SliceEntry&, const SliceEntry&) = default;
};

// What the encoder takes (and what tensor(i) copies out, for tests and tools).
struct TensorEntry {
  std::string_view name;
  std::string_view dtype;  // safetensors spelling
  uint32_t ndim = 0;
  std::array<uint64_t, kMaxTensorDims> shape{};  // shape[ndim..] are 0
  uint32_t allocation = 0;                       // index into the allocations (and the fds)
  uint64_t offset = 0;                           // byte offset inside that allocation
  uint64_t nbytes = 0;
  // The content checksum of the tensor's bytes for --verify: XXH64 of the XXH64s of its
  // 256 KiB chunks (common/checksum.h, docs/integrity.md), not a plain XXH64 of the bytes.
  uint64_t checksum = 0;
  std::optional<SliceEntry> slice;  // nullopt: the whole tensor

  std::span<const uint64_t> dims() const { return {shape.data(), ndim}; }
};

// One record as views into the validated manifest bytes: nothing is copied.
struct TensorRecord {
  std::string_view name;  // NUL-terminated in the manifest: name.data()[name.size()] == '\0'
  std::string_view dtype;
  std::span<const int64_t> shape;    // every entry >= 0
  std::span<const int64_t> strides;  // contiguous row-major, in elements; shape.size() entries
  uint32_t allocation = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint64_t checksum = 0;
  std::optional<SliceEntry> slice;  // nullopt: the whole tensor
};

// How much of a manifest to check when decoding it.
enum class RecordCheck {
  kNow,       // header, allocations and every record
  kDeferred,  // header and allocations; the records wait for Manifest::ValidateRecords()
};

class Manifest {
 public:
  Manifest() = default;
  Manifest(Manifest&&) noexcept = default;
  Manifest& operator=(Manifest&&) noexcept = default;

  // Validates a copy of `bytes` (tests, fuzzing, in-process use).
  static Result<Manifest> Decode(std::span<const uint8_t> bytes);
  // Validates the bytes of a read-only mapping of a sealed memfd (the attach path: no copy).
  // The caller has checked the seals, so the bytes cannot change after validation.
  static Result<Manifest> DecodeMapped(os::MappedRegion region,
                                       RecordCheck check = RecordCheck::kNow);
  // The record checks (kProtocol naming the tensor and field). Idempotent: the second call
  // returns the first call's verdict without checking again. Not thread-safe against readers.
  Status ValidateRecords();
  bool records_validated() const { return records_status_ && records_status_->ok(); }

  Tier tier() const { return tier_; }
  const std::vector<uint64_t>& allocation_sizes() const { return allocation_sizes_; }
  size_t tensor_count() const { return tensor_count_; }
  // Record i (< tensor_count()) as views into the validated bytes; names in ascending order.
  // The attach path reads this: no copy, no check.
  TensorRecord record(size_t i) const;
  // The same record copied into a TensorEntry (tests, tools, re-encoding).
  TensorEntry tensor(size_t i) const;
  // The metadata section (a publisher's blob; empty for a loaded cache). Views the bytes.
  std::string_view metadata() const { return metadata_; }
  // The encoded manifest (what EncodeManifest produced).
  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  Status ValidateHeader();
  Status CheckRecords();

  Tier tier_ = Tier::kHost;
  std::vector<uint64_t> allocation_sizes_;
  size_t tensor_count_ = 0;
  std::span<const uint8_t> bytes_;  // into owned_ or mapped_
  const uint8_t* records_ = nullptr;
  const int64_t* dims_ = nullptr;
  const char* strings_ = nullptr;
  std::string_view metadata_;
  uint32_t allocation_count_ = 0, dim_total_ = 0, table_size_ = 0;
  std::optional<Status> records_status_;  // the verdict of ValidateRecords, once run
  std::unique_ptr<uint8_t[]> owned_;
  os::MappedRegion mapped_;
};

// Builds the manifest bytes, records in ascending name order whatever the order of `tensors`.
// Dtype strings are interned in the table. `metadata` (<= kMaxManifestMetadataSize bytes)
// becomes the metadata section.
Result<std::vector<uint8_t>> EncodeManifest(Tier tier, std::span<const uint64_t> allocation_sizes,
                                            std::span<const TensorEntry> tensors,
                                            std::string_view metadata = {});

// The memfd a daemon hands out with every AttachReply: `manifest` written once, then sealed
// read-only (F_SEAL_WRITE|GROW|SHRINK|SEAL). `name` shows in /proc/<pid>/fd.
Result<UniqueFd> CreateManifestMemfd(std::span<const uint8_t> manifest, const std::string& name);

// The client side: checks the seals and that the file is exactly `size` bytes (<=
// kMaxManifestSize), maps it read-only and decodes it. kProtocol / kPermissionDenied naming what is
// wrong.
Result<Manifest> MapManifestMemfd(int fd, uint64_t size, RecordCheck check = RecordCheck::kNow);

}  // namespace weightcache::protocol
