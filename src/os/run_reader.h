// RunReader — how a reader thread of the load pipeline reads one contiguous run of a file
// (cuda/upload_pipeline.h, UploadOptions::run_reader; without one it preads). One object per
// reader thread: an implementation may keep per-thread state (os/uring_read.h keeps a ring).
#pragma once

#include <cstddef>
#include <cstdint>

#include "weightcache/status.h"

namespace weightcache::os {

class RunReader {
 public:
  virtual ~RunReader() = default;
  // Reads [offset, offset + length) of `fd` into `dst` and returns the bytes read: `length`,
  // or fewer only when the file ends first. An error names what failed and carries the errno.
  // Never changes `fd`'s file offset.
  virtual Result<uint64_t> Read(int fd, std::byte* dst, uint64_t length, uint64_t offset) = 0;
};

}  // namespace weightcache::os
