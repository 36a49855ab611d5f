// XXH64, written once for two compilers: nvcc builds it into the checksum kernel
// (kernels/checksum.cu) and the host compiler builds it into the unit test that proves it equals
// libxxhash's XXH64 bit for bit (tests/unit/cuda/checksum_test.cc). Keeping one copy is the
// point: a kernel that cannot be run in CI is only trustworthy if its arithmetic is tested on
// the host.
//
// Header-only, no state, no allocation; every function is pure and thread-safe. Little-endian
// only (x86-64, aarch64 and every CUDA GPU are).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define WEIGHTCACHE_HD __host__ __device__ __forceinline__
#define WEIGHTCACHE_UNROLL _Pragma("unroll")
#else
#define WEIGHTCACHE_HD inline
#define WEIGHTCACHE_UNROLL
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "weightcache checksums assume a little-endian host"
#endif

namespace weightcache::cuda::xxh64 {

inline constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

WEIGHTCACHE_HD uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

WEIGHTCACHE_HD uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kPrime2;
  acc = Rotl(acc, 31);
  return acc * kPrime1;
}

WEIGHTCACHE_HD uint64_t MergeRound(uint64_t acc, uint64_t val) {
  acc ^= Round(0, val);
  return acc * kPrime1 + kPrime4;
}

WEIGHTCACHE_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

// Little-endian loads from any address, assembled byte by byte (never faults on misalignment).
WEIGHTCACHE_HD uint64_t LoadBytes64(const uint8_t* p) {
  uint64_t v = 0;
  WEIGHTCACHE_UNROLL
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
WEIGHTCACHE_HD uint32_t LoadBytes32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// How the 32-byte stripes are read. kVector16 needs a 16-byte aligned start: on the GPU each
// thread then issues 128-bit loads (ld.global.nc.v2.u64), so every 32-byte DRAM sector it
// touches is consumed whole; kBytewise works from any address.
enum class Access { kVector16, kBytewise };

template <Access kAccess>
WEIGHTCACHE_HD void Load2x64(const uint8_t* p, uint64_t& a, uint64_t& b) {
  if constexpr (kAccess == Access::kVector16) {
#if defined(__CUDA_ARCH__)
    const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(p));
    a = v.x;
    b = v.y;
#else
    memcpy(&a, p, 8);
    memcpy(&b, p + 8, 8);
#endif
  } else {
    a = LoadBytes64(p);
    b = LoadBytes64(p + 8);
  }
}

// The four accumulators of XXH64's bulk loop.
struct Lanes {
  uint64_t v1, v2, v3, v4;

  WEIGHTCACHE_HD explicit Lanes(uint64_t seed)
      : v1(seed + kPrime1 + kPrime2), v2(seed + kPrime2), v3(seed), v4(seed - kPrime1) {}

  WEIGHTCACHE_HD void Stripe(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    v1 = Round(v1, a);
    v2 = Round(v2, b);
    v3 = Round(v3, c);
    v4 = Round(v4, d);
  }

  WEIGHTCACHE_HD uint64_t Converge() const {
    uint64_t h = Rotl(v1, 1) + Rotl(v2, 7) + Rotl(v3, 12) + Rotl(v4, 18);
    h = MergeRound(h, v1);
    h = MergeRound(h, v2);
    h = MergeRound(h, v3);
    return MergeRound(h, v4);
  }
};

// The < 32 trailing bytes and the final mix.
WEIGHTCACHE_HD uint64_t Tail(uint64_t h, const uint8_t* p, uint64_t len) {
  while (len >= 8) {
    h ^= Round(0, LoadBytes64(p));
    h = Rotl(h, 27) * kPrime1 + kPrime4;
    p += 8;
    len -= 8;
  }
  if (len >= 4) {
    h ^= static_cast<uint64_t>(LoadBytes32(p)) * kPrime1;
    h = Rotl(h, 23) * kPrime2 + kPrime3;
    p += 4;
    len -= 4;
  }
  while (len > 0) {
    h ^= (*p) * kPrime5;
    h = Rotl(h, 11) * kPrime1;
    ++p;
    --len;
  }
  return Avalanche(h);
}

// XXH64(p, len, seed), identical to libxxhash's result. The bulk loop reads four stripes
// (128 bytes) before hashing them, so a GPU thread has eight independent 16-byte loads in
// flight: with one thread per chunk, that memory-level parallelism is what hides DRAM latency.
template <Access kAccess>
WEIGHTCACHE_HD uint64_t Hash(const uint8_t* p, uint64_t len, uint64_t seed) {
  uint64_t h;
  const uint64_t stripes = len / 32;
  if (stripes > 0) {
    Lanes lanes(seed);
    uint64_t s = 0;
    for (; s + 4 <= stripes; s += 4) {
      uint64_t w[16];
      WEIGHTCACHE_UNROLL
      for (int k = 0; k < 8; ++k) Load2x64<kAccess>(p + s * 32 + k * 16, w[2 * k], w[2 * k + 1]);
      WEIGHTCACHE_UNROLL
      for (int k = 0; k < 4; ++k) lanes.Stripe(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
    for (; s < stripes; ++s) {
      uint64_t a, b, c, d;
      Load2x64<kAccess>(p + s * 32, a, b);
      Load2x64<kAccess>(p + s * 32 + 16, c, d);
      lanes.Stripe(a, b, c, d);
    }
    h = lanes.Converge();
  } else {
    h = seed + kPrime5;
  }
  h += len;
  return Tail(h, p + stripes * 32, len % 32);
}

}  // namespace weightcache::cuda::xxh64
