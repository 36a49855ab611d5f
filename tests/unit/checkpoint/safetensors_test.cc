// ParseSafetensorsHeader on valid and hostile headers: each defect gets kInvalidCheckpoint
// and its own message.
#include "checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "unit/checkpoint/header_builder.h"

namespace weightcache::checkpoint {
namespace {

using testing::Bytes;
using ::testing::HasSubstr;
using testing::SafetensorsBytes;

Result<ParsedHeader> Parse(const std::string& file) {
  return ParseSafetensorsHeader(Bytes(file), file.size());
}

// Asserts that `json` followed by `data_bytes` bytes is refused with `message`.
void ExpectInvalid(const std::string& json, uint64_t data_bytes, const std::string& message) {
  Result<ParsedHeader> r = Parse(SafetensorsBytes(json, data_bytes));
  ASSERT_FALSE(r.ok()) << json;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidCheckpoint) << r.status().ToString();
  EXPECT_THAT(r.status().message(), HasSubstr(message)) << json;
}

std::string U8(const std::string& name, uint64_t n, uint64_t begin) {
  return "\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(n) +
         "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(begin + n) + "]}";
}

TEST(DTypeTest, EveryDTypeRoundTripsThroughItsName) {
  std::set<std::string_view> names;
  for (DType d : kAllDTypes) {
    Result<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << DTypeName(d);
    EXPECT_EQ(*parsed, d);
    names.insert(DTypeName(d));
  }
  EXPECT_EQ(names.size(), 22u);  // every dtype of safetensors 0.8
  EXPECT_EQ(DTypeBits(DType::kF4), 4u);
  EXPECT_EQ(DTypeBits(DType::kF6E2M3), 6u);
  EXPECT_EQ(DTypeBits(DType::kF8E8M0), 8u);
  EXPECT_EQ(DTypeBits(DType::kBF16), 16u);
  EXPECT_EQ(DTypeBits(DType::kC64), 64u);
}

TEST(DTypeTest, ParseIsExactAndNamesTheUnknownString) {
  Result<DType> r = ParseDType("bf16");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(r.status().message(), HasSubstr("unknown dtype \"bf16\""));
}

TEST(DTypeTest, SubByteSizesMustBeWholeBytes) {
  EXPECT_EQ(*DTypeByteSize(DType::kF4, 4), 2u);
  EXPECT_EQ(*DTypeByteSize(DType::kF6E3M2, 8), 6u);
  Result<uint64_t> odd = DTypeByteSize(DType::kF4, 3);
  ASSERT_FALSE(odd.ok());
  EXPECT_THAT(odd.status().message(), HasSubstr("not a whole number of bytes"));
  Result<uint64_t> big = DTypeByteSize(DType::kF64, uint64_t{1} << 62);
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(big.status().message(), HasSubstr("size overflow"));
}

TEST(SafetensorsHeaderTest, AcceptsAnEmptyHeader) {
  Result<ParsedHeader> r = Parse(SafetensorsBytes("{}"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->tensors.empty());
  EXPECT_EQ(r->header_len, 2u);
  EXPECT_EQ(r->data_start, 10u);
  EXPECT_EQ(r->data_size, 0u);
}

TEST(SafetensorsHeaderTest, ParsesTensorsInOffsetOrderWithMetadataAndPadding) {
  // Out of order in the JSON, padded with spaces as the reference writer pads, an unknown
  // field (ignored like the reference), a zero-size tensor and a sub-byte one.
  const std::string json =
      "{\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[4,16],\"x\":{\"y\":[1]}},"
      "\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\"},"
      "\"a\":{\"dtype\":\"F4\",\"shape\":[8],\"data_offsets\":[0,4]},"
      "\"z\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[16,16]}}    ";
  const std::string file = SafetensorsBytes(json, 16);
  Result<ParsedHeader> r = Parse(file);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->tensors.size(), 3u);
  EXPECT_EQ(r->tensors[0].name, "a");
  EXPECT_EQ(r->tensors[0].dtype, DType::kF4);
  EXPECT_EQ(r->tensors[1].name, "b");
  EXPECT_EQ(r->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(r->tensors[1].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(r->tensors[1].begin, 4u);
  EXPECT_EQ(r->tensors[1].end, 16u);
  EXPECT_EQ(r->tensors[2].name, "z");
  EXPECT_EQ(r->metadata.size(), 2u);
  EXPECT_EQ(r->metadata.at("format"), "pt");
  EXPECT_EQ(r->header_json, json);
  EXPECT_EQ(r->data_start, 8 + json.size());
  EXPECT_EQ(r->data_size, 16u);
}

TEST(SafetensorsHeaderTest, NullMetadataIsNoMetadata) {
  Result<ParsedHeader> r = Parse(SafetensorsBytes("{\"__metadata__\":null}"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->metadata.empty());
}

TEST(SafetensorsHeaderTest, FileSmallerThanTheLengthPrefix) {
  Result<ParsedHeader> r = Parse(std::string("\x02\0\0", 3));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(r.status().message(), HasSubstr("too small for the 8-byte header length"));
}

TEST(SafetensorsHeaderTest, HeaderLengthOverTheBound) {
  std::string file = SafetensorsBytes("{}");
  const uint64_t n = kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  Result<ParsedHeader> r = ParseSafetensorsHeader(Bytes(file), uint64_t{1} << 40);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(r.status().message(), HasSubstr("exceeds the limit of 100000000 bytes"));
}

TEST(SafetensorsHeaderTest, HeaderLengthBeyondTheFile) {
  std::string file = SafetensorsBytes("{}");
  file[0] = 3;  // claims 3 header bytes; the file holds 2
  Result<ParsedHeader> r = Parse(file);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(r.status().message(), HasSubstr("runs past the end of the file (10 bytes)"));
}

TEST(SafetensorsHeaderTest, HeaderLengthAtMaxUint64DoesNotWrap) {
  std::string file(16, '\xff');
  Result<ParsedHeader> r = Parse(file);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsHeaderTest, TooFewBytesGivenIsACallerError) {
  const std::string file = SafetensorsBytes("{}", 0);
  Result<ParsedHeader> r = ParseSafetensorsHeader(Bytes(file).first(9), file.size());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("need the first 10 bytes"));
}

TEST(SafetensorsHeaderTest, MalformedJson) {
  ExpectInvalid("{\"a\":", 0, "header is not valid JSON");
  ExpectInvalid("{} x", 0, "header is not valid JSON");
  ExpectInvalid("{\"a\xff\":1}", 0, "header is not valid JSON");  // invalid UTF-8
}

TEST(SafetensorsHeaderTest, NotAnObject) {
  ExpectInvalid("[]", 0, "header is not a JSON object");
  ExpectInvalid("42", 0, "header is not a JSON object");
}

TEST(SafetensorsHeaderTest, WrongFieldTypes) {
  ExpectInvalid("{\"t\":[1]}", 0, "tensor 't': entry is not an object");
  ExpectInvalid("{\"t\":{\"dtype\":5,\"shape\":[],\"data_offsets\":[0,1]}}", 1,
                "tensor 't': field 'dtype' is not a string");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,1]}}", 1,
                "tensor 't': field 'shape' is not an array of non-negative integers");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", 1,
                "field 'shape' is not an array of non-negative integers");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1,
                "tensor 't': negative dimension in 'shape'");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1,
                "tensor 't': field 'data_offsets' is not [begin, end]");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1,
                "field 'data_offsets' is not [begin, end]");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{}}}", 1,
                "field 'data_offsets' is not [begin, end]");
}

TEST(SafetensorsHeaderTest, MissingField) {
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1,
                "tensor 't': missing field 'shape'");
  ExpectInvalid("{\"t\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                "tensor 't': missing field 'dtype'");
}

TEST(SafetensorsHeaderTest, UnknownDType) {
  ExpectInvalid("{\"t\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,16]}}", 16,
                "tensor 't': unknown dtype \"F128\"");
}

TEST(SafetensorsHeaderTest, BeginAfterEnd) {
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,1]}}", 2,
                "tensor 't': data_offsets begin 2 > end 1");
}

TEST(SafetensorsHeaderTest, EndBeyondTheDataRegion) {
  ExpectInvalid("{" + U8("t", 4, 0) + "}", 3,
                "tensor 't': data_offsets end 4 is beyond the data region of 3 bytes");
}

TEST(SafetensorsHeaderTest, GapBetweenTensors) {
  ExpectInvalid("{" + U8("a", 2, 0) + "," + U8("b", 2, 3) + "}", 5,
                "tensor 'b': data_offsets leave a gap: bytes [2, 3)");
}

TEST(SafetensorsHeaderTest, GapAtTheStart) {
  ExpectInvalid("{" + U8("a", 2, 1) + "}", 3, "tensor 'a': data_offsets leave a gap: bytes [0, 1)");
}

TEST(SafetensorsHeaderTest, OverlappingTensors) {
  ExpectInvalid("{" + U8("a", 4, 0) + "," + U8("b", 4, 2) + "}", 6,
                "tensor 'b': data_offsets [2, 6) overlap tensor 'a', which ends at 4");
}

TEST(SafetensorsHeaderTest, TrailingDataNotCovered) {
  ExpectInvalid("{" + U8("a", 4, 0) + "}", 5,
                "tensors cover 4 bytes of a data region of 5 bytes: trailing bytes");
}

TEST(SafetensorsHeaderTest, ShapeTimesDTypeDiffersFromByteLength) {
  ExpectInvalid("{\"t\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 12,
                "tensor 't': shape [2, 2] of F32 is 16 bytes but data_offsets span 12");
}

TEST(SafetensorsHeaderTest, MisalignedSubByteTensor) {
  ExpectInvalid("{\"t\":{\"dtype\":\"F6_E2M3\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
                "tensor 't' shape [2]: misaligned sub-byte tensor");
}

TEST(SafetensorsHeaderTest, ElementCountOverflow) {
  ExpectInvalid(
      "{\"t\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
      "tensor 't': element count of shape [4294967296, 4294967296] overflows 64 bits");
}

TEST(SafetensorsHeaderTest, ByteSizeOverflow) {
  // 2^61 elements fit in 64 bits; 2^61 * 64 bits do not.
  ExpectInvalid(
      "{\"t\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,0]}}", 0,
      "size overflow: 2305843009213693952 elements of F64");
}

TEST(SafetensorsHeaderTest, HugeNumbersAreNotIntegers) {
  // Past uint64, nlohmann reports a float: refused as a type error, not wrapped.
  ExpectInvalid(
      "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}", 1,
      "field 'data_offsets' is not [begin, end]");
}

TEST(SafetensorsHeaderTest, DuplicateTensorName) {
  // nlohmann's DOM would keep the last; the reference keeps one. We refuse.
  ExpectInvalid("{" + U8("t", 1, 0) + "," + U8("t", 1, 1) + "}", 2, "duplicate tensor name 't'");
}

TEST(SafetensorsHeaderTest, DuplicateFieldInATensor) {
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"dtype\":\"I8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                1, "tensor 't': duplicate field 'dtype'");
}

TEST(SafetensorsHeaderTest, BadMetadata) {
  ExpectInvalid("{\"__metadata__\":[\"a\"]}", 0, "__metadata__ is not an object");
  ExpectInvalid("{\"__metadata__\":\"x\"}", 0, "__metadata__ is not an object");
  ExpectInvalid("{\"__metadata__\":{\"k\":1}}", 0, "__metadata__ value for 'k' is not a string");
  ExpectInvalid("{\"__metadata__\":{\"k\":{}}}", 0, "__metadata__ value for 'k' is not a string");
  ExpectInvalid("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0,
                "duplicate __metadata__ key 'k'");
  ExpectInvalid("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate __metadata__ entry");
}

TEST(SafetensorsHeaderTest, BadTensorNames) {
  ExpectInvalid("{" + U8("", 1, 0) + "}", 1, "empty tensor name");
  const std::string long_name(kMaxTensorNameBytes + 1, 'n');
  ExpectInvalid("{" + U8(long_name, 1, 0) + "}", 1, "bytes, over the 4096-byte limit");
}

TEST(SafetensorsHeaderTest, RankOverTheLimit) {
  std::string shape;
  for (size_t i = 0; i <= kMaxTensorRank; ++i) shape += (i ? ",1" : "1");
  ExpectInvalid("{\"t\":{\"dtype\":\"U8\",\"shape\":[" + shape + "],\"data_offsets\":[0,1]}}", 1,
                "tensor 't': rank over the limit of 8 dimensions");
}

TEST(SafetensorsHeaderTest, DeeplyNestedUnknownFieldIsBounded) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  ExpectInvalid(
      "{\"t\":{\"x\":" + deep + ",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
      "tensor 't': unknown field nested deeper than 64");
}

}  // namespace
}  // namespace weightcache::checkpoint
