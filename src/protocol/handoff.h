// The keeper handoff: what a daemon deposits with its keeper and withdraws again after a
// restart (docs/protocol.md §8, docs/keeper.md), and the checks the receiver runs before it
// holds or adopts anything.
//
// Messages (frame types 32..39, versioned by kHandoffVersion in the frame header, frame.h):
//   Deposit        depositor → keeper   DepositInfo payload; fds: manifest memfd + one per
//                                       allocation (the same fds an AttachReply carries)
//   DepositReply   keeper → depositor   empty
//   Withdraw       withdrawer → keeper  the withdrawer's config digest (64 hex bytes)
//   WithdrawReply  keeper → withdrawer  the deposit's DepositInfo payload and fds, unchanged
//   Query          any allowed peer     empty
//   QueryReply     keeper → peer        KeeperQuery payload
//   Drop           owner → keeper       empty; the keeper replies DropReply, closes its fds
//   DropReply      keeper → owner       empty                             and exits
//   Handover       daemon → successor   DepositInfo payload; fds: the Deposit's, then the
//                                       identity lock's (an upgrade, docs/upgrade.md)
//   HandoverDone   successor → daemon   empty: the successor serves at the socket path
// Refusals are the daemon protocol's Error frame (frozen across versions).
//
// The per-allocation sizes and per-tensor checksums of a deposit are the manifest's (the
// sealed memfd the daemon already hands to its clients): a deposit does not repeat them.
//
// Contract:
//  * Payloads are binary, little-endian, fixed layouts (docs/protocol.md §8); decoders treat
//    them as untrusted and fail with kProtocol naming the message and the field.
//  * DecodeHandoff takes a whole Deposit or WithdrawReply frame and checks, before anything is
//    held: the payload; the fd count (1 + allocation_count); the manifest memfd (seals, size,
//    every record); that the manifest's allocation count and tier agree; each allocation fd
//    (host tier: a regular file with the read-only seals, at least the allocation's size; gpu
//    tier: the caller's FdCheck, for it cannot be checked without CUDA). A failure holds
//    nothing: every fd of the frame is closed.
//  * CheckAdoptable is the withdrawer's second half: the config digest must equal its own
//    (kMismatch naming both), then the memory must match the manifest's checksums, for every
//    tensor or for a sample (host tier: mapped read-only here; gpu tier: the caller's
//    ChecksumFn). Nothing is adopted unless both pass.
//  * Types are move-only values (they own fds and mappings). Functions are thread-safe (pure
//    except for the reads of the fds they are given).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "weightcache/status.h"

namespace weightcache::protocol {

// The fixed part of a Deposit / WithdrawReply payload (the config JSON follows it).
inline constexpr size_t kDepositHeaderSize = 96;
inline constexpr size_t kDigestHexLength = 64;
inline constexpr size_t kQueryReplyHeaderSize = 112;

// What a deposit says about itself. state is always "ready": a load that did not complete is
// never deposited, so the wire has no other value (any other byte is rejected).
struct DepositInfo {
  std::string config_digest;  // 64 lowercase hex: the CacheConfig digest
  std::string config_json;    // its canonical JSON (for listings; the digest decides)
  int64_t depositor_pid = 0;
  uint64_t manifest_size = 0;
  uint32_t allocation_count = 0;
};

// A received deposit: its description, the manifest memfd (kept to hand on), the decoded
// manifest mapped from it, and one fd per allocation, in manifest order.
struct Handoff {
  DepositInfo info;
  UniqueFd manifest_fd;
  Manifest manifest;
  std::vector<UniqueFd> allocations;
  UniqueFd lock;  // a Handover's: the identity lock's open file description (else invalid)

  Tier tier() const { return manifest.tier(); }
  uint64_t bytes() const;  // the sum of the allocation sizes
  // manifest fd first, then the allocations: what Deposit and WithdrawReply carry (borrowed).
  std::vector<int> frame_fds() const;
};

// The gpu tier's per-allocation fd check (a VMM POSIX fd says nothing about itself without
// the CUDA driver): OK or the reason. Null: gpu fds are held unchecked (the keeper).
using FdCheck = std::function<Status(int fd, uint64_t allocation_size, uint32_t index)>;
Result<Handoff> DecodeHandoff(Frame frame, const FdCheck& gpu_fd_check = nullptr);

// One host-tier allocation fd: a regular file (memfd) carrying F_SEAL_WRITE|GROW|SHRINK, of at
// least `size` bytes. kProtocol (not a memfd, too small) or kPermissionDenied (seals missing),
// naming allocation `index`.
Status CheckHostAllocationFd(int fd, uint64_t size, uint32_t index);

enum class ChecksumCheck {
  kFull,    // every tensor
  kSample,  // AdoptOptions::sample_tensors tensors spread evenly over the name order
};

// `nbytes` at `offset` of allocation `allocation`: one tensor for the checksum function.
struct ChecksumRange {
  uint32_t allocation = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};
// The checksums of every range, in order, in ONE call (the gpu tier's kernel: one launch and
// one synchronization for all the tensors checked, not one per tensor).
using ChecksumFn = std::function<Result<std::vector<uint64_t>>(std::span<const ChecksumRange>)>;

struct AdoptOptions {
  std::string expected_digest;  // the withdrawer's CacheConfig digest
  ChecksumCheck checksums = ChecksumCheck::kFull;
  uint32_t sample_tensors = 64;
  ChecksumFn gpu_checksum;  // required for a gpu-tier handoff
};
// kMismatch "keeper holds cache <A>, this daemon serves <B>"; kProtocol naming the tensor whose
// checksum differs ("... in memory, ... in the manifest").
Status CheckAdoptable(const Handoff& handoff, const AdoptOptions& options);

// Deposit / WithdrawReply frames: send with Handoff::frame_fds() (or the same fds in that
// order). kInvalidArgument for a digest that is not 64 lowercase hex, an allocation count over
// kMaxAllocations or a config JSON that does not fit the frame.
Result<std::vector<uint8_t>> EncodeDeposit(const DepositInfo& info);
Result<std::vector<uint8_t>> EncodeWithdrawReply(const DepositInfo& info);
// Send with Handoff::frame_fds() and then the lock's fd: 2 + allocation_count fds.
Result<std::vector<uint8_t>> EncodeHandover(const DepositInfo& info);

Result<std::vector<uint8_t>> EncodeWithdraw(std::string_view config_digest);
// The digest a Withdraw asks for (64 lowercase hex).
Result<std::string> DecodeWithdraw(std::span<const uint8_t> payload);

enum class KeeperState : uint8_t { kWaiting = 1, kHolding = 2 };
std::string_view KeeperStateName(KeeperState state);  // "waiting", "holding"

// What a keeper holds (QueryReply). While waiting, the deposit fields are empty / 0.
struct KeeperQuery {
  KeeperState state = KeeperState::kWaiting;
  int64_t keeper_pid = 0;
  uint64_t age_ms = 0;    // since the deposit (holding) or since the keeper started (waiting)
  uint64_t bytes = 0;     // the allocations' total
  uint32_t fd_count = 0;  // allocation fds held (the manifest memfd not counted)
  int64_t depositor_pid = 0;
  std::string config_digest;
  std::string config_json;
};
Result<std::vector<uint8_t>> EncodeQueryReply(const KeeperQuery& query);
Result<KeeperQuery> DecodeQueryReply(std::span<const uint8_t> payload);

// DepositReply, Query, Drop, DropReply and HandoverDone carry no payload.
Result<std::vector<uint8_t>> EncodeEmptyHandoff(MessageType type);
// kProtocol "<type>: payload must be empty (N bytes)" unless `payload` is empty.
Status CheckEmptyHandoff(MessageType type, std::span<const uint8_t> payload);

}  // namespace weightcache::protocol
