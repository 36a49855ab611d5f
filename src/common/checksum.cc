#include "common/checksum.h"

#define XXH_INLINE_ALL  // header-only use: no libxxhash at run time
#include <xxhash.h>

#include <algorithm>
#include <cassert>

#include "common/hash.h"

namespace weightcache {

void HashChunks(const void* data, size_t size, std::span<uint64_t> out) {
  assert(out.size() == ChecksumChunkCount(size));
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t offset = i * kChecksumChunkBytes;
    out[i] =
        Xxh64(p + offset, std::min<uint64_t>(kChecksumChunkBytes, size - offset), kChecksumSeed);
  }
}

uint64_t CombineChunkHashes(std::span<const uint64_t> chunk_hashes) {
  // The array is hashed as stored: the little-endian layout is the definition (the header of
  // xxh64_core.h refuses big-endian builds).
  return Xxh64(chunk_hashes.data(), chunk_hashes.size_bytes(), kChecksumSeed);
}

uint64_t TensorChecksum(const void* data, size_t size) {
  std::vector<uint64_t> hashes(ChecksumChunkCount(size));
  HashChunks(data, size, hashes);
  return CombineChunkHashes(hashes);
}

struct ChecksumBuilder::ChunkState {
  XXH64_state_t state;
  uint64_t filled = 0;  // bytes of the current chunk hashed so far
};

ChecksumBuilder::ChecksumBuilder() : chunk_(std::make_unique<ChunkState>()) {
  XXH64_reset(&chunk_->state, kChecksumSeed);
}
ChecksumBuilder::~ChecksumBuilder() = default;
ChecksumBuilder::ChecksumBuilder(ChecksumBuilder&&) noexcept = default;
ChecksumBuilder& ChecksumBuilder::operator=(ChecksumBuilder&&) noexcept = default;

void ChecksumBuilder::Update(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  bytes_ += size;
  while (size > 0) {
    // Whole chunks that start on a boundary skip the streaming state (the common case when
    // a staging buffer is fed whole).
    if (chunk_->filled == 0 && size >= kChecksumChunkBytes) {
      chunk_hashes_.push_back(Xxh64(p, kChecksumChunkBytes, kChecksumSeed));
      p += kChecksumChunkBytes;
      size -= kChecksumChunkBytes;
      continue;
    }
    const size_t take = std::min<uint64_t>(size, kChecksumChunkBytes - chunk_->filled);
    XXH64_update(&chunk_->state, p, take);
    chunk_->filled += take;
    p += take;
    size -= take;
    if (chunk_->filled == kChecksumChunkBytes) {
      chunk_hashes_.push_back(XXH64_digest(&chunk_->state));
      XXH64_reset(&chunk_->state, kChecksumSeed);
      chunk_->filled = 0;
    }
  }
}

uint64_t ChecksumBuilder::Finish() const {
  if (chunk_->filled == 0) return CombineChunkHashes(chunk_hashes_);
  std::vector<uint64_t> hashes = chunk_hashes_;
  hashes.push_back(XXH64_digest(&chunk_->state));
  return CombineChunkHashes(hashes);
}

}  // namespace weightcache
