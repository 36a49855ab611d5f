// Byte streams with file descriptors attached (SCM_RIGHTS) over AF_UNIX stream sockets.
//
// Contract:
//  * Sending: the fds ride on the first byte of the message (one sendmsg carries them all;
//    the kernel's SCM_MAX_FD caps that at kMaxFdsPerMessage). Every send uses MSG_NOSIGNAL
//    (the library installs no SIGPIPE handler: a closed peer is an EPIPE error) and
//    MSG_DONTWAIT (deadlines are enforced with poll, whatever the fd's blocking mode). The
//    caller keeps ownership of the fds it sends; the peer gets its own duplicates.
//  * Receiving: every recvmsg passes MSG_CMSG_CLOEXEC, and every fd that arrives is wrapped in
//    a UniqueFd before anything is checked, so on every error path it is closed. MSG_CTRUNC
//    (the sender attached more fds than the receiver allowed) is a kProtocol error; fds
//    beyond `max_fds`, including any fd when none was expected, are closed and reported as
//    kProtocol. Nothing leaks.
//  * A peer that went away is kUnavailable (errno kept): EOF before or inside a message (a
//    truncated message is a peer that left, not a malformed one), EPIPE on send, ECONNRESET
//    (it closed with our data unread). Other failures are kIo with errno. The client's
//    discovery treats every kUnavailable of these as a daemon that is gone (a fallback).
//  * EINTR is retried everywhere. The single-shot functions (SendSome, RecvSome) report
//    EAGAIN as `would_block` — distinct from an error — for the daemon's epoll loop. The
//    whole-message functions (SendMessage, RecvMessage) poll until their Deadline (kTimeout).
//  * Every syscall goes through a SysCalls (fault-injection seam for tests).
//  * Thread-safety: none needed beyond the fd's own; do not send on one fd from two threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/unique_fd.h"
#include "os/syscalls.h"
#include "weightcache/status.h"

namespace weightcache::os {

// SCM_MAX_FD in the Linux kernel: the most fds one sendmsg may carry.
inline constexpr size_t kMaxFdsPerMessage = 253;

struct SendProgress {
  size_t bytes = 0;          // bytes the kernel accepted (fds went with the first of them)
  bool would_block = false;  // the socket buffer is full; nothing was sent
};

struct RecvChunk {
  size_t bytes = 0;  // bytes read into the buffer
  std::vector<UniqueFd> fds;
  bool would_block = false;  // nothing available now
  bool eof = false;          // the peer shut down its end (nothing was read)
};

// One sendmsg (EINTR retried). `fds` are attached only if non-empty; pass them again only if
// the previous call sent zero bytes. `bytes` must be non-empty when fds are given.
Result<SendProgress> SendSome(int fd, std::span<const uint8_t> bytes, std::span<const int> fds,
                              SysCalls& sys = SysCalls::Default());

// One recvmsg (EINTR retried) into `buffer`, accepting at most `max_fds` fds.
Result<RecvChunk> RecvSome(int fd, std::span<uint8_t> buffer, size_t max_fds,
                           SysCalls& sys = SysCalls::Default());

// Sends all of `bytes`, with `fds` attached to the first byte, handling short writes and
// EAGAIN (poll until `deadline`: kTimeout naming how much was sent).
Status SendMessage(int fd, std::span<const uint8_t> bytes, std::span<const int> fds,
                   Deadline deadline = Deadline::Never(), SysCalls& sys = SysCalls::Default());

// Fills all of `buffer`, accepting at most `max_fds` fds in total over the reads. A peer that
// closes before the buffer is full is kUnavailable ("peer closed the connection", and "after
// N of M bytes (truncated message)" part-way). Returns the fds received, in order.
Result<std::vector<UniqueFd>> RecvMessage(int fd, std::span<uint8_t> buffer, size_t max_fds,
                                          Deadline deadline = Deadline::Never(),
                                          SysCalls& sys = SysCalls::Default());

// Polls one fd for `events` until `deadline`: OK when ready, kTimeout otherwise. POLLHUP and
// POLLERR count as ready (the following read or write reports what happened).
Status WaitFor(int fd, short events, Deadline deadline, SysCalls& sys = SysCalls::Default());

}  // namespace weightcache::os
