// Pure parser and validator of a safetensors file header: no I/O, no allocation beyond the
// result, safe on arbitrary bytes (fuzzed by tests/fuzz/header_fuzzer.cc).
//
// File layout: 8-byte little-endian N, N bytes of UTF-8 JSON, then the data region. The JSON
// maps tensor name -> {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
// the data region) plus an optional "__metadata__" string->string map.
//
// Contract: a header is accepted only if the reference implementation (safetensors 0.8)
// would load it, and it is refused with kInvalidCheckpoint and a message naming the tensor
// or field in every case listed in docs/checkpoint.md (size bounds, JSON shape, dtypes,
// offsets that do not tile the data region exactly, shape/size mismatch, overflow, duplicate
// names). Deliberately stricter than the reference in three places, each of which the
// reference silently tolerates: duplicate keys (it keeps one), empty or over-long tensor
// names, and the bounds of checkpoint/limits.h (rank, name length, tensor count, name bytes).
// Unknown fields inside a tensor entry are ignored, as the reference does. All functions are
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/dtype.h"
#include "checkpoint/limits.h"
#include "weightcache/status.h"

namespace weightcache::checkpoint {

// The reference implementation's bound on N (safetensors MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Bytes of the length prefix.
inline constexpr uint64_t kHeaderPrefixBytes = 8;
// Our own bounds (the reference has none) are in checkpoint/limits.h: name length, rank,
// tensor count and total name bytes of one header are checked here, while it is parsed.

struct ParsedTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // relative to the start of the data region
  uint64_t end = 0;    // exclusive; end - begin == byte size
};

struct ParsedHeader {
  uint64_t header_len = 0;  // N
  uint64_t data_start = 0;  // 8 + N: absolute offset of the data region in the file
  uint64_t data_size = 0;   // file_size - data_start, exactly covered by the tensors
  // Sorted by (begin, end, name): the on-disk order, which tiles [0, data_size).
  std::vector<ParsedTensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent/null
  std::string header_json;                      // the N raw header bytes (fingerprints)
};

// Reads N from the first 8 bytes and checks it against kMaxHeaderBytes and file_size.
// Returns N; the caller then reads 8 + N bytes and calls ParseSafetensorsHeader.
Result<uint64_t> ParseHeaderLength(std::span<const uint8_t> first_bytes, uint64_t file_size);

// Parses and validates the header. `first_bytes_of_file` must hold at least the first 8 + N
// bytes of the file (more is ignored); `file_size` is the size of the whole file, used to
// check that the tensors tile the data region exactly. Fewer than 8 + N bytes while the file
// holds them is a caller error (kInvalidArgument); every defect of the file itself is
// kInvalidCheckpoint.
Result<ParsedHeader> ParseSafetensorsHeader(std::span<const uint8_t> first_bytes_of_file,
                                            uint64_t file_size);

}  // namespace weightcache::checkpoint
