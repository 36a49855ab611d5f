// The two implementations behind arena_transfer.h, private to src/fleet (docs/fleet.md
// "Transport"): host memory over the weightcache-native TCP protocol (arena_tcp_server.cc,
// arena_tcp_fetch.cc), CUDA memory over UCX (arena_ucx.cc). arena_transfer.cc checks the
// options once and picks one by the regions' memory; neither implementation re-checks them.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "fleet/arena_transfer.h"
#include "os/syscalls.h"

namespace weightcache::fleet {

// One non-blocking send/recv through the syscall seam (MSG_NOSIGNAL: a peer gone is EPIPE,
// never SIGPIPE). The syscall's result, errno as it left it.
inline ssize_t SendSome(int fd, const void* data, size_t bytes) {
  iovec iov{const_cast<void*>(data), bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  return os::SysCalls::Default().SendMsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}
inline ssize_t RecvSome(int fd, void* data, size_t bytes) {
  iovec iov{data, bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  return os::SysCalls::Default().RecvMsg(fd, &msg, MSG_DONTWAIT);
}

// A running server of either kind. Stop() is idempotent and prompt; the destructor calls it.
class ArenaServer::Impl {
 public:
  virtual ~Impl() = default;
  virtual const std::string& endpoint_name() const = 0;
  virtual uint64_t peers_accepted() const = 0;
  virtual uint64_t peers_refused() const = 0;
  virtual void Stop() = 0;
};

// Every region host memory.
Result<std::unique_ptr<ArenaServer::Impl>> StartTcpServer(ArenaServerOptions options);

// What the TCP server's thread drives besides its sockets: the UCX server's worker. Called on
// that thread only; destroyed after it is joined.
class ServerThreadHook {
 public:
  virtual ~ServerThreadHook() = default;
  virtual int fd() const = 0;  // polled for POLLIN (the worker's event fd)
  virtual void Progress() = 0;
  // Before the thread sleeps: false if events are pending already (it must not sleep).
  virtual bool Arm() = 0;
};
enum class AfterHello { kServeReads, kClose };
// The TCP listener, allow-list, peer slots and hello of both servers: kServeReads answers
// read requests (the host memory protocol); kClose closes a peer once its hello is sent (the
// UCX server: the peer reads over UCX). `hook` may be null.
Result<std::unique_ptr<ArenaServer::Impl>> StartHelloServer(ArenaServerOptions options,
                                                            std::vector<uint8_t> hello,
                                                            AfterHello after,
                                                            std::unique_ptr<ServerThreadHook> hook);
// Any region CUDA memory.
Result<std::unique_ptr<ArenaServer::Impl>> StartUcxServer(ArenaServerOptions options);
// Every destination region host memory.
Result<FetchResult> FetchOverTcp(const FetchOptions& options);
// Any destination region CUDA memory.
Result<FetchResult> FetchOverUcx(const FetchOptions& options);

}  // namespace weightcache::fleet
