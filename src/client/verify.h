// Verification of attached memory: `weightcache attach --verify` (every tensor's content
// checksum recomputed over the mapped memory and compared with the daemon's record) and
// `weightcache verify` (the mapped memory compared with the checkpoint files on disk).
//
// Host tier memory is hashed on the CPU (TensorChecksum); gpu tier memory with the GPU
// checksum kernel (cuda::ChecksumKernel) in the device's primary context, so the bytes never
// travel to the host. File bytes are read with pread and hashed on the CPU. Both sides use the
// one checksum definition of docs/integrity.md.
//
// Thread-safety: reentrant; the Attachment is only read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::client {

struct TensorProblem {
  std::string name;
  std::string what;  // "checksum 0123… != recorded 4567…", "missing from the cache", …
};

struct VerifyReport {
  size_t tensors_checked = 0;
  uint64_t bytes_checked = 0;
  double seconds = 0;
  std::vector<TensorProblem> problems;
  bool ok() const { return problems.empty(); }
};

// The content checksum of every tensor of `attachment`, in tensors() order, computed over
// the memory it maps.
Result<std::vector<uint64_t>> MemoryChecksums(const Attachment& attachment, int threads);

// Recomputed checksums vs the record each tensor carries.
Result<VerifyReport> VerifyChecksums(const Attachment& attachment, int threads);

// The attachment vs the checkpoint: same tensor names, dtypes, shapes and sizes, and the
// checksum of each tensor's file bytes equal to that of its memory.
Result<VerifyReport> VerifyAgainstCheckpoint(const Attachment& attachment,
                                             const checkpoint::Checkpoint& checkpoint, int threads);

}  // namespace weightcache::client
