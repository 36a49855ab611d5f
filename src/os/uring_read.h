// UringReader — a RunReader (os/run_reader.h) that reads the run as many reads in flight through
// io_uring (liburing): a measured variant of the pipeline's pread readers (docs/benchmarks.md,
// "io_uring"), in its own library (wc_uring) so that nothing else links liburing.
//
// Contract:
//  * Create() sets up a ring of `depth` submission entries owned by the reader (closed on
//    destruction). kUnavailable when weightcache was built without liburing
//    (UringReader::Built() is false), or with the errno when the kernel refuses a ring
//    (io_uring_setup: kernel.io_uring_disabled, a seccomp profile, an old kernel).
//  * Read() reads [offset, offset + length) of `fd` into `dst` as pieces of `piece_bytes`, at
//    most `depth` in flight (both fixed at Create); a short read of a piece is resumed where it
//    stopped. With UringDispatch::kWorkers every piece is queued to the kernel's io-wq workers
//    (IOSQE_ASYNC): the pieces of one run are copied by several kernel threads at once. With
//    kInline the kernel tries each read in the submitting thread first (a page-cache hit is
//    then a copy by this thread, as pread does).
//  * Read() returns only when no read it submitted is still in flight (`dst` is borrowed for the
//    call only), with the bytes read: `length`, or fewer when the file ends first (the bytes up
//    to its end are all in). A failed read is kIo naming the file offset and the errno; the
//    first failure is reported after every other piece has completed. A failed submission
//    (io_uring_submit) leaves entries in the ring that never ran: that Read waits for the ones
//    that did, and the reader refuses every later Read (kIo: make another). Create refuses a
//    depth or piece size of 0 (kInvalidArgument).
//  * Reads go through `fd` as it is (buffered, or whatever its flags say; O_DIRECT's alignment
//    rules are the caller's) and never change its file offset.
//  * Thread-safety: one thread at a time per reader; each pipeline reader owns its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "os/run_reader.h"
#include "weightcache/status.h"

namespace weightcache::os {

enum class UringDispatch { kInline, kWorkers };

struct UringOptions {
  unsigned depth = 8;                        // pieces in flight
  uint64_t piece_bytes = uint64_t{4} << 20;  // a run is cut into pieces of this size
  UringDispatch dispatch = UringDispatch::kWorkers;
};

class UringReader final : public RunReader {
 public:
  // Whether this build has liburing (else every Create is kUnavailable).
  static bool Built();
  static Result<std::unique_ptr<UringReader>> Create(const UringOptions& options);

  UringReader(const UringReader&) = delete;
  UringReader& operator=(const UringReader&) = delete;
  ~UringReader() override;

  Result<uint64_t> Read(int fd, std::byte* dst, uint64_t length, uint64_t offset) override;

 private:
  struct Ring;
  UringReader(std::unique_ptr<Ring> ring, const UringOptions& options);
  std::unique_ptr<Ring> ring_;
  UringOptions options_;
};

}  // namespace weightcache::os
