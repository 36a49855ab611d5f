#include "protocol/manifest.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
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

// Everything about one entry except name uniqueness. `error` builds the Status (kProtocol when
// decoding, kInvalidArgument when encoding).
// `known_dtype` is a dtype string already checked (the previous record's: dtype names are
// interned in the table, so consecutive records usually point at the same bytes).
template <typename MakeError>
Status ValidateEntry(size_t i, const TensorEntry& t, std::span<const uint64_t> allocations,
                     std::string_view known_dtype, MakeError error) {
  if (t.name.empty()) return error(Describe(i, "") + ": empty name");
  if (t.name.size() > kMaxTensorNameLength) {
    return error(Describe(i, t.name) + ": name of " + std::to_string(t.name.size()) +
                 " bytes exceeds " + std::to_string(kMaxTensorNameLength));
  }
  if (t.dtype.data() != known_dtype.data() || t.dtype.size() != known_dtype.size()) {
    if (!ValidDTypeName(t.dtype)) {
      return error(Describe(i, t.name) + ": invalid dtype name (1-16 bytes of [A-Z0-9_] expected)");
    }
  }
  if (t.ndim > kMaxTensorDims) {
    return error(Describe(i, t.name) + ": ndim " + std::to_string(t.ndim) + " exceeds " +
                 std::to_string(kMaxTensorDims));
  }
  // No division: at 10,000 tensors every nanosecond per record is 10 us of attach.
  uint64_t elements = 1, unused = 0;
  bool overflow = false;
  for (uint32_t d = 0; d < kMaxTensorDims; ++d) {
    if (d >= t.ndim) {
      unused |= t.shape[d];
    } else {
      // Once a dimension is 0 the product stays 0: an overflow only counts before it.
      overflow |= __builtin_mul_overflow(elements, t.shape[d], &elements);
    }
  }
  if (unused != 0) return error(Describe(i, t.name) + ": unused shape dimension not 0");
  if (overflow) return error(Describe(i, t.name) + ": element count overflows 64 bits");
  if (t.allocation >= allocations.size()) {
    return error(Describe(i, t.name) + ": allocation index " + std::to_string(t.allocation) +
                 " out of range (" + std::to_string(allocations.size()) + " allocations)");
  }
  uint64_t alloc_size = allocations[t.allocation];
  if (t.offset > alloc_size || t.nbytes > alloc_size - t.offset) {
    return error(Describe(i, t.name) + ": offset " + std::to_string(t.offset) + " + nbytes " +
                 std::to_string(t.nbytes) + " exceeds allocation " + std::to_string(t.allocation) +
                 " of " + std::to_string(alloc_size) + " bytes");
  }
  return Status::Ok();
}

// The same checks as ValidateEntry for a decoded record (its dtype aside), as one branch-light
// predicate with no Status on the way: the hot loop of Decode calls only this, and ValidateEntry
// runs to name the problem once this says there is one.
inline bool EntryLooksValid(const TensorEntry& t, std::span<const uint64_t> allocations) {
  if (t.name.empty() || t.name.size() > kMaxTensorNameLength || t.ndim > kMaxTensorDims ||
      t.allocation >= allocations.size()) {
    return false;
  }
  uint64_t elements = 1, unused = 0;
  bool overflow = false;
  for (uint32_t d = 0; d < kMaxTensorDims; ++d) {
    if (d >= t.ndim) {
      unused |= t.shape[d];
    } else {
      overflow |= __builtin_mul_overflow(elements, t.shape[d], &elements);
    }
  }
  const uint64_t alloc_size = allocations[t.allocation];
  return unused == 0 && !overflow && t.offset <= alloc_size && t.nbytes <= alloc_size - t.offset;
}

Status ManifestError(const std::string& message) {
  return ProtocolError("attach manifest: " + message);
}
Status EncodeError(const std::string& message) {
  return InvalidArgument("cannot encode attach manifest: " + message);
}

}  // namespace

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
  }
  return "unknown";
}

Result<Tier> ParseTier(std::string_view name) {
  if (name == "gpu") return Tier::kGpu;
  if (name == "host") return Tier::kHost;
  return ProtocolError("unknown tier \"" + std::string(name.substr(0, 32)) + "\"");
}

Result<std::vector<uint8_t>> EncodeManifest(Tier tier, std::span<const uint64_t> allocation_sizes,
                                            std::span<const TensorEntry> tensors) {
  if (tier != Tier::kGpu && tier != Tier::kHost) return EncodeError("unknown tier");
  if (allocation_sizes.size() > kMaxAllocations) {
    return EncodeError(std::to_string(allocation_sizes.size()) + " allocations exceed the " +
                       std::to_string(kMaxAllocations) +
                       " one AttachReply can carry (one fd is the manifest's)");
  }
  for (size_t a = 0; a < allocation_sizes.size(); ++a) {
    if (allocation_sizes[a] == 0)
      return EncodeError("allocation " + std::to_string(a) + " is empty");
  }
  if (tensors.size() > UINT32_MAX) return EncodeError("too many tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(ValidateEntry(i, tensors[i], allocation_sizes, {}, EncodeError));
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

  // The string table: names in record order, dtype names interned (a handful of distinct ones).
  std::string table;
  std::vector<std::pair<std::string_view, uint32_t>> dtypes;
  std::vector<uint32_t> name_offsets(tensors.size()), dtype_offsets(tensors.size());
  for (uint32_t i : order) {
    name_offsets[i] = static_cast<uint32_t>(table.size());
    table.append(tensors[i].name);
    uint32_t off = UINT32_MAX;
    for (const auto& [name, at] : dtypes) {
      if (name == tensors[i].dtype) off = at;
    }
    if (off == UINT32_MAX) {
      off = static_cast<uint32_t>(table.size());
      table.append(tensors[i].dtype);
      dtypes.emplace_back(tensors[i].dtype, off);
    }
    dtype_offsets[i] = off;
    if (table.size() > kMaxManifestSize) return EncodeError("string table too large");
  }
  uint64_t total = kManifestHeaderSize + allocation_sizes.size() * kManifestAllocationSize +
                   tensors.size() * kManifestTensorSize + table.size();
  if (total > kMaxManifestSize) {
    return EncodeError(std::to_string(total) + " bytes exceed the " +
                       std::to_string(kMaxManifestSize) + "-byte manifest limit");
  }

  std::vector<uint8_t> out;
  out.reserve(total);
  out.insert(out.end(), std::begin(kManifestMagic), std::end(kManifestMagic));
  wire::PutU8(out, static_cast<uint8_t>(tier));
  for (int r = 0; r < 3; ++r) wire::PutU8(out, 0);
  wire::PutU32(out, static_cast<uint32_t>(allocation_sizes.size()));
  wire::PutU32(out, static_cast<uint32_t>(tensors.size()));
  wire::PutU32(out, static_cast<uint32_t>(table.size()));
  wire::PutU32(out, 0);
  for (uint64_t size : allocation_sizes) wire::PutU64(out, size);
  for (uint32_t i : order) {
    const TensorEntry& t = tensors[i];
    wire::PutU32(out, name_offsets[i]);
    wire::PutU32(out, static_cast<uint32_t>(t.name.size()));
    wire::PutU32(out, dtype_offsets[i]);
    wire::PutU32(out, static_cast<uint32_t>(t.dtype.size()));
    wire::PutU32(out, t.allocation);
    wire::PutU8(out, static_cast<uint8_t>(t.ndim));
    for (int r = 0; r < 3; ++r) wire::PutU8(out, 0);
    wire::PutU64(out, t.offset);
    wire::PutU64(out, t.nbytes);
    wire::PutU64(out, t.checksum);
    for (uint64_t d : t.shape) wire::PutU64(out, d);
  }
  out.insert(out.end(), table.begin(), table.end());
  return out;
}

Result<Manifest> Manifest::Decode(std::span<const uint8_t> bytes) {
  Manifest m;
  m.owned_ = std::make_unique_for_overwrite<uint8_t[]>(std::max<size_t>(bytes.size(), 1));
  std::memcpy(m.owned_.get(), bytes.data(), bytes.size());
  m.bytes_ = std::span<const uint8_t>(m.owned_.get(), bytes.size());
  WEIGHTCACHE_RETURN_IF_ERROR(m.Validate());
  return m;
}

Result<Manifest> Manifest::DecodeMapped(os::MappedRegion region) {
  Manifest m;
  m.mapped_ = std::move(region);
  m.bytes_ =
      std::span<const uint8_t>(static_cast<const uint8_t*>(m.mapped_.data()), m.mapped_.size());
  WEIGHTCACHE_RETURN_IF_ERROR(m.Validate());
  return m;
}

TensorEntry Manifest::tensor(size_t i) const {
  const uint8_t* r = records_ + i * kManifestTensorSize;
  TensorEntry t;
  t.name = std::string_view(strings_ + wire::GetU32(r), wire::GetU32(r + 4));
  t.dtype = std::string_view(strings_ + wire::GetU32(r + 8), wire::GetU32(r + 12));
  t.allocation = wire::GetU32(r + 16);
  t.ndim = r[20];
  t.offset = wire::GetU64(r + 24);
  t.nbytes = wire::GetU64(r + 32);
  t.checksum = wire::GetU64(r + 40);
  for (uint32_t d = 0; d < kMaxTensorDims; ++d) t.shape[d] = wire::GetU64(r + 48 + size_t{8} * d);
  return t;
}

// One pass over the records, no allocation per tensor: each record is read into a
// TensorEntry on the stack, checked, and its name compared with the previous one.
Status Manifest::Validate() {
  std::span<const uint8_t> payload = bytes_;
  if (payload.size() < kManifestHeaderSize) {
    return ManifestError("truncated header (" + std::to_string(payload.size()) + " of " +
                         std::to_string(kManifestHeaderSize) + " bytes)");
  }
  const uint8_t* p = payload.data();
  if (std::memcmp(p, kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return ManifestError("bad magic (expected \"WCMF\")");
  }
  uint8_t tier = p[4];
  if (tier != static_cast<uint8_t>(Tier::kGpu) && tier != static_cast<uint8_t>(Tier::kHost)) {
    return ManifestError("unknown tier code " + std::to_string(tier));
  }
  if (p[5] != 0 || p[6] != 0 || p[7] != 0 || wire::GetU32(p + 20) != 0) {
    return ManifestError("reserved header bytes are not 0");
  }
  uint32_t allocation_count = wire::GetU32(p + 8);
  uint32_t tensor_count = wire::GetU32(p + 12);
  uint32_t table_size = wire::GetU32(p + 16);
  if (allocation_count > kMaxAllocations) {
    return ManifestError(std::to_string(allocation_count) + " allocations exceed the limit of " +
                         std::to_string(kMaxAllocations));
  }
  // 32-bit counts times small record sizes cannot overflow 64 bits.
  uint64_t expected = kManifestHeaderSize + uint64_t{allocation_count} * kManifestAllocationSize +
                      uint64_t{tensor_count} * kManifestTensorSize + table_size;
  if (expected != payload.size()) {
    return ManifestError("header describes " + std::to_string(expected) + " bytes (" +
                         std::to_string(allocation_count) + " allocations, " +
                         std::to_string(tensor_count) + " tensors, " + std::to_string(table_size) +
                         "-byte string table) but the manifest has " +
                         std::to_string(payload.size()));
  }
  tier_ = static_cast<Tier>(tier);
  const uint8_t* alloc_p = p + kManifestHeaderSize;
  allocation_sizes_.resize(allocation_count);
  for (uint32_t a = 0; a < allocation_count; ++a) {
    allocation_sizes_[a] = wire::GetU64(alloc_p + a * kManifestAllocationSize);
    if (allocation_sizes_[a] == 0) {
      return ManifestError("allocation " + std::to_string(a) + " has size 0");
    }
  }
  records_ = alloc_p + uint64_t{allocation_count} * kManifestAllocationSize;
  strings_ = reinterpret_cast<const char*>(records_ + uint64_t{tensor_count} * kManifestTensorSize);
  tensor_count_ = tensor_count;

  auto string_ok = [&](const uint8_t* at) {
    uint32_t offset = wire::GetU32(at), length = wire::GetU32(at + 4);
    return offset <= table_size && length <= table_size - offset;
  };
  auto string_error = [&](size_t i, const uint8_t* at, const char* what) {
    uint32_t offset = wire::GetU32(at), length = wire::GetU32(at + 4);
    return ManifestError(Describe(i, "") + ": " + what + " (offset " + std::to_string(offset) +
                         ", length " + std::to_string(length) +
                         ") lies outside the string table of " + std::to_string(table_size) +
                         " bytes");
  };
  std::string_view previous, known_dtype;
  name_bytes_ = 0;
  dim_count_ = 0;
  for (uint32_t i = 0; i < tensor_count; ++i) {
    const uint8_t* r = records_ + uint64_t{i} * kManifestTensorSize;
    // Strings first: tensor(i) may only build views that lie inside the table.
    if (!string_ok(r)) return string_error(i, r, "name");
    if (!string_ok(r + 8)) return string_error(i, r + 8, "dtype");
    const TensorEntry t = tensor(i);
    if (r[21] != 0 || r[22] != 0 || r[23] != 0) {
      return ManifestError(Describe(i, t.name) + ": reserved bytes are not 0");
    }
    // Dtype names are interned: a record pointing at the bytes already checked skips the
    // character check.
    const bool dtype_known =
        t.dtype.data() == known_dtype.data() && t.dtype.size() == known_dtype.size();
    if (!dtype_known || !EntryLooksValid(t, allocation_sizes_)) {
      WEIGHTCACHE_RETURN_IF_ERROR(
          ValidateEntry(i, t, allocation_sizes_, known_dtype, ManifestError));
      known_dtype = t.dtype;
    }
    name_bytes_ += t.name.size();
    dim_count_ += t.ndim;
    if (i > 0 && !(previous < t.name)) {
      return ManifestError(Describe(i, t.name) +
                           (previous == t.name
                                ? ": duplicate name (also tensor " + std::to_string(i - 1) + ")"
                                : ": names out of ascending byte order (after '" +
                                      std::string(previous.substr(0, 200)) + "')"));
    }
    previous = t.name;
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

Result<Manifest> MapManifestMemfd(int fd, uint64_t size) {
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
  return Manifest::DecodeMapped(std::move(region).value());
}

}  // namespace weightcache::protocol
