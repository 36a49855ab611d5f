// vmm_peer_helper — the other process of the gpu tier tests: fork+exec'ed by vmm_gpu_test with
// a socketpair on fd 3 (tests/gpu/peer_channel.h). It reads one request and acts on it:
//
//   "import <device> <seed> <write_seed> <size>..." + one fd per size
//       ImportedArena on <device>, check every byte against the pattern for <seed>, then fill
//       the last allocation with the pattern for <write_seed> (to prove writes are shared).
//       Replies "ok <bytes checked>" or "error <what>".
//   "export <device> <seed> <requested size>..."
//       ExportedArena on <device>, filled with the pattern for <seed>. Replies
//       "exported <size>..." + the fds, then blocks until the channel closes or it is killed.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "cuda/imported_arena.h"
#include "gpu/peer_channel.h"

namespace weightcache::testing {
namespace {

using cuda::DriverApi;

Status ImportAndCheck(const DriverApi* api, std::istringstream& in, std::vector<UniqueFd> fds,
                      std::string* reply) {
  int ordinal = 0;
  uint64_t seed = 0, write_seed = 0;
  in >> ordinal >> seed >> write_seed;
  std::vector<uint64_t> sizes;
  for (uint64_t s; in >> s;) sizes.push_back(s);
  CUdevice device = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGet(&device, ordinal), "cuDeviceGet");
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::ImportedArena arena,
                               cuda::ImportedArena::Import(api, device, std::move(fds), sizes));
  uint64_t checked = 0;
  std::vector<unsigned char> host;
  for (size_t i = 0; i < arena.allocations().size(); ++i) {
    const cuda::ImportedAllocation& a = arena.allocations()[i];
    host.resize(a.size);
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemcpyDtoH(host.data(), a.ptr, a.size), "cuMemcpyDtoH");
    int64_t bad = FirstMismatch(seed, i, host.data(), a.size);
    if (bad >= 0) {
      return InternalError("allocation " + std::to_string(i) + " differs at byte " +
                           std::to_string(bad));
    }
    checked += a.size;
  }
  const cuda::ImportedAllocation& last = arena.allocations().back();
  host.resize(last.size);
  FillPattern(write_seed, arena.allocations().size() - 1, host.data(), last.size);
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemcpyHtoD(last.ptr, host.data(), last.size),
                                 "cuMemcpyHtoD");
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxSynchronize(), "cuCtxSynchronize");
  *reply = "ok " + std::to_string(checked);
  return Status::Ok();
}

Status ExportAndWait(const DriverApi* api, std::istringstream& in, int channel) {
  int ordinal = 0;
  uint64_t seed = 0;
  in >> ordinal >> seed;
  std::vector<uint64_t> requested;
  for (uint64_t s; in >> s;) requested.push_back(s);
  CUdevice device = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGet(&device, ordinal), "cuDeviceGet");
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::ExportedArena arena,
                               cuda::ExportedArena::Create(api, device, requested));
  std::string reply = "exported";
  std::vector<int> fds;
  std::vector<unsigned char> host;
  for (size_t i = 0; i < arena.allocations().size(); ++i) {
    const cuda::ExportedAllocation& a = arena.allocations()[i];
    host.resize(a.size);
    FillPattern(seed, i, host.data(), a.size);
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuMemcpyHtoD(a.ptr, host.data(), a.size), "cuMemcpyHtoD");
    reply += " " + std::to_string(a.size);
    fds.push_back(a.fd);
  }
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuCtxSynchronize(), "cuCtxSynchronize");
  WEIGHTCACHE_RETURN_IF_ERROR(SendMessage(channel, reply, fds));
  char byte;
  while (::read(channel, &byte, 1) > 0) {
  }
  return Status::Ok();
}

int Main() {
  const int channel = kChildChannelFd;
  std::string request;
  std::vector<UniqueFd> fds;
  if (Status s = ReceiveMessage(channel, &request, &fds); !s.ok()) {
    std::fprintf(stderr, "vmm_peer_helper: %s\n", s.ToString().c_str());
    return 1;
  }
  std::istringstream in(request);
  std::string verb;
  in >> verb;
  Status status;
  std::string reply;
  Result<const DriverApi*> api = cuda::LoadDriver();
  if (!api.ok()) {
    status = api.status();
  } else if (verb == "import") {
    status = ImportAndCheck(*api, in, std::move(fds), &reply);
  } else if (verb == "export") {
    status = ExportAndWait(*api, in, channel);
    if (status.ok()) return 0;
  } else {
    status = InvalidArgument("unknown request '" + verb + "'");
  }
  if (!status.ok()) reply = "error " + status.ToString();
  (void)SendMessage(channel, reply);
  return status.ok() ? 0 : 1;
}

}  // namespace
}  // namespace weightcache::testing

int main() { return weightcache::testing::Main(); }
