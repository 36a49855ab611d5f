// ReadSmallFile — read a whole, bounded configuration file (device inventory, quantization
// config, /proc entries). Inputs are untrusted: the size is bounded before anything is
// parsed. Thread-safe; the fd is CLOEXEC and closed before returning.
#pragma once

#include <cstddef>
#include <string>

#include "weightcache/status.h"

namespace weightcache::identity {

// The file's bytes; kNotFound / kPermissionDenied / kIo naming the path, kInvalidArgument
// when it holds more than max_bytes or is not a regular file (a FIFO, a directory, a device:
// "<path> is a FIFO, not a regular file"), refused at once without reading.
Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes);

}  // namespace weightcache::identity
