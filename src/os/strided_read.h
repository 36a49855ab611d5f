// Reading a strided run of a file: `rows` pieces of `row_bytes`, piece r at
// `file_offset + r * pitch`, delivered one after the other (the "held bytes" of a tensor
// slice along a dim > 0, sharding/planner.h's CopyGeometry). The one implementation of the
// gather that the daemon's host tier, the gpu tier's upload pipeline and the client's
// fallback loaders share.
//
// A run of one piece is one pread. Pieces with gaps of kStridedOwnReadGap or more between them
// are read one pread each, straight into the destination: the bytes between them are never
// copied (a TP=4 rank of a row-parallel weight keeps a quarter of each row; reading whole rows
// made its 4 ranks read 30.6 GB of page cache for a 16 GB checkpoint, measured on an H200).
// Pieces closer than that are gathered by reading blocks of whole source rows with one pread
// each into a staging buffer (kStridedStageBytes, allocated on first need and kept by the
// caller for its next reads) and copying the pieces out, so small rows cost no syscall each.
//
// Errors name the file and the offset of the failed pread: kIo with the errno, or kIo
// "unexpected end of file" for a file shorter than the run. Reads go through the given fd as
// it is (buffered, or whatever its flags say); the fd's file offset is never changed.
//
// Thread-safety: reentrant; concurrent calls need their own `stage`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "weightcache/status.h"

namespace weightcache::os {

inline constexpr uint64_t kStridedStageBytes = uint64_t{8} << 20;
// A gap this large costs about what one pread call does (a syscall and a page-cache lookup,
// ~1 us, against copying the gap at a few GB/s per thread).
inline constexpr uint64_t kStridedOwnReadGap = 4096;

// `rows` pieces of `row_bytes`, piece r at byte `file_offset + r * pitch` of the file.
struct StridedRun {
  uint64_t file_offset = 0;
  uint64_t rows = 1;
  uint64_t row_bytes = 0;
  uint64_t pitch = 0;
};

// Reads exactly `length` bytes at `offset` of `fd` into `dest`, resuming after EINTR and short
// reads. `path` names the file in errors only; end of file first is kIo naming the file and
// offset (the file shrank since it was opened).
Status PreadExact(int fd, const std::string& path, uint64_t offset, uint64_t length, void* dest);

// Reads the bytes [at, at + length) of the run's pieces (laid end to end) into `dest`.
// `stage`: the caller's staging buffer, empty or kStridedStageBytes from an earlier call.
// kInvalidArgument for a run with row_bytes 0 or a range past its rows * row_bytes bytes.
Status ReadStrided(int fd, const std::string& path, const StridedRun& run, uint64_t at,
                   uint64_t length, uint8_t* dest, std::unique_ptr<uint8_t[]>& stage);

}  // namespace weightcache::os
