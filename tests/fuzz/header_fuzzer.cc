// libFuzzer target for the safetensors header parser (checkpoint/safetensors.h), the first
// thing that touches an untrusted checkpoint. Beyond "no crash, no sanitizer report" it
// checks the parser's promises on every header it accepts, so a validation hole is a
// finding too. Build and run: scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <span>

#include "checkpoint/safetensors.h"

namespace {

using weightcache::checkpoint::DTypeByteSize;
using weightcache::checkpoint::ParsedHeader;
using weightcache::checkpoint::ParseSafetensorsHeader;

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

// What an accepted header guarantees (docs/checkpoint.md): sorted tensors tiling the data
// region exactly, each one's size equal to its shape times its dtype.
void CheckInvariants(const ParsedHeader& h, uint64_t file_size) {
  Check(h.data_start == 8 + h.header_len);
  Check(h.data_start + h.data_size == file_size);
  Check(h.header_json.size() == h.header_len);
  uint64_t expected = 0;
  for (const auto& t : h.tensors) {
    Check(!t.name.empty());
    Check(t.begin == expected && t.begin <= t.end && t.end <= h.data_size);
    uint64_t elements = 1;
    for (uint64_t d : t.shape) Check(!__builtin_mul_overflow(elements, d, &elements));
    auto nbytes = DTypeByteSize(t.dtype, elements);
    Check(nbytes.ok() && *nbytes == t.end - t.begin);
    expected = t.end;
  }
  Check(expected == h.data_size);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  // The input as a whole file.
  auto whole = ParseSafetensorsHeader(bytes, size);
  if (whole.ok()) CheckInvariants(*whole, size);
  // The input as the start of a larger file whose data region the header must describe; the
  // extra size comes from the input so the fuzzer can steer it.
  if (size >= 8) {
    const uint64_t file_size = size + data[size - 1] * 4096ull;
    auto prefix = ParseSafetensorsHeader(bytes, file_size);
    if (prefix.ok()) CheckInvariants(*prefix, file_size);
  }
  return 0;
}
