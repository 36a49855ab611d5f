// ReadSmallFile — read a whole, bounded configuration file (device inventory, quantization
// config, /proc entries, config.json, shard rules). Inputs are untrusted: the size is bounded
// before anything is parsed. Thread-safe; the fd is CLOEXEC and closed before returning.
#pragma once

#include <cstddef>
#include <string>

#include "weightcache/status.h"

namespace weightcache::os {

// The file's bytes; kNotFound / kPermissionDenied / kIo naming the path, `refuse_code`
// (kInvalidArgument by default; the caller's code, e.g. kInvalidCheckpoint for a model's
// config.json) when it holds more than max_bytes or is not a regular file (a FIFO, a
// directory, a device: "<path> is a FIFO, not a regular file"), refused at once without
// reading.
Result<std::string> ReadSmallFile(const std::string& path, size_t max_bytes,
                                  StatusCode refuse_code = StatusCode::kInvalidArgument);

// Opens the FIFO at `path` for reading and reads it until every writer has closed it: a test
// seam's pause (a test holds the process there, acts, then closes its end). Returns at once
// when it cannot be opened.
void WaitForFifoEof(const char* path);

// The path of this process's executable (/proc/self/exe), as it was when the process started:
// what the keeper and an upgrade's successor are started from by default.
Result<std::string> SelfExecutable();

}  // namespace weightcache::os
