#include "os/strided_read.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace weightcache::os {
namespace {

// One pread never asks for more than this (Linux caps a read at ~2 GiB anyway).
constexpr uint64_t kMaxPreadBytes = uint64_t{1} << 30;

}  // namespace

Status PreadExact(int fd, const std::string& path, uint64_t offset, uint64_t length, void* dest) {
  auto* out = static_cast<uint8_t*>(dest);
  while (length > 0) {
    const auto want = static_cast<size_t>(std::min(length, kMaxPreadBytes));
    const ssize_t n = ::pread(fd, out, want, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("pread " + path + " at offset " + std::to_string(offset), errno);
    }
    if (n == 0) {
      return Status(StatusCode::kIo, "unexpected end of file in " + path + " at offset " +
                                         std::to_string(offset) + " (" + std::to_string(length) +
                                         " more bytes expected): the file shrank since it was "
                                         "opened");
    }
    out += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status ReadStrided(int fd, const std::string& path, const StridedRun& run, uint64_t at,
                   uint64_t length, uint8_t* dest, std::unique_ptr<uint8_t[]>& stage) {
  const StridedRun& g = run;
  uint64_t held = 0;
  uint64_t extent = 0;  // from piece 0's start to the last piece's end
  if (g.row_bytes == 0 || g.rows == 0 || __builtin_mul_overflow(g.rows, g.row_bytes, &held) ||
      (g.rows > 1 && g.pitch < g.row_bytes) ||
      __builtin_mul_overflow(g.rows - 1, g.pitch, &extent) ||
      __builtin_add_overflow(extent, g.row_bytes, &extent) ||
      __builtin_add_overflow(extent, g.file_offset, &extent) || at > held || length > held - at) {
    return InvalidArgument("strided read of " + path + ": bytes [" + std::to_string(at) + ", +" +
                           std::to_string(length) + ") of " + std::to_string(g.rows) +
                           " row(s) of " + std::to_string(g.row_bytes) + " bytes, " +
                           std::to_string(g.pitch) + " apart from offset " +
                           std::to_string(g.file_offset) + ": not a valid run");
  }
  uint64_t pos = at;
  const uint64_t end = at + length;
  while (pos < end) {
    const uint64_t row = pos / g.row_bytes, in = pos % g.row_bytes;
    const uint64_t source = g.file_offset + row * g.pitch;
    if (g.row_bytes - in >= end - pos || g.pitch > kStridedStageBytes ||
        g.pitch - g.row_bytes >= kStridedOwnReadGap) {
      // The rest lies in this row, or rows are too far apart to stage, or the gap between
      // pieces costs more to read than a pread call: straight into dest.
      const uint64_t n = std::min(g.row_bytes - in, end - pos);
      WEIGHTCACHE_RETURN_IF_ERROR(PreadExact(fd, path, source + in, n, dest + (pos - at)));
      pos += n;
      continue;
    }
    // Rows [row, row + k): from this row's start to the end of the k-th piece, in one read.
    const uint64_t rows_needed = (in + (end - pos) + g.row_bytes - 1) / g.row_bytes;
    const uint64_t k =
        std::min({rows_needed, g.rows - row, 1 + (kStridedStageBytes - g.row_bytes) / g.pitch});
    if (!stage) stage = std::make_unique<uint8_t[]>(kStridedStageBytes);
    WEIGHTCACHE_RETURN_IF_ERROR(
        PreadExact(fd, path, source, (k - 1) * g.pitch + g.row_bytes, stage.get()));
    for (uint64_t j = 0; j < k && pos < end; ++j) {
      const uint64_t from = j == 0 ? in : 0;
      const uint64_t n = std::min(g.row_bytes - from, end - pos);
      std::memcpy(dest + (pos - at), stage.get() + j * g.pitch + from, n);
      pos += n;
    }
  }
  return Status::Ok();
}

}  // namespace weightcache::os
