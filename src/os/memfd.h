// memfd shared memory (the host tier) and RAII memory mappings.
//
// Contract:
//  * CreateMemfd returns a MFD_CLOEXEC | MFD_ALLOW_SEALING memfd of `size` bytes (zero-filled,
//    pages allocated on first touch) owned by the caller.
//  * SealReadOnly adds F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL. The kernel
//    refuses F_SEAL_WRITE (EBUSY) while any writable shared mapping of the memfd exists, so
//    the loader must destroy its MapReadWrite region (munmap) BEFORE sealing. After sealing,
//    the contents can never change again, in any process: a client can map it safely.
//  * Received memfds are untrusted: CheckSealedReadOnly verifies the seals, and MapReadOnly
//    verifies that the mapping fits in the file, so a later access cannot SIGBUS (a sealed
//    file cannot shrink).
//  * MappedRegion owns one mapping; move-only; munmap on destruction. It does not own the fd
//    it was mapped from (the mapping stays valid after that fd is closed).
//  * Thread-safety: free functions are thread-safe; a MappedRegion is not synchronised.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/unique_fd.h"
#include "common/unique_handle.h"
#include "weightcache/status.h"

namespace weightcache::os {

Result<UniqueFd> CreateMemfd(const std::string& name, uint64_t size);

Status SealReadOnly(int fd);

// OK if `fd` carries at least F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE; kPermissionDenied
// naming the missing seals otherwise (kIo if fcntl fails, e.g. not a memfd).
Status CheckSealedReadOnly(int fd);

// Writes all `length` bytes of `data` at `offset` of `fd` (a memfd being filled: shmem
// allocates the pages inside the write, with no fault and no zeroing), resuming after EINTR and
// short writes. An error names the offset and the errno (IoError's codes: kIo for ENOSPC or
// ENOMEM, no room in host memory; kPermissionDenied for a sealed memfd's EPERM); a write that
// makes no progress is EIO.
Status PwriteAll(int fd, const void* data, uint64_t length, uint64_t offset);

// fstat size of an fd.
Result<uint64_t> FileSize(int fd);

// The release rule of a mapping, for UniqueHandle: munmap of the whole region.
struct MappingTraits {
  struct Handle {
    void* data = nullptr;
    size_t size = 0;
    friend bool operator==(const Handle&, const Handle&) = default;
  };
  using Context = NoContext;
  static constexpr Handle Null() { return {}; }
  static void Close(NoContext /*unused*/, const Handle& h) noexcept;
};

class MappedRegion {
 public:
  MappedRegion() = default;

  void* data() const { return owned_.get().data; }
  size_t size() const { return owned_.get().size; }

 private:
  friend Result<MappedRegion> MapReadOnly(int fd, size_t size);
  friend Result<MappedRegion> MapReadWrite(int fd, size_t size);
  friend Result<MappedRegion> MapCopyOnWrite(int fd, size_t size);
  MappedRegion(void* data, size_t size) : owned_(MappingTraits::Handle{data, size}) {}

  UniqueHandle<MappingTraits> owned_;
};

// PROT_READ, MAP_SHARED, from offset 0. kInvalidArgument if `size` exceeds the file's size.
// A zero size gives an empty region (mmap refuses zero-length mappings).
Result<MappedRegion> MapReadOnly(int fd, size_t size);
// PROT_READ | PROT_WRITE, MAP_SHARED, from offset 0 (the loader filling a memfd).
Result<MappedRegion> MapReadWrite(int fd, size_t size);
// PROT_READ | PROT_WRITE, MAP_PRIVATE, from offset 0: reads share the file's pages; a write
// gives this mapping a private copy of that page and never reaches the file or any other
// mapping. Allowed on a memfd sealed with F_SEAL_WRITE (which refuses writable *shared*
// mappings only), so a client can take a sealed cache copy-on-write.
Result<MappedRegion> MapCopyOnWrite(int fd, size_t size);

}  // namespace weightcache::os
