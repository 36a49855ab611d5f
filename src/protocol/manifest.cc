#include "protocol/manifest.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>

#include "protocol/frame.h"
#include "protocol/wire.h"

namespace weightcache::protocol {
namespace {

constexpr uint8_t kManifestMagic[4] = {'W', 'C', 'M', 'F'};

std::string Describe(size_t index, std::string_view name) {
  std::string out = "tensor " + std::to_string(index);
  if (!name.empty()) {
    out += " '";
    out += name.substr(0, 200);
    out += "'";
  }
  return out;
}

bool ValidDTypeName(std::string_view dtype) {
  if (dtype.empty() || dtype.size() > kMaxDTypeNameLength) return false;
  for (char c : dtype) {
    if (!((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

// The contiguous row-major strides of `shape` (in elements) into `strides`; false when one
// overflows int64 (possible only when a later dimension is 0, so the element count does not).
bool ContiguousStrides(std::span<const uint64_t> shape, int64_t* strides) {
  int64_t stride = 1;
  bool overflow = false;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = stride;
    if (d > 0) overflow |= __builtin_mul_overflow(stride, shape[d], &stride);
  }
  return !overflow;
}

// Everything the encoder checks about one entry except name uniqueness (the decoder checks
// the same rules on the encoded form, in Manifest::Validate).
Status ValidateEntry(size_t i, const TensorEntry& t, std::span<const uint64_t> allocations) {
  auto error = [&](const std::string& what) {
    return InvalidArgument("cannot encode attach manifest: " + Describe(i, t.name) + ": " + what);
  };
  if (t.name.empty()) return error("empty name");
  if (t.name.size() > kMaxTensorNameLength) {
    return error("name of " + std::to_string(t.name.size()) + " bytes exceeds " +
                 std::to_string(kMaxTensorNameLength));
  }
  if (!ValidDTypeName(t.dtype))
    return error("invalid dtype name (1-16 bytes of [A-Z0-9_] expected)");
  if (t.ndim > kMaxTensorDims) {
    return error("ndim " + std::to_string(t.ndim) + " exceeds " + std::to_string(kMaxTensorDims));
  }
  uint64_t elements = 1, unused = 0;
  bool overflow = false, negative = false, zero = false;
  for (uint32_t d = 0; d < kMaxTensorDims; ++d) {
    if (d >= t.ndim) {
      unused |= t.shape[d];
    } else {
      negative |= t.shape[d] > static_cast<uint64_t>(INT64_MAX);
      zero |= t.shape[d] == 0;
      overflow |= __builtin_mul_overflow(elements, t.shape[d], &elements);
    }
  }
  if (unused != 0) return error("unused shape dimension not 0");
  if (negative) return error("dimension above the int64 range");
  // A zero dimension makes the product 0 whatever the order of the multiplications.
  if (overflow && !zero) return error("element count overflows 64 bits");
  std::array<int64_t, kMaxTensorDims> strides{};
  if (!ContiguousStrides(t.dims(), strides.data())) return error("a stride overflows int64");
  if (t.allocation >= allocations.size()) {
    return error("allocation index " + std::to_string(t.allocation) + " out of range (" +
                 std::to_string(allocations.size()) + " allocations)");
  }
  if (t.slice) {
    if (t.slice->dim >= t.ndim) {
      return error("slice dim " + std::to_string(t.slice->dim) + " is not below ndim " +
                   std::to_string(t.ndim));
    }
    const uint64_t length = t.shape[t.slice->dim];
    if (t.slice->offset > t.slice->full_length || length > t.slice->full_length - t.slice->offset) {
      return error("slice offset " + std::to_string(t.slice->offset) + " + length " +
                   std::to_string(length) + " exceeds the full dim of " +
                   std::to_string(t.slice->full_length));
    }
  }
  uint64_t alloc_size = allocations[t.allocation];
  if (t.offset > alloc_size || t.nbytes > alloc_size - t.offset) {
    return error("offset " + std::to_string(t.offset) + " + nbytes " + std::to_string(t.nbytes) +
                 " exceeds allocation " + std::to_string(t.allocation) + " of " +
                 std::to_string(alloc_size) + " bytes");
  }
  return Status::Ok();
}

Status ManifestError(const std::string& message) {
  return ProtocolError("attach manifest: " + message);
}
Status EncodeError(const std::string& message) {
  return InvalidArgument("cannot encode attach manifest: " + message);
}

// The tier's manifest byte: the one place the wire value of a Tier is spelt. 0 and any other
// byte are no tier.
constexpr uint8_t kTierByteGpu = 1;
constexpr uint8_t kTierByteHost = 2;

std::optional<uint8_t> TierToByte(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return kTierByteGpu;
    case Tier::kHost:
      return kTierByteHost;
  }
  return std::nullopt;
}

std::optional<Tier> TierFromByte(uint8_t byte) {
  if (byte == kTierByteGpu) return Tier::kGpu;
  if (byte == kTierByteHost) return Tier::kHost;
  return std::nullopt;
}

}  // namespace

Result<std::vector<uint8_t>> EncodeManifest(Tier tier, std::span<const uint64_t> allocation_sizes,
                                            std::span<const TensorEntry> tensors,
                                            std::string_view metadata) {
  const std::optional<uint8_t> tier_byte = TierToByte(tier);
  if (!tier_byte) return EncodeError("unknown tier");
  if (metadata.size() > kMaxManifestMetadataSize) {
    return EncodeError("metadata of " + std::to_string(metadata.size()) + " bytes exceeds the " +
                       std::to_string(kMaxManifestMetadataSize) + "-byte limit");
  }
  if (allocation_sizes.size() > kMaxAllocations) {
    return EncodeError(std::to_string(allocation_sizes.size()) + " allocations exceed the " +
                       std::to_string(kMaxAllocations) +
                       " one AttachReply can carry (one fd is the manifest's)");
  }
  for (size_t a = 0; a < allocation_sizes.size(); ++a) {
    if (allocation_sizes[a] == 0)
      return EncodeError("allocation " + std::to_string(a) + " is empty");
  }
  if (tensors.size() > kMaxTensorCount) {
    return EncodeError(std::to_string(tensors.size()) + " tensors exceed the limit of " +
                       std::to_string(kMaxTensorCount));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(ValidateEntry(i, tensors[i], allocation_sizes));
  }
  // Records go out in ascending name order (the decoder's uniqueness check and the client's
  // table order); equal neighbours are duplicates.
  std::vector<uint32_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return tensors[a].name < tensors[b].name; });
  for (size_t k = 1; k < order.size(); ++k) {
    if (tensors[order[k]].name == tensors[order[k - 1]].name) {
      return EncodeError(Describe(order[k], tensors[order[k]].name) +
                         ": duplicate name (also tensor " + std::to_string(order[k - 1]) + ")");
    }
  }

  // The string table: names in record order, each followed by a NUL (the client hands them
  // out as C strings in place); dtype names interned (a handful of distinct ones).
  std::string table;
  std::vector<std::pair<std::string_view, uint32_t>> dtypes;
  std::vector<uint32_t> name_offsets(tensors.size()), dtype_offsets(tensors.size());
  uint64_t dim_count = 0;
  for (uint32_t i : order) {
    name_offsets[i] = static_cast<uint32_t>(table.size());
    table.append(tensors[i].name);
    table.push_back('\0');
    uint32_t off = UINT32_MAX;
    for (const auto& [name, at] : dtypes) {
      if (name == tensors[i].dtype) off = at;
    }
    if (off == UINT32_MAX) {
      off = static_cast<uint32_t>(table.size());
      table.append(tensors[i].dtype);
      table.push_back('\0');
      dtypes.emplace_back(tensors[i].dtype, off);
    }
    dtype_offsets[i] = off;
    dim_count += 2 * uint64_t{tensors[i].ndim};
    if (table.size() > kMaxManifestSize) return EncodeError("string table too large");
  }
  const uint64_t total = kManifestHeaderSize + allocation_sizes.size() * kManifestAllocationSize +
                         tensors.size() * kManifestTensorSize + dim_count * kManifestDimSize +
                         table.size() + metadata.size();
  if (total > kMaxManifestSize) {
    return EncodeError(std::to_string(total) + " bytes exceed the " +
                       std::to_string(kMaxManifestSize) + "-byte manifest limit");
  }

  std::vector<uint8_t> out;
  out.reserve(total);
  out.insert(out.end(), std::begin(kManifestMagic), std::end(kManifestMagic));
  wire::PutU8(out, *tier_byte);
  for (int r = 0; r < 3; ++r) wire::PutU8(out, 0);
  wire::PutU32(out, static_cast<uint32_t>(allocation_sizes.size()));
  wire::PutU32(out, static_cast<uint32_t>(tensors.size()));
  wire::PutU32(out, static_cast<uint32_t>(dim_count));
  wire::PutU32(out, static_cast<uint32_t>(table.size()));
  wire::PutU32(out, static_cast<uint32_t>(metadata.size()));
  wire::PutU32(out, 0);
  for (uint64_t size : allocation_sizes) wire::PutU64(out, size);
  uint32_t dims_at = 0;
  for (uint32_t i : order) {
    const TensorEntry& t = tensors[i];
    wire::PutU32(out, name_offsets[i]);
    wire::PutU32(out, static_cast<uint32_t>(t.name.size()));
    wire::PutU32(out, dtype_offsets[i]);
    wire::PutU8(out, static_cast<uint8_t>(t.dtype.size()));
    wire::PutU8(out, static_cast<uint8_t>(t.ndim));
    wire::PutU8(out, t.slice ? static_cast<uint8_t>(t.slice->dim + 1) : 0);
    wire::PutU8(out, 0);
    wire::PutU32(out, t.allocation);
    wire::PutU32(out, dims_at);
    wire::PutU64(out, t.offset);
    wire::PutU64(out, t.nbytes);
    wire::PutU64(out, t.checksum);
    wire::PutU64(out, t.slice ? t.slice->offset : 0);
    wire::PutU64(out, t.slice ? t.slice->full_length : 0);
    dims_at += 2 * t.ndim;
  }
  for (uint32_t i : order) {
    const TensorEntry& t = tensors[i];
    std::array<int64_t, kMaxTensorDims> strides{};
    ContiguousStrides(t.dims(), strides.data());  // checked by ValidateEntry
    for (uint64_t d : t.dims()) wire::PutU64(out, d);
    for (uint32_t d = 0; d < t.ndim; ++d) wire::PutU64(out, static_cast<uint64_t>(strides[d]));
  }
  out.insert(out.end(), table.begin(), table.end());
  out.insert(out.end(), metadata.begin(), metadata.end());
  return out;
}

Result<Manifest> Manifest::Decode(std::span<const uint8_t> bytes) {
  Manifest m;
  m.owned_ = std::make_unique_for_overwrite<uint8_t[]>(std::max<size_t>(bytes.size(), 1));
  std::memcpy(m.owned_.get(), bytes.data(), bytes.size());
  m.bytes_ = std::span<const uint8_t>(m.owned_.get(), bytes.size());
  WEIGHTCACHE_RETURN_IF_ERROR(m.ValidateHeader());
  WEIGHTCACHE_RETURN_IF_ERROR(m.ValidateRecords());
  return m;
}

Result<Manifest> Manifest::DecodeMapped(os::MappedRegion region, RecordCheck check) {
  Manifest m;
  m.mapped_ = std::move(region);
  m.bytes_ =
      std::span<const uint8_t>(static_cast<const uint8_t*>(m.mapped_.data()), m.mapped_.size());
  WEIGHTCACHE_RETURN_IF_ERROR(m.ValidateHeader());
  if (check == RecordCheck::kNow) WEIGHTCACHE_RETURN_IF_ERROR(m.ValidateRecords());
  return m;
}

TensorRecord Manifest::record(size_t i) const {
  assert(records_validated() && "Manifest::record before ValidateRecords");
  const uint8_t* r = records_ + i * kManifestTensorSize;
  const uint32_t ndim = r[13];
  const int64_t* shape = dims_ + wire::GetU32(r + 20);
  TensorRecord t;
  t.name = std::string_view(strings_ + wire::GetU32(r), wire::GetU32(r + 4));
  t.dtype = std::string_view(strings_ + wire::GetU32(r + 8), r[12]);
  t.shape = std::span<const int64_t>(shape, ndim);
  t.strides = std::span<const int64_t>(shape + ndim, ndim);
  t.allocation = wire::GetU32(r + 16);
  t.offset = wire::GetU64(r + 24);
  t.nbytes = wire::GetU64(r + 32);
  t.checksum = wire::GetU64(r + 40);
  if (r[14] != 0) t.slice = SliceEntry{r[14] - 1u, wire::GetU64(r + 48), wire::GetU64(r + 56)};
  return t;
}

TensorEntry Manifest::tensor(size_t i) const {
  const TensorRecord r = record(i);
  TensorEntry t;
  t.name = r.name;
  t.dtype = r.dtype;
  t.ndim = static_cast<uint32_t>(r.shape.size());
  for (size_t d = 0; d < r.shape.size(); ++d) t.shape[d] = static_cast<uint64_t>(r.shape[d]);
  t.allocation = r.allocation;
  t.offset = r.offset;
  t.nbytes = r.nbytes;
  t.checksum = r.checksum;
  t.slice = r.slice;
  return t;
}

Status Manifest::ValidateHeader() {
  static_assert(std::endian::native == std::endian::little,
                "the dims are read in place as little-endian int64");
  std::span<const uint8_t> payload = bytes_;
  if (payload.size() < kManifestHeaderSize) {
    return ManifestError("truncated header (" + std::to_string(payload.size()) + " of " +
                         std::to_string(kManifestHeaderSize) + " bytes)");
  }
  const uint8_t* p = payload.data();
  if (reinterpret_cast<uintptr_t>(p) % alignof(int64_t) != 0) {
    return InternalError("attach manifest bytes are not 8-byte aligned");
  }
  if (std::memcmp(p, kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return ManifestError("bad magic (expected \"WCMF\")");
  }
  const std::optional<Tier> tier = TierFromByte(p[4]);
  if (!tier) return ManifestError("unknown tier code " + std::to_string(p[4]));
  if (p[5] != 0 || p[6] != 0 || p[7] != 0 || wire::GetU32(p + 28) != 0) {
    return ManifestError("reserved header bytes are not 0");
  }
  const uint32_t allocation_count = wire::GetU32(p + 8);
  const uint32_t tensor_count = wire::GetU32(p + 12);
  const uint32_t dim_count = wire::GetU32(p + 16);
  const uint32_t table_size = wire::GetU32(p + 20);
  const uint32_t metadata_size = wire::GetU32(p + 24);
  if (metadata_size > kMaxManifestMetadataSize) {
    return ManifestError("metadata of " + std::to_string(metadata_size) + " bytes exceeds the " +
                         std::to_string(kMaxManifestMetadataSize) + "-byte limit");
  }
  if (allocation_count > kMaxAllocations) {
    return ManifestError(std::to_string(allocation_count) + " allocations exceed the limit of " +
                         std::to_string(kMaxAllocations));
  }
  if (tensor_count > kMaxTensorCount) {
    return ManifestError(std::to_string(tensor_count) + " tensors exceed the limit of " +
                         std::to_string(kMaxTensorCount));
  }
  // 32-bit counts times small record sizes cannot overflow 64 bits.
  const uint64_t expected = kManifestHeaderSize +
                            uint64_t{allocation_count} * kManifestAllocationSize +
                            uint64_t{tensor_count} * kManifestTensorSize +
                            uint64_t{dim_count} * kManifestDimSize + table_size + metadata_size;
  if (expected != payload.size()) {
    return ManifestError("header describes " + std::to_string(expected) + " bytes (" +
                         std::to_string(allocation_count) + " allocations, " +
                         std::to_string(tensor_count) + " tensors, " + std::to_string(dim_count) +
                         " dims, " + std::to_string(table_size) + "-byte string table, " +
                         std::to_string(metadata_size) + "-byte metadata) but the manifest has " +
                         std::to_string(payload.size()));
  }
  tier_ = *tier;
  const uint8_t* alloc_p = p + kManifestHeaderSize;
  allocation_sizes_.resize(allocation_count);
  for (uint32_t a = 0; a < allocation_count; ++a) {
    allocation_sizes_[a] = wire::GetU64(alloc_p + a * kManifestAllocationSize);
    if (allocation_sizes_[a] == 0) {
      return ManifestError("allocation " + std::to_string(a) + " has size 0");
    }
  }
  records_ = alloc_p + uint64_t{allocation_count} * kManifestAllocationSize;
  const uint8_t* dims_p = records_ + uint64_t{tensor_count} * kManifestTensorSize;
  // Every section offset is a multiple of 8 (sizes above), and the base is aligned: the
  // bytes are storage for int64 objects (a mapping, or an unsigned char array).
  dims_ = reinterpret_cast<const int64_t*>(dims_p);
  strings_ = reinterpret_cast<const char*>(dims_p + uint64_t{dim_count} * kManifestDimSize);
  tensor_count_ = tensor_count;
  allocation_count_ = allocation_count;
  dim_total_ = dim_count;
  table_size_ = table_size;
  metadata_ = std::string_view(strings_ + table_size, metadata_size);
  return Status::Ok();
}

// One pass over the records, no allocation: each record's fields are read straight from the
// bytes and checked; an error message is built only on the way out.
Status Manifest::ValidateRecords() {
  if (!records_status_) records_status_ = CheckRecords();
  return *records_status_;
}

Status Manifest::CheckRecords() {
  const uint32_t tensor_count = static_cast<uint32_t>(tensor_count_);
  const uint32_t allocation_count = allocation_count_;
  const uint32_t dim_count = dim_total_;
  const uint32_t table_size = table_size_;

  std::string_view previous, known_dtype;
  for (uint32_t i = 0; i < tensor_count; ++i) {
    const uint8_t* r = records_ + uint64_t{i} * kManifestTensorSize;
    const uint32_t name_offset = wire::GetU32(r), name_length = wire::GetU32(r + 4);
    // Strictly inside the table: the name's NUL follows it.
    if (name_offset > table_size || name_length >= table_size - name_offset) {
      return ManifestError(Describe(i, "") + ": name (offset " + std::to_string(name_offset) +
                           ", length " + std::to_string(name_length) +
                           " and its NUL) lies outside the string table of " +
                           std::to_string(table_size) + " bytes");
    }
    if (name_length == 0) return ManifestError(Describe(i, "") + ": empty name");
    const std::string_view name(strings_ + name_offset, name_length);
    if (name_length > kMaxTensorNameLength) {
      return ManifestError(Describe(i, name) + ": name of " + std::to_string(name_length) +
                           " bytes exceeds " + std::to_string(kMaxTensorNameLength));
    }
    if (strings_[name_offset + name_length] != '\0') {
      return ManifestError(Describe(i, name) + ": name is not followed by a NUL");
    }
    if (i > 0 && !(previous < name)) {
      return ManifestError(Describe(i, name) +
                           (previous == name
                                ? ": duplicate name (also tensor " + std::to_string(i - 1) + ")"
                                : ": names out of ascending byte order (after '" +
                                      std::string(previous.substr(0, 200)) + "')"));
    }
    previous = name;

    const uint32_t dtype_offset = wire::GetU32(r + 8), dtype_length = r[12];
    if (dtype_offset > table_size || dtype_length > table_size - dtype_offset) {
      return ManifestError(Describe(i, name) + ": dtype (offset " + std::to_string(dtype_offset) +
                           ", length " + std::to_string(dtype_length) +
                           ") lies outside the string table of " + std::to_string(table_size) +
                           " bytes");
    }
    // Dtype names are interned: a record pointing at the bytes already checked skips the
    // character check.
    const std::string_view dtype(strings_ + dtype_offset, dtype_length);
    if (dtype.data() != known_dtype.data() || dtype.size() != known_dtype.size()) {
      if (!ValidDTypeName(dtype)) {
        return ManifestError(Describe(i, name) +
                             ": invalid dtype name (1-16 bytes of [A-Z0-9_] expected)");
      }
      known_dtype = dtype;
    }
    const uint32_t ndim = r[13];
    if (r[15] != 0) return ManifestError(Describe(i, name) + ": reserved bytes are not 0");
    if (ndim > kMaxTensorDims) {
      return ManifestError(Describe(i, name) + ": ndim " + std::to_string(ndim) + " exceeds " +
                           std::to_string(kMaxTensorDims));
    }
    const uint32_t dims_at = wire::GetU32(r + 20);
    if (dims_at > dim_count || 2 * ndim > dim_count - dims_at) {
      return ManifestError(Describe(i, name) + ": dims " + std::to_string(dims_at) + " + 2 x " +
                           std::to_string(ndim) + " lie outside the " + std::to_string(dim_count) +
                           " dims of the manifest");
    }
    const int64_t* shape = dims_ + dims_at;
    const int64_t* strides = shape + ndim;
    uint64_t elements = 1;
    int64_t stride = 1;
    bool negative = false, zero = false, overflow = false, stride_overflow = false,
         wrong_stride = false;
    for (uint32_t d = ndim; d-- > 0;) {
      negative |= shape[d] < 0;
      zero |= shape[d] == 0;
      overflow |= __builtin_mul_overflow(elements, static_cast<uint64_t>(shape[d]), &elements);
      wrong_stride |= strides[d] != stride;
      if (d > 0) stride_overflow |= __builtin_mul_overflow(stride, shape[d], &stride);
    }
    if (negative) return ManifestError(Describe(i, name) + ": negative dimension");
    // The same rule as the encoder's: a zero dimension makes the product 0.
    if (overflow && !zero) {
      return ManifestError(Describe(i, name) + ": element count overflows 64 bits");
    }
    if (stride_overflow) return ManifestError(Describe(i, name) + ": a stride overflows int64");
    if (wrong_stride) {
      return ManifestError(Describe(i, name) + ": strides are not the contiguous row-major ones");
    }
    const uint32_t slice_dim_1 = r[14];  // 0: whole, else the slice's dim + 1
    const uint64_t slice_offset = wire::GetU64(r + 48), full_length = wire::GetU64(r + 56);
    if (slice_dim_1 == 0) {
      if (slice_offset != 0 || full_length != 0) {
        return ManifestError(Describe(i, name) +
                             ": a whole tensor has a slice offset or full length");
      }
    } else {
      if (slice_dim_1 > ndim) {
        return ManifestError(Describe(i, name) + ": slice dim " + std::to_string(slice_dim_1 - 1) +
                             " is not below ndim " + std::to_string(ndim));
      }
      const uint64_t length = static_cast<uint64_t>(shape[slice_dim_1 - 1]);
      if (slice_offset > full_length || length > full_length - slice_offset) {
        return ManifestError(Describe(i, name) + ": slice offset " + std::to_string(slice_offset) +
                             " + length " + std::to_string(length) + " exceeds the full dim of " +
                             std::to_string(full_length));
      }
    }
    const uint32_t allocation = wire::GetU32(r + 16);
    if (allocation >= allocation_count) {
      return ManifestError(Describe(i, name) + ": allocation index " + std::to_string(allocation) +
                           " out of range (" + std::to_string(allocation_count) + " allocations)");
    }
    const uint64_t offset = wire::GetU64(r + 24), nbytes = wire::GetU64(r + 32);
    const uint64_t alloc_size = allocation_sizes_[allocation];
    if (offset > alloc_size || nbytes > alloc_size - offset) {
      return ManifestError(Describe(i, name) + ": offset " + std::to_string(offset) + " + nbytes " +
                           std::to_string(nbytes) + " exceeds allocation " +
                           std::to_string(allocation) + " of " + std::to_string(alloc_size) +
                           " bytes");
    }
  }
  return Status::Ok();
}

Result<UniqueFd> CreateManifestMemfd(std::span<const uint8_t> manifest, const std::string& name) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd fd, os::CreateMemfd(name, manifest.size()));
  size_t done = 0;
  while (done < manifest.size()) {
    ssize_t n = ::pwrite(fd.get(), manifest.data() + done, manifest.size() - done,
                         static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return IoError("writing the attach manifest into memfd " + name, errno);
    done += static_cast<size_t>(n);
  }
  WEIGHTCACHE_RETURN_IF_ERROR(os::SealReadOnly(fd.get()));
  return fd;
}

Result<Manifest> MapManifestMemfd(int fd, uint64_t size, RecordCheck check) {
  Status sealed = os::CheckSealedReadOnly(fd);
  if (!sealed.ok()) return sealed.Context("attach manifest memfd");
  if (size < kManifestHeaderSize || size > kMaxManifestSize) {
    return ManifestError("announced size of " + std::to_string(size) + " bytes is outside " +
                         std::to_string(kManifestHeaderSize) + "-" +
                         std::to_string(kMaxManifestSize));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t file_size, os::FileSize(fd));
  // Sealed against shrinking and growing: the size checked here is the size for good.
  if (file_size != size) {
    return ManifestError("memfd holds " + std::to_string(file_size) + " bytes, the reply says " +
                         std::to_string(size));
  }
  // No MAP_POPULATE: shmem read faults map 16 pages at a time (fault-around), which measured
  // cheaper than populating every page up front (docs/benchmarks.md).
  auto region = os::MapReadOnly(fd, size);
  if (!region.ok()) return region.status().Context("mapping the attach manifest");
  return Manifest::DecodeMapped(std::move(region).value(), check);
}

}  // namespace weightcache::protocol
