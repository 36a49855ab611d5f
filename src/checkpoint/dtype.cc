#include "checkpoint/dtype.h"

#include <string>

namespace weightcache::checkpoint {

std::string_view DTypeName(DType dtype) { return NameIn(kDTypeNames, dtype, "?"); }

Result<DType> ParseDType(std::string_view name) {
  if (auto dtype = ParseIn(kDTypeNames, name)) return *dtype;
  std::string shown(name.substr(0, 64));
  return InvalidCheckpoint("unknown dtype \"" + shown + "\"");
}

uint32_t DTypeBits(DType dtype) {
  switch (dtype) {
    case DType::kF4:
      return 4;
    case DType::kF6E2M3:
    case DType::kF6E3M2:
      return 6;
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
    case DType::kF8E5M2:
    case DType::kF8E4M3:
    case DType::kF8E8M0:
    case DType::kF8E4M3Fnuz:
    case DType::kF8E5M2Fnuz:
      return 8;
    case DType::kI16:
    case DType::kU16:
    case DType::kF16:
    case DType::kBF16:
      return 16;
    case DType::kI32:
    case DType::kU32:
    case DType::kF32:
      return 32;
    case DType::kC64:
    case DType::kF64:
    case DType::kI64:
    case DType::kU64:
      return 64;
  }
  return 0;
}

Result<uint64_t> DTypeByteSize(DType dtype, uint64_t elements) {
  uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, uint64_t{DTypeBits(dtype)}, &bits)) {
    return InvalidCheckpoint("size overflow: " + std::to_string(elements) + " elements of " +
                             std::string(DTypeName(dtype)));
  }
  if (bits % 8 != 0) {
    return InvalidCheckpoint("misaligned sub-byte tensor: " + std::to_string(elements) +
                             " elements of " + std::string(DTypeName(dtype)) + " are " +
                             std::to_string(bits) + " bits, not a whole number of bytes");
  }
  return bits / 8;
}

}  // namespace weightcache::checkpoint
