#include "protocol/messages.h"

#include <concepts>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "checkpoint/dtype.h"
#include "checkpoint/limits.h"
#include "common/strict_json.h"
#include "protocol/wire.h"

namespace weightcache::protocol {
namespace {

using nlohmann::json;

// Parses a control payload with the one strict reader (common/strict_json.h): nesting capped
// at kMaxJsonDepth before anything else touches the tree, duplicate keys refused.
Result<json> ParseObject(std::string_view message, std::span<const uint8_t> payload) {
  json value;
  const std::string error = ParseStrictJson(
      std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()), value,
      {.max_depth = kMaxJsonDepth});
  if (error == kNotValidJson) return ProtocolError(std::string(message) + ": payload is not JSON");
  if (!error.empty()) return ProtocolError(std::string(message) + ": " + error);
  if (!value.is_object()) {
    return ProtocolError(std::string(message) + ": payload is not a JSON object");
  }
  return value;
}

// ---- the field lists --------------------------------------------------------------------------
//
// Each message's fields are listed once, in a Fields overload below, and both directions read
// that list: Encoder writes each field into a JSON object; Decoder reads each back strictly (it
// must be present, with its type) and Finish refuses any other. The two cannot drift apart.
// `M` is the message, const when encoding.

template <class M, class Message>
concept Is = std::same_as<std::remove_const_t<M>, Message>;

void Fields(auto& v, Is<Hello> auto& m) {
  v("protocol_version", m.protocol_version);
  v("config", m.config);
  v("client_pid", m.client_pid);
  v("client_name", m.client_name);
}

void Fields(auto& v, Is<ConfigDifference> auto& m) {
  v("field", m.field);
  v("daemon", m.daemon);
  v("client", m.client);
}

// The load state that HelloReply and StatusReply both carry.
void LoadStateFields(auto& v, auto& m) {
  v("state", m.state);
  v("bytes_done", m.bytes_done);
  v("bytes_total", m.bytes_total);
  v("failure_reason", m.failure_reason);
  v.FailureCode("failure_code", m.failure_code, m.state);
}

void Fields(auto& v, Is<HelloReply> auto& m) {
  LoadStateFields(v, m);
  v("match", m.match);
  v("config", m.daemon_config);
  v("differences", m.differences);
}

void Fields(auto& v, Is<StatusReply> auto& m) {
  LoadStateFields(v, m);
  v("tier", m.tier);
  v("device_uuid", m.device_uuid);
  v("model_id", m.model_id);
  v("tensor_count", m.tensor_count);
  v("bytes", m.bytes);
  v("clients", m.clients);
  v("pid", m.pid);
  v("config_digest", m.config_digest);
  v("origin", m.origin);
}

void Fields(auto& v, Is<PlannedTensor> auto& m) {
  v("name", m.name);
  v("dtype", m.dtype);
  v.Shape("shape", m.shape);
  v("nbytes", m.nbytes);
  v("alias_of", m.alias_of);
}

void Fields(auto& v, Is<PublishBegin> auto& m) {
  v("tensors", m.tensors);
  v("metadata", m.metadata);
}

void Fields(auto& v, Is<PublishCommit> auto& m) { v("checksums", m.checksums); }

void Fields(auto& v, Is<PublishCommitted> auto& m) {
  v("tensor_count", m.tensor_count);
  v("bytes", m.bytes);
}

void Fields(auto& v, Is<MetricsReply> auto& m) {
  v("hits", m.hits);
  v("misses", m.misses);
  v("attaches_daemon", m.attaches_daemon);
  v("attaches_mismatch", m.attaches_mismatch);
  v("attaches_unavailable", m.attaches_unavailable);
  v("attaches_error", m.attaches_error);
  v("last_attach_unix_ms", m.last_attach_unix_ms);
  v("clients", m.clients);
}

void Fields(auto& v, Is<EvictReply> auto& m) {
  v("evicted", m.evicted);
  v("clients", m.clients);
  v("reason", m.reason);
}

void Fields(auto& v, Is<StopReply> auto& m) { v("clients", m.clients); }

void Fields(auto& v, Is<UpgradeRequest> auto& m) { v("binary", m.binary); }

void Fields(auto& v, Is<UpgradeReply> auto& m) {
  v("successor_pid", m.successor_pid);
  v("handover_us", m.handover_us);
}

template <class T>
struct IsRecordList : std::false_type {};
template <class R>
struct IsRecordList<std::vector<R>> : std::is_class<R> {};

class Encoder {
 public:
  template <class T>
  void operator()(const char* key, const T& value) {
    object_[key] = ToJson(value);
  }
  void FailureCode(const char* key, StatusCode code, CacheState /*state*/) {
    object_[key] = static_cast<uint32_t>(code);
  }
  void Shape(const char* key, const std::vector<uint64_t>& shape) { object_[key] = shape; }
  json Take() && { return std::move(object_); }

 private:
  template <class T>
  static json ToJson(const T& value) {
    if constexpr (std::is_same_v<T, CacheState>) {
      return CacheStateName(value);
    } else if constexpr (std::is_same_v<T, Tier>) {
      return TierName(value);
    } else if constexpr (IsRecordList<T>::value) {
      json items = json::array();
      for (const auto& item : value) {
        Encoder e;
        Fields(e, item);
        items.push_back(std::move(e).Take());
      }
      return items;
    } else {
      return value;
    }
  }

  json object_ = json::object();
};

// Reads the fields in their listed order; the first error is kept, and every later field is
// skipped, so a message reports what is wrong with it first.
class Decoder {
 public:
  Decoder(std::string message, const json& object)
      : message_(std::move(message)), object_(object) {}

  void operator()(const char* key, std::string& out) {
    if (const json* v = Get(key, &json::is_string, "a string")) out = v->get<std::string>();
  }
  void operator()(const char* key, uint64_t& out) {
    if (const json* v = Get(key, &json::is_number_unsigned, "a non-negative integer"))
      out = v->get<uint64_t>();
  }
  void operator()(const char* key, uint32_t& out) {
    uint64_t wide = 0;
    (*this)(key, wide);
    if (!error_.ok()) return;
    if (wide > std::numeric_limits<uint32_t>::max()) {
      Fail(TypeError(key, "a 32-bit integer"));
      return;
    }
    out = static_cast<uint32_t>(wide);
  }
  void operator()(const char* key, int64_t& out) {
    const json* v = Get(key, &json::is_number_integer, "an integer");
    if (v == nullptr) return;
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
        Fail(TypeError(key, "a 64-bit integer"));
        return;
      }
      out = static_cast<int64_t>(v->get<uint64_t>());
      return;
    }
    out = v->get<int64_t>();
  }
  void operator()(const char* key, bool& out) {
    if (const json* v = Get(key, &json::is_boolean, "a boolean")) out = v->get<bool>();
  }
  void operator()(const char* key, json& out) {
    if (const json* v = Get(key, &json::is_object, "an object")) out = *v;
  }
  void operator()(const char* key, CacheState& out) {
    std::string name;
    (*this)(key, name);
    if (!error_.ok()) return;
    Result<CacheState> state = ParseCacheState(name);
    if (!state.ok()) {
      Fail(TypeError(key, "one of loading, ready, failed, draining, awaiting, demoted"));
      return;
    }
    out = *state;
  }
  void operator()(const char* key, Tier& out) {
    std::string name;
    (*this)(key, name);
    if (!error_.ok()) return;
    const std::optional<Tier> tier = ParseTier(name);
    if (!tier) {
      Fail(TypeError(key, "gpu or host"));
      return;
    }
    out = *tier;
  }
  void operator()(const char* key, std::vector<uint64_t>& out) {
    if (const json* items = Get(key, &json::is_array, "an array")) Integers(key, *items, out);
  }
  template <class R>
  void operator()(const char* key, std::vector<R>& out) {
    const json* items = Get(key, &json::is_array, "an array");
    if (items == nullptr) return;
    out.reserve(items->size());
    for (size_t i = 0; i < items->size(); ++i) {
      const json& item = (*items)[i];
      const std::string what = message_ + ": " + key + "[" + std::to_string(i) + "]";
      if (!item.is_object()) {
        Fail(ProtocolError(what + " must be an object"));
        return;
      }
      Decoder d(what, item);
      R record;
      Fields(d, record);
      if (Status done = d.Finish(); !done.ok()) {
        Fail(std::move(done));
        return;
      }
      out.push_back(std::move(record));
    }
  }
  // `failure_code`: an error code when `state` is failed, else 0.
  void FailureCode(const char* key, StatusCode& out, CacheState state) {
    uint32_t v = 0;
    (*this)(key, v);
    if (!error_.ok()) return;
    if (state == CacheState::kFailed && !IsErrorCodeValue(v)) {
      Fail(ProtocolError(message_ + ": field '" + key + "' must be an error code (1 … " +
                         std::to_string(kStatusCodeCount - 1) + ") when the state is failed"));
      return;
    }
    if (state != CacheState::kFailed && v != 0) {
      Fail(ProtocolError(message_ + ": field '" + key + "' must be 0 unless the state is failed"));
      return;
    }
    out = static_cast<StatusCode>(v);
  }
  // A tensor's shape: at most checkpoint::kMaxTensorRank dimensions.
  void Shape(const char* key, std::vector<uint64_t>& out) {
    const json* dims = Get(key, &json::is_array, "an array");
    if (dims == nullptr) return;
    if (dims->size() > checkpoint::kMaxTensorRank) {
      Fail(ProtocolError(message_ + ": field '" + key + "' has " + std::to_string(dims->size()) +
                         " dimensions; at most " + std::to_string(checkpoint::kMaxTensorRank)));
      return;
    }
    Integers(key, *dims, out);
  }

  // The first error, else any field the list did not read.
  Status Finish() const {
    if (!error_.ok()) return error_;
    for (const auto& item : object_.items()) {
      if (!seen_.contains(item.key())) {
        return ProtocolError(message_ + ": unknown field '" + item.key().substr(0, 64) + "'");
      }
    }
    return Status::Ok();
  }

 private:
  using Check = bool (json::*)() const noexcept;  // json::is_string and its kin

  // The field, when no error came before and it is there with the type `check` asks for.
  const json* Get(const char* key, Check check, const char* expected) {
    if (!error_.ok()) return nullptr;
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end()) {
      Fail(ProtocolError(message_ + ": field '" + key + "' missing"));
      return nullptr;
    }
    if (!((*it).*check)()) {
      Fail(TypeError(key, expected));
      return nullptr;
    }
    return &*it;
  }
  // The items of the array field `key`, each a non-negative integer.
  void Integers(const char* key, const json& items, std::vector<uint64_t>& out) {
    out.reserve(items.size());
    for (const json& item : items) {
      if (!item.is_number_unsigned()) {
        Fail(ProtocolError(message_ + ": field '" + key + "' must hold non-negative integers"));
        return;
      }
      out.push_back(item.get<uint64_t>());
    }
  }
  void Fail(Status status) {
    if (error_.ok()) error_ = std::move(status);
  }
  Status TypeError(const char* key, const char* expected) const {
    return ProtocolError(message_ + ": field '" + key + "' must be " + expected);
  }

  std::string message_;
  const json& object_;
  std::set<std::string, std::less<>> seen_;
  Status error_;
};

// Serialises without throwing: invalid UTF-8 in a string (a path, a reason) is replaced.
Result<std::vector<uint8_t>> EncodeJson(MessageType type, const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return EncodeFrame(
      type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

template <class M>
Result<std::vector<uint8_t>> Encode(MessageType type, const M& msg) {
  Encoder e;
  Fields(e, msg);
  return EncodeJson(type, std::move(e).Take());
}

template <class M>
Result<M> Decode(std::string_view message, std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject(message, payload));
  Decoder d(std::string(message), obj);
  M msg;
  Fields(d, msg);
  WEIGHTCACHE_RETURN_IF_ERROR(d.Finish());
  return msg;
}

}  // namespace

std::string_view CacheStateName(CacheState state) {
  return NameIn(kCacheStateNames, state, "unknown");
}

Result<CacheState> ParseCacheState(std::string_view name) {
  if (auto state = ParseIn(kCacheStateNames, name)) return *state;
  return ProtocolError("unknown cache state \"" + std::string(name.substr(0, 32)) + "\"");
}

// ---- Hello ------------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeHello(const Hello& msg) {
  if (!msg.config.is_object()) return InvalidArgument("Hello: config must be a JSON object");
  return Encode(MessageType::kHello, msg);
}

Result<Hello> DecodeHello(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(Hello msg, Decode<Hello>("Hello", payload));
  if (msg.protocol_version != kProtocolVersion) {
    return ProtocolError("Hello: client speaks protocol version " +
                         std::to_string(msg.protocol_version) + ", this build speaks " +
                         std::to_string(kProtocolVersion));
  }
  return msg;
}

// ---- HelloReply -------------------------------------------------------------------------------

namespace {

// What the decoders check of failure_code, so that a daemon cannot send what clients reject.
Status CheckFailureCode(std::string_view message, CacheState state, StatusCode code) {
  if ((state == CacheState::kFailed) != (code != StatusCode::kOk)) {
    return InvalidArgument(std::string(message) +
                           ": failure_code must be an error code exactly when failed");
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<uint8_t>> EncodeHelloReply(const HelloReply& msg) {
  if (!msg.daemon_config.is_object()) {
    return InvalidArgument("HelloReply: daemon config must be a JSON object");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFailureCode("HelloReply", msg.state, msg.failure_code));
  return Encode(MessageType::kHelloReply, msg);
}

Result<HelloReply> DecodeHelloReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(HelloReply msg, Decode<HelloReply>("HelloReply", payload));
  if (msg.match && !msg.differences.empty()) {
    return ProtocolError("HelloReply: match is true but differences are listed");
  }
  return msg;
}

// ---- empty requests ---------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeStatusRequest() { return EncodeFrame(MessageType::kStatus, {}); }
Result<std::vector<uint8_t>> EncodeAttachRequest() { return EncodeFrame(MessageType::kAttach, {}); }
Result<std::vector<uint8_t>> EncodeStopRequest() { return EncodeFrame(MessageType::kStop, {}); }

Status DecodeEmptyRequest(MessageType type, std::span<const uint8_t> payload) {
  if (!payload.empty()) {
    return ProtocolError(MessageTypeName(type) + " request carries " +
                         std::to_string(payload.size()) + " unexpected payload bytes");
  }
  return Status::Ok();
}

// ---- StatusReply ------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeStatusReply(const StatusReply& msg) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFailureCode("StatusReply", msg.state, msg.failure_code));
  return Encode(MessageType::kStatusReply, msg);
}

Result<StatusReply> DecodeStatusReply(std::span<const uint8_t> payload) {
  return Decode<StatusReply>("StatusReply", payload);
}

// ---- AttachReply ------------------------------------------------------------------------------

static_assert(kMaxAllocations + 1 == kMaxFdsPerFrame, "the manifest memfd takes one fd");

namespace {

// AttachReply and PublishArena share the layout: 16 bytes, the manifest memfd, then one fd per
// allocation.
Result<std::vector<uint8_t>> EncodeArenaReply(MessageType type, uint64_t manifest_size,
                                              uint32_t allocation_count) {
  if (allocation_count > kMaxAllocations) {
    return InvalidArgument("cannot send " + MessageTypeName(type) + " with " +
                           std::to_string(allocation_count) + " allocations; at most " +
                           std::to_string(kMaxAllocations));
  }
  std::vector<uint8_t> payload;
  payload.reserve(kAttachReplyPayloadSize);
  wire::PutU64(payload, manifest_size);
  wire::PutU32(payload, allocation_count);
  wire::PutU32(payload, 0);
  return EncodeFrame(type, payload, allocation_count + 1);
}

Result<AttachReply> DecodeArenaReply(MessageType type, Frame frame, RecordCheck check) {
  const std::string what = MessageTypeName(type);
  if (frame.type != type) {
    return ProtocolError("expected " + what + ", got " + MessageTypeName(frame.type));
  }
  std::vector<UniqueFd> fds = std::move(frame.fds);  // owned from here, closed on every error
  if (frame.payload.size() != kAttachReplyPayloadSize) {
    return ProtocolError(what + ": payload of " + std::to_string(frame.payload.size()) +
                         " bytes (expected " + std::to_string(kAttachReplyPayloadSize) + ")");
  }
  const uint8_t* p = frame.payload.data();
  const uint64_t manifest_size = wire::GetU64(p);
  const uint32_t allocation_count = wire::GetU32(p + 8);
  if (wire::GetU32(p + 12) != 0) return ProtocolError(what + ": reserved field is not 0");
  if (fds.size() != uint64_t{allocation_count} + 1) {
    return ProtocolError(what + ": " + std::to_string(allocation_count) + " allocations need " +
                         std::to_string(uint64_t{allocation_count} + 1) +
                         " fds (manifest first) but " + std::to_string(fds.size()) + " arrived");
  }
  AttachReply reply;
  WEIGHTCACHE_ASSIGN_OR_RETURN(reply.manifest,
                               MapManifestMemfd(fds[0].get(), manifest_size, check));
  if (reply.manifest.allocation_sizes().size() != allocation_count) {
    return ProtocolError(
        what + ": manifest lists " + std::to_string(reply.manifest.allocation_sizes().size()) +
        " allocations but the reply announces " + std::to_string(allocation_count));
  }
  // The mapping keeps the manifest; its fd is not needed any more.
  reply.fds.reserve(allocation_count);
  for (size_t i = 1; i < fds.size(); ++i) reply.fds.push_back(std::move(fds[i]));
  return reply;
}

}  // namespace

Result<std::vector<uint8_t>> EncodeAttachReply(uint64_t manifest_size, uint32_t allocation_count) {
  return EncodeArenaReply(MessageType::kAttachReply, manifest_size, allocation_count);
}

Result<AttachReply> DecodeAttachReply(Frame frame, RecordCheck check) {
  return DecodeArenaReply(MessageType::kAttachReply, std::move(frame), check);
}

// ---- publishing -------------------------------------------------------------------------------

Status ValidatePublishPlan(const PublishBegin& plan) {
  if (plan.tensors.empty()) return InvalidArgument("publish plan: no tensors (at least 1 needed)");
  if (plan.tensors.size() > checkpoint::kMaxTensorCount) {
    return InvalidArgument("publish plan: " + std::to_string(plan.tensors.size()) +
                           " tensors, over the limit of " +
                           std::to_string(checkpoint::kMaxTensorCount));
  }
  if (plan.metadata.size() > kMaxPublishMetadataBytes) {
    return InvalidArgument("publish plan: metadata of " + std::to_string(plan.metadata.size()) +
                           " bytes, over the limit of " + std::to_string(kMaxPublishMetadataBytes));
  }
  std::map<std::string_view, size_t> names;  // name → plan index
  uint64_t name_bytes = 0;
  uint64_t total = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const PlannedTensor& t = plan.tensors[i];
    const std::string shown = t.name.substr(0, 256);
    const auto bad = [&](const std::string& what) {
      return InvalidArgument("publish plan: tensor " + std::to_string(i) + " '" + shown +
                             "': " + what);
    };
    if (t.name.empty()) return bad("empty name");
    if (t.name.size() > checkpoint::kMaxTensorNameBytes) {
      return bad("name of " + std::to_string(t.name.size()) + " bytes, over the limit of " +
                 std::to_string(checkpoint::kMaxTensorNameBytes));
    }
    if (t.name.find('\0') != std::string::npos) return bad("name contains a NUL byte");
    name_bytes += t.name.size();
    if (name_bytes > checkpoint::kMaxTensorNameBytesTotal) {
      return bad("the names add up to more than " +
                 std::to_string(checkpoint::kMaxTensorNameBytesTotal) + " bytes");
    }
    if (!names.emplace(t.name, i).second) return bad("duplicate name");
    auto dtype = checkpoint::ParseDType(t.dtype);
    if (!dtype.ok()) return bad("unknown dtype \"" + t.dtype.substr(0, 32) + "\"");
    if (t.shape.size() > checkpoint::kMaxTensorRank) {
      return bad("rank " + std::to_string(t.shape.size()) + " over the limit of " +
                 std::to_string(checkpoint::kMaxTensorRank));
    }
    uint64_t elements = 1;
    bool zero = false;
    bool overflow = false;
    for (uint64_t d : t.shape) {
      if (d == 0) zero = true;
      if (__builtin_mul_overflow(elements, d, &elements)) overflow = true;
    }
    if (zero) {
      elements = 0;
    } else if (overflow || elements > uint64_t{std::numeric_limits<int64_t>::max()}) {
      return bad("element count of the shape overflows 64 bits");
    }
    auto bytes = checkpoint::DTypeByteSize(*dtype, elements);
    if (!bytes.ok()) {
      return bad("size of " + std::to_string(elements) + " elements of " + t.dtype +
                 " overflows or is not a whole number of bytes");
    }
    if (*bytes != t.nbytes) {
      return bad("nbytes " + std::to_string(t.nbytes) + " but the shape and dtype make " +
                 std::to_string(*bytes));
    }
    // 2^62: the arena planner's padding of every tensor then still fits in 63 bits.
    if (__builtin_add_overflow(total, t.nbytes, &total) || total > (uint64_t{1} << 62)) {
      return bad("the plan's total size overflows (over 2^62 bytes)");
    }
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const PlannedTensor& t = plan.tensors[i];
    if (t.alias_of.empty()) continue;
    const auto bad = [&](const std::string& what) {
      return InvalidArgument("publish plan: tensor " + std::to_string(i) + " '" +
                             t.name.substr(0, 256) + "': alias_of '" + t.alias_of.substr(0, 256) +
                             "' " + what);
    };
    auto target = names.find(t.alias_of);
    if (target == names.end()) return bad("names no tensor of the plan");
    if (target->second == i) return bad("names the tensor itself");
    const PlannedTensor& of = plan.tensors[target->second];
    if (!of.alias_of.empty()) return bad("is itself an alias (alias the tensor with the bytes)");
    if (of.dtype != t.dtype || of.shape != t.shape || of.nbytes != t.nbytes) {
      return bad("differs in dtype, shape or nbytes (an alias shares its target's bytes)");
    }
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> EncodePublishBegin(const PublishBegin& msg) {
  return Encode(MessageType::kPublishBegin, msg);
}

Result<PublishBegin> DecodePublishBegin(std::span<const uint8_t> payload) {
  return Decode<PublishBegin>("PublishBegin", payload);
}

Result<std::vector<uint8_t>> EncodePublishArena(uint64_t manifest_size, uint32_t allocation_count) {
  return EncodeArenaReply(MessageType::kPublishArena, manifest_size, allocation_count);
}

Result<AttachReply> DecodePublishArena(Frame frame) {
  return DecodeArenaReply(MessageType::kPublishArena, std::move(frame), RecordCheck::kNow);
}

Result<std::vector<uint8_t>> EncodePublishCommit(const PublishCommit& msg) {
  return Encode(MessageType::kPublishCommit, msg);
}

Result<PublishCommit> DecodePublishCommit(std::span<const uint8_t> payload) {
  return Decode<PublishCommit>("PublishCommit", payload);
}

Result<std::vector<uint8_t>> EncodePublishCommitted(const PublishCommitted& msg) {
  return Encode(MessageType::kPublishCommitted, msg);
}

Result<PublishCommitted> DecodePublishCommitted(std::span<const uint8_t> payload) {
  return Decode<PublishCommitted>("PublishCommitted", payload);
}

// ---- Metrics ----------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeMetricsRequest() {
  return EncodeFrame(MessageType::kMetrics, {});
}

Result<std::vector<uint8_t>> EncodeMetricsReply(const MetricsReply& msg) {
  return Encode(MessageType::kMetricsReply, msg);
}

Result<MetricsReply> DecodeMetricsReply(std::span<const uint8_t> payload) {
  return Decode<MetricsReply>("MetricsReply", payload);
}

// ---- Evict ------------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeEvictRequest() { return EncodeFrame(MessageType::kEvict, {}); }

Result<std::vector<uint8_t>> EncodeEvictReply(const EvictReply& msg) {
  return Encode(MessageType::kEvictReply, msg);
}

Result<EvictReply> DecodeEvictReply(std::span<const uint8_t> payload) {
  return Decode<EvictReply>("EvictReply", payload);
}

// ---- StopReply --------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeStopReply(const StopReply& msg) {
  return Encode(MessageType::kStopReply, msg);
}

Result<StopReply> DecodeStopReply(std::span<const uint8_t> payload) {
  return Decode<StopReply>("StopReply", payload);
}

// ---- Upgrade ----------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeUpgradeRequest(const UpgradeRequest& msg) {
  return Encode(MessageType::kUpgrade, msg);
}

Result<UpgradeRequest> DecodeUpgradeRequest(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UpgradeRequest msg, Decode<UpgradeRequest>("Upgrade", payload));
  if (msg.binary.size() > 4096 || msg.binary.find('\0') != std::string::npos) {
    return ProtocolError("Upgrade: field 'binary' is not a path");
  }
  return msg;
}

Result<std::vector<uint8_t>> EncodeUpgradeReply(const UpgradeReply& msg) {
  return Encode(MessageType::kUpgradeReply, msg);
}

Result<UpgradeReply> DecodeUpgradeReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UpgradeReply msg, Decode<UpgradeReply>("UpgradeReply", payload));
  if (msg.successor_pid <= 0) return ProtocolError("UpgradeReply: successor_pid must be positive");
  return msg;
}

// ---- Error ------------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeError(const Status& status) {
  if (status.ok()) return InternalError("EncodeError called with an OK status");
  // Bound the message so that an Error always fits its frame.
  return EncodeJson(MessageType::kError, json{{"code", static_cast<int>(status.code())},
                                              {"message", status.message().substr(0, 16384)}});
}

Result<ErrorReply> DecodeError(std::span<const uint8_t> payload) {
  // Not a Fields list: the code goes out from a Status, and comes back checked as one.
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("Error", payload));
  Decoder d("Error", obj);
  uint32_t code = 0;
  ErrorReply msg;
  d("code", code);
  d("message", msg.message);
  WEIGHTCACHE_RETURN_IF_ERROR(d.Finish());
  if (!IsErrorCodeValue(code)) {
    return ProtocolError("Error: field 'code' " + std::to_string(code) + " is not an error code");
  }
  msg.code = static_cast<StatusCode>(code);
  return msg;
}

}  // namespace weightcache::protocol
