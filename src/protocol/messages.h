// The messages of the weightcache protocol and their payload codecs (docs/protocol.md §3).
//
// Contract:
//  * EncodeX returns a complete frame (header + payload, see frame.h) ready for WriteFrame;
//    kInvalidArgument if it would exceed the frame bounds.
//  * DecodeX takes a received payload (untrusted) and returns the message or kProtocol naming
//    the message and the offending field: control payloads are JSON objects with exactly the
//    documented fields (a missing, ill-typed or unknown field is an error), nesting at most
//    kMaxJsonDepth deep. Decoders never throw and never trust a length they have not checked.
//  * AttachReply's payload is 16 bytes { u64 manifest_size, u32 allocation_count, u32 0 };
//    its fds travel in the same frame: first the sealed memfd holding the binary manifest
//    (manifest.h), then one per allocation, in allocation order. DecodeAttachReply checks the
//    manifest memfd's seals and size, maps it and validates it (MapManifestMemfd).
//  * Types are plain values (AttachReply is move-only: it owns fds). Thread-safe: pure.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "weightcache/enum_names.h"
#include "weightcache/status.h"

namespace weightcache::protocol {

inline constexpr int kMaxJsonDepth = 16;

// kAwaiting: a published cache (source published:<tag>) waiting for its publisher's commit.
// kDemoted: a gpu-tier cache whose memory was moved to host RAM (serve --demote host); an
// Attach promotes it back before it is answered (docs/budget.md).
enum class CacheState : uint8_t { kLoading, kReady, kFailed, kDraining, kAwaiting, kDemoted };
inline constexpr std::array<EnumName<CacheState>, 6> kCacheStateNames{{
    {CacheState::kLoading, "loading"},
    {CacheState::kReady, "ready"},
    {CacheState::kFailed, "failed"},
    {CacheState::kDraining, "draining"},
    {CacheState::kAwaiting, "awaiting"},
    {CacheState::kDemoted, "demoted"},
}};
static_assert(IsDenseEnumTable(kCacheStateNames));
std::string_view CacheStateName(CacheState state);  // "unknown" outside the table
Result<CacheState> ParseCacheState(std::string_view name);

// Client → daemon, first message of a connection.
struct Hello {
  uint32_t protocol_version = kProtocolVersion;
  nlohmann::json config = nlohmann::json::object();  // the client's CacheConfig::ToJson()
  int64_t client_pid = 0;
  std::string client_name;
};

struct ConfigDifference {
  std::string field;
  std::string daemon;  // the daemon's value, as text
  std::string client;  // the client's value, as text
  bool operator==(const ConfigDifference&) const = default;
};

struct HelloReply {
  CacheState state = CacheState::kLoading;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  std::string failure_reason;  // set when state == kFailed
  // The failed load's code (kOk unless state == kFailed, then an error code): a client acts on
  // it (exit code, exception) without parsing failure_reason.
  StatusCode failure_code = StatusCode::kOk;
  // The daemon's own verdict, informational: a client compares daemon_config with its config
  // itself and never acts on this flag (docs/client.md).
  bool match = false;
  nlohmann::json daemon_config = nlohmann::json::object();
  std::vector<ConfigDifference> differences;  // empty when match
};

// Status request: empty payload.
struct StatusReply {
  CacheState state = CacheState::kLoading;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  std::string failure_reason;
  StatusCode failure_code = StatusCode::kOk;  // as in HelloReply
  Tier tier = Tier::kHost;
  std::string device_uuid;  // "GPU-…", "MIG-…" or "host"
  std::string model_id;
  uint64_t tensor_count = 0;
  uint64_t bytes = 0;  // bytes resident in the cache
  uint32_t clients = 0;
  int64_t pid = 0;
  std::string config_digest;  // 64 hex chars
  // Where the cache's bytes came from (StoreSummary::origin: "disk", "fleet", "peer <device
  // key>", "published", "adopted"); "" before its store exists (loading, awaiting). Version 8.
  std::string origin;
};

// Attach request: empty payload. The reply is AttachReply (or Error, e.g. not ready).
struct AttachReply {
  Manifest manifest;          // mapped from the reply's first fd, which is then closed
  std::vector<UniqueFd> fds;  // one per manifest allocation, in order
};
inline constexpr size_t kAttachReplyPayloadSize = 16;

// Stop request: empty payload. The daemon answers, then drains and exits.
struct StopReply {
  uint32_t clients = 0;  // clients attached when the stop was accepted
};

// Upgrade request (docs/upgrade.md): the daemon starts `binary` (empty: its own executable
// as it was at its start) as its successor and hands the cache over. Owner uid only.
struct UpgradeRequest {
  std::string binary;
};
// Sent once the successor serves at the socket path (or an Error: the daemon keeps serving).
struct UpgradeReply {
  int64_t successor_pid = 0;
  uint64_t handover_us = 0;  // from the successor's start to its HandoverDone
};

// Evict request: empty payload; the daemon's owner uid only (docs/budget.md). A daemon with no
// attached client, not pinned and ready answers evicted and stops (dropping its keeper: the
// memory is freed); any other answers refused, saying why.
struct EvictReply {
  bool evicted = false;
  uint32_t clients = 0;  // clients attached when it answered
  std::string reason;    // why it refused ("" when evicted)
};

// Metrics request: empty payload. The daemon's attach counters (daemon/metrics.h), for
// `weightcache status`; the same values its --metrics-addr endpoint exposes.
struct MetricsReply {
  uint64_t hits = 0;    // attaches served
  uint64_t misses = 0;  // mismatch + unavailable
  uint64_t attaches_daemon = 0;
  uint64_t attaches_mismatch = 0;
  uint64_t attaches_unavailable = 0;
  uint64_t attaches_error = 0;
  uint64_t last_attach_unix_ms = 0;  // 0: never attached
  uint32_t clients = 0;
};

// Any request may be answered with an Error (the daemon keeps the connection open unless the
// request itself was malformed).
struct ErrorReply {
  StatusCode code = StatusCode::kInternal;
  std::string message;
};

Result<std::vector<uint8_t>> EncodeHello(const Hello& msg);
Result<Hello> DecodeHello(std::span<const uint8_t> payload);

Result<std::vector<uint8_t>> EncodeHelloReply(const HelloReply& msg);
Result<HelloReply> DecodeHelloReply(std::span<const uint8_t> payload);

Result<std::vector<uint8_t>> EncodeStatusRequest();
Result<std::vector<uint8_t>> EncodeAttachRequest();
Result<std::vector<uint8_t>> EncodeStopRequest();
// Status, Attach and Stop requests carry no payload: OK if `payload` is empty.
Status DecodeEmptyRequest(MessageType type, std::span<const uint8_t> payload);

Result<std::vector<uint8_t>> EncodeStatusReply(const StatusReply& msg);
Result<StatusReply> DecodeStatusReply(std::span<const uint8_t> payload);

// The frame to send with fds {manifest memfd (CreateManifestMemfd), allocation fds...}:
// 1 + allocation_count fds. kInvalidArgument beyond kMaxAllocations.
Result<std::vector<uint8_t>> EncodeAttachReply(uint64_t manifest_size, uint32_t allocation_count);
// Takes the whole frame: maps and validates the manifest memfd (its first fd) and checks one
// further fd per allocation.
// `check`: RecordCheck::kDeferred leaves the manifest's records to the consumer
// (Manifest::ValidateRecords), which then must run it before reading a record.
Result<AttachReply> DecodeAttachReply(Frame frame, RecordCheck check = RecordCheck::kNow);

Result<std::vector<uint8_t>> EncodeMetricsRequest();
Result<std::vector<uint8_t>> EncodeEvictRequest();
Result<std::vector<uint8_t>> EncodeEvictReply(const EvictReply& msg);
Result<EvictReply> DecodeEvictReply(std::span<const uint8_t> payload);
Result<std::vector<uint8_t>> EncodeMetricsReply(const MetricsReply& msg);
Result<MetricsReply> DecodeMetricsReply(std::span<const uint8_t> payload);

Result<std::vector<uint8_t>> EncodeStopReply(const StopReply& msg);
Result<StopReply> DecodeStopReply(std::span<const uint8_t> payload);

Result<std::vector<uint8_t>> EncodeUpgradeRequest(const UpgradeRequest& msg);
Result<UpgradeRequest> DecodeUpgradeRequest(std::span<const uint8_t> payload);
Result<std::vector<uint8_t>> EncodeUpgradeReply(const UpgradeReply& msg);
Result<UpgradeReply> DecodeUpgradeReply(std::span<const uint8_t> payload);

// ---- publishing (docs/publish.md) ----

// One tensor of a publish plan. Shape entries are element counts (JSON non-negative integers).
struct PlannedTensor {
  std::string name;
  std::string dtype;  // the safetensors spelling ("BF16", "F8_E4M3")
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
  // Empty: the tensor has bytes of its own. Else the name of another plan tensor whose bytes
  // this one shares (tied weights: one region, several names): same dtype, shape and nbytes,
  // and not itself an alias. The arena places it at its target's offset; the publisher writes
  // the target only.
  std::string alias_of = {};
};

inline constexpr uint64_t kMaxPublishMetadataBytes = uint64_t{64} << 10;

// PublishBegin {tensors: [{name, dtype, shape: [u64], nbytes: u64, alias_of: string}],
//               metadata: string}.
struct PublishBegin {
  std::vector<PlannedTensor> tensors;
  std::string metadata;  // free-form (engine version, layout notes), <= kMaxPublishMetadataBytes
};

// The semantic rules of a plan, the one home of them (the daemon refuses, the Publisher checks
// before sending): 1 … checkpoint::kMaxTensorCount tensors; names non-empty, at most
// kMaxTensorNameBytes each and kMaxTensorNameBytesTotal together, unique; dtype a known
// safetensors spelling; ndim <= kMaxTensorRank; nbytes == product(shape) × dtype size,
// computed with overflow checks; the total of nbytes fits in 62 bits; metadata <= 64 KiB;
// alias_of, when set, names another plan tensor that is no alias, of the same dtype, shape
// and nbytes. kInvalidArgument "publish plan: tensor <i> '<name>': <what>".
Status ValidatePublishPlan(const PublishBegin& plan);

// PublishCommit {checksums: [u64]}: one per plan tensor, in plan order (common/checksum.h).
struct PublishCommit {
  std::vector<uint64_t> checksums;
};

// PublishCommitted {tensor_count: u64, bytes: u64}: the cache is ready with them.
struct PublishCommitted {
  uint64_t tensor_count = 0;
  uint64_t bytes = 0;  // resident bytes of the arena
};

// The encoders check structure only (sizes of the frame), not ValidatePublishPlan: the
// decoder's side (the daemon) is the authority on the plan.
Result<std::vector<uint8_t>> EncodePublishBegin(const PublishBegin& msg);
Result<PublishBegin> DecodePublishBegin(std::span<const uint8_t> payload);
// PublishArena: the AttachReply layout under its own type (16 bytes; fds: the manifest memfd,
// whose records carry checksum 0, then one writable memfd per allocation).
Result<std::vector<uint8_t>> EncodePublishArena(uint64_t manifest_size, uint32_t allocation_count);
Result<AttachReply> DecodePublishArena(Frame frame);
Result<std::vector<uint8_t>> EncodePublishCommit(const PublishCommit& msg);
Result<PublishCommit> DecodePublishCommit(std::span<const uint8_t> payload);
Result<std::vector<uint8_t>> EncodePublishCommitted(const PublishCommitted& msg);
Result<PublishCommitted> DecodePublishCommitted(std::span<const uint8_t> payload);

// `status` must be an error; its code and message travel.
Result<std::vector<uint8_t>> EncodeError(const Status& status);
Result<ErrorReply> DecodeError(std::span<const uint8_t> payload);

}  // namespace weightcache::protocol
