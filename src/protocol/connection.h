// Connection — one client-side protocol connection: send a request, receive its one reply,
// with a deadline. The daemon uses the same frame functions (or FrameReader/FrameWriter for
// its non-blocking loop) on its side.
//
// Contract:
//  * Owns its socket fd (UniqueFd); move-only; closing it ends the conversation.
//  * Each typed call sends one request and reads exactly one reply before the deadline. A
//    reply of the expected type is decoded; an Error reply becomes a Status with the
//    daemon's code and message (prefixed "daemon"); any other type is kProtocol. After a
//    kProtocol, kTimeout or I/O error the stream position is unknown: discard the Connection.
//  * Not thread-safe: one request at a time.
#pragma once

#include <chrono>
#include <span>
#include <string>

#include "common/unique_fd.h"
#include "os/syscalls.h"
#include "protocol/frame.h"
#include "protocol/messages.h"
#include "weightcache/status.h"

namespace weightcache::protocol {

class Connection {
 public:
  // ConnectUnix with `timeout` (see os/unix_socket.h for its error codes).
  static Result<Connection> Connect(const std::string& socket_path,
                                    std::chrono::milliseconds timeout);

  explicit Connection(UniqueFd fd, os::SysCalls& sys = os::SysCalls::Default())
      : fd_(std::move(fd)), sys_(&sys) {}
  Connection(Connection&&) noexcept = default;
  Connection& operator=(Connection&&) noexcept = default;

  int fd() const { return fd_.get(); }

  Result<HelloReply> SendHello(const Hello& hello, os::Deadline deadline);
  Result<StatusReply> QueryStatus(os::Deadline deadline);
  Result<AttachReply> Attach(os::Deadline deadline);
  Result<StopReply> Stop(os::Deadline deadline);
  Result<MetricsReply> QueryMetrics(os::Deadline deadline);
  Result<EvictReply> Evict(os::Deadline deadline);

  // Sends an encoded request frame and returns the reply frame, which is of type `expected`
  // (an Error reply is returned as its Status).
  Result<Frame> Call(std::span<const uint8_t> request_frame, MessageType expected,
                     os::Deadline deadline);

 private:
  UniqueFd fd_;
  os::SysCalls* sys_;
};

// The Status an Error reply stands for: its code, "daemon: <message>".
Status StatusFromErrorReply(const ErrorReply& error);

}  // namespace weightcache::protocol
