// UniqueFd — sole owner of one file descriptor. Move-only; closes on destruction.
// Every fd in the project is held by one of these from the moment it exists (received fds
// are wrapped before they are validated). The ownership rules are UniqueHandle's
// (common/unique_handle.h); an fd is live when it is >= 0, and -1 is the empty value.
#pragma once

#include <unistd.h>

#include "common/unique_handle.h"

namespace weightcache {

struct FdTraits {
  using Handle = int;
  using Context = NoContext;
  static constexpr int Null() { return -1; }
  static bool IsValid(int fd) { return fd >= 0; }
  static void Close(NoContext /*unused*/, int fd) noexcept { ::close(fd); }
};

// A class, not an alias, so that it can be forward-declared.
class UniqueFd : public UniqueHandle<FdTraits> {
 public:
  using UniqueHandle::UniqueHandle;
};

}  // namespace weightcache
