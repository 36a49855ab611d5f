#include "protocol/connection.h"

#include "os/unix_socket.h"

namespace weightcache::protocol {

Status StatusFromErrorReply(const ErrorReply& error) {
  return Status(error.code, "daemon: " + error.message);
}

Result<Connection> Connection::Connect(const std::string& socket_path,
                                       std::chrono::milliseconds timeout) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd fd, os::ConnectUnix(socket_path, timeout));
  return Connection(std::move(fd));
}

Result<Frame> Connection::Call(std::span<const uint8_t> request_frame, MessageType expected,
                               os::Deadline deadline) {
  WEIGHTCACHE_RETURN_IF_ERROR(WriteFrame(fd_.get(), request_frame, {}, deadline, *sys_));
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, ReadFrame(fd_.get(), Expect::kReply, deadline, *sys_));
  if (reply.type == MessageType::kError) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(ErrorReply error, DecodeError(reply.payload));
    return StatusFromErrorReply(error);
  }
  if (reply.type != expected) {
    return ProtocolError("expected " + MessageTypeName(expected) + " in reply, got " +
                         MessageTypeName(reply.type));
  }
  return reply;
}

Result<HelloReply> Connection::SendHello(const Hello& hello, os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeHello(hello));
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kHelloReply, deadline));
  return DecodeHelloReply(reply.payload);
}

Result<StatusReply> Connection::QueryStatus(os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeStatusRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kStatusReply, deadline));
  return DecodeStatusReply(reply.payload);
}

Result<AttachReply> Connection::Attach(os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeAttachRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kAttachReply, deadline));
  return DecodeAttachReply(std::move(reply));
}

Result<StopReply> Connection::Stop(os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeStopRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kStopReply, deadline));
  return DecodeStopReply(reply.payload);
}

Result<EvictReply> Connection::Evict(os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeEvictRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kEvictReply, deadline));
  return DecodeEvictReply(reply.payload);
}

Result<MetricsReply> Connection::QueryMetrics(os::Deadline deadline) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, EncodeMetricsRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(Frame reply, Call(request, MessageType::kMetricsReply, deadline));
  return DecodeMetricsReply(reply.payload);
}

}  // namespace weightcache::protocol
