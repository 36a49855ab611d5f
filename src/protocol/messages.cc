#include "protocol/messages.h"

#include <limits>
#include <map>
#include <set>
#include <string>

#include "checkpoint/dtype.h"
#include "checkpoint/limits.h"
#include "protocol/wire.h"

namespace weightcache::protocol {
namespace {

using nlohmann::json;

// Parses a control payload into a JSON object without exceptions, bounding nesting depth.
// nlohmann's parser is iterative, but destroying or printing a value recurses, so depth is
// capped before anything else touches the tree.
Result<json> ParseObject(std::string_view message, std::span<const uint8_t> payload) {
  bool too_deep = false;
  json::parser_callback_t limit_depth = [&too_deep](int depth, json::parse_event_t event, json&) {
    if (depth > kMaxJsonDepth) {
      too_deep = true;
      return false;  // discard: keeps the tree shallow while the parse finishes
    }
    return true;
  };
  json value = json::parse(payload.begin(), payload.end(), limit_depth,
                           /*allow_exceptions=*/false);
  if (too_deep) {
    return ProtocolError(std::string(message) + ": JSON nested deeper than " +
                         std::to_string(kMaxJsonDepth) + " levels");
  }
  if (value.is_discarded()) return ProtocolError(std::string(message) + ": payload is not JSON");
  if (!value.is_object()) {
    return ProtocolError(std::string(message) + ": payload is not a JSON object");
  }
  return value;
}

// Strict field access: every field read is recorded, Finish() rejects the rest.
class Fields {
 public:
  Fields(std::string_view message, const json& object) : message_(message), object_(object) {}

  Result<std::string> String(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_string()) return TypeError(key, "a string");
    return v->get<std::string>();
  }
  Result<uint64_t> U64(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_number_unsigned()) return TypeError(key, "a non-negative integer");
    return v->get<uint64_t>();
  }
  Result<uint32_t> U32(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t v, U64(key));
    if (v > std::numeric_limits<uint32_t>::max()) return TypeError(key, "a 32-bit integer");
    return static_cast<uint32_t>(v);
  }
  Result<int64_t> I64(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
        return TypeError(key, "a 64-bit integer");
      }
      return static_cast<int64_t>(v->get<uint64_t>());
    }
    if (!v->is_number_integer()) return TypeError(key, "an integer");
    return v->get<int64_t>();
  }
  Result<bool> Bool(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_boolean()) return TypeError(key, "a boolean");
    return v->get<bool>();
  }
  Result<json> Object(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_object()) return TypeError(key, "an object");
    return *v;
  }
  Result<const json*> Array(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* v, Get(key));
    if (!v->is_array()) return TypeError(key, "an array");
    return v;
  }
  Result<CacheState> State(const char* key) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string s, String(key));
    Result<CacheState> state = ParseCacheState(s);
    if (!state.ok())
      return TypeError(key, "one of loading, ready, failed, draining, awaiting, demoted");
    return state;
  }

  // `failure_code`: an error code when `state` is failed, else 0.
  Result<StatusCode> FailureCode(const char* key, CacheState state) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(uint32_t v, U32(key));
    if (state == CacheState::kFailed) {
      if (!IsErrorCodeValue(v)) {
        return ProtocolError(message_ + ": field '" + key + "' must be an error code (1 … " +
                             std::to_string(kStatusCodeCount - 1) + ") when the state is failed");
      }
    } else if (v != 0) {
      return ProtocolError(message_ + ": field '" + key + "' must be 0 unless the state is failed");
    }
    return static_cast<StatusCode>(v);
  }

  Status Finish() const {
    for (const auto& item : object_.items()) {
      if (!seen_.contains(item.key())) {
        return ProtocolError(message_ + ": unknown field '" + item.key().substr(0, 64) + "'");
      }
    }
    return Status::Ok();
  }

 private:
  Result<const json*> Get(const char* key) {
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end()) return ProtocolError(message_ + ": field '" + key + "' missing");
    return &*it;
  }
  Status TypeError(const char* key, const char* expected) const {
    return ProtocolError(message_ + ": field '" + key + "' must be " + expected);
  }

  std::string message_;
  const json& object_;
  std::set<std::string, std::less<>> seen_;
};

// Serialises without throwing: invalid UTF-8 in a string (a path, a reason) is replaced.
Result<std::vector<uint8_t>> EncodeJson(MessageType type, const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return EncodeFrame(
      type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace

std::string_view CacheStateName(CacheState state) {
  switch (state) {
    case CacheState::kLoading:
      return "loading";
    case CacheState::kReady:
      return "ready";
    case CacheState::kFailed:
      return "failed";
    case CacheState::kDraining:
      return "draining";
    case CacheState::kAwaiting:
      return "awaiting";
    case CacheState::kDemoted:
      return "demoted";
  }
  return "unknown";
}

Result<CacheState> ParseCacheState(std::string_view name) {
  if (name == "loading") return CacheState::kLoading;
  if (name == "ready") return CacheState::kReady;
  if (name == "failed") return CacheState::kFailed;
  if (name == "draining") return CacheState::kDraining;
  if (name == "awaiting") return CacheState::kAwaiting;
  if (name == "demoted") return CacheState::kDemoted;
  return ProtocolError("unknown cache state \"" + std::string(name.substr(0, 32)) + "\"");
}

// ---- Hello ------------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeHello(const Hello& msg) {
  if (!msg.config.is_object()) return InvalidArgument("Hello: config must be a JSON object");
  return EncodeJson(MessageType::kHello, json{{"protocol_version", msg.protocol_version},
                                              {"config", msg.config},
                                              {"client_pid", msg.client_pid},
                                              {"client_name", msg.client_name}});
}

Result<Hello> DecodeHello(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("Hello", payload));
  Fields f("Hello", obj);
  Hello msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.protocol_version, f.U32("protocol_version"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.config, f.Object("config"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.client_pid, f.I64("client_pid"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.client_name, f.String("client_name"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
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
  json diffs = json::array();
  for (const ConfigDifference& d : msg.differences) {
    diffs.push_back({{"field", d.field}, {"daemon", d.daemon}, {"client", d.client}});
  }
  return EncodeJson(MessageType::kHelloReply,
                    json{{"state", CacheStateName(msg.state)},
                         {"bytes_done", msg.bytes_done},
                         {"bytes_total", msg.bytes_total},
                         {"failure_reason", msg.failure_reason},
                         {"failure_code", static_cast<uint32_t>(msg.failure_code)},
                         {"match", msg.match},
                         {"config", msg.daemon_config},
                         {"differences", std::move(diffs)}});
}

Result<HelloReply> DecodeHelloReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("HelloReply", payload));
  Fields f("HelloReply", obj);
  HelloReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.state, f.State("state"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes_done, f.U64("bytes_done"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes_total, f.U64("bytes_total"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.failure_reason, f.String("failure_reason"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.failure_code, f.FailureCode("failure_code", msg.state));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.match, f.Bool("match"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.daemon_config, f.Object("config"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(const json* diffs, f.Array("differences"));
  for (size_t i = 0; i < diffs->size(); ++i) {
    const json& item = (*diffs)[i];
    std::string what = "HelloReply: differences[" + std::to_string(i) + "]";
    if (!item.is_object()) return ProtocolError(what + " must be an object");
    Fields df(what, item);
    ConfigDifference d;
    WEIGHTCACHE_ASSIGN_OR_RETURN(d.field, df.String("field"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(d.daemon, df.String("daemon"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(d.client, df.String("client"));
    WEIGHTCACHE_RETURN_IF_ERROR(df.Finish());
    msg.differences.push_back(std::move(d));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
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
  return EncodeJson(MessageType::kStatusReply,
                    json{{"state", CacheStateName(msg.state)},
                         {"bytes_done", msg.bytes_done},
                         {"bytes_total", msg.bytes_total},
                         {"failure_reason", msg.failure_reason},
                         {"failure_code", static_cast<uint32_t>(msg.failure_code)},
                         {"tier", TierName(msg.tier)},
                         {"device_uuid", msg.device_uuid},
                         {"model_id", msg.model_id},
                         {"tensor_count", msg.tensor_count},
                         {"bytes", msg.bytes},
                         {"clients", msg.clients},
                         {"pid", msg.pid},
                         {"config_digest", msg.config_digest},
                         {"origin", msg.origin}});
}

Result<StatusReply> DecodeStatusReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("StatusReply", payload));
  Fields f("StatusReply", obj);
  StatusReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.state, f.State("state"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes_done, f.U64("bytes_done"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes_total, f.U64("bytes_total"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.failure_reason, f.String("failure_reason"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.failure_code, f.FailureCode("failure_code", msg.state));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string tier, f.String("tier"));
  const std::optional<Tier> parsed_tier = ParseTier(tier);
  if (!parsed_tier) return ProtocolError("StatusReply: field 'tier' must be gpu or host");
  msg.tier = *parsed_tier;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.device_uuid, f.String("device_uuid"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.model_id, f.String("model_id"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.tensor_count, f.U64("tensor_count"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes, f.U64("bytes"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.clients, f.U32("clients"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.pid, f.I64("pid"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.config_digest, f.String("config_digest"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.origin, f.String("origin"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  return msg;
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
  json tensors = json::array();
  for (const PlannedTensor& t : msg.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", t.dtype},
                       {"shape", t.shape},
                       {"nbytes", t.nbytes},
                       {"alias_of", t.alias_of}});
  }
  return EncodeJson(MessageType::kPublishBegin,
                    json{{"tensors", std::move(tensors)}, {"metadata", msg.metadata}});
}

Result<PublishBegin> DecodePublishBegin(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("PublishBegin", payload));
  Fields f("PublishBegin", obj);
  PublishBegin msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(const json* tensors, f.Array("tensors"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.metadata, f.String("metadata"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  msg.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    const json& item = (*tensors)[i];
    const std::string what = "PublishBegin: tensors[" + std::to_string(i) + "]";
    if (!item.is_object()) return ProtocolError(what + " must be an object");
    Fields tf(what, item);
    PlannedTensor t;
    WEIGHTCACHE_ASSIGN_OR_RETURN(t.name, tf.String("name"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(t.dtype, tf.String("dtype"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(const json* shape, tf.Array("shape"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(t.nbytes, tf.U64("nbytes"));
    WEIGHTCACHE_ASSIGN_OR_RETURN(t.alias_of, tf.String("alias_of"));
    WEIGHTCACHE_RETURN_IF_ERROR(tf.Finish());
    if (shape->size() > checkpoint::kMaxTensorRank) {
      return ProtocolError(what + ": field 'shape' has " + std::to_string(shape->size()) +
                           " dimensions; at most " + std::to_string(checkpoint::kMaxTensorRank));
    }
    for (const json& d : *shape) {
      if (!d.is_number_unsigned()) {
        return ProtocolError(what + ": field 'shape' must hold non-negative integers");
      }
      t.shape.push_back(d.get<uint64_t>());
    }
    msg.tensors.push_back(std::move(t));
  }
  return msg;
}

Result<std::vector<uint8_t>> EncodePublishArena(uint64_t manifest_size, uint32_t allocation_count) {
  return EncodeArenaReply(MessageType::kPublishArena, manifest_size, allocation_count);
}

Result<AttachReply> DecodePublishArena(Frame frame) {
  return DecodeArenaReply(MessageType::kPublishArena, std::move(frame), RecordCheck::kNow);
}

Result<std::vector<uint8_t>> EncodePublishCommit(const PublishCommit& msg) {
  return EncodeJson(MessageType::kPublishCommit, json{{"checksums", msg.checksums}});
}

Result<PublishCommit> DecodePublishCommit(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("PublishCommit", payload));
  Fields f("PublishCommit", obj);
  PublishCommit msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(const json* checksums, f.Array("checksums"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  msg.checksums.reserve(checksums->size());
  for (const json& c : *checksums) {
    if (!c.is_number_unsigned()) {
      return ProtocolError("PublishCommit: field 'checksums' must hold non-negative integers");
    }
    msg.checksums.push_back(c.get<uint64_t>());
  }
  return msg;
}

Result<std::vector<uint8_t>> EncodePublishCommitted(const PublishCommitted& msg) {
  return EncodeJson(MessageType::kPublishCommitted,
                    json{{"tensor_count", msg.tensor_count}, {"bytes", msg.bytes}});
}

Result<PublishCommitted> DecodePublishCommitted(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("PublishCommitted", payload));
  Fields f("PublishCommitted", obj);
  PublishCommitted msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.tensor_count, f.U64("tensor_count"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.bytes, f.U64("bytes"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  return msg;
}

// ---- Metrics ----------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeMetricsRequest() {
  return EncodeFrame(MessageType::kMetrics, {});
}

Result<std::vector<uint8_t>> EncodeMetricsReply(const MetricsReply& msg) {
  return EncodeJson(MessageType::kMetricsReply,
                    json{{"hits", msg.hits},
                         {"misses", msg.misses},
                         {"attaches_daemon", msg.attaches_daemon},
                         {"attaches_mismatch", msg.attaches_mismatch},
                         {"attaches_unavailable", msg.attaches_unavailable},
                         {"attaches_error", msg.attaches_error},
                         {"last_attach_unix_ms", msg.last_attach_unix_ms},
                         {"clients", msg.clients}});
}

Result<MetricsReply> DecodeMetricsReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("MetricsReply", payload));
  Fields f("MetricsReply", obj);
  MetricsReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.hits, f.U64("hits"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.misses, f.U64("misses"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.attaches_daemon, f.U64("attaches_daemon"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.attaches_mismatch, f.U64("attaches_mismatch"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.attaches_unavailable, f.U64("attaches_unavailable"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.attaches_error, f.U64("attaches_error"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.last_attach_unix_ms, f.U64("last_attach_unix_ms"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.clients, f.U32("clients"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  return msg;
}

// ---- Evict ------------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeEvictRequest() { return EncodeFrame(MessageType::kEvict, {}); }

Result<std::vector<uint8_t>> EncodeEvictReply(const EvictReply& msg) {
  return EncodeJson(
      MessageType::kEvictReply,
      json{{"evicted", msg.evicted}, {"clients", msg.clients}, {"reason", msg.reason}});
}

Result<EvictReply> DecodeEvictReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("EvictReply", payload));
  Fields f("EvictReply", obj);
  EvictReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.evicted, f.Bool("evicted"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.clients, f.U32("clients"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.reason, f.String("reason"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  return msg;
}

// ---- StopReply --------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeStopReply(const StopReply& msg) {
  return EncodeJson(MessageType::kStopReply, json{{"clients", msg.clients}});
}

Result<StopReply> DecodeStopReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("StopReply", payload));
  Fields f("StopReply", obj);
  StopReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.clients, f.U32("clients"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  return msg;
}

// ---- Upgrade ----------------------------------------------------------------------------------

Result<std::vector<uint8_t>> EncodeUpgradeRequest(const UpgradeRequest& msg) {
  return EncodeJson(MessageType::kUpgrade, json{{"binary", msg.binary}});
}

Result<UpgradeRequest> DecodeUpgradeRequest(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("Upgrade", payload));
  Fields f("Upgrade", obj);
  UpgradeRequest msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.binary, f.String("binary"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  if (msg.binary.size() > 4096 || msg.binary.find('\0') != std::string::npos) {
    return ProtocolError("Upgrade: field 'binary' is not a path");
  }
  return msg;
}

Result<std::vector<uint8_t>> EncodeUpgradeReply(const UpgradeReply& msg) {
  return EncodeJson(MessageType::kUpgradeReply,
                    json{{"successor_pid", msg.successor_pid}, {"handover_us", msg.handover_us}});
}

Result<UpgradeReply> DecodeUpgradeReply(std::span<const uint8_t> payload) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("UpgradeReply", payload));
  Fields f("UpgradeReply", obj);
  UpgradeReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.successor_pid, f.I64("successor_pid"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.handover_us, f.U64("handover_us"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
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
  WEIGHTCACHE_ASSIGN_OR_RETURN(json obj, ParseObject("Error", payload));
  Fields f("Error", obj);
  ErrorReply msg;
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint32_t code, f.U32("code"));
  WEIGHTCACHE_ASSIGN_OR_RETURN(msg.message, f.String("message"));
  WEIGHTCACHE_RETURN_IF_ERROR(f.Finish());
  if (!IsErrorCodeValue(code)) {
    return ProtocolError("Error: field 'code' " + std::to_string(code) + " is not an error code");
  }
  msg.code = static_cast<StatusCode>(code);
  return msg;
}

}  // namespace weightcache::protocol
