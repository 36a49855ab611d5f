#include "os/host_name.h"

#include <unistd.h>

#include <cerrno>
#include <climits>

namespace weightcache::os {

Result<std::string> HostName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return IoError("gethostname", errno);
  return std::string(name);
}

}  // namespace weightcache::os
