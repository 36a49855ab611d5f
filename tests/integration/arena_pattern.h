// The bytes an arena source of the fleet transport tests serves: a function of a seed and the
// offset in the arena, so that a test can tell which source served which stripe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace weightcache::testing {

// splitmix64 of (seed, 8-byte word index): a different word at every offset and seed.
inline uint64_t PatternWord(uint64_t seed, uint64_t word) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + word + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Writes the pattern of bytes [offset, offset + bytes) of the arena at `out`.
inline void FillPattern(uint64_t seed, uint64_t offset, uint8_t* out, size_t bytes) {
  for (size_t i = 0; i < bytes;) {
    const uint64_t at = offset + i;
    const uint64_t word = PatternWord(seed, at / 8);
    const size_t in_word = at % 8;
    const size_t n = bytes - i < 8 - in_word ? bytes - i : 8 - in_word;
    std::memcpy(out + i, reinterpret_cast<const uint8_t*>(&word) + in_word, n);
    i += n;
  }
}

// Whether `data` holds the pattern of [offset, offset + bytes).
inline bool MatchesPattern(uint64_t seed, uint64_t offset, const uint8_t* data, size_t bytes) {
  uint8_t chunk[4096];
  for (size_t i = 0; i < bytes; i += sizeof(chunk)) {
    const size_t n = bytes - i < sizeof(chunk) ? bytes - i : sizeof(chunk);
    FillPattern(seed, offset + i, chunk, n);
    if (std::memcmp(chunk, data + i, n) != 0) return false;
  }
  return true;
}

}  // namespace weightcache::testing
