// OpenRegularFile — the one way weightcache opens a file it is about to read as data (a
// checkpoint shard, an index, a quantization config, a device inventory). Every such path is
// untrusted: it may name a FIFO (an open would block forever), a directory, a character
// device (/dev/zero never ends), a socket, or a symlink to any of them.
//
// Contract: the file is opened O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY (so opening a
// FIFO or a tty cannot block or become the controlling terminal), fstat-ed, refused unless
// S_ISREG, and O_NONBLOCK is then cleared. The fstat is of the open fd, so the returned stat
// describes the very inode that will be read, whatever the path points to later.
// Thread-safe; the fd is owned by the result.
#pragma once

#include <sys/stat.h>

#include <string>
#include <string_view>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::os {

struct RegularFile {
  UniqueFd fd;
  struct stat st {};
};

// "regular file", "directory", "FIFO", "character device", "block device", "socket",
// "symbolic link" or "file of unknown type".
std::string_view FileTypeName(mode_t mode);

// A non-regular file is `refuse_code` with "<path> is a <type>, not a regular file"; open and
// fstat failures are IoError naming the path (kNotFound, kPermissionDenied, kIo).
Result<RegularFile> OpenRegularFile(const std::string& path, StatusCode refuse_code);

}  // namespace weightcache::os
