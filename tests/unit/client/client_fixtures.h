// Fixtures shared by the client's unit and integration tests: real checkpoints with a
// reference manifest (per-tensor SHA-256 computed by the Python safetensors library, i.e. by
// a reader other than ours), and hashing of the bytes a client sees.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "weightcache/client.h"

namespace weightcache::testing {

struct ReferenceTensor {
  std::string dtype;  // "BF16", …
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  std::string sha256;  // of the tensor's bytes as safetensors.deserialize returns them
};

struct ReferenceCheckpoint {
  std::string dir;
  std::map<std::string, ReferenceTensor> tensors;
};

// Writes a checkpoint with tests/tools/make_checkpoint.py and reads its --manifest. Returns
// false (and fills *why) when Python or safetensors is unavailable (tests then skip); other
// failures are test failures.
bool MakeReferenceCheckpoint(const std::string& dir, int tensors, int shards, int seed,
                             const std::string& dtypes, int max_elems, ReferenceCheckpoint* out,
                             std::string* why);

// SHA-256 hex of a host tensor's bytes.
std::string HostTensorSha256(const Tensor& tensor);

// Checks every tensor of `attachment` against the reference: same names, dtype, shape, size,
// and the bytes' SHA-256. Returns "" when equal, else a description of the first difference.
std::string CompareWithReference(const Attachment& attachment, const ReferenceCheckpoint& ref);

}  // namespace weightcache::testing
