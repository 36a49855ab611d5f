// The weightcache wire protocol: frame codec. Full specification: docs/protocol.md.
//
// Summary. A connection is an AF_UNIX stream socket carrying frames; the client sends one
// request, the daemon answers with exactly one reply, in order. Every frame is
//
//   offset size  field            (all integers little-endian)
//   0      4     magic            "WCPF" (0x57 0x43 0x50 0x46)
//   4      2     version          kProtocolVersion (7)
//   6      2     type             MessageType
//   8      4     flags            0 (any other value is rejected)
//   12     4     fd_count         fds attached (SCM_RIGHTS) to the frame's first byte
//   16     8     payload_length   bytes following the header
//   24     ...   payload          JSON object for control messages; empty for Status, Attach
//                                 and Stop requests; 16 bytes for AttachReply (the manifest
//                                 itself travels as a sealed memfd, see messages.h)
//
// Bounds are enforced from the header alone, BEFORE any payload allocation: 64 KiB for a
// request (16 MiB for PublishBegin and PublishCommit), 1 MiB for a control reply, 64 KiB for
// AttachReply and PublishArena; fds only on those two (at most 253, the kernel's SCM_MAX_FD). A
// frame of another version is rejected with kProtocol naming both versions, except Error frames,
// whose header and payload are frozen across versions so that a peer can always explain a version
// mismatch. Any malformed frame fails with kProtocol and a specific message; the receiver then
// closes that connection only.
//
// Handoff frames (types 32 and up, handoff.h, docs/protocol.md §8) travel between a daemon and
// its keeper (docs/keeper.md). They carry kHandoffVersion in the version field instead of
// kProtocolVersion, so that a keeper and a daemon of another build can still hand over; only
// a keeper reads handoff requests (Expect::kKeeperRequest), and only a keeper's client their
// replies (Expect::kKeeperReply). A daemon's reader (Expect::kRequest) still accepts no fds
// and no handoff type at all.
//
// Thread-safety: the codec functions are pure; FrameReader/FrameWriter are per-connection,
// single-threaded objects. Ownership: a Frame owns its payload and the fds received with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/unique_fd.h"
#include "os/fd_passing.h"
#include "os/syscalls.h"
#include "weightcache/status.h"

namespace weightcache::protocol {

inline constexpr uint16_t kProtocolVersion = 8;
inline constexpr uint8_t kFrameMagic[4] = {'W', 'C', 'P', 'F'};
inline constexpr size_t kFrameHeaderSize = 24;

inline constexpr uint64_t kMaxRequestPayload = uint64_t{64} * 1024;
inline constexpr uint64_t kMaxControlReplyPayload = uint64_t{1024} * 1024;
inline constexpr uint64_t kMaxAttachReplyPayload = uint64_t{64} * 1024;
// PublishBegin (the plan: every tensor's name, dtype, shape and bytes) and PublishCommit (every
// tensor's checksum) grow with the tensor count: ~160k tensors of 100-byte names fit.
inline constexpr uint64_t kMaxPublishRequestPayload = uint64_t{16} << 20;
inline constexpr uint32_t kMaxFdsPerFrame = static_cast<uint32_t>(os::kMaxFdsPerMessage);
// The version of the handoff messages (types >= kFirstHandoffType), independent of
// kProtocolVersion; the payload bound of every handoff frame.
inline constexpr uint16_t kHandoffVersion = 1;
inline constexpr uint16_t kFirstHandoffType = 32;
inline constexpr uint64_t kMaxHandoffPayload = uint64_t{64} * 1024;

enum class MessageType : uint16_t {
  kHello = 1,
  kHelloReply = 2,
  kStatus = 3,
  kStatusReply = 4,
  kAttach = 5,
  kAttachReply = 6,
  kStop = 7,
  kStopReply = 8,
  kError = 9,
  kPublishBegin = 10,      // client → daemon: the plan (docs/publish.md)
  kPublishArena = 11,      // daemon → client: the arena to fill (AttachReply's layout, fds)
  kPublishCommit = 12,     // client → daemon: the checksums; the daemon verifies and seals
  kPublishCommitted = 13,  // daemon → client: the cache is ready with the published tensors
  kUpgrade = 14,           // owner → daemon: hand the cache to a successor (docs/upgrade.md)
  kUpgradeReply = 15,      // daemon → owner: the successor serves (its pid), or an Error
  kMetrics = 16,           // client → daemon: empty; the attach counters (`weightcache status`)
  kMetricsReply = 17,      // daemon → client: hits, misses, attaches by result, last attach
  kEvict = 18,       // owner → daemon: give the memory back (budget admission, docs/budget.md)
  kEvictReply = 19,  // daemon → owner: evicted (it stops), or refused with its clients

  // Keeper handoff (handoff.h), from kFirstHandoffType up: daemon types stay below 32.
  kDeposit = 32,
  kDepositReply = 33,
  kWithdraw = 34,
  kWithdrawReply = 35,
  kQuery = 36,
  kQueryReply = 37,
  kDrop = 38,
  kDropReply = 39,
  // Upgrade handover (docs/upgrade.md), on the socketpair between a daemon and its successor.
  kHandover = 40,  // daemon → successor: a Deposit's payload; fds: manifest, allocations, lock
  kHandoverDone = 41,  // successor → daemon: empty; the successor serves at the socket path
};

// "Hello", "AttachReply", ...; "type <n>" for values outside the enum.
std::string MessageTypeName(MessageType type);
bool IsKnownMessageType(uint16_t type);
// The payload bound and the fd bound for one message type.
uint64_t MaxPayloadFor(MessageType type);
uint32_t MaxFdsFor(MessageType type);

// Which side is reading: a daemon accepts only requests (and so never allocates for a reply
// type's larger bound, and never accepts fds); a client accepts only replies. A keeper accepts
// only handoff requests (Deposit carries fds), its client only handoff replies and Error.
enum class Expect { kRequest, kReply, kKeeperRequest, kKeeperReply };
bool IsRequest(MessageType type);
// AttachReply and PublishArena: the manifest memfd and one fd per allocation.
bool CarriesArena(MessageType type);
// Types 32 and up: the keeper's, versioned by kHandoffVersion.
bool IsHandoffType(MessageType type);

struct FrameHeader {
  uint16_t version = kProtocolVersion;
  MessageType type = MessageType::kError;
  uint32_t fd_count = 0;
  uint64_t payload_length = 0;
};

// Validates magic, version, flags, type (known, and a request or reply as `expect` says) and
// the size and fd bounds of `type`. `bytes` must hold at least kFrameHeaderSize bytes.
Result<FrameHeader> DecodeFrameHeader(std::span<const uint8_t> bytes, Expect expect);

// Header + payload in one buffer, ready to send. kInvalidArgument if the payload or fd count
// exceeds the bounds of `type` (a sender never emits what its peer must reject).
Result<std::vector<uint8_t>> EncodeFrame(MessageType type, std::span<const uint8_t> payload,
                                         uint32_t fd_count = 0);

struct Frame {
  MessageType type = MessageType::kError;
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;
};

// Blocking-style (poll with a deadline) whole-frame I/O, for clients and simple servers.
// WriteFrame sends `frame_bytes` (from EncodeFrame) with `fds` on its first byte; the count
// must match the header's fd_count.
Status WriteFrame(int fd, std::span<const uint8_t> frame_bytes, std::span<const int> fds,
                  os::Deadline deadline, os::SysCalls& sys = os::SysCalls::Default());
// Reads one frame: header first (bounds checked), then exactly payload_length bytes. The frame
// must carry exactly fd_count fds. A peer that closed before the frame was complete (before it
// began, or inside it) is kUnavailable: it went away (os::RecvMessage).
Result<Frame> ReadFrame(int fd, Expect expect, os::Deadline deadline,
                        os::SysCalls& sys = os::SysCalls::Default());

// Incremental frame reading for a non-blocking (epoll) server: call ReadAvailable when the fd
// is readable. It returns a complete Frame, std::nullopt when more bytes are needed (the
// socket would block), kUnavailable when the peer closed (between frames, or inside one: a
// peer that left, as for ReadFrame), kProtocol for a bad frame. After an error the reader must
// not be used again.
class FrameReader {
 public:
  explicit FrameReader(Expect expect, os::SysCalls& sys = os::SysCalls::Default())
      : expect_(expect), sys_(&sys) {}
  Result<std::optional<Frame>> ReadAvailable(int fd);

 private:
  Expect expect_;
  os::SysCalls* sys_;
  uint8_t header_bytes_[kFrameHeaderSize] = {};
  size_t header_got_ = 0;
  std::optional<FrameHeader> header_;
  Frame frame_;
  size_t payload_got_ = 0;
};

// Incremental frame writing for a non-blocking server. Holds the encoded bytes and borrows the
// fds (the caller keeps them open until Done()). Flush returns true once everything is sent,
// false when the socket would block (wait for EPOLLOUT and call again).
class FrameWriter {
 public:
  FrameWriter(std::vector<uint8_t> frame_bytes, std::vector<int> fds,
              os::SysCalls& sys = os::SysCalls::Default())
      : sys_(&sys), bytes_(std::move(frame_bytes)), fds_(std::move(fds)) {}
  Result<bool> Flush(int fd);
  bool Done() const { return sent_ == bytes_.size(); }

 private:
  os::SysCalls* sys_;
  std::vector<uint8_t> bytes_;
  std::vector<int> fds_;
  size_t sent_ = 0;
};

}  // namespace weightcache::protocol
