#include "identity/cache_config.h"

#include <algorithm>
#include <array>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "common/hash.h"
#include "common/strict_json.h"

namespace weightcache::identity {
namespace {

// One row per field, in canonical (sorted) order. ToJson, FromJson, Diff and FieldText all
// walk this table, so a field added to the struct but not here is caught by the unit test
// that compares FieldNames() with the JSON keys.
// Exactly one of str, num and tier is set; the tier is spelt TierName() in JSON.
struct Field {
  std::string_view name;
  std::string CacheConfig::*str = nullptr;
  uint32_t CacheConfig::*num = nullptr;
  Tier CacheConfig::*tier = nullptr;
};

constexpr std::array<Field, 19> kFields = {{
    {"checkpoint_files", &CacheConfig::checkpoint_files, nullptr},
    {"checkpoint_fingerprint", &CacheConfig::checkpoint_fingerprint, nullptr},
    {"dp_size", nullptr, &CacheConfig::dp_size},
    {"dtype", &CacheConfig::dtype, nullptr},
    {"ep_rank", nullptr, &CacheConfig::ep_rank},
    {"ep_size", nullptr, &CacheConfig::ep_size},
    {"format_version", nullptr, &CacheConfig::format_version},
    {"layout_tag", &CacheConfig::layout_tag, nullptr},
    {"model_id", &CacheConfig::model_id, nullptr},
    {"pp_rank", nullptr, &CacheConfig::pp_rank},
    {"pp_size", nullptr, &CacheConfig::pp_size},
    {"quantization", &CacheConfig::quantization, nullptr},
    {"quantization_config_sha256", &CacheConfig::quantization_config_sha256, nullptr},
    {"revision", &CacheConfig::revision, nullptr},
    {"shard_rules_digest", &CacheConfig::shard_rules_digest, nullptr},
    {"source", &CacheConfig::source, nullptr},
    {"tier", nullptr, nullptr, &CacheConfig::tier},
    {"tp_rank", nullptr, &CacheConfig::tp_rank},
    {"tp_size", nullptr, &CacheConfig::tp_size},
}};

// Bounds that keep a config printable and its canonical form small; real values are far
// below them.
constexpr size_t kMaxStringField = 1024;
constexpr uint32_t kMaxParallelSize = 1 << 16;

// JSON text of a string with every non-ASCII byte escaped; invalid UTF-8 is replaced rather
// than thrown on (Validate() rejects non-ASCII, so valid configs never hit that).
std::string JsonDump(const nlohmann::json& j) {
  return j.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

bool IsPrintableAscii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c <= 0x7e; });
}

bool IsSha256Hex(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool IsTagChars(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

Status FieldError(std::string_view field, const std::string& what) {
  return InvalidArgument("config field " + std::string(field) + " " + what);
}

}  // namespace

const std::vector<std::string_view>& CacheConfig::FieldNames() {
  static const std::vector<std::string_view> kNames = [] {
    std::vector<std::string_view> out;
    out.reserve(std::size(kFields));
    for (const Field& f : kFields) out.push_back(f.name);
    return out;
  }();
  return kNames;
}

nlohmann::json CacheConfig::ToJson() const {
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : kFields) {
    if (f.str != nullptr) {
      j[std::string(f.name)] = this->*f.str;
    } else if (f.tier != nullptr) {
      j[std::string(f.name)] = std::string(TierName(this->*f.tier));
    } else {
      j[std::string(f.name)] = this->*f.num;
    }
  }
  return j;
}

std::string CacheConfig::Canonical() const { return JsonDump(ToJson()); }

std::string CacheConfig::Digest() const { return Sha256Hex(Canonical()); }

std::string CacheConfig::ShortDigest() const { return Digest().substr(0, 16); }

const std::vector<std::string_view>& CacheConfig::NodeLocalFieldNames() {
  static const std::vector<std::string_view> kNames = {"checkpoint_files", "tier"};
  return kNames;
}

std::string CacheConfig::FleetDigest(std::string_view content_anchor) const {
  nlohmann::json j = ToJson();
  for (std::string_view field : NodeLocalFieldNames()) j.erase(std::string(field));
  if (!content_anchor.empty()) j["content_sha256"] = std::string(content_anchor);
  return Sha256Hex(JsonDump(j));
}

std::string CacheConfig::FieldText(std::string_view field) const {
  for (const Field& f : kFields) {
    if (f.name != field) continue;
    if (f.str != nullptr) return JsonDump(nlohmann::json(this->*f.str));
    if (f.tier != nullptr) return JsonDump(nlohmann::json(std::string(TierName(this->*f.tier))));
    return std::to_string(this->*f.num);
  }
  return "";
}

Status CacheConfig::Validate() const {
  for (const Field& f : kFields) {
    if (f.str == nullptr) continue;
    const std::string& v = this->*f.str;
    if (v.size() > kMaxStringField) {
      return FieldError(f.name, "is longer than " + std::to_string(kMaxStringField) + " bytes");
    }
    if (!IsPrintableAscii(v)) return FieldError(f.name, "must be printable ASCII");
  }
  if (format_version < 1) return FieldError("format_version", "must be >= 1");
  if (model_id.empty()) return FieldError("model_id", "must not be empty");
  if (!IsSha256Hex(checkpoint_fingerprint)) {
    return FieldError("checkpoint_fingerprint", "must be 64 lowercase hex characters (got \"" +
                                                    checkpoint_fingerprint + "\")");
  }
  if (!IsSha256Hex(checkpoint_files)) {
    return FieldError("checkpoint_files",
                      "must be 64 lowercase hex characters (got \"" + checkpoint_files + "\")");
  }
  if (!IsTagChars(dtype)) return FieldError("dtype", "must match [A-Za-z0-9._-]+");
  if (!IsTagChars(quantization)) return FieldError("quantization", "must match [A-Za-z0-9._-]+");
  if (!quantization_config_sha256.empty() && !IsSha256Hex(quantization_config_sha256)) {
    return FieldError("quantization_config_sha256", "must be empty or 64 lowercase hex");
  }
  if (quantization == "none" && !quantization_config_sha256.empty()) {
    return FieldError("quantization_config_sha256", "must be empty when quantization is \"none\"");
  }
  if (!shard_rules_digest.empty() && !IsSha256Hex(shard_rules_digest)) {
    return FieldError("shard_rules_digest", "must be empty or 64 lowercase hex");
  }
  if (source != "disk" &&
      !(source.starts_with("published:") && IsTagChars(std::string_view(source).substr(10)))) {
    return FieldError("source",
                      "must be \"disk\" or \"published:<producer tag>\" (got \"" + source + "\")");
  }
  if (!IsTagChars(layout_tag)) return FieldError("layout_tag", "must match [A-Za-z0-9._-]+");
  if (!ParseTier(TierName(tier))) {  // a value cast from outside the enum
    return FieldError("tier", "must be \"gpu\" or \"host\" (got code " +
                                  std::to_string(static_cast<int>(tier)) + ")");
  }
  struct Pair {
    std::string_view size_name;
    uint32_t size;
    std::string_view rank_name;
    uint32_t rank;
  };
  const Pair pairs[] = {{"tp_size", tp_size, "tp_rank", tp_rank},
                        {"pp_size", pp_size, "pp_rank", pp_rank},
                        {"ep_size", ep_size, "ep_rank", ep_rank},
                        {"dp_size", dp_size, "", 0}};
  for (const Pair& p : pairs) {
    if (p.size < 1 || p.size > kMaxParallelSize) {
      return FieldError(p.size_name, "must be between 1 and " + std::to_string(kMaxParallelSize) +
                                         " (got " + std::to_string(p.size) + ")");
    }
    if (!p.rank_name.empty() && p.rank >= p.size) {
      return FieldError(p.rank_name, "must be < " + std::string(p.size_name) + " (" +
                                         std::to_string(p.rank) + " >= " + std::to_string(p.size) +
                                         ")");
    }
  }
  return Status::Ok();
}

Result<CacheConfig> CacheConfig::FromJson(const nlohmann::json& json) {
  if (!json.is_object()) return ProtocolError("config: expected a JSON object");
  for (const auto& item : json.items()) {
    // A named reference, not a structured binding: clang (and so clang-tidy) before 16 cannot
    // capture a binding in the lambda below.
    const std::string& key = item.key();
    if (std::none_of(kFields.begin(), kFields.end(),
                     [&](const Field& f) { return f.name == key; })) {
      return ProtocolError("config: unknown field \"" + key + "\"");
    }
  }
  CacheConfig c;
  for (const Field& f : kFields) {
    const std::string key(f.name);
    auto it = json.find(key);
    if (it == json.end()) return ProtocolError("config: missing field \"" + key + "\"");
    if (f.str != nullptr) {
      if (!it->is_string()) return ProtocolError("config: field \"" + key + "\" must be a string");
      c.*f.str = it->get<std::string>();
    } else if (f.tier != nullptr) {
      if (!it->is_string()) return ProtocolError("config: field \"" + key + "\" must be a string");
      const std::string text = it->get<std::string>();
      const std::optional<Tier> tier = ParseTier(text);
      if (!tier) {  // quoted like Validate's messages, and bounded: the text is untrusted
        const std::string got = JsonDump(nlohmann::json(text.substr(0, 64)));
        return ProtocolError(
            "config: " +
            FieldError(key, "must be \"gpu\" or \"host\" (got " + got + ")").message());
      }
      c.*f.tier = *tier;
    } else {
      // Parsed text yields number_unsigned for non-negative integers; a json built in code
      // from an int literal is number_integer. Both are fine if the value fits.
      const bool fits = it->is_number_unsigned()
                            ? it->get<uint64_t>() <= std::numeric_limits<uint32_t>::max()
                            : it->is_number_integer() && it->get<int64_t>() >= 0 &&
                                  it->get<int64_t>() <= std::numeric_limits<uint32_t>::max();
      if (!fits) {
        return ProtocolError("config: field \"" + key + "\" must be an unsigned 32-bit integer");
      }
      c.*f.num = static_cast<uint32_t>(it->get<int64_t>());
    }
  }
  Status valid = c.Validate();
  if (!valid.ok()) return ProtocolError("config: " + valid.message());
  return c;
}

std::vector<FieldDiff> Diff(const CacheConfig& ours, const CacheConfig& theirs) {
  std::vector<FieldDiff> diffs;
  for (const Field& f : kFields) {
    const bool differ = f.str != nullptr    ? ours.*f.str != theirs.*f.str
                        : f.tier != nullptr ? ours.*f.tier != theirs.*f.tier
                                            : ours.*f.num != theirs.*f.num;
    if (differ) {
      diffs.push_back({std::string(f.name), ours.FieldText(f.name), theirs.FieldText(f.name)});
    }
  }
  return diffs;
}

std::string_view FieldNote(std::string_view field) {
  if (field == "checkpoint_files") {
    return "the checkpoint files on this host are not the ones the daemon loaded: rewritten, "
           "replaced or another copy";
  }
  return "";
}

std::string FormatDiffOneLine(const std::vector<FieldDiff>& diffs) {
  std::string out;
  for (const FieldDiff& d : diffs) {
    if (!out.empty()) out += "; ";
    out += d.field + ": ours=" + d.ours + " theirs=" + d.theirs;
    const std::string_view note = FieldNote(d.field);
    if (!note.empty()) out += " (" + std::string(note) + ")";
  }
  return out;
}

std::string FormatDiffMultiLine(const std::vector<FieldDiff>& diffs) {
  size_t field_width = 0;
  size_t ours_width = 0;
  for (const FieldDiff& d : diffs) {
    field_width = std::max(field_width, d.field.size());
    ours_width = std::max(ours_width, d.ours.size());
  }
  std::string out;
  for (const FieldDiff& d : diffs) {
    out += "  " + d.field + std::string(field_width - d.field.size() + 2, ' ');
    out += "ours=" + d.ours + std::string(ours_width - d.ours.size() + 2, ' ');
    out += "theirs=" + d.theirs;
    const std::string_view note = FieldNote(d.field);
    if (!note.empty()) out += "  (" + std::string(note) + ")";
    out += "\n";
  }
  return out;
}

Result<std::string> QuantizationConfigDigest(std::string_view json_text) {
  // Two texts that differ only in which of a duplicate key comes last would digest alike:
  // the strict reader refuses duplicates.
  nlohmann::json doc;
  if (std::string error = ParseStrictJson(json_text, doc); !error.empty()) {
    return InvalidArgument("quantization config: " + error);
  }
  if (!doc.is_object()) return InvalidArgument("quantization config: expected a JSON object");
  return Sha256Hex(JsonDump(doc));
}

}  // namespace weightcache::identity
