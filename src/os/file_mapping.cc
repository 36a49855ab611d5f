#include "os/file_mapping.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace weightcache::os {

Result<ReadOnlyMapping> ReadOnlyMapping::Map(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError("fstat of " + path, errno);
  if (st.st_size <= 0) return ReadOnlyMapping(nullptr, 0);
  const auto size = static_cast<uint64_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return IoError("mmap of " + path + " (read-only)", errno);
  return ReadOnlyMapping(static_cast<std::byte*>(p), size);
}

ReadOnlyMapping::~ReadOnlyMapping() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

Result<void*> MapAnonymousPopulated(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED)
    return IoError("mmap of " + std::to_string(bytes) + " bytes of memory", errno);
  return p;
}

void UnmapAnonymous(void* p, size_t bytes) {
  if (p != nullptr) ::munmap(p, bytes);
}

void PrefaultWritable(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end > begin)
    (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)p;
  (void)bytes;
#endif
}

Result<double> PageCacheResidency(const ReadOnlyMapping& mapping) {
  if (mapping.size() == 0) return 1.0;
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t pages = (mapping.size() + page - 1) / page;
  std::vector<unsigned char> resident(pages);
  // mincore takes a non-const pointer but only reads the page tables.
  if (::mincore(const_cast<std::byte*>(mapping.data()), mapping.size(), resident.data()) != 0) {
    return IoError("mincore of a " + std::to_string(mapping.size()) + "-byte mapping", errno);
  }
  uint64_t in_cache = 0;
  for (unsigned char r : resident) in_cache += r & 1U;
  return static_cast<double>(in_cache) / static_cast<double>(pages);
}

}  // namespace weightcache::os
