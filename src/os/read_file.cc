#include "os/read_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <climits>

#include "common/unique_fd.h"
#include "os/regular_file.h"

namespace weightcache::os {

Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes,
                                  StatusCode refuse_code) {
  // A FIFO would block forever and /dev/zero never ends: only regular files (os/regular_file.h).
  WEIGHTCACHE_ASSIGN_OR_RETURN(RegularFile file, OpenRegularFile(path, refuse_code));
  const UniqueFd fd = std::move(file.fd);
  // /proc files report size 0 and are read to EOF; the bound below holds either way.
  if (static_cast<uint64_t>(file.st.st_size) > max_bytes) {
    return Status(refuse_code, path + ": " + std::to_string(file.st.st_size) +
                                   " bytes, larger than the " + std::to_string(max_bytes) +
                                   "-byte limit for this kind of file");
  }
  std::string data;
  char buf[8192];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("read " + path, errno);
    }
    if (n == 0) break;
    if (data.size() + static_cast<size_t>(n) > max_bytes) {
      return Status(refuse_code, path + ": larger than the " + std::to_string(max_bytes) +
                                     "-byte limit for this kind of file");
    }
    data.append(buf, static_cast<size_t>(n));
  }
  return data;
}

void WaitForFifoEof(const char* path) {
  const UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd) return;
  char buf[64];
  while (true) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n > 0 || (n < 0 && errno == EINTR)) continue;
    return;
  }
}

Result<std::string> SelfExecutable() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n < 0) return IoError("readlink /proc/self/exe", errno);
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace weightcache::os
