#include "common/hash.h"

// Header-only use: no libxxhash at run time. Not under clang-tidy's analyzer: xxhash states
// its precondition (null input only with length 0) as a no-op XXH_ASSERT, so the analyzer
// walks impossible null-with-length paths inside it; there it sees only the declarations.
#ifndef __clang_analyzer__
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>

namespace weightcache {

// SHA-256 as FIPS 180-4 specifies it, in process. Not OpenSSL's: its first digest in a process
// initialises the library (configuration, the default provider, the algorithm fetch), 0.7-2 ms
// measured on the CI box, which every fresh client's attach paid for a few hundred bytes of
// identity digests (issue 14: a fresh attach in <= 2 ms). The identity hashes are small; the
// largest input, the shard headers of a cold fingerprint (~1 MB at 10,000 tensors), costs a few
// ms more here than with SHA-NI, on a path that parses those headers anyway.
namespace {

constexpr uint32_t kSha256K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr uint32_t kSha256Init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

constexpr uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// One 64-byte block into the state (FIPS 180-4 §6.2.2).
void Sha256Compress(uint32_t state[8], const uint8_t* block) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = uint32_t{block[4 * i]} << 24 | uint32_t{block[4 * i + 1]} << 16 |
           uint32_t{block[4 * i + 2]} << 8 | uint32_t{block[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 =
        h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + kSha256K[i] + w[i];
    const uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
  state[4] += e;
  state[5] += f;
  state[6] += g;
  state[7] += h;
}

}  // namespace

struct Sha256::Ctx {
  uint32_t state[8];
  uint8_t block[64];
  size_t buffered = 0;  // bytes in `block`
  uint64_t total = 0;   // message bytes so far
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  std::copy(std::begin(kSha256Init), std::end(kSha256Init), ctx_->state);
}

Sha256::~Sha256() = default;

void Sha256::Update(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  Ctx& c = *ctx_;
  c.total += size;
  if (c.buffered > 0) {
    const size_t take = std::min(size, sizeof(c.block) - c.buffered);
    std::memcpy(c.block + c.buffered, p, take);
    c.buffered += take;
    p += take;
    size -= take;
    if (c.buffered < sizeof(c.block)) return;
    Sha256Compress(c.state, c.block);
    c.buffered = 0;
  }
  for (; size >= sizeof(c.block); p += sizeof(c.block), size -= sizeof(c.block)) {
    Sha256Compress(c.state, p);
  }
  if (size > 0) std::memcpy(c.block, p, size);
  c.buffered = size;
}

std::string Sha256::FinalHex() {
  Ctx& c = *ctx_;
  // Padding (FIPS 180-4 §5.1.1): 0x80, zeros to 56 mod 64, the message length in bits.
  const uint64_t bits = c.total * 8;
  uint8_t tail[72] = {0x80};
  const size_t pad = (c.buffered < 56 ? 56 : 120) - c.buffered;
  for (int i = 0; i < 8; ++i) tail[pad + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  Update(tail, pad + 8);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (uint32_t word : c.state) {
    for (int shift = 28; shift >= 0; shift -= 4) out.push_back(kHex[(word >> shift) & 0xf]);
  }
  return out;
}

std::string Sha256Hex(std::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.FinalHex();
}

uint64_t Xxh64(const void* data, size_t size, uint64_t seed) { return XXH64(data, size, seed); }

std::string Hex64(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return std::string(buf, 16);
}

}  // namespace weightcache
