#include "common/hash.h"

#include <nettle/sha2.h>
// Header-only use: no libxxhash at run time. Not under clang-tidy's analyzer: xxhash states
// its precondition (null input only with length 0) as a no-op XXH_ASSERT, so the analyzer
// walks impossible null-with-length paths inside it; there it sees only the declarations.
#ifndef __clang_analyzer__
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <cstdio>

namespace weightcache {

struct Sha256::Ctx {
  sha256_ctx state;
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) { sha256_init(&ctx_->state); }

Sha256::~Sha256() = default;

void Sha256::Update(const void* data, size_t size) {
  if (size > 0) sha256_update(&ctx_->state, size, static_cast<const uint8_t*>(data));
}

std::string Sha256::FinalHex() {
  uint8_t digest[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx_->state, sizeof(digest), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(sizeof(digest) * 2);
  for (const uint8_t byte : digest) {
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xf]);
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
