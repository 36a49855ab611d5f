// Content checksums of tensors (docs/integrity.md has the definition and the reasons).
//
//   chunk hash  = XXH64(chunk bytes, seed kChecksumSeed), chunks of kChecksumChunkBytes from the
//                 tensor's first byte, the last one short;
//   checksum    = XXH64(little-endian uint64 array of the chunk hashes, seed kChecksumSeed).
//
// Chunks are independent, so the same value is computed by the load pipeline on the host (one
// staging buffer at a time, in any order) and by the GPU kernel (one thread per chunk) over
// device memory. An empty tensor has zero chunks: its checksum is XXH64 of zero bytes.
//
// Everything here is pure CPU (the host tier, the fallback loader and the verifier use it with
// no CUDA; the gpu tier's upload pipeline and kernel compute the same values). Free functions are
// thread-safe; a ChecksumBuilder is a value used by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace weightcache {

inline constexpr uint64_t kChecksumChunkBytes = uint64_t{256} << 10;  // 256 KiB
inline constexpr uint64_t kChecksumSeed = 0;

// Number of chunks of a tensor of `size` bytes (0 for an empty tensor).
inline uint64_t ChecksumChunkCount(uint64_t size) {
  return (size + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
}

// Hashes the consecutive chunks of `data` into `out` (out.size() == ChecksumChunkCount(size)).
// `data` must start on a chunk boundary of its tensor; only the last chunk may be short, so a
// caller that feeds a tensor piecewise passes pieces whose sizes are multiples of the chunk
// size, except the tensor's last piece.
void HashChunks(const void* data, size_t size, std::span<uint64_t> out);

// The tensor checksum from its chunk hashes, in order.
uint64_t CombineChunkHashes(std::span<const uint64_t> chunk_hashes);

// One-shot checksum of a host buffer.
uint64_t TensorChecksum(const void* data, size_t size);

// Incremental checksum over bytes that arrive in order, in pieces of any size.
class ChecksumBuilder {
 public:
  ChecksumBuilder();
  ~ChecksumBuilder();
  ChecksumBuilder(ChecksumBuilder&&) noexcept;
  ChecksumBuilder& operator=(ChecksumBuilder&&) noexcept;

  void Update(const void* data, size_t size);
  // The checksum of everything fed so far (the builder may keep being fed afterwards).
  uint64_t Finish() const;
  uint64_t bytes() const { return bytes_; }

 private:
  struct ChunkState;  // XXH64 streaming state of the chunk being filled
  std::unique_ptr<ChunkState> chunk_;
  std::vector<uint64_t> chunk_hashes_;  // completed chunks
  uint64_t bytes_ = 0;
};

}  // namespace weightcache
