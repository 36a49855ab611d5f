#include "fleet/registry_entry.h"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <set>

#include "common/logging.h"
#include "common/strict_json.h"
#include "common/terminal_text.h"
#include "os/tcp_socket.h"

namespace weightcache::fleet {
namespace {

using nlohmann::json;

constexpr size_t kMaxText = 1024;
constexpr uint32_t kMaxParallelSize = 1 << 16;

bool IsHex64(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool IsPrintable(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

bool IsNodeChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

Status FieldError(std::string_view field, const std::string& what) {
  return InvalidArgument("registry entry field " + std::string(field) + " " + what);
}

// The rule of the tier field, for Validate and FromJson alike.
Status TierError() {
  return FieldError("tier", "must be \"" + std::string(TierName(Tier::kGpu)) + "\" or \"" +
                                std::string(TierName(Tier::kHost)) + "\"");
}

// The table of fields, in the order ToJson writes them (JSON objects are sorted anyway).
enum class Kind { kString, kU32, kU64, kI64, kState };
struct Field {
  std::string_view name;
  Kind kind;
};
constexpr std::array<Field, 20> kFields = {{
    {"format", Kind::kU32},      {"fleet_key", Kind::kString},
    {"digest", Kind::kString},   {"node", Kind::kString},
    {"endpoint", Kind::kString}, {"tier", Kind::kString},
    {"device", Kind::kString},   {"bytes", Kind::kU64},
    {"tensors", Kind::kU64},     {"state", Kind::kState},
    {"pid", Kind::kI64},         {"model_id", Kind::kString},
    {"revision", Kind::kString}, {"tp_rank", Kind::kU32},
    {"tp_size", Kind::kU32},     {"pp_rank", Kind::kU32},
    {"pp_size", Kind::kU32},     {"ep_rank", Kind::kU32},
    {"ep_size", Kind::kU32},     {"manifest_digest", Kind::kString},
}};

}  // namespace

bool IsEndpoint(std::string_view e) {
  const size_t colon = e.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == e.size()) return false;
  const std::string_view port = e.substr(colon + 1);
  if (port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const int p = std::stoi(std::string(port));
  const std::string_view host = e.substr(0, colon);
  return p >= 1 && p <= 65535 && std::all_of(host.begin(), host.end(), [](char c) {
           return c > 0x20 && c <= 0x7e && c != '/';
         });
}

bool IsWildcardEndpoint(const std::string& endpoint) {
  auto split = os::SplitHostPort(endpoint);
  return split.ok() && os::IsWildcardHost(split->host);
}

std::string_view EntryStateName(EntryState state) {
  return NameIn(kEntryStateNames, state, "unknown");
}

std::optional<EntryState> ParseEntryState(std::string_view name) {
  return ParseIn(kEntryStateNames, name);
}

Status ValidatePrefix(std::string_view prefix) {
  if (prefix.empty() || prefix.front() != '/' || prefix.size() > 256 ||
      (prefix.size() > 1 && prefix.back() == '/') || prefix.find("//") != std::string_view::npos ||
      !std::all_of(prefix.begin(), prefix.end(), [](char c) { return c > 0x20 && c <= 0x7e; })) {
    return InvalidArgument("registry prefix \"" + std::string(prefix.substr(0, 300)) +
                           "\": expected /NAME[/NAME...] (printable, no spaces, no trailing /)");
  }
  if (prefix == "/") {
    return InvalidArgument("registry prefix \"/\": give a name, e.g. /weightcache");
  }
  return Status::Ok();
}

Status ValidateNodeName(std::string_view node) {
  if (node.empty() || node.size() > 253 || !std::all_of(node.begin(), node.end(), IsNodeChar)) {
    return InvalidArgument("node name \"" + std::string(node.substr(0, 300)) +
                           "\": expected 1-253 characters of A-Z a-z 0-9 . _ -");
  }
  return Status::Ok();
}

Status RegistryEntry::Validate() const {
  if (format != kRegistryEntryFormat) {
    return FieldError("format", "must be " + std::to_string(kRegistryEntryFormat));
  }
  if (!IsHex64(fleet_key)) return FieldError("fleet_key", "must be 64 lowercase hex characters");
  if (!IsHex64(digest)) return FieldError("digest", "must be 64 lowercase hex characters");
  if (Status node_ok = ValidateNodeName(node); !node_ok.ok()) {
    return FieldError("node", node_ok.message());
  }
  if (!endpoint.empty() && !IsEndpoint(endpoint)) {
    return FieldError("endpoint", "must be \"\" or HOST:PORT");
  }
  if (!endpoint.empty() && IsWildcardEndpoint(endpoint)) {
    return FieldError("endpoint",
                      "is a wildcard address (0.0.0.0 or ::), which no other node can connect to");
  }
  if (!ParseTier(TierName(tier))) return TierError();  // a value cast from outside the enum
  const bool gpu_uuid =
      (device.rfind("GPU-", 0) == 0 || device.rfind("MIG-", 0) == 0) && device.size() <= 128 &&
      std::all_of(device.begin(), device.end(), [](char c) { return IsNodeChar(c) || c == '/'; });
  if (device != "host" && !gpu_uuid) {
    return FieldError("device", "must be \"host\" or a GPU UUID (GPU-..., MIG-...)");
  }
  if (pid <= 0 || pid > (int64_t{1} << 32)) return FieldError("pid", "must be a process id");
  if (model_id.empty()) return FieldError("model_id", "must not be empty");
  for (const auto& [name, value] :
       {std::pair<std::string_view, const std::string*>{"model_id", &model_id},
        {"revision", &revision}}) {
    if (value->size() > kMaxText || !IsPrintable(*value)) {
      return FieldError(
          name, "must be printable ASCII of at most " + std::to_string(kMaxText) + " bytes");
    }
  }
  const std::array<std::array<uint32_t, 2>, 3> ranks = {
      {{tp_rank, tp_size}, {pp_rank, pp_size}, {ep_rank, ep_size}}};
  const std::array<std::string_view, 3> names = {"tp", "pp", "ep"};
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i][1] < 1 || ranks[i][1] > kMaxParallelSize || ranks[i][0] >= ranks[i][1]) {
      return FieldError(std::string(names[i]) + "_rank",
                        "must be below " + std::string(names[i]) + "_size (1-65536)");
    }
  }
  if (!manifest_digest.empty() && !IsHex64(manifest_digest)) {
    return FieldError("manifest_digest", "must be \"\" or 64 lowercase hex characters");
  }
  return Status::Ok();
}

json RegistryEntry::ToJson() const {
  return json{{"format", format},     {"fleet_key", fleet_key},
              {"digest", digest},     {"node", node},
              {"endpoint", endpoint}, {"tier", std::string(TierName(tier))},
              {"device", device},     {"bytes", bytes},
              {"tensors", tensors},   {"state", std::string(EntryStateName(state))},
              {"pid", pid},           {"model_id", model_id},
              {"revision", revision}, {"tp_rank", tp_rank},
              {"tp_size", tp_size},   {"pp_rank", pp_rank},
              {"pp_size", pp_size},   {"ep_rank", ep_rank},
              {"ep_size", ep_size},   {"manifest_digest", manifest_digest}};
}

std::string RegistryEntry::ToJsonText() const {
  return ToJson().dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
}

Result<RegistryEntry> RegistryEntry::FromJson(const json& j) {
  if (!j.is_object()) return ProtocolError("registry entry is not a JSON object");
  std::set<std::string_view> known;
  for (const Field& f : kFields) known.insert(f.name);
  for (const auto& item : j.items()) {
    if (known.count(item.key()) == 0) {
      // A registry writer chooses these bytes: escaped before they reach a log.
      return ProtocolError("registry entry has an unknown field \"" +
                           EscapeForTerminal(item.key().substr(0, 64)) + "\"");
    }
  }
  RegistryEntry e;
  for (const Field& f : kFields) {
    const std::string name(f.name);
    auto it = j.find(name);
    if (it == j.end()) return ProtocolError("registry entry lacks field " + name);
    switch (f.kind) {
      case Kind::kString:
      case Kind::kState:
        if (!it->is_string())
          return ProtocolError("registry entry field " + name + " is not a string");
        break;
      case Kind::kI64:
        if (!it->is_number_integer()) {
          return ProtocolError("registry entry field " + name + " is not an integer");
        }
        break;
      case Kind::kU32:
      case Kind::kU64:
        // A non-negative integer, whichever way the parser stored it (JSON does not say).
        if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0)) {
          return ProtocolError("registry entry field " + name + " is not a non-negative integer");
        }
        if (f.kind == Kind::kU32 && it->get<uint64_t>() > UINT32_MAX) {
          return ProtocolError("registry entry field " + name + " is out of range");
        }
        break;
    }
  }
  e.format = j["format"].get<uint32_t>();
  if (e.format != kRegistryEntryFormat) {
    return ProtocolError("registry entry format " + std::to_string(e.format) + " is not " +
                         std::to_string(kRegistryEntryFormat));
  }
  e.fleet_key = j["fleet_key"].get<std::string>();
  e.digest = j["digest"].get<std::string>();
  e.node = j["node"].get<std::string>();
  e.endpoint = j["endpoint"].get<std::string>();
  const std::optional<Tier> parsed_tier = ParseTier(j["tier"].get<std::string>());
  if (!parsed_tier) return ProtocolError(TierError().message());
  e.tier = *parsed_tier;
  e.device = j["device"].get<std::string>();
  e.bytes = j["bytes"].get<uint64_t>();
  e.tensors = j["tensors"].get<uint64_t>();
  const std::string state = j["state"].get<std::string>();
  const std::optional<EntryState> parsed_state = ParseEntryState(state);
  if (!parsed_state) return ProtocolError("registry entry field state is not a known state");
  e.state = *parsed_state;
  e.pid = j["pid"].get<int64_t>();
  e.model_id = j["model_id"].get<std::string>();
  e.revision = j["revision"].get<std::string>();
  e.tp_rank = j["tp_rank"].get<uint32_t>();
  e.tp_size = j["tp_size"].get<uint32_t>();
  e.pp_rank = j["pp_rank"].get<uint32_t>();
  e.pp_size = j["pp_size"].get<uint32_t>();
  e.ep_rank = j["ep_rank"].get<uint32_t>();
  e.ep_size = j["ep_size"].get<uint32_t>();
  e.manifest_digest = j["manifest_digest"].get<std::string>();
  if (Status valid = e.Validate(); !valid.ok()) return ProtocolError(valid.message());
  return e;
}

Result<RegistryEntry> RegistryEntry::FromJsonText(std::string_view text) {
  if (text.size() > kMaxEntryBytes) {
    return ProtocolError("registry entry is larger than " + std::to_string(kMaxEntryBytes) +
                         " bytes");
  }
  json parsed;
  const std::string error = ParseStrictJson(text, parsed);
  if (!error.empty()) return ProtocolError("registry entry: " + error);
  return FromJson(parsed);
}

std::string CachesPrefix(std::string_view prefix) { return std::string(prefix) + "/v1/caches/"; }

std::string FleetKeyPrefix(std::string_view prefix, std::string_view fleet_key) {
  return CachesPrefix(prefix) + std::string(fleet_key) + "/";
}

std::string EntryKey(std::string_view prefix, const RegistryEntry& entry) {
  return FleetKeyPrefix(prefix, entry.fleet_key) + entry.node + "/" + entry.ShortDigest();
}

Result<std::vector<RegistryEntry>> LookupEntries(const EtcdClient& client, std::string_view prefix,
                                                 const std::optional<std::string>& fleet_key) {
  WEIGHTCACHE_RETURN_IF_ERROR(ValidatePrefix(prefix));
  const std::string range =
      fleet_key.has_value() ? FleetKeyPrefix(prefix, *fleet_key) : CachesPrefix(prefix);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, client.RangePrefix(range));
  std::vector<RegistryEntry> out;
  for (const KeyValue& kv : kvs) {
    auto entry = RegistryEntry::FromJsonText(kv.value);
    const std::string shown_key = EscapeForTerminal(kv.key.substr(0, 300));  // a writer's bytes
    if (!entry.ok()) {
      LOG_WARN << "registry: skipping " << shown_key << ": " << entry.status().message();
      continue;
    }
    if (EntryKey(prefix, *entry) != kv.key) {
      LOG_WARN << "registry: skipping " << shown_key
               << ": its key does not match its fleet_key, node and digest";
      continue;
    }
    out.push_back(std::move(entry).value());
  }
  return out;
}

Result<std::vector<RegistryEntry>> LookupSources(const EtcdClient& client, std::string_view prefix,
                                                 std::string_view fleet_key) {
  if (!IsHex64(fleet_key)) return InvalidArgument("fleet key must be 64 lowercase hex characters");
  return LookupEntries(client, prefix, std::string(fleet_key));
}

}  // namespace weightcache::fleet
