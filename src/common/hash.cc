#include "common/hash.h"

#include <openssl/evp.h>
// Header-only use: no libxxhash at run time. Not under clang-tidy's analyzer: xxhash states
// its precondition (null input only with length 0) as a no-op XXH_ASSERT, so the analyzer
// walks impossible null-with-length paths inside it; there it sees only the declarations.
#ifndef __clang_analyzer__
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <cstdio>
#include <stdexcept>

namespace weightcache {

struct Sha256::Ctx {
  EVP_MD_CTX* md = nullptr;
  ~Ctx() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  ctx_->md = EVP_MD_CTX_new();
  // Allocation failure here is an out-of-memory condition the process cannot recover from.
  if (ctx_->md == nullptr || EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1) {
    std::abort();
  }
}

Sha256::~Sha256() = default;

void Sha256::Update(const void* data, size_t size) {
  if (size > 0) EVP_DigestUpdate(ctx_->md, data, size);
}

std::string Sha256::FinalHex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx_->md, digest, &len);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(size_t{len} * 2);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xf]);
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
