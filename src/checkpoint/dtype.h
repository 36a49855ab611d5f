// Element types of the safetensors format.
//
// Contract: the set of DType values is exactly the set of dtype strings the reference
// safetensors implementation (Rust crate + Python binding 0.8) accepts in a header; nothing
// more, so a file we accept is a file the reference loads. Sub-byte types (F4, F6_*) have a
// bit width that is not a multiple of 8: a tensor's byte size is elements * bits / 8 and the
// format requires that product to be a whole number of bytes (DTypeByteSize reports an error
// otherwise). All functions are pure and thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "weightcache/enum_names.h"
#include "weightcache/status.h"

namespace weightcache::checkpoint {

enum class DType : uint8_t {
  kBool,
  kF4,      // MXFP4 E2M1, two per byte
  kF6E2M3,  // MXFP6, four per three bytes
  kF6E3M2,  // MXFP6
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,      // MX scale format
  kF8E4M3Fnuz,  // AMD fp8 variants
  kF8E5M2Fnuz,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,  // complex with two F32 parts
  kF64,
  kI64,
  kU64,
};

// The header spelling of each DType (the safetensors format's names).
inline constexpr std::array<EnumName<DType>, 22> kDTypeNames{{
    {DType::kBool, "BOOL"},
    {DType::kF4, "F4"},
    {DType::kF6E2M3, "F6_E2M3"},
    {DType::kF6E3M2, "F6_E3M2"},
    {DType::kU8, "U8"},
    {DType::kI8, "I8"},
    {DType::kF8E5M2, "F8_E5M2"},
    {DType::kF8E4M3, "F8_E4M3"},
    {DType::kF8E8M0, "F8_E8M0"},
    {DType::kF8E4M3Fnuz, "F8_E4M3FNUZ"},
    {DType::kF8E5M2Fnuz, "F8_E5M2FNUZ"},
    {DType::kI16, "I16"},
    {DType::kU16, "U16"},
    {DType::kF16, "F16"},
    {DType::kBF16, "BF16"},
    {DType::kI32, "I32"},
    {DType::kU32, "U32"},
    {DType::kF32, "F32"},
    {DType::kC64, "C64"},
    {DType::kF64, "F64"},
    {DType::kI64, "I64"},
    {DType::kU64, "U64"},
}};
static_assert(IsDenseEnumTable(kDTypeNames));
static_assert(kDTypeNames.back().value == DType::kU64, "every DType has its name");

// Every DType, in declaration order (tests and tools iterate over it).
inline constexpr auto kAllDTypes = ValuesIn(kDTypeNames);

// The header spelling: "BF16", "F8_E4M3", "F6_E2M3", ...; "?" outside the enum.
std::string_view DTypeName(DType dtype);

// Inverse of DTypeName (exact, case-sensitive, as the reference parser is). kInvalidCheckpoint
// naming the string for anything else.
Result<DType> ParseDType(std::string_view name);

// Bits per element: 4, 6, 8, 16, 32 or 64.
uint32_t DTypeBits(DType dtype);

// Bytes occupied by `elements` elements: kInvalidCheckpoint when elements * bits overflows
// 64 bits or is not a whole number of bytes (sub-byte types).
Result<uint64_t> DTypeByteSize(DType dtype, uint64_t elements);

}  // namespace weightcache::checkpoint
