// ReadOnlyMapping — a whole file mapped PROT_READ, MAP_SHARED: its pages are the page cache's
// own, so a device that reads them (cuMemHostRegister, cuda/mapped_upload.h) reads the file
// without a CPU copy. And PageCacheResidency: how much of a mapping is in the page cache
// (mincore), which is what decides whether reading it through the mapping pays.
//
// Contract: move-only; the mapping is unmapped on destruction. An empty file maps to nothing
// (data() null, size() 0). The mapping is never written (PROT_READ). Touching a page past the
// file's end after a truncation raises SIGBUS: a caller that lets the CPU read the mapping
// must own the file or accept that; the upload path only hands it to the device, where a
// truncation surfaces as a failed registration instead. Thread-safe for concurrent reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "weightcache/status.h"

namespace weightcache::os {

class ReadOnlyMapping {
 public:
  // mmap of [0, st_size) of `fd` (borrowed: the mapping outlives a close of the fd). kIo
  // naming `path` and the errno when fstat or mmap fails.
  static Result<ReadOnlyMapping> Map(int fd, const std::string& path);

  ReadOnlyMapping(ReadOnlyMapping&& other) noexcept : data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
    other.size_ = 0;
  }
  ReadOnlyMapping& operator=(ReadOnlyMapping&&) = delete;
  ReadOnlyMapping(const ReadOnlyMapping&) = delete;
  ReadOnlyMapping& operator=(const ReadOnlyMapping&) = delete;
  ~ReadOnlyMapping();

  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  ReadOnlyMapping(std::byte* data, uint64_t size) : data_(data), size_(size) {}
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

// `bytes` of private anonymous memory, its pages populated (faulted in and zeroed) by the
// kernel inside the call, so that a later pinning (cuMemHostRegister) finds them present.
// Concurrent calls populate in parallel. kIo naming the size (ENOMEM) when mmap fails.
// Released with UnmapAnonymous(p, bytes).
Result<void*> MapAnonymousPopulated(size_t bytes);
void UnmapAnonymous(void* p, size_t bytes);

// Faults in the whole pages inside [p, p + bytes) of private writable memory (e.g. a fresh
// heap buffer about to be filled) in one call (MADV_POPULATE_WRITE), instead of one page fault
// per page as the fill touches them: cheaper for a buffer of a megabyte or more that a new
// process fills once (the attach's tensor table). Best effort: a kernel without it (before 5.14)
// or a failure leaves the pages to be faulted in as usual.
void PrefaultWritable(void* p, size_t bytes);

// The fraction (0 to 1) of the mapping's pages in the page cache now, by mincore; 1 for an
// empty mapping. Costs one byte per page of scratch (4 MiB for 16 GiB) and no I/O.
Result<double> PageCacheResidency(const ReadOnlyMapping& mapping);

}  // namespace weightcache::os
