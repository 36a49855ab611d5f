#include "os/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <string>
#include <thread>

namespace weightcache::os {
namespace {

constexpr int kReadOnlySeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;

std::string FdName(int fd) { return "fd " + std::to_string(fd); }

}  // namespace

Result<UniqueFd> CreateMemfd(const std::string& name, uint64_t size) {
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return IoError("memfd_create " + name, errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return IoError("ftruncate memfd " + name + " to " + std::to_string(size) + " bytes", errno);
  }
  return fd;
}

Status SealReadOnly(int fd) {
  // F_SEAL_WRITE is refused (EBUSY) while any page of the file holds a reference beyond its
  // mappings: a writable shared mapping, but also, for a moment, pages just written that still
  // sit in another CPU's LRU batch (the kernel drains only the sealing CPU's before it gives
  // up). Seen as a rare failure right after a pwrite; so EBUSY is tried again for up to
  // ~0.25 s before it is reported. A mapping that is really still there fails all the same.
  std::chrono::milliseconds pause{1};
  int rc = 0;
  for (int tries = 0;; ++tries) {
    rc = ::fcntl(fd, F_ADD_SEALS, kReadOnlySeals | F_SEAL_SEAL);
    if (rc == 0 || errno != EBUSY || tries == 8) break;
    std::this_thread::sleep_for(pause);
    pause *= 2;
  }
  if (rc != 0) {
    const int err = errno;
    Status s = IoError("sealing memfd " + FdName(fd) + " read-only", err);
    if (err == EBUSY) s.Context("a writable shared mapping still exists (munmap it first)");
    return s;
  }
  return Status::Ok();
}

Status CheckSealedReadOnly(int fd) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return IoError("F_GET_SEALS on " + FdName(fd) + " (not a memfd?)", errno);
  if ((seals & kReadOnlySeals) != kReadOnlySeals) {
    std::string missing;
    if (!(seals & F_SEAL_WRITE)) missing += " F_SEAL_WRITE";
    if (!(seals & F_SEAL_SHRINK)) missing += " F_SEAL_SHRINK";
    if (!(seals & F_SEAL_GROW)) missing += " F_SEAL_GROW";
    return PermissionDenied("memfd " + FdName(fd) + " is not sealed read-only (missing" + missing +
                            ")");
  }
  return Status::Ok();
}

Status PwriteAll(int fd, const void* data, uint64_t length, uint64_t offset) {
  const auto* bytes = static_cast<const std::byte*>(data);
  while (length > 0) {
    const ssize_t n = ::pwrite(fd, bytes, length, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return IoError("pwrite into the memfd at offset " + std::to_string(offset),
                     n < 0 ? errno : EIO);
    }
    bytes += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Result<uint64_t> FileSize(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("fstat " + FdName(fd), errno);
  return static_cast<uint64_t>(st.st_size);
}

void MappingTraits::Close(NoContext /*unused*/, const Handle& h) noexcept {
  ::munmap(h.data, h.size);
}

namespace {

Result<void*> MapChecked(int fd, size_t size, int prot, int flags = MAP_SHARED) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t file_size, FileSize(fd));
  if (size > file_size) {
    return InvalidArgument("cannot map " + std::to_string(size) + " bytes of " + FdName(fd) +
                           ", which holds only " + std::to_string(file_size));
  }
  if (size == 0) return static_cast<void*>(nullptr);
  void* p = ::mmap(nullptr, size, prot, flags, fd, 0);
  if (p == MAP_FAILED) {
    return IoError("mmap " + std::to_string(size) + " bytes of " + FdName(fd), errno);
  }
  return p;
}

}  // namespace

Result<MappedRegion> MapReadOnly(int fd, size_t size) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(void* p, MapChecked(fd, size, PROT_READ));
  return MappedRegion(p, p == nullptr ? 0 : size);
}

Result<MappedRegion> MapReadWrite(int fd, size_t size) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(void* p, MapChecked(fd, size, PROT_READ | PROT_WRITE));
  return MappedRegion(p, p == nullptr ? 0 : size);
}

Result<MappedRegion> MapCopyOnWrite(int fd, size_t size) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(void* p, MapChecked(fd, size, PROT_READ | PROT_WRITE, MAP_PRIVATE));
  return MappedRegion(p, p == nullptr ? 0 : size);
}

}  // namespace weightcache::os
