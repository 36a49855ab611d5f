#include "os/uring_read.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if WEIGHTCACHE_HAVE_IO_URING
#include <liburing.h>
#endif

namespace weightcache::os {

#if WEIGHTCACHE_HAVE_IO_URING

struct UringReader::Ring {
  io_uring ring{};
  bool broken = false;  // a submission failed: entries that never completed are left in it
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() { io_uring_queue_exit(&ring); }
};

bool UringReader::Built() { return true; }

Result<std::unique_ptr<UringReader>> UringReader::Create(const UringOptions& options) {
  if (options.depth == 0 || options.piece_bytes == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "io_uring reads need a depth and a piece size of at least 1");
  }
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(options.depth, &ring->ring, 0);
  if (rc < 0) {
    Status s(StatusCode::kUnavailable,
             "io_uring_setup of " + std::to_string(options.depth) +
                 " entries refused by the kernel (kernel.io_uring_disabled, a seccomp profile or "
                 "an old kernel)");
    s.WithErrno(-rc);
    return s;
  }
  return std::unique_ptr<UringReader>(new UringReader(std::move(ring), options));
}

namespace {

struct Piece {
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  uint64_t done = 0;
};

// One read asks for at most 1 GiB (Linux caps a read at 0x7ffff000 bytes).
constexpr uint64_t kMaxReadBytes = uint64_t{1} << 30;

// Waits for one completion without submitting anything (a broken ring's stale entries must
// not enter the kernel). Reads into the caller's buffer are still in flight, so it does not
// give up: an error other than EINTR is retried after a pause.
int WaitOne(io_uring* ring) {
  io_uring_cqe* cqe = nullptr;
  for (;;) {
    const int rc = io_uring_wait_cqe(ring, &cqe);
    if (rc == 0 || rc == -EINTR) return rc;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

Result<uint64_t> UringReader::Read(int fd, std::byte* dst, uint64_t length, uint64_t offset) {
  if (ring_->broken) {
    return Status(StatusCode::kIo, "this io_uring reader failed to submit before: make another");
  }
  const uint64_t piece_bytes = options_.piece_bytes;
  std::vector<Piece> pieces;
  pieces.reserve(static_cast<size_t>((length + piece_bytes - 1) / piece_bytes));
  for (uint64_t at = 0; at < length; at += piece_bytes) {
    pieces.push_back({.offset = offset + at, .length = std::min(piece_bytes, length - at)});
  }
  io_uring* ring = &ring_->ring;
  const unsigned char flags = options_.dispatch == UringDispatch::kWorkers ? IOSQE_ASYNC : 0;
  size_t next = 0;                 // the first piece never submitted
  unsigned in_flight = 0;          // prepared (submitted or about to be), not yet completed
  uint64_t end = offset + length;  // where the file ends, if a read found that sooner
  Status failed = Status::Ok();
  auto prepare = [&](size_t i) {
    Piece& p = pieces[i];
    io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: in_flight < depth entries
    io_uring_prep_read(sqe, fd, dst + (p.offset - offset) + p.done,
                       static_cast<unsigned>(std::min(p.length - p.done, kMaxReadBytes)),
                       p.offset + p.done);
    io_uring_sqe_set_data64(sqe, i);
    io_uring_sqe_set_flags(sqe, flags);
    ++in_flight;
  };
  // After a failed submission the prepared entries stay in the ring, never to complete: they
  // are not counted, nothing is submitted again, and the reader is broken for later reads.
  while (true) {
    while (failed.ok() && in_flight < options_.depth && next < pieces.size()) prepare(next++);
    if (in_flight == 0) break;
    // Submits what was prepared (new pieces, resumed ones) and waits for one completion.
    const int rc = ring_->broken ? WaitOne(ring) : io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && !ring_->broken) {
      if (failed.ok()) {
        failed = IoError("io_uring_submit at file offset " + std::to_string(offset), -rc);
      }
      ring_->broken = true;
      in_flight -= std::min(in_flight, io_uring_sq_ready(ring));
      continue;
    }
    // Every completion there is now; a read to resume is prepared for the next submission.
    io_uring_cqe* cqe = nullptr;
    while (in_flight > 0 && io_uring_peek_cqe(ring, &cqe) == 0) {
      const size_t i = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
      Piece& p = pieces[i];
      if (res == -EINTR || res == -EAGAIN) {
        if (failed.ok()) prepare(i);
      } else if (res < 0) {
        if (failed.ok()) {
          failed =
              IoError("io_uring read at file offset " + std::to_string(p.offset + p.done), -res);
        }
      } else if (res == 0) {
        end = std::min(end, p.offset + p.done);
      } else {
        p.done += static_cast<uint64_t>(res);
        if (p.done < p.length && failed.ok()) prepare(i);
      }
    }
  }
  if (!failed.ok()) return failed;
  return end - offset;
}

#else  // !WEIGHTCACHE_HAVE_IO_URING

struct UringReader::Ring {};

bool UringReader::Built() { return false; }

Result<std::unique_ptr<UringReader>> UringReader::Create(const UringOptions& /*options*/) {
  return Status(StatusCode::kUnavailable,
                "built without io_uring: install liburing-dev and configure weightcache again");
}

Result<uint64_t> UringReader::Read(int /*fd*/, std::byte* /*dst*/, uint64_t /*length*/,
                                   uint64_t /*offset*/) {
  return Status(StatusCode::kUnavailable, "built without io_uring");
}

#endif

UringReader::UringReader(std::unique_ptr<Ring> ring, const UringOptions& options)
    : ring_(std::move(ring)), options_(options) {}
UringReader::~UringReader() = default;

}  // namespace weightcache::os
