#include "checkpoint/safetensors.h"

#include <algorithm>
#include <exception>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

#include "common/terminal_text.h"

namespace weightcache::checkpoint {
namespace {

using Json = nlohmann::json;

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// A SAX handler that checks the header's shape while nlohmann parses it, so that no DOM is
// built (an adversarial header cannot make us allocate a deep tree) and duplicate keys are
// seen (a DOM keeps only the last one). It accepts exactly:
//   { "__metadata__": null | {string: string, ...},
//     <name>: {"dtype": string, "shape": [uint, ...], "data_offsets": [uint, uint], <other>:
//              any (ignored, bounded depth)}, ... }
// Every callback returns false after recording the first error, which stops the parse.
class HeaderSax {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  bool null() { return Scalar(ValueKind::kNull, 0); }
  bool boolean(bool) { return Scalar(ValueKind::kOther, 0); }
  bool number_integer(number_integer_t v) {
    return Scalar(v < 0 ? ValueKind::kNegative : ValueKind::kUnsigned, static_cast<uint64_t>(v));
  }
  bool number_unsigned(number_unsigned_t v) { return Scalar(ValueKind::kUnsigned, v); }
  bool number_float(number_float_t, const string_t&) { return Scalar(ValueKind::kOther, 0); }
  bool binary(binary_t&) { return Scalar(ValueKind::kOther, 0); }
  bool string(string_t& s) {
    pending_string_ = &s;
    bool ok = Scalar(ValueKind::kString, 0);
    pending_string_ = nullptr;
    return ok;
  }

  bool start_object(std::size_t) {
    if (skip_depth_ > 0) return Nest();
    switch (state_) {
      case State::kStart:
        state_ = State::kRootKey;
        return true;
      case State::kRootValue:
        if (is_metadata_) {
          state_ = State::kMetadataKey;
        } else {
          current_ = ParsedTensor{};
          current_.name = std::move(current_key_);
          seen_fields_ = 0;
          state_ = State::kTensorKey;
        }
        return true;
      case State::kTensorValue:
        return field_ == Field::kOther ? BeginSkip() : FailField();
      case State::kMetadataValue:
        return Fail("__metadata__ value for " + QuoteBounded(current_key_) + " is not a string");
      case State::kShapeItem:
      case State::kOffsetsItem:
        return FailField();
      default:
        return Fail("unexpected object in header");
    }
  }

  bool start_array(std::size_t) {
    if (skip_depth_ > 0) return Nest();
    switch (state_) {
      case State::kStart:
        return Fail("header is not a JSON object");
      case State::kRootValue:
        return is_metadata_
                   ? Fail("__metadata__ is not an object")
                   : Fail("tensor " + QuoteBounded(current_key_) + ": entry is not an object");
      case State::kTensorValue:
        if (field_ == Field::kShape) {
          state_ = State::kShapeItem;
          return true;
        }
        if (field_ == Field::kOffsets) {
          offsets_count_ = 0;
          state_ = State::kOffsetsItem;
          return true;
        }
        if (field_ == Field::kDType) return FailField();
        return BeginSkip();
      case State::kMetadataValue:
        return Fail("__metadata__ value for " + QuoteBounded(current_key_) + " is not a string");
      default:
        return FailField();
    }
  }

  bool key(string_t& k) {
    if (skip_depth_ > 0) return true;
    switch (state_) {
      case State::kRootKey: {
        if (!root_keys_.insert(k).second) {
          return Fail(k == "__metadata__" ? "duplicate __metadata__ entry"
                                          : "duplicate tensor name " + QuoteBounded(k));
        }
        is_metadata_ = (k == "__metadata__");
        if (!is_metadata_) {
          if (k.empty()) return Fail("empty tensor name");
          if (k.size() > kMaxTensorNameBytes) {
            return Fail("tensor name " + QuoteBounded(k) + " is " + std::to_string(k.size()) +
                        " bytes, over the " + std::to_string(kMaxTensorNameBytes) + "-byte limit");
          }
          if (++tensor_count_ > kMaxTensorCount) {
            return Fail("more than " + std::to_string(kMaxTensorCount) +
                        " tensors, over the limit of " + std::to_string(kMaxTensorCount) +
                        " tensors per checkpoint");
          }
          name_bytes_ += k.size();
          if (name_bytes_ > kMaxTensorNameBytesTotal) {
            return Fail("tensor names total more than " + std::to_string(kMaxTensorNameBytesTotal) +
                        " bytes, over the limit for one checkpoint");
          }
        }
        current_key_ = k;
        state_ = State::kRootValue;
        return true;
      }
      case State::kMetadataKey:
        if (header_.metadata.count(k) != 0) {
          return Fail("duplicate __metadata__ key " + QuoteBounded(k));
        }
        current_key_ = k;
        state_ = State::kMetadataValue;
        return true;
      case State::kTensorKey: {
        Field f = Field::kOther;
        if (k == "dtype") f = Field::kDType;
        if (k == "shape") f = Field::kShape;
        if (k == "data_offsets") f = Field::kOffsets;
        if (f != Field::kOther) {
          const unsigned bit = 1u << static_cast<unsigned>(f);
          if ((seen_fields_ & bit) != 0) {
            return Fail("tensor " + QuoteBounded(current_.name) + ": duplicate field '" + k + "'");
          }
          seen_fields_ |= bit;
        }
        field_ = f;
        state_ = State::kTensorValue;
        return true;
      }
      default:
        return Fail("unexpected key in header");
    }
  }

  bool end_object() {
    if (skip_depth_ > 0) return Unnest();
    switch (state_) {
      case State::kRootKey:
        state_ = State::kDone;
        return true;
      case State::kMetadataKey:
        state_ = State::kRootKey;
        return true;
      case State::kTensorKey: {
        static constexpr std::pair<Field, const char*> kRequired[] = {
            {Field::kDType, "dtype"}, {Field::kShape, "shape"}, {Field::kOffsets, "data_offsets"}};
        for (const auto& [f, name] : kRequired) {
          if ((seen_fields_ & (1u << static_cast<unsigned>(f))) == 0) {
            return Fail("tensor " + QuoteBounded(current_.name) + ": missing field '" + name + "'");
          }
        }
        header_.tensors.push_back(std::move(current_));
        state_ = State::kRootKey;
        return true;
      }
      default:
        return Fail("unexpected end of object in header");
    }
  }

  bool end_array() {
    if (skip_depth_ > 0) return Unnest();
    if (state_ == State::kShapeItem) {
      state_ = State::kTensorKey;
      return true;
    }
    if (state_ == State::kOffsetsItem) {
      if (offsets_count_ != 2) return FailField();
      state_ = State::kTensorKey;
      return true;
    }
    return Fail("unexpected end of array in header");
  }

  bool parse_error(std::size_t position, const std::string& last_token, const Json::exception& ex) {
    return Fail(std::string("header is not valid JSON: ") + ex.what());
  }

  // Valid after a successful sax_parse.
  ParsedHeader& header() { return header_; }
  const std::string& error() const { return error_; }
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State {
    kStart,          // before the root object
    kRootKey,        // in the root object, expecting a key or its end
    kRootValue,      // after a root key, expecting its value
    kMetadataKey,    // in __metadata__, expecting a key or its end
    kMetadataValue,  // expecting a string
    kTensorKey,      // in a tensor entry, expecting a field name or its end
    kTensorValue,    // expecting the value of field_
    kShapeItem,      // in "shape": [...]
    kOffsetsItem,    // in "data_offsets": [...]
    kDone,
  };
  enum class Field : unsigned { kDType = 0, kShape = 1, kOffsets = 2, kOther = 3 };
  enum class ValueKind { kNull, kUnsigned, kNegative, kString, kOther };

  // Bound on the nesting of ignored fields, so skipping cannot be made expensive.
  static constexpr int kMaxSkipDepth = 64;

  bool Scalar(ValueKind kind, uint64_t value) {
    if (skip_depth_ > 0) return true;
    switch (state_) {
      case State::kStart:
        return Fail("header is not a JSON object");
      case State::kRootValue:
        if (is_metadata_) {
          if (kind == ValueKind::kNull) {
            state_ = State::kRootKey;
            return true;
          }
          return Fail("__metadata__ is not an object");
        }
        return Fail("tensor " + QuoteBounded(current_key_) + ": entry is not an object");
      case State::kMetadataValue:
        if (kind != ValueKind::kString) {
          return Fail("__metadata__ value for " + QuoteBounded(current_key_) + " is not a string");
        }
        header_.metadata.emplace(std::move(current_key_), std::move(*pending_string_));
        state_ = State::kMetadataKey;
        return true;
      case State::kTensorValue:
        if (field_ == Field::kOther) {
          state_ = State::kTensorKey;
          return true;
        }
        if (field_ != Field::kDType || kind != ValueKind::kString) return FailField();
        {
          Result<DType> dtype = ParseDType(*pending_string_);
          if (!dtype.ok()) {
            return Fail("tensor " + QuoteBounded(current_.name) + ": " + dtype.status().message());
          }
          current_.dtype = *dtype;
        }
        state_ = State::kTensorKey;
        return true;
      case State::kShapeItem:
        if (kind == ValueKind::kNegative) {
          return Fail("tensor " + QuoteBounded(current_.name) + ": negative dimension in 'shape'");
        }
        if (kind != ValueKind::kUnsigned) return FailField();
        if (current_.shape.size() >= kMaxTensorRank) {
          return Fail("tensor " + QuoteBounded(current_.name) + ": rank over the limit of " +
                      std::to_string(kMaxTensorRank) + " dimensions");
        }
        current_.shape.push_back(value);
        return true;
      case State::kOffsetsItem:
        if (kind != ValueKind::kUnsigned || offsets_count_ >= 2) return FailField();
        (offsets_count_ == 0 ? current_.begin : current_.end) = value;
        ++offsets_count_;
        return true;
      default:
        return Fail("unexpected value in header");
    }
  }

  bool FailField() {
    switch (field_) {
      case Field::kDType:
        return Fail("tensor " + QuoteBounded(current_.name) + ": field 'dtype' is not a string");
      case Field::kShape:
        return Fail("tensor " + QuoteBounded(current_.name) +
                    ": field 'shape' is not an array of non-negative integers");
      case Field::kOffsets:
        return Fail("tensor " + QuoteBounded(current_.name) +
                    ": field 'data_offsets' is not [begin, end] (two non-negative integers)");
      case Field::kOther:
        break;
    }
    return Fail("tensor " + QuoteBounded(current_.name) + ": malformed entry");
  }

  bool BeginSkip() {
    skip_depth_ = 1;
    return true;
  }
  bool Nest() {
    if (++skip_depth_ > kMaxSkipDepth) {
      return Fail("tensor " + QuoteBounded(current_.name) + ": unknown field nested deeper than " +
                  std::to_string(kMaxSkipDepth));
    }
    return true;
  }
  bool Unnest() {
    if (--skip_depth_ == 0) state_ = State::kTensorKey;
    return true;
  }

  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  State state_ = State::kStart;
  ParsedHeader header_;
  std::set<std::string> root_keys_;
  std::string current_key_;
  ParsedTensor current_;
  bool is_metadata_ = false;
  Field field_ = Field::kOther;
  unsigned seen_fields_ = 0;
  int offsets_count_ = 0;
  int skip_depth_ = 0;
  uint64_t tensor_count_ = 0;
  uint64_t name_bytes_ = 0;
  string_t* pending_string_ = nullptr;
  std::string error_;
};

uint64_t LoadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The layout rules of the reference (Metadata::validate + read_metadata): sorted by offset,
// the tensors tile [0, data_size) exactly, and each one's byte range matches shape x dtype.
Status ValidateLayout(ParsedHeader& header) {
  auto& tensors = header.tensors;
  for (const ParsedTensor& t : tensors) {
    if (t.begin > t.end) {
      return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + ": data_offsets begin " +
                               std::to_string(t.begin) + " > end " + std::to_string(t.end));
    }
    if (t.end > header.data_size) {
      return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + ": data_offsets end " +
                               std::to_string(t.end) + " is beyond the data region of " +
                               std::to_string(header.data_size) + " bytes");
    }
  }
  std::sort(tensors.begin(), tensors.end(), [](const ParsedTensor& a, const ParsedTensor& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  const ParsedTensor* previous = nullptr;
  for (const ParsedTensor& t : tensors) {
    if (t.begin > expected) {
      return InvalidCheckpoint("tensor " + QuoteBounded(t.name) +
                               ": data_offsets leave a gap: bytes [" + std::to_string(expected) +
                               ", " + std::to_string(t.begin) +
                               ") of the data region belong to no tensor");
    }
    if (t.begin < expected) {
      return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + ": data_offsets [" +
                               std::to_string(t.begin) + ", " + std::to_string(t.end) +
                               ") overlap tensor " + QuoteBounded(previous->name) +
                               ", which ends at " + std::to_string(expected));
    }
    uint64_t elements = 1;
    for (uint64_t dim : t.shape) {
      if (__builtin_mul_overflow(elements, dim, &elements)) {
        return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + ": element count of shape " +
                                 ShapeString(t.shape) + " overflows 64 bits");
      }
    }
    Result<uint64_t> nbytes = DTypeByteSize(t.dtype, elements);
    if (!nbytes.ok()) {
      Status s = nbytes.status();
      return s.Context("tensor " + QuoteBounded(t.name) + " shape " + ShapeString(t.shape));
    }
    if (*nbytes != t.end - t.begin) {
      return InvalidCheckpoint("tensor " + QuoteBounded(t.name) + ": shape " +
                               ShapeString(t.shape) + " of " + std::string(DTypeName(t.dtype)) +
                               " is " + std::to_string(*nbytes) + " bytes but data_offsets span " +
                               std::to_string(t.end - t.begin));
    }
    expected = t.end;
    previous = &t;
  }
  if (expected != header.data_size) {
    return InvalidCheckpoint("tensors cover " + std::to_string(expected) +
                             " bytes of a data region of " + std::to_string(header.data_size) +
                             " bytes: trailing bytes belong to no tensor");
  }
  return Status::Ok();
}

}  // namespace

Result<uint64_t> ParseHeaderLength(std::span<const uint8_t> first_bytes, uint64_t file_size) {
  if (file_size < kHeaderPrefixBytes) {
    return InvalidCheckpoint("file is " + std::to_string(file_size) +
                             " bytes, too small for the 8-byte header length");
  }
  if (first_bytes.size() < kHeaderPrefixBytes) {
    return InvalidArgument("need the first 8 bytes of the file, got " +
                           std::to_string(first_bytes.size()));
  }
  const uint64_t n = LoadLe64(first_bytes.data());
  if (n > kMaxHeaderBytes) {
    return InvalidCheckpoint("header length " + std::to_string(n) + " exceeds the limit of " +
                             std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (n > file_size - kHeaderPrefixBytes) {
    return InvalidCheckpoint("header length " + std::to_string(n) +
                             " runs past the end of the file (" + std::to_string(file_size) +
                             " bytes)");
  }
  return n;
}

Result<ParsedHeader> ParseSafetensorsHeader(std::span<const uint8_t> first_bytes_of_file,
                                            uint64_t file_size) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(const uint64_t n, ParseHeaderLength(first_bytes_of_file, file_size));
  if (first_bytes_of_file.size() - kHeaderPrefixBytes < n) {
    return InvalidArgument("need the first " + std::to_string(kHeaderPrefixBytes + n) +
                           " bytes of the file, got " + std::to_string(first_bytes_of_file.size()));
  }
  const uint8_t* json_begin = first_bytes_of_file.data() + kHeaderPrefixBytes;
  const uint8_t* json_end = json_begin + n;

  HeaderSax sax;
  bool parsed = false;
  try {
    // strict: nothing but whitespace may follow the object (the reference pads with spaces).
    parsed = Json::sax_parse(json_begin, json_end, &sax, nlohmann::json::input_format_t::json,
                             /*strict=*/true);
  } catch (const std::exception& e) {
    // nlohmann reports errors through parse_error; this only guards its allocation paths.
    return InvalidCheckpoint(std::string("header is not valid JSON: ") + e.what());
  }
  if (!parsed || !sax.done()) {
    return InvalidCheckpoint(sax.error().empty() ? std::string("header is not a JSON object")
                                                 : sax.error());
  }

  ParsedHeader header = std::move(sax.header());
  header.header_len = n;
  header.data_start = kHeaderPrefixBytes + n;
  header.data_size = file_size - header.data_start;
  WEIGHTCACHE_RETURN_IF_ERROR(ValidateLayout(header));
  header.header_json.assign(reinterpret_cast<const char*>(json_begin), n);
  return header;
}

}  // namespace weightcache::checkpoint
