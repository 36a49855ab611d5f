#include "protocol/handoff.h"

#include <sys/stat.h>

#include <cstring>
#include <string>

#include "common/checksum.h"
#include "os/memfd.h"
#include "protocol/wire.h"

namespace weightcache::protocol {
namespace {

// The only state a deposit can be in (docs/protocol.md §8).
constexpr uint8_t kStateReady = 1;

bool IsDigest(std::string_view s) {
  if (s.size() != kDigestHexLength) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// A digest field as it arrived: quoted only when it is printable hex, so that hostile bytes
// never reach a log line.
std::string ShowDigest(std::span<const uint8_t> bytes) {
  std::string s(bytes.begin(), bytes.end());
  return IsDigest(s) ? "\"" + s + "\"" : "that is not 64 lowercase hex characters";
}

std::string Hex64(uint64_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out = "0x";
  for (int shift = 60; shift >= 0; shift -= 4) out += kDigits[(v >> shift) & 0xf];
  return out;
}

Result<std::vector<uint8_t>> EncodeInfo(MessageType type, const DepositInfo& info) {
  const std::string name = MessageTypeName(type);
  if (!IsDigest(info.config_digest)) {
    return InvalidArgument(name + ": config digest is not 64 lowercase hex characters");
  }
  if (info.allocation_count > kMaxAllocations) {
    return InvalidArgument(name + ": " + std::to_string(info.allocation_count) +
                           " allocations; at most " + std::to_string(kMaxAllocations) +
                           " fit one frame");
  }
  if (info.manifest_size < kManifestHeaderSize || info.manifest_size > kMaxManifestSize) {
    return InvalidArgument(name + ": manifest size " + std::to_string(info.manifest_size) +
                           " out of range");
  }
  if (info.depositor_pid <= 0) return InvalidArgument(name + ": depositor pid must be positive");
  std::vector<uint8_t> payload;
  payload.reserve(kDepositHeaderSize + info.config_json.size());
  wire::PutU64(payload, info.manifest_size);
  wire::PutU32(payload, info.allocation_count);
  wire::PutU8(payload, kStateReady);
  for (int i = 0; i < 3; ++i) wire::PutU8(payload, 0);
  wire::PutU64(payload, static_cast<uint64_t>(info.depositor_pid));
  payload.insert(payload.end(), info.config_digest.begin(), info.config_digest.end());
  wire::PutU32(payload, static_cast<uint32_t>(info.config_json.size()));
  wire::PutU32(payload, 0);
  payload.insert(payload.end(), info.config_json.begin(), info.config_json.end());
  // A Handover carries the lock's fd after the allocations': one fd fewer for them.
  const uint32_t extra = type == MessageType::kHandover ? 1 : 0;
  if (info.allocation_count + 1 + extra > kMaxFdsPerFrame) {
    return InvalidArgument(name + ": " + std::to_string(info.allocation_count) +
                           " allocations and the lock do not fit one frame's " +
                           std::to_string(kMaxFdsPerFrame) + " fds");
  }
  return EncodeFrame(type, payload, 1 + info.allocation_count + extra);
}

Result<DepositInfo> DecodeInfo(MessageType type, std::span<const uint8_t> payload) {
  const std::string name = MessageTypeName(type);
  if (payload.size() < kDepositHeaderSize) {
    return ProtocolError(name + ": payload of " + std::to_string(payload.size()) +
                         " bytes is shorter than its " + std::to_string(kDepositHeaderSize) +
                         "-byte header");
  }
  const uint8_t* p = payload.data();
  DepositInfo info;
  info.manifest_size = wire::GetU64(p);
  info.allocation_count = wire::GetU32(p + 8);
  const uint8_t state = p[12];
  const uint64_t pid = wire::GetU64(p + 16);
  const uint32_t json_length = wire::GetU32(p + 88);
  if (state != kStateReady) {
    return ProtocolError(name + ": state " + std::to_string(state) +
                         " is not ready (1): only a completed load is ever handed over");
  }
  if (p[13] != 0 || p[14] != 0 || p[15] != 0 || wire::GetU32(p + 92) != 0) {
    return ProtocolError(name + ": reserved bytes are not 0");
  }
  if (info.allocation_count == 0 || info.allocation_count > kMaxAllocations) {
    return ProtocolError(name + ": allocation_count " + std::to_string(info.allocation_count) +
                         " outside 1 … " + std::to_string(kMaxAllocations));
  }
  if (info.manifest_size < kManifestHeaderSize || info.manifest_size > kMaxManifestSize) {
    return ProtocolError(name + ": manifest_size " + std::to_string(info.manifest_size) +
                         " outside " + std::to_string(kManifestHeaderSize) + " … " +
                         std::to_string(kMaxManifestSize));
  }
  if (pid == 0 || pid > static_cast<uint64_t>(INT64_MAX)) {
    return ProtocolError(name + ": depositor_pid " + std::to_string(pid) + " is not a pid");
  }
  info.depositor_pid = static_cast<int64_t>(pid);
  std::span<const uint8_t> digest = payload.subspan(24, kDigestHexLength);
  info.config_digest.assign(digest.begin(), digest.end());
  if (!IsDigest(info.config_digest)) {
    return ProtocolError(name + ": config_digest " + ShowDigest(digest));
  }
  if (json_length != payload.size() - kDepositHeaderSize) {
    return ProtocolError(name + ": config_json_length " + std::to_string(json_length) + " but " +
                         std::to_string(payload.size() - kDepositHeaderSize) +
                         " bytes follow the header");
  }
  info.config_json.assign(payload.begin() + kDepositHeaderSize, payload.end());
  return info;
}

// Which tensors a checksum check covers: all, or `n` spread evenly over the name order, the
// first and the last included.
std::vector<size_t> TensorsToCheck(size_t count, ChecksumCheck mode, uint32_t n) {
  std::vector<size_t> out;
  if (mode == ChecksumCheck::kFull || n >= count) {
    for (size_t i = 0; i < count; ++i) out.push_back(i);
    return out;
  }
  if (n == 0) return out;
  if (n == 1) return {0};
  for (uint32_t i = 0; i < n; ++i) out.push_back(i * (count - 1) / (n - 1));
  return out;
}

}  // namespace

uint64_t Handoff::bytes() const {
  uint64_t total = 0;
  for (uint64_t size : manifest.allocation_sizes()) total += size;
  return total;
}

std::vector<int> Handoff::frame_fds() const {
  std::vector<int> fds;
  fds.reserve(1 + allocations.size());
  fds.push_back(manifest_fd.get());
  for (const UniqueFd& fd : allocations) fds.push_back(fd.get());
  return fds;
}

Status CheckHostAllocationFd(int fd, uint64_t size, uint32_t index) {
  const std::string what = "allocation " + std::to_string(index);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return IoError(what + ": fstat", errno);
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISFIFO(st.st_mode)   ? "a pipe"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                                              : "not a regular file";
    return ProtocolError(what + ": the fd is " + std::string(kind) + ", not a sealed memfd");
  }
  Status sealed = os::CheckSealedReadOnly(fd);
  if (!sealed.ok()) return sealed.Context(what);
  if (static_cast<uint64_t>(st.st_size) < size) {
    return ProtocolError(what + ": memfd of " + std::to_string(st.st_size) +
                         " bytes is smaller than the allocation's " + std::to_string(size) +
                         " bytes");
  }
  return Status::Ok();
}

Result<Handoff> DecodeHandoff(Frame frame, const FdCheck& gpu_fd_check) {
  if (frame.type != MessageType::kDeposit && frame.type != MessageType::kWithdrawReply &&
      frame.type != MessageType::kHandover) {
    return ProtocolError("expected a Deposit, WithdrawReply or Handover, got " +
                         MessageTypeName(frame.type));
  }
  const std::string name = MessageTypeName(frame.type);
  WEIGHTCACHE_ASSIGN_OR_RETURN(DepositInfo info, DecodeInfo(frame.type, frame.payload));
  const bool handover = frame.type == MessageType::kHandover;
  if (frame.fds.size() != 1 + size_t{info.allocation_count} + (handover ? 1 : 0)) {
    return ProtocolError(name + " carries " + std::to_string(frame.fds.size()) + " fds for " +
                         std::to_string(info.allocation_count) +
                         " allocations (expected the manifest memfd + one per allocation" +
                         (handover ? " + the lock" : "") + ")");
  }
  Handoff handoff;
  if (handover) {
    handoff.lock = std::move(frame.fds.back());
    frame.fds.pop_back();
    struct stat st {};
    if (::fstat(handoff.lock.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return ProtocolError(name + ": the lock fd is not a regular file");
    }
  }
  handoff.info = std::move(info);
  handoff.manifest_fd = std::move(frame.fds[0]);
  auto manifest = MapManifestMemfd(handoff.manifest_fd.get(), handoff.info.manifest_size);
  if (!manifest.ok()) {
    Status status = manifest.status();
    return status.Context(name + ": manifest memfd");
  }
  handoff.manifest = std::move(manifest).value();
  const std::vector<uint64_t>& sizes = handoff.manifest.allocation_sizes();
  if (sizes.size() != handoff.info.allocation_count) {
    return ProtocolError(name + ": the manifest lists " + std::to_string(sizes.size()) +
                         " allocations, the deposit " +
                         std::to_string(handoff.info.allocation_count));
  }
  for (uint32_t i = 0; i < handoff.info.allocation_count; ++i) {
    UniqueFd fd = std::move(frame.fds[1 + i]);
    Status ok = Status::Ok();
    if (handoff.tier() == Tier::kHost) {
      ok = CheckHostAllocationFd(fd.get(), sizes[i], i);
    } else if (gpu_fd_check) {
      ok = gpu_fd_check(fd.get(), sizes[i], i);
    }
    if (!ok.ok()) return ok.Context(name);
    handoff.allocations.push_back(std::move(fd));
  }
  return handoff;
}

Status CheckAdoptable(const Handoff& handoff, const AdoptOptions& options) {
  if (handoff.info.config_digest != options.expected_digest) {
    return Status(StatusCode::kMismatch, "keeper holds cache " + handoff.info.config_digest +
                                             ", this daemon serves " + options.expected_digest);
  }
  const Manifest& manifest = handoff.manifest;
  if (handoff.tier() == Tier::kGpu && !options.gpu_checksum) {
    return InvalidArgument("a gpu-tier handoff needs a checksum function to be checked");
  }
  std::vector<os::MappedRegion> maps;
  if (handoff.tier() == Tier::kHost) {
    for (size_t i = 0; i < handoff.allocations.size(); ++i) {
      auto region = os::MapReadOnly(handoff.allocations[i].get(), manifest.allocation_sizes()[i]);
      if (!region.ok()) {
        Status status = region.status();
        return status.Context("mapping allocation " + std::to_string(i));
      }
      maps.push_back(std::move(region).value());
    }
  }
  const std::vector<size_t> checked =
      TensorsToCheck(manifest.tensor_count(), options.checksums, options.sample_tensors);
  std::vector<uint64_t> gpu_sums;
  if (handoff.tier() == Tier::kGpu && !checked.empty()) {
    std::vector<ChecksumRange> ranges;
    ranges.reserve(checked.size());
    for (size_t i : checked) {
      const TensorRecord r = manifest.record(i);
      ranges.push_back({r.allocation, r.offset, r.nbytes});
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(gpu_sums, options.gpu_checksum(ranges));
    if (gpu_sums.size() != ranges.size()) {
      return InternalError("the checksum function returned " + std::to_string(gpu_sums.size()) +
                           " checksums for " + std::to_string(ranges.size()) + " tensors");
    }
  }
  for (size_t k = 0; k < checked.size(); ++k) {
    const TensorRecord r = manifest.record(checked[k]);
    const uint64_t sum =
        handoff.tier() == Tier::kHost
            ? TensorChecksum(static_cast<const uint8_t*>(maps[r.allocation].data()) + r.offset,
                             r.nbytes)
            : gpu_sums[k];
    if (sum != r.checksum) {
      return ProtocolError("tensor '" + std::string(r.name) + "' (allocation " +
                           std::to_string(r.allocation) + ", offset " + std::to_string(r.offset) +
                           "): checksum " + Hex64(sum) + " in memory, " + Hex64(r.checksum) +
                           " in the manifest");
    }
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> EncodeDeposit(const DepositInfo& info) {
  return EncodeInfo(MessageType::kDeposit, info);
}

Result<std::vector<uint8_t>> EncodeWithdrawReply(const DepositInfo& info) {
  return EncodeInfo(MessageType::kWithdrawReply, info);
}

Result<std::vector<uint8_t>> EncodeHandover(const DepositInfo& info) {
  return EncodeInfo(MessageType::kHandover, info);
}

Result<std::vector<uint8_t>> EncodeWithdraw(std::string_view config_digest) {
  if (!IsDigest(config_digest)) {
    return InvalidArgument("Withdraw: config digest is not 64 lowercase hex characters");
  }
  return EncodeFrame(
      MessageType::kWithdraw,
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(config_digest.data()),
                               config_digest.size()));
}

Result<std::string> DecodeWithdraw(std::span<const uint8_t> payload) {
  if (payload.size() != kDigestHexLength) {
    return ProtocolError("Withdraw: payload of " + std::to_string(payload.size()) +
                         " bytes (expected the " + std::to_string(kDigestHexLength) +
                         "-character config digest)");
  }
  std::string digest(payload.begin(), payload.end());
  if (!IsDigest(digest)) return ProtocolError("Withdraw: config digest " + ShowDigest(payload));
  return digest;
}

std::string_view KeeperStateName(KeeperState state) {
  switch (state) {
    case KeeperState::kWaiting:
      return "waiting";
    case KeeperState::kHolding:
      return "holding";
  }
  return "unknown";
}

Result<std::vector<uint8_t>> EncodeQueryReply(const KeeperQuery& q) {
  const bool holding = q.state == KeeperState::kHolding;
  if (holding && !IsDigest(q.config_digest)) {
    return InvalidArgument("QueryReply: config digest is not 64 lowercase hex characters");
  }
  if (!holding && (!q.config_digest.empty() || !q.config_json.empty() || q.fd_count != 0)) {
    return InvalidArgument("QueryReply: a waiting keeper holds no deposit");
  }
  std::vector<uint8_t> payload;
  wire::PutU8(payload, static_cast<uint8_t>(q.state));
  for (int i = 0; i < 7; ++i) wire::PutU8(payload, 0);
  wire::PutU64(payload, static_cast<uint64_t>(q.keeper_pid));
  wire::PutU64(payload, q.age_ms);
  wire::PutU64(payload, q.bytes);
  wire::PutU32(payload, q.fd_count);
  wire::PutU32(payload, static_cast<uint32_t>(q.config_json.size()));
  wire::PutU64(payload, static_cast<uint64_t>(q.depositor_pid));
  if (holding) {
    payload.insert(payload.end(), q.config_digest.begin(), q.config_digest.end());
  } else {
    payload.insert(payload.end(), kDigestHexLength, 0);
  }
  payload.insert(payload.end(), q.config_json.begin(), q.config_json.end());
  return EncodeFrame(MessageType::kQueryReply, payload);
}

Result<KeeperQuery> DecodeQueryReply(std::span<const uint8_t> payload) {
  if (payload.size() < kQueryReplyHeaderSize) {
    return ProtocolError("QueryReply: payload of " + std::to_string(payload.size()) +
                         " bytes is shorter than its " + std::to_string(kQueryReplyHeaderSize) +
                         "-byte header");
  }
  const uint8_t* p = payload.data();
  KeeperQuery q;
  if (p[0] != static_cast<uint8_t>(KeeperState::kWaiting) &&
      p[0] != static_cast<uint8_t>(KeeperState::kHolding)) {
    return ProtocolError("QueryReply: unknown keeper state " + std::to_string(p[0]));
  }
  for (int i = 1; i < 8; ++i) {
    if (p[i] != 0) return ProtocolError("QueryReply: reserved bytes are not 0");
  }
  q.state = static_cast<KeeperState>(p[0]);
  q.keeper_pid = static_cast<int64_t>(wire::GetU64(p + 8));
  q.age_ms = wire::GetU64(p + 16);
  q.bytes = wire::GetU64(p + 24);
  q.fd_count = wire::GetU32(p + 32);
  const uint32_t json_length = wire::GetU32(p + 36);
  q.depositor_pid = static_cast<int64_t>(wire::GetU64(p + 40));
  if (json_length != payload.size() - kQueryReplyHeaderSize) {
    return ProtocolError("QueryReply: config_json_length " + std::to_string(json_length) + " but " +
                         std::to_string(payload.size() - kQueryReplyHeaderSize) +
                         " bytes follow the header");
  }
  std::span<const uint8_t> digest = payload.subspan(48, kDigestHexLength);
  if (q.state == KeeperState::kHolding) {
    q.config_digest.assign(digest.begin(), digest.end());
    if (!IsDigest(q.config_digest)) {
      return ProtocolError("QueryReply: config_digest " + ShowDigest(digest));
    }
  } else {
    for (uint8_t b : digest) {
      if (b != 0) return ProtocolError("QueryReply: a waiting keeper reports a digest");
    }
    if (q.fd_count != 0 || json_length != 0) {
      return ProtocolError("QueryReply: a waiting keeper reports fds or a config");
    }
  }
  q.config_json.assign(payload.begin() + kQueryReplyHeaderSize, payload.end());
  return q;
}

Result<std::vector<uint8_t>> EncodeEmptyHandoff(MessageType type) {
  if (type != MessageType::kDepositReply && type != MessageType::kQuery &&
      type != MessageType::kDrop && type != MessageType::kDropReply &&
      type != MessageType::kHandoverDone) {
    return InvalidArgument(MessageTypeName(type) + " is not an empty handoff message");
  }
  return EncodeFrame(type, {});
}

Status CheckEmptyHandoff(MessageType type, std::span<const uint8_t> payload) {
  if (!payload.empty()) {
    return ProtocolError(MessageTypeName(type) + ": payload must be empty (" +
                         std::to_string(payload.size()) + " bytes)");
  }
  return Status::Ok();
}

}  // namespace weightcache::protocol
