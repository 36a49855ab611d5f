// Hashing: SHA-256 (Nettle: no process-wide initialisation, so a fresh client pays nothing for
// its first digest) for identities and digests, XXH64 (libxxhash) for content checksums.
// Objects are single-threaded; the free functions are thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace weightcache {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t size);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  // Finish and return the 64-char lowercase hex digest. The object is spent afterwards.
  std::string FinalHex();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

std::string Sha256Hex(std::string_view data);

uint64_t Xxh64(const void* data, size_t size, uint64_t seed = 0);
// 16-char lowercase hex of a 64-bit value.
std::string Hex64(uint64_t value);

}  // namespace weightcache
