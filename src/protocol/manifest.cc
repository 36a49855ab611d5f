#include "protocol/manifest.h"

#include <cstring>
#include <string>

#include "common/hash.h"
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
template <typename MakeError>
Status ValidateEntry(size_t i, const TensorEntry& t, std::span<const uint64_t> allocations,
                     MakeError error) {
  if (t.name.empty()) return error(Describe(i, "") + ": empty name");
  if (t.name.size() > kMaxTensorNameLength) {
    return error(Describe(i, t.name) + ": name of " + std::to_string(t.name.size()) +
                 " bytes exceeds " + std::to_string(kMaxTensorNameLength));
  }
  if (!ValidDTypeName(t.dtype)) {
    return error(Describe(i, t.name) + ": invalid dtype name (1-16 bytes of [A-Z0-9_] expected)");
  }
  if (t.ndim > kMaxTensorDims) {
    return error(Describe(i, t.name) + ": ndim " + std::to_string(t.ndim) + " exceeds " +
                 std::to_string(kMaxTensorDims));
  }
  uint64_t elements = 1;
  for (uint32_t d = 0; d < kMaxTensorDims; ++d) {
    if (d >= t.ndim) {
      if (t.shape[d] != 0) return error(Describe(i, t.name) + ": unused shape dimension not 0");
      continue;
    }
    if (t.shape[d] != 0 && elements > UINT64_MAX / t.shape[d]) {
      return error(Describe(i, t.name) + ": element count overflows 64 bits");
    }
    elements *= t.shape[d];
  }
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

// Open-addressing set of tensor names: one flat array, no allocation per name, so checking
// 10,000 names for duplicates costs tens of microseconds.
class NameSet {
 public:
  explicit NameSet(size_t count) {
    size_t capacity = 16;
    while (capacity < count * 2) capacity *= 2;
    slots_.assign(capacity, kEmpty);
    names_.reserve(count);
  }
  // False if `name` is already present (the index of the earlier one in *previous).
  bool Insert(std::string_view name, size_t* previous) {
    size_t mask = slots_.size() - 1;
    size_t pos = Xxh64(name.data(), name.size()) & mask;
    while (slots_[pos] != kEmpty) {
      if (names_[slots_[pos]] == name) {
        *previous = slots_[pos];
        return false;
      }
      pos = (pos + 1) & mask;
    }
    slots_[pos] = static_cast<uint32_t>(names_.size());
    names_.push_back(name);
    return true;
  }

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  std::vector<uint32_t> slots_;
  std::vector<std::string_view> names_;
};

template <typename MakeError>
Status CheckUniqueNames(std::span<const TensorEntry> tensors, MakeError error) {
  NameSet names(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    size_t previous = 0;
    if (!names.Insert(tensors[i].name, &previous)) {
      return error(Describe(i, tensors[i].name) + ": duplicate name (also tensor " +
                   std::to_string(previous) + ")");
    }
  }
  return Status::Ok();
}

Status ManifestError(std::string message) { return ProtocolError("attach manifest: " + message); }
Status EncodeError(std::string message) {
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
  if (allocation_sizes.size() > kMaxFdsPerFrame) {
    return EncodeError(std::to_string(allocation_sizes.size()) + " allocations exceed the " +
                       std::to_string(kMaxFdsPerFrame) + " fds one frame can carry");
  }
  for (size_t a = 0; a < allocation_sizes.size(); ++a) {
    if (allocation_sizes[a] == 0)
      return EncodeError("allocation " + std::to_string(a) + " is empty");
  }
  if (tensors.size() > UINT32_MAX) return EncodeError("too many tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(ValidateEntry(i, tensors[i], allocation_sizes, EncodeError));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckUniqueNames(tensors, EncodeError));

  // The string table: names in order, dtype names interned (a handful of distinct ones).
  std::string table;
  std::vector<std::pair<std::string_view, uint32_t>> dtypes;
  std::vector<uint32_t> name_offsets(tensors.size()), dtype_offsets(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
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
    if (table.size() > kMaxAttachReplyPayload) return EncodeError("string table too large");
  }
  uint64_t total = kManifestHeaderSize + allocation_sizes.size() * kManifestAllocationSize +
                   tensors.size() * kManifestTensorSize + table.size();
  if (total > kMaxAttachReplyPayload) {
    return EncodeError(std::to_string(total) + " bytes exceed the " +
                       std::to_string(kMaxAttachReplyPayload) + "-byte AttachReply limit");
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
  for (size_t i = 0; i < tensors.size(); ++i) {
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

Result<Manifest> Manifest::Decode(std::span<const uint8_t> payload) {
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
  if (allocation_count > kMaxFdsPerFrame) {
    return ManifestError(std::to_string(allocation_count) + " allocations exceed the limit of " +
                         std::to_string(kMaxFdsPerFrame));
  }
  // 32-bit counts times small record sizes cannot overflow 64 bits.
  uint64_t expected = kManifestHeaderSize + uint64_t{allocation_count} * kManifestAllocationSize +
                      uint64_t{tensor_count} * kManifestTensorSize + table_size;
  if (expected != payload.size()) {
    return ManifestError("header describes " + std::to_string(expected) + " bytes (" +
                         std::to_string(allocation_count) + " allocations, " +
                         std::to_string(tensor_count) + " tensors, " + std::to_string(table_size) +
                         "-byte string table) but the payload has " +
                         std::to_string(payload.size()));
  }

  Manifest m;
  m.tier_ = static_cast<Tier>(tier);
  const uint8_t* alloc_p = p + kManifestHeaderSize;
  m.allocation_sizes_.resize(allocation_count);
  for (uint32_t a = 0; a < allocation_count; ++a) {
    m.allocation_sizes_[a] = wire::GetU64(alloc_p + a * kManifestAllocationSize);
    if (m.allocation_sizes_[a] == 0) {
      return ManifestError("allocation " + std::to_string(a) + " has size 0");
    }
  }
  const uint8_t* tensor_p = alloc_p + uint64_t{allocation_count} * kManifestAllocationSize;
  const uint8_t* table_p = tensor_p + uint64_t{tensor_count} * kManifestTensorSize;
  m.strings_ = std::make_unique<char[]>(table_size == 0 ? 1 : table_size);
  std::memcpy(m.strings_.get(), table_p, table_size);

  auto string_at = [&](size_t i, uint32_t offset, uint32_t length, const char* what,
                       std::string_view* out) -> Status {
    if (offset > table_size || length > table_size - offset) {
      return ManifestError(Describe(i, "") + ": " + what + " (offset " + std::to_string(offset) +
                           ", length " + std::to_string(length) +
                           ") lies outside the string table of " + std::to_string(table_size) +
                           " bytes");
    }
    *out = std::string_view(m.strings_.get() + offset, length);
    return Status::Ok();
  };

  m.tensors_.resize(tensor_count);
  for (uint32_t i = 0; i < tensor_count; ++i) {
    const uint8_t* r = tensor_p + uint64_t{i} * kManifestTensorSize;
    TensorEntry& t = m.tensors_[i];
    WEIGHTCACHE_RETURN_IF_ERROR(
        string_at(i, wire::GetU32(r), wire::GetU32(r + 4), "name", &t.name));
    WEIGHTCACHE_RETURN_IF_ERROR(
        string_at(i, wire::GetU32(r + 8), wire::GetU32(r + 12), "dtype", &t.dtype));
    t.allocation = wire::GetU32(r + 16);
    t.ndim = r[20];
    if (r[21] != 0 || r[22] != 0 || r[23] != 0) {
      return ManifestError(Describe(i, t.name) + ": reserved bytes are not 0");
    }
    t.offset = wire::GetU64(r + 24);
    t.nbytes = wire::GetU64(r + 32);
    t.checksum = wire::GetU64(r + 40);
    for (uint32_t d = 0; d < kMaxTensorDims; ++d) t.shape[d] = wire::GetU64(r + 48 + 8 * d);
    WEIGHTCACHE_RETURN_IF_ERROR(ValidateEntry(i, t, m.allocation_sizes_, ManifestError));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckUniqueNames(m.tensors_, ManifestError));
  return m;
}

}  // namespace weightcache::protocol
