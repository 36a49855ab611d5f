// Test-only plumbing for the gpu tier tests and the attach benchmark: a socketpair to a child
// process (the helper binary, fork+exec'ed with its end on fd 3) carrying one text message
// plus up to kMaxFds fds per send (SCM_RIGHTS). The product's wire protocol lives in
// src/protocol; this is deliberately minimal and trusts its peer (it is our own child).
//
// Also the byte pattern both sides write and verify: a pure function of (seed, allocation,
// offset), so the verifier needs no copy of the data.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::testing {

inline constexpr int kMaxFds = 250;  // Linux caps SCM_RIGHTS at 253 fds per message
inline constexpr int kChildChannelFd = 3;

Status SendMessage(int sock, const std::string& text, const std::vector<int>& fds = {});
// Blocks until a message arrives. kIo on EOF (the peer died) or error; kProtocol on
// MSG_CTRUNC. Received fds are CLOEXEC and owned by the caller.
Status ReceiveMessage(int sock, std::string* text, std::vector<UniqueFd>* fds);

struct Child {
  pid_t pid = -1;
  UniqueFd channel;  // our end of the socketpair
};
// fork+exec `argv` with the child's end of a new socketpair on fd kChildChannelFd.
Result<Child> SpawnWithChannel(const std::vector<std::string>& argv);
// waitpid; returns the exit code, or 128+signal.
int WaitChild(pid_t pid);

// Fill / check `size` bytes of allocation `index` with the pattern for `seed`.
void FillPattern(uint64_t seed, uint64_t index, void* data, uint64_t size);
// Offset of the first byte that differs from the pattern, or -1 if all match.
int64_t FirstMismatch(uint64_t seed, uint64_t index, const void* data, uint64_t size);

}  // namespace weightcache::testing
