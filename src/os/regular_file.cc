#include "os/regular_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace weightcache::os {

std::string_view FileTypeName(mode_t mode) {
  if (S_ISREG(mode)) return "regular file";
  if (S_ISDIR(mode)) return "directory";
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISLNK(mode)) return "symbolic link";
  return "file of unknown type";
}

Result<RegularFile> OpenRegularFile(const std::string& path, StatusCode refuse_code) {
  RegularFile file;
  file.fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!file.fd) {
    // A socket cannot be opened (ENXIO): it is as much "not a regular file" as the rest.
    if (errno == ENXIO) {
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        return Status(refuse_code, path + " is a " + std::string(FileTypeName(st.st_mode)) +
                                       ", not a regular file");
      }
      errno = ENXIO;
    }
    return IoError("open " + path, errno);
  }
  if (::fstat(file.fd.get(), &file.st) != 0) return IoError("fstat " + path, errno);
  if (!S_ISREG(file.st.st_mode)) {
    return Status(refuse_code, path + " is a " + std::string(FileTypeName(file.st.st_mode)) +
                                   ", not a regular file");
  }
  const int flags = ::fcntl(file.fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(file.fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return IoError("fcntl(F_SETFL) " + path, errno);
  }
  return file;
}

}  // namespace weightcache::os
