#include "checkpoint/dtype.h"

#include <string>

namespace weightcache::checkpoint {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "BOOL";
    case DType::kF4:
      return "F4";
    case DType::kF6E2M3:
      return "F6_E2M3";
    case DType::kF6E3M2:
      return "F6_E3M2";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E8M0:
      return "F8_E8M0";
    case DType::kF8E4M3Fnuz:
      return "F8_E4M3FNUZ";
    case DType::kF8E5M2Fnuz:
      return "F8_E5M2FNUZ";
    case DType::kI16:
      return "I16";
    case DType::kU16:
      return "U16";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kU32:
      return "U32";
    case DType::kF32:
      return "F32";
    case DType::kC64:
      return "C64";
    case DType::kF64:
      return "F64";
    case DType::kI64:
      return "I64";
    case DType::kU64:
      return "U64";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  // 22 entries: a linear scan is as fast as a map and needs no static initialisation.
  for (DType d : kAllDTypes) {
    if (DTypeName(d) == name) return d;
  }
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
