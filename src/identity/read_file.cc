#include "identity/read_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "common/unique_fd.h"

namespace weightcache::identity {

Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return IoError("open " + path, errno);
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
      return InvalidArgument(path + ": larger than the " + std::to_string(max_bytes) +
                             "-byte limit for this kind of file");
    }
    data.append(buf, static_cast<size_t>(n));
  }
  return data;
}

}  // namespace weightcache::identity
