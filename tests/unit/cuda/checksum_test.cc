// The content checksum (common/checksum.h) against a reference written straight from its
// definition, and the kernel's XXH64 (kernels/xxh64_core.h) against libxxhash.
#include "common/checksum.h"

#include <gtest/gtest.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/hash.h"
#include "cuda/kernels/xxh64_core.h"

namespace weightcache::cuda {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// The definition, spelled out with nothing shared with the implementation but XXH64.
uint64_t ReferenceChecksum(const uint8_t* data, size_t size) {
  std::vector<uint8_t> le;
  for (size_t off = 0; off < size; off += 256 * 1024) {
    const size_t n = std::min<size_t>(256 * 1024, size - off);
    const uint64_t h = XXH64(data + off, n, 0);
    for (int i = 0; i < 8; ++i) le.push_back(static_cast<uint8_t>(h >> (8 * i)));
  }
  return XXH64(le.data(), le.size(), 0);
}

const size_t kAwkwardSizes[] = {0,
                                1,
                                7,
                                31,
                                32,
                                33,
                                kChecksumChunkBytes - 1,
                                kChecksumChunkBytes,
                                kChecksumChunkBytes + 1,
                                3 * kChecksumChunkBytes,
                                3 * kChecksumChunkBytes + 13};

TEST(ChecksumTest, EmptyTensorIsXxh64OfNothing) {
  EXPECT_EQ(ChecksumChunkCount(0), 0u);
  EXPECT_EQ(TensorChecksum(nullptr, 0), 0xEF46DB3751D8E999ULL);
}

TEST(ChecksumTest, ChunkCountRoundsUp) {
  EXPECT_EQ(ChecksumChunkCount(1), 1u);
  EXPECT_EQ(ChecksumChunkCount(kChecksumChunkBytes), 1u);
  EXPECT_EQ(ChecksumChunkCount(kChecksumChunkBytes + 1), 2u);
}

TEST(ChecksumTest, MatchesReferenceOnRandomDataAtChunkBoundaries) {
  const auto data = RandomBytes(3 * kChecksumChunkBytes + 13, 1);
  for (size_t size : kAwkwardSizes) {
    SCOPED_TRACE(size);
    EXPECT_EQ(TensorChecksum(data.data(), size), ReferenceChecksum(data.data(), size));
  }
}

TEST(ChecksumTest, OneByteChangeInAnyChunkChangesTheChecksum) {
  auto data = RandomBytes(2 * kChecksumChunkBytes + 5, 2);
  const uint64_t before = TensorChecksum(data.data(), data.size());
  for (size_t pos : {size_t{0}, kChecksumChunkBytes, data.size() - 1}) {
    data[pos] ^= 1;
    EXPECT_NE(TensorChecksum(data.data(), data.size()), before) << pos;
    data[pos] ^= 1;
  }
}

TEST(ChecksumTest, PiecewiseChunkHashesCombineToTheSameValue) {
  // The load pipeline hashes each staging-buffer piece of a tensor separately, in any order.
  const auto data = RandomBytes(5 * kChecksumChunkBytes + 100, 3);
  std::vector<uint64_t> hashes(ChecksumChunkCount(data.size()));
  const size_t piece = 2 * kChecksumChunkBytes;
  for (size_t off = data.size() / piece * piece;; off -= piece) {  // last piece first
    const size_t n = std::min(piece, data.size() - off);
    HashChunks(
        data.data() + off, n,
        std::span<uint64_t>(hashes).subspan(off / kChecksumChunkBytes, ChecksumChunkCount(n)));
    if (off == 0) break;
  }
  EXPECT_EQ(CombineChunkHashes(hashes), ReferenceChecksum(data.data(), data.size()));
}

TEST(ChecksumTest, BuilderFedInOddPiecesEqualsOneShot) {
  const auto data = RandomBytes(3 * kChecksumChunkBytes + 13, 4);
  std::mt19937 rng(5);
  for (size_t size : kAwkwardSizes) {
    SCOPED_TRACE(size);
    ChecksumBuilder b;
    size_t off = 0;
    while (off < size) {
      const size_t n = std::min<size_t>(size - off, 1 + rng() % (kChecksumChunkBytes / 3 * 4));
      b.Update(data.data() + off, n);
      off += n;
    }
    EXPECT_EQ(b.bytes(), size);
    EXPECT_EQ(b.Finish(), ReferenceChecksum(data.data(), size));
  }
}

TEST(ChecksumTest, BuilderFedWholeChunksEqualsOneShot) {
  const auto data = RandomBytes(2 * kChecksumChunkBytes, 6);
  ChecksumBuilder b;
  b.Update(data.data(), data.size());
  EXPECT_EQ(b.Finish(), ReferenceChecksum(data.data(), data.size()));
  ChecksumBuilder empty;
  EXPECT_EQ(empty.Finish(), TensorChecksum(nullptr, 0));
}

// The kernel's arithmetic, both load paths, on the host: every length 0..300 (all tail
// shapes, 0-9 stripes, the 4-stripe unrolled loop and its remainder) and chunk-sized ones.
TEST(Xxh64CoreTest, EqualsLibxxhashForEveryTailShape) {
  const auto data = RandomBytes(kChecksumChunkBytes + 64, 7);
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (size_t n : {kChecksumChunkBytes - 1, kChecksumChunkBytes, kChecksumChunkBytes + 1}) {
    sizes.push_back(n);
  }
  for (uint64_t seed : {uint64_t{0}, uint64_t{0x9E3779B97F4A7C15}}) {
    for (size_t n : sizes) {
      SCOPED_TRACE(n);
      const uint64_t want = XXH64(data.data(), n, seed);
      EXPECT_EQ(xxh64::Hash<xxh64::Access::kVector16>(data.data(), n, seed), want);
      EXPECT_EQ(xxh64::Hash<xxh64::Access::kBytewise>(data.data() + 3, n, seed),
                XXH64(data.data() + 3, n, seed));
    }
  }
}

}  // namespace
}  // namespace weightcache::cuda
