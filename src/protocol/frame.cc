#include "protocol/frame.h"

#include <cstring>
#include <string>

#include "protocol/wire.h"

namespace weightcache::protocol {
namespace {

uint32_t MaxFdsFor(Expect expect) { return expect == Expect::kRequest ? 0 : kMaxFdsPerFrame; }

// The one rule of who reads which type: the daemon's and the keeper's channels never mix, and
// Error is a reply on both.
bool Accepts(Expect expect, MessageType type) {
  const bool handoff = IsHandoffType(type);
  switch (expect) {
    case Expect::kRequest:
      return IsRequest(type) && !handoff;
    case Expect::kReply:
      return !IsRequest(type) && !handoff;
    case Expect::kKeeperRequest:
      return IsRequest(type) && handoff;
    case Expect::kKeeperReply:
      return (!IsRequest(type) && handoff) || type == MessageType::kError;
  }
  return false;
}

std::string ExpectName(Expect expect) {
  switch (expect) {
    case Expect::kRequest:
      return "a request";
    case Expect::kReply:
      return "a reply";
    case Expect::kKeeperRequest:
      return "a keeper request";
    case Expect::kKeeperReply:
      return "a keeper reply";
  }
  return "a frame";
}

std::string Hex32(uint32_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) out += kDigits[(v >> shift) & 0xf];
  return out;
}

// Fds that arrived must match the header exactly: fewer means a lying sender, more cannot
// happen (they are bounded per read) but is checked anyway.
Status CheckFdCount(const FrameHeader& header, size_t received) {
  if (received != header.fd_count) {
    return ProtocolError(MessageTypeName(header.type) + " frame announces " +
                         std::to_string(header.fd_count) + " fds but " + std::to_string(received) +
                         " arrived");
  }
  return Status::Ok();
}

}  // namespace

std::string MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kHello:
      return "Hello";
    case MessageType::kHelloReply:
      return "HelloReply";
    case MessageType::kStatus:
      return "Status";
    case MessageType::kStatusReply:
      return "StatusReply";
    case MessageType::kAttach:
      return "Attach";
    case MessageType::kAttachReply:
      return "AttachReply";
    case MessageType::kStop:
      return "Stop";
    case MessageType::kStopReply:
      return "StopReply";
    case MessageType::kError:
      return "Error";
    case MessageType::kPublishBegin:
      return "PublishBegin";
    case MessageType::kPublishArena:
      return "PublishArena";
    case MessageType::kPublishCommit:
      return "PublishCommit";
    case MessageType::kPublishCommitted:
      return "PublishCommitted";
    case MessageType::kDeposit:
      return "Deposit";
    case MessageType::kDepositReply:
      return "DepositReply";
    case MessageType::kWithdraw:
      return "Withdraw";
    case MessageType::kWithdrawReply:
      return "WithdrawReply";
    case MessageType::kQuery:
      return "Query";
    case MessageType::kQueryReply:
      return "QueryReply";
    case MessageType::kDrop:
      return "Drop";
    case MessageType::kDropReply:
      return "DropReply";
    case MessageType::kUpgrade:
      return "Upgrade";
    case MessageType::kUpgradeReply:
      return "UpgradeReply";
    case MessageType::kHandover:
      return "Handover";
    case MessageType::kMetrics:
      return "Metrics";
    case MessageType::kMetricsReply:
      return "MetricsReply";
    case MessageType::kEvict:
      return "Evict";
    case MessageType::kEvictReply:
      return "EvictReply";
    case MessageType::kHandoverDone:
      return "HandoverDone";
  }
  return "type " + std::to_string(static_cast<uint16_t>(type));
}

bool IsKnownMessageType(uint16_t type) {
  return (type >= static_cast<uint16_t>(MessageType::kHello) &&
          type <= static_cast<uint16_t>(MessageType::kEvictReply)) ||
         (type >= kFirstHandoffType && type <= static_cast<uint16_t>(MessageType::kHandoverDone));
}

bool IsHandoffType(MessageType type) { return static_cast<uint16_t>(type) >= kFirstHandoffType; }

bool IsRequest(MessageType type) {
  return type == MessageType::kHello || type == MessageType::kStatus ||
         type == MessageType::kAttach || type == MessageType::kStop ||
         type == MessageType::kPublishBegin || type == MessageType::kPublishCommit ||
         type == MessageType::kDeposit || type == MessageType::kWithdraw ||
         type == MessageType::kQuery || type == MessageType::kDrop ||
         type == MessageType::kUpgrade || type == MessageType::kHandover ||
         type == MessageType::kMetrics || type == MessageType::kEvict;
}

// The replies that carry an arena's fds (the manifest memfd first, then one per allocation).
bool CarriesArena(MessageType type) {
  return type == MessageType::kAttachReply || type == MessageType::kPublishArena;
}

uint64_t MaxPayloadFor(MessageType type) {
  if (IsHandoffType(type)) return kMaxHandoffPayload;
  if (type == MessageType::kPublishBegin || type == MessageType::kPublishCommit) {
    return kMaxPublishRequestPayload;
  }
  if (IsRequest(type)) return kMaxRequestPayload;
  if (CarriesArena(type)) return kMaxAttachReplyPayload;
  return kMaxControlReplyPayload;
}

// An arena's fds travel on the attach and publish replies, on the keeper's deposit and
// withdraw reply, and on an upgrade's handover; no other frame takes any.
uint32_t MaxFdsFor(MessageType type) {
  return CarriesArena(type) || type == MessageType::kDeposit ||
                 type == MessageType::kWithdrawReply || type == MessageType::kHandover
             ? kMaxFdsPerFrame
             : 0;
}

Result<FrameHeader> DecodeFrameHeader(std::span<const uint8_t> bytes, Expect expect) {
  if (bytes.size() < kFrameHeaderSize) {
    return ProtocolError("frame header truncated: " + std::to_string(bytes.size()) + " of " +
                         std::to_string(kFrameHeaderSize) + " bytes");
  }
  const uint8_t* p = bytes.data();
  if (std::memcmp(p, kFrameMagic, sizeof(kFrameMagic)) != 0) {
    return ProtocolError("bad frame magic " + Hex32(wire::GetU32(p)) +
                         " (expected \"WCPF\"): the peer does not speak the weightcache protocol");
  }
  FrameHeader h;
  h.version = wire::GetU16(p + 4);
  uint16_t type = wire::GetU16(p + 6);
  uint32_t flags = wire::GetU32(p + 8);
  h.fd_count = wire::GetU32(p + 12);
  h.payload_length = wire::GetU64(p + 16);

  if (!IsKnownMessageType(type)) {
    return ProtocolError("unknown message type " + std::to_string(type) + " (protocol version " +
                         std::to_string(h.version) + ")");
  }
  h.type = static_cast<MessageType>(type);
  // Error frames are frozen across versions, so any version's Error is readable.
  if (IsHandoffType(h.type) && h.version != kHandoffVersion) {
    return ProtocolError("unsupported handoff version " + std::to_string(h.version) + " in " +
                         MessageTypeName(h.type) + " (this build speaks handoff version " +
                         std::to_string(kHandoffVersion) + ")");
  }
  if (!IsHandoffType(h.type) && h.version != kProtocolVersion &&
      !(h.type == MessageType::kError && h.version >= 1)) {
    return ProtocolError("unsupported protocol version " + std::to_string(h.version) +
                         " (this build speaks version " + std::to_string(kProtocolVersion) + ")");
  }
  if (flags != 0) return ProtocolError("unknown frame flags " + Hex32(flags));
  if (!Accepts(expect, h.type)) {
    return ProtocolError("unexpected " + MessageTypeName(h.type) + " frame: expected " +
                         ExpectName(expect));
  }
  if (h.payload_length > MaxPayloadFor(h.type)) {
    return ProtocolError(MessageTypeName(h.type) + " frame payload of " +
                         std::to_string(h.payload_length) + " bytes exceeds the " +
                         std::to_string(MaxPayloadFor(h.type)) + "-byte limit");
  }
  if (h.fd_count > MaxFdsFor(h.type)) {
    return ProtocolError(MessageTypeName(h.type) + " frame announces " +
                         std::to_string(h.fd_count) + " fds; at most " +
                         std::to_string(MaxFdsFor(h.type)) + " allowed");
  }
  return h;
}

Result<std::vector<uint8_t>> EncodeFrame(MessageType type, std::span<const uint8_t> payload,
                                         uint32_t fd_count) {
  if (payload.size() > MaxPayloadFor(type)) {
    return InvalidArgument("cannot send " + MessageTypeName(type) + ": payload of " +
                           std::to_string(payload.size()) + " bytes exceeds the " +
                           std::to_string(MaxPayloadFor(type)) + "-byte limit");
  }
  if (fd_count > MaxFdsFor(type)) {
    return InvalidArgument("cannot send " + MessageTypeName(type) + " with " +
                           std::to_string(fd_count) + " fds; at most " +
                           std::to_string(MaxFdsFor(type)) + " allowed");
  }
  std::vector<uint8_t> out;
  out.reserve(kFrameHeaderSize + payload.size());
  out.insert(out.end(), std::begin(kFrameMagic), std::end(kFrameMagic));
  wire::PutU16(out, IsHandoffType(type) ? kHandoffVersion : kProtocolVersion);
  wire::PutU16(out, static_cast<uint16_t>(type));
  wire::PutU32(out, 0);
  wire::PutU32(out, fd_count);
  wire::PutU64(out, payload.size());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Status WriteFrame(int fd, std::span<const uint8_t> frame_bytes, std::span<const int> fds,
                  os::Deadline deadline, os::SysCalls& sys) {
  if (frame_bytes.size() < kFrameHeaderSize ||
      wire::GetU32(frame_bytes.data() + 12) != fds.size()) {
    return InternalError("WriteFrame: frame bytes do not come from EncodeFrame with " +
                         std::to_string(fds.size()) + " fds");
  }
  return os::SendMessage(fd, frame_bytes, fds, deadline, sys);
}

Result<Frame> ReadFrame(int fd, Expect expect, os::Deadline deadline, os::SysCalls& sys) {
  uint8_t header_bytes[kFrameHeaderSize];
  // Fds ride on the first byte of a frame, so they arrive with the header.
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<UniqueFd> fds,
                               os::RecvMessage(fd, header_bytes, MaxFdsFor(expect), deadline, sys));
  WEIGHTCACHE_ASSIGN_OR_RETURN(FrameHeader header, DecodeFrameHeader(header_bytes, expect));
  if (fds.size() > header.fd_count) return CheckFdCount(header, fds.size());
  Frame frame;
  frame.type = header.type;
  frame.payload.resize(header.payload_length);  // bounded by DecodeFrameHeader
  if (!frame.payload.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        std::vector<UniqueFd> more,
        os::RecvMessage(fd, frame.payload, header.fd_count - fds.size(), deadline, sys));
    for (UniqueFd& f : more) fds.push_back(std::move(f));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFdCount(header, fds.size()));
  frame.fds = std::move(fds);
  return frame;
}

Result<std::optional<Frame>> FrameReader::ReadAvailable(int fd) {
  while (true) {
    std::span<uint8_t> target;
    size_t max_fds;
    if (!header_) {
      target = std::span<uint8_t>(header_bytes_ + header_got_, kFrameHeaderSize - header_got_);
      max_fds = MaxFdsFor(expect_) - frame_.fds.size();
    } else {
      target = std::span<uint8_t>(frame_.payload).subspan(payload_got_);
      max_fds = header_->fd_count - frame_.fds.size();
    }
    if (header_ && target.empty()) {
      WEIGHTCACHE_RETURN_IF_ERROR(CheckFdCount(*header_, frame_.fds.size()));
      Frame done = std::move(frame_);
      frame_ = Frame();
      header_.reset();
      header_got_ = 0;
      payload_got_ = 0;
      return std::optional<Frame>(std::move(done));
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::RecvChunk chunk, os::RecvSome(fd, target, max_fds, *sys_));
    for (UniqueFd& f : chunk.fds) frame_.fds.push_back(std::move(f));
    if (chunk.would_block) return std::optional<Frame>();
    if (chunk.eof) {
      // Between frames or inside one, the peer went away (os/fd_passing.h's rule).
      if (!header_ && header_got_ == 0) {
        return Status(StatusCode::kUnavailable, "peer closed the connection");
      }
      return Status(StatusCode::kUnavailable,
                    "peer closed the connection in the middle of a frame");
    }
    if (!header_) {
      header_got_ += chunk.bytes;
      if (header_got_ < kFrameHeaderSize) continue;
      WEIGHTCACHE_ASSIGN_OR_RETURN(FrameHeader h, DecodeFrameHeader(header_bytes_, expect_));
      if (frame_.fds.size() > h.fd_count) return CheckFdCount(h, frame_.fds.size());
      header_ = h;
      frame_.type = h.type;
      frame_.payload.resize(h.payload_length);
    } else {
      payload_got_ += chunk.bytes;
    }
  }
}

Result<bool> FrameWriter::Flush(int fd) {
  while (sent_ < bytes_.size()) {
    std::span<const int> fds = sent_ == 0 ? std::span<const int>(fds_) : std::span<const int>();
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        os::SendProgress p,
        os::SendSome(fd, std::span<const uint8_t>(bytes_).subspan(sent_), fds, *sys_));
    if (p.would_block) return false;
    sent_ += p.bytes;
  }
  return true;
}

}  // namespace weightcache::protocol
