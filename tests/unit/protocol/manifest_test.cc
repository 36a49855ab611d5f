#include "protocol/manifest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "os/memfd.h"
#include "protocol/wire.h"
#include "unit/protocol/protocol_test_util.h"

namespace weightcache::protocol {
namespace {

// A valid two-allocation manifest; tests corrupt one field at its documented offset.
class ManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tensors_.clear();
    names_ = {"embed.weight", "layers.0.attn.k", "layers.0.attn.q"};  // name order
    allocs_ = {1 << 20, 4096};
    for (size_t i = 0; i < names_.size(); ++i) {
      TensorEntry t;
      t.name = names_[i];
      t.dtype = i == 2 ? "F8_E4M3" : "BF16";
      t.ndim = 2;
      t.shape = {16, 32};
      t.allocation = i == 2 ? 1 : 0;
      t.offset = i == 1 ? 1024 : 0;
      t.nbytes = 1024;
      t.checksum = 1000 + i;
      tensors_.push_back(t);
    }
    auto bytes = EncodeManifest(Tier::kGpu, allocs_, tensors_);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    bytes_ = std::move(bytes).value();
  }
  size_t TensorAt(size_t i) const {
    return kManifestHeaderSize + 8 * allocs_.size() + kManifestTensorSize * i;
  }
  // Entry k of the dims section (tensor i's shape starts at 4 * i: every tensor is 2-d).
  size_t DimAt(size_t k) const { return TensorAt(tensors_.size()) + 8 * k; }
  // Byte k of the string table (12 dims in all).
  size_t StringAt(size_t k) const { return DimAt(12) + k; }
  void SetU32(size_t at, uint32_t v) {
    for (int k = 0; k < 4; ++k) bytes_[at + k] = static_cast<uint8_t>(v >> (8 * k));
  }
  Status Decoded() const { return Manifest::Decode(bytes_).status(); }

  std::vector<std::string> names_;
  std::vector<uint64_t> allocs_;
  std::vector<TensorEntry> tensors_;
  std::vector<uint8_t> bytes_;
};

TEST_F(ManifestTest, RoundTripsEveryField) {
  auto m = Manifest::Decode(bytes_);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tier(), Tier::kGpu);
  EXPECT_EQ(m->allocation_sizes(), allocs_);
  ASSERT_EQ(m->tensor_count(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const TensorEntry t = m->tensor(i);
    EXPECT_EQ(t.name, names_[i]);
    EXPECT_EQ(t.dtype, tensors_[i].dtype);
    EXPECT_EQ(t.ndim, 2u);
    EXPECT_EQ(std::vector<uint64_t>(t.dims().begin(), t.dims().end()),
              (std::vector<uint64_t>{16, 32}));
    EXPECT_EQ(t.allocation, tensors_[i].allocation);
    EXPECT_EQ(t.offset, tensors_[i].offset);
    EXPECT_EQ(t.nbytes, 1024u);
    EXPECT_EQ(t.checksum, 1000 + i);
  }
  // Views survive a move of the Manifest.
  Manifest moved = std::move(m).value();
  EXPECT_EQ(moved.tensor(1).name, "layers.0.attn.k");
}

TEST_F(ManifestTest, MetadataRoundTripsAfterTheStringTable) {
  EXPECT_TRUE(Manifest::Decode(bytes_)->metadata().empty());
  const std::string blob("engine 2.0\0binary\xff", 18);
  auto bytes = EncodeManifest(Tier::kHost, allocs_, tensors_, blob);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(bytes->size(), bytes_.size() + blob.size());
  EXPECT_EQ(std::string(bytes->end() - 18, bytes->end()), blob);
  auto m = Manifest::Decode(*bytes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Manifest moved = std::move(m).value();
  EXPECT_EQ(moved.metadata(), blob);
  EXPECT_EQ(moved.tensor(2).name, "layers.0.attn.q");
  Status too_large =
      EncodeManifest(Tier::kHost, allocs_, tensors_, std::string(kMaxManifestMetadataSize + 1, 'm'))
          .status();
  EXPECT_EQ(too_large.code(), StatusCode::kInvalidArgument) << too_large.ToString();
  EXPECT_NE(too_large.message().find("metadata of 65537 bytes exceeds the 65536-byte limit"),
            std::string::npos)
      << too_large.message();
}

TEST_F(ManifestTest, RecordsAreViewsIntoTheManifestBytes) {
  auto m = Manifest::Decode(bytes_);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto inside = [&](const void* p) {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= m->bytes().data() && b < m->bytes().data() + m->bytes().size();
  };
  for (size_t i = 0; i < 3; ++i) {
    const TensorRecord r = m->record(i);
    EXPECT_EQ(r.name, names_[i]);
    EXPECT_TRUE(inside(r.name.data()));
    EXPECT_EQ(r.name.data()[r.name.size()], '\0');  // usable as a C string in place
    EXPECT_EQ(r.dtype, tensors_[i].dtype);
    EXPECT_EQ(std::vector<int64_t>(r.shape.begin(), r.shape.end()), (std::vector<int64_t>{16, 32}));
    EXPECT_EQ(std::vector<int64_t>(r.strides.begin(), r.strides.end()),
              (std::vector<int64_t>{32, 1}));
    EXPECT_TRUE(inside(r.shape.data()));
    EXPECT_TRUE(inside(r.strides.data()));
    EXPECT_EQ(r.allocation, tensors_[i].allocation);
    EXPECT_EQ(r.offset, tensors_[i].offset);
    EXPECT_EQ(r.nbytes, 1024u);
    EXPECT_EQ(r.checksum, 1000 + i);
  }
  // 32-byte header, 2 allocations of 8 bytes, 3 records of 64, 12 dims of 8, then the strings.
  EXPECT_EQ(StringAt(0), 336u);
  EXPECT_EQ(std::string_view(reinterpret_cast<const char*>(&bytes_[StringAt(0)]), 18),
            std::string_view("embed.weight\0BF16\0", 18));
}

// A sharded cache's record says which slice of the full tensor it holds: dim + 1 at byte 14
// (0 = whole), the offset at 48, the full length of that dim at 56; its length is shape[dim].
TEST_F(ManifestTest, SliceRoundTripsAndIsCheckedAgainstTheHeldShape) {
  tensors_[1].slice = SliceEntry{1, 32, 128};  // columns [32, 64) of 128
  auto bytes = EncodeManifest(Tier::kGpu, allocs_, tensors_);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  bytes_ = std::move(bytes).value();
  auto m = Manifest::Decode(bytes_);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->record(0).slice, std::nullopt);
  EXPECT_EQ(m->record(1).slice, (SliceEntry{1, 32, 128}));
  EXPECT_EQ(m->tensor(1).slice, (SliceEntry{1, 32, 128}));
  EXPECT_EQ(bytes_[TensorAt(1) + 14], 2);
  EXPECT_EQ(wire::GetU64(&bytes_[TensorAt(1) + 48]), 32u);
  EXPECT_EQ(wire::GetU64(&bytes_[TensorAt(1) + 56]), 128u);

  const std::vector<uint8_t> saved = bytes_;
  bytes_[TensorAt(1) + 14] = 3;  // dim 2 of a 2-d tensor
  ExpectProtocolError(Decoded(), "tensor 1 'layers.0.attn.k': slice dim 2 is not below ndim 2");
  bytes_ = saved;
  wire::SetU64(bytes_, TensorAt(1) + 48, 97);  // 97 + 32 > 128
  ExpectProtocolError(Decoded(),
                      "tensor 1 'layers.0.attn.k': slice offset 97 + length 32 exceeds the full "
                      "dim of 128");
  bytes_ = saved;
  wire::SetU64(bytes_, TensorAt(1) + 56, 31);  // a full dim smaller than the held one
  ExpectProtocolError(Decoded(), "slice offset 32 + length 32 exceeds the full dim of 31");
  bytes_ = saved;
  wire::SetU64(bytes_, TensorAt(0) + 56, 16);  // a whole tensor with slice fields
  ExpectProtocolError(Decoded(),
                      "tensor 0 'embed.weight': a whole tensor has a slice offset or full length");

  tensors_[1].slice = SliceEntry{0, 8, 16};  // rows [8, 24) of 16
  Status encoded = EncodeManifest(Tier::kGpu, allocs_, tensors_).status();
  EXPECT_EQ(encoded.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(encoded.message().find("slice offset 8 + length 16 exceeds the full dim of 16"),
            std::string::npos)
      << encoded.message();
  tensors_[1].slice = SliceEntry{2, 0, 16};
  encoded = EncodeManifest(Tier::kGpu, allocs_, tensors_).status();
  EXPECT_EQ(encoded.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(encoded.message().find("slice dim 2 is not below ndim 2"), std::string::npos)
      << encoded.message();
}

TEST_F(ManifestTest, TenThousandTensorsRoundTrip) {
  std::vector<std::string> names;
  for (int i = 0; i < 10000; ++i) names.push_back("model.layers." + std::to_string(i) + ".w");
  std::vector<TensorEntry> many;
  for (int i = 0; i < 10000; ++i) {
    TensorEntry t;
    t.name = names[i];
    t.dtype = "BF16";
    t.ndim = 1;
    t.shape = {512};
    t.offset = uint64_t(i) * 1024;
    t.nbytes = 1024;
    many.push_back(t);
  }
  std::vector<uint64_t> allocs = {10000ull * 1024};
  auto bytes = EncodeManifest(Tier::kHost, allocs, many);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto m = Manifest::Decode(*bytes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->tensor_count(), 10000u);
  // Records in name order: "model.layers.9999.w" sorts last, with its own fields.
  EXPECT_EQ(m->tensor(9999).name, "model.layers.9999.w");
  EXPECT_EQ(m->tensor(9999).offset, 9999ull * 1024);
  EXPECT_EQ(m->tensor(0).name, "model.layers.0.w");
  EXPECT_EQ(m->tensor(1).name, "model.layers.1.w");
  EXPECT_EQ(m->tensor(2).name, "model.layers.10.w");
  EXPECT_EQ(m->tensor(2).offset, 10ull * 1024);
}

TEST_F(ManifestTest, OffsetOutsideAllocationIsRejected) {
  wire::SetU64(bytes_, TensorAt(2) + 24, 4096 - 1000);  // tensor 2: 3096 + 1024 > 4096
  ExpectProtocolError(Decoded(),
                      "tensor 2 'layers.0.attn.q': offset 3096 + nbytes 1024 exceeds allocation 1 "
                      "of 4096 bytes");
}

TEST_F(ManifestTest, OffsetPlusNbytesOverflowIsRejected) {
  wire::SetU64(bytes_, TensorAt(0) + 24, UINT64_MAX - 10);
  ExpectProtocolError(Decoded(), "tensor 0 'embed.weight': offset 18446744073709551605 + nbytes");
  SetUp();
  wire::SetU64(bytes_, TensorAt(0) + 32, UINT64_MAX);
  ExpectProtocolError(Decoded(), "nbytes 18446744073709551615 exceeds allocation 0");
}

TEST_F(ManifestTest, DuplicateNamesAreRejected) {
  // Point tensor 2's name at tensor 1's bytes.
  auto m = Manifest::Decode(bytes_);
  ASSERT_TRUE(m.ok());
  SetU32(TensorAt(2), static_cast<uint32_t>(m->tensor(1).name.data() - m->tensor(0).name.data()));
  SetU32(TensorAt(2) + 4, static_cast<uint32_t>(names_[1].size()));
  ExpectProtocolError(Decoded(), "tensor 2 'layers.0.attn.k': duplicate name (also tensor 1)");
}

TEST_F(ManifestTest, AllocationIndexOutOfRangeIsRejected) {
  SetU32(TensorAt(1) + 16, 2);
  ExpectProtocolError(Decoded(),
                      "tensor 1 'layers.0.attn.k': allocation index 2 out of range "
                      "(2 allocations)");
}

TEST_F(ManifestTest, StringOutsideTableIsRejected) {
  SetU32(TensorAt(0), 0xfffffff0);
  ExpectProtocolError(Decoded(),
                      "tensor 0: name (offset 4294967280, length 12 and its NUL) lies outside "
                      "the string table");
  SetUp();
  SetU32(TensorAt(0) + 8, 0xffffffff);
  ExpectProtocolError(Decoded(), "tensor 0 'embed.weight': dtype (offset 4294967295, length 4)");
  SetUp();
  bytes_[StringAt(12)] = 'x';  // the NUL after "embed.weight"
  ExpectProtocolError(Decoded(), "tensor 0 'embed.weight': name is not followed by a NUL");
}

TEST_F(ManifestTest, ShapeChecks) {
  bytes_[TensorAt(0) + 13] = 9;
  ExpectProtocolError(Decoded(), "tensor 0 'embed.weight': ndim 9 exceeds 8");
  SetUp();
  SetU32(TensorAt(1) + 20, 10);  // dims 10..13 of 12
  ExpectProtocolError(Decoded(),
                      "tensor 1 'layers.0.attn.k': dims 10 + 2 x 2 lie outside the 12 dims");
  SetUp();
  wire::SetU64(bytes_, DimAt(0), UINT64_MAX);  // -1
  ExpectProtocolError(Decoded(), "tensor 0 'embed.weight': negative dimension");
  SetUp();
  wire::SetU64(bytes_, DimAt(0), uint64_t{1} << 40);
  wire::SetU64(bytes_, DimAt(1), uint64_t{1} << 40);
  ExpectProtocolError(Decoded(), "element count overflows 64 bits");
  SetUp();
  wire::SetU64(bytes_, DimAt(2), 31);  // tensor 0's strides are {32, 1}
  ExpectProtocolError(Decoded(),
                      "tensor 0 'embed.weight': strides are not the contiguous row-major ones");
  SetUp();
  wire::SetU64(bytes_, DimAt(3), 0);
  ExpectProtocolError(Decoded(), "strides are not the contiguous row-major ones");
}

TEST_F(ManifestTest, AZeroDimensionMakesAnyShapeValidInEveryOrder) {
  // {2^40, 2^40, 0} holds 0 elements: the partial product overflows before the 0, and that is
  // no overflow. Encoder and decoder agree.
  std::vector<TensorEntry> t = {tensors_[0]};
  t[0].ndim = 3;
  t[0].shape = {uint64_t{1} << 40, uint64_t{1} << 40, 0};
  t[0].nbytes = 0;
  auto bytes = EncodeManifest(Tier::kGpu, allocs_, t);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto m = Manifest::Decode(*bytes);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(std::vector<int64_t>(m->record(0).strides.begin(), m->record(0).strides.end()),
            (std::vector<int64_t>{0, 0, 1}));
  // {0, 2^40, 2^40} holds 0 elements too, but its first stride (2^80) has no int64.
  t[0].shape = {0, uint64_t{1} << 40, uint64_t{1} << 40};
  auto overflow = EncodeManifest(Tier::kGpu, allocs_, t);
  EXPECT_EQ(overflow.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overflow.status().message().find("'embed.weight': a stride overflows int64"),
            std::string::npos)
      << overflow.status().ToString();
}

TEST_F(ManifestTest, HeaderChecks) {
  std::vector<uint8_t> saved = bytes_;
  bytes_[0] = 'X';
  ExpectProtocolError(Decoded(), "attach manifest: bad magic");
  bytes_ = saved;
  bytes_[4] = 3;
  ExpectProtocolError(Decoded(), "unknown tier code 3");
  bytes_ = saved;
  bytes_[6] = 1;
  ExpectProtocolError(Decoded(), "reserved header bytes are not 0");
  bytes_ = saved;
  bytes_.pop_back();
  ExpectProtocolError(Decoded(), "but the manifest has");
  bytes_ = saved;
  SetU32(12, 0x7fffffff);  // tensor count far beyond the payload
  ExpectProtocolError(Decoded(), "2147483647 tensors");
  bytes_ = saved;
  SetU32(8, 300);
  ExpectProtocolError(Decoded(), "300 allocations exceed the limit of 252");
  bytes_ = saved;
  wire::SetU64(bytes_, kManifestHeaderSize + 8, 0);
  ExpectProtocolError(Decoded(), "allocation 1 has size 0");
  bytes_ = saved;
  SetU32(28, 1);
  ExpectProtocolError(Decoded(), "reserved header bytes are not 0");
  bytes_ = saved;
  SetU32(24, 1);  // a metadata byte the manifest does not have
  ExpectProtocolError(Decoded(), "1-byte metadata) but the manifest has");
  bytes_ = saved;
  SetU32(24, kMaxManifestMetadataSize + 1);
  ExpectProtocolError(Decoded(), "metadata of 65537 bytes exceeds the 65536-byte limit");
  bytes_ = saved;
  bytes_[TensorAt(1) + 15] = 1;
  ExpectProtocolError(Decoded(), "tensor 1 'layers.0.attn.k': reserved bytes are not 0");
  bytes_ = saved;
  SetU32(16, 13);  // one dim more than the section holds
  ExpectProtocolError(Decoded(), "13 dims");
  ExpectProtocolError(Manifest::Decode(std::span(saved).first(10)).status(),
                      "truncated header (10 of 32 bytes)");
}

TEST_F(ManifestTest, EncoderRejectsInvalidInputWithTheSameChecks) {
  std::vector<TensorEntry> bad = tensors_;
  bad[2].name = "embed.weight";
  auto dup = EncodeManifest(Tier::kGpu, allocs_, bad);
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("duplicate name (also tensor 0)"), std::string::npos);
  bad = tensors_;
  bad[0].dtype = "bf16";
  auto dtype = EncodeManifest(Tier::kGpu, allocs_, bad);
  EXPECT_NE(dtype.status().message().find("invalid dtype name"), std::string::npos);
  bad = tensors_;
  bad[1].shape[5] = 7;  // dim 5 of a 2-d tensor
  auto unused = EncodeManifest(Tier::kGpu, allocs_, bad);
  EXPECT_NE(unused.status().message().find("'layers.0.attn.k': unused shape dimension not 0"),
            std::string::npos)
      << unused.status().ToString();
  bad = tensors_;
  bad[0].shape[0] = uint64_t{1} << 63;
  auto huge = EncodeManifest(Tier::kGpu, allocs_, bad);
  EXPECT_NE(huge.status().message().find("dimension above the int64 range"), std::string::npos);
  // 253 fds per frame, one of them the manifest's memfd.
  std::vector<uint64_t> too_many(253, 4096);
  auto allocs = EncodeManifest(Tier::kGpu, too_many, {});
  EXPECT_NE(allocs.status().message().find("253 allocations exceed the 252 one AttachReply"),
            std::string::npos);
}

TEST_F(ManifestTest, NamesOutOfOrderAreRejected) {
  // Swap the name references of records 1 and 2: both names still exist, once each, but
  // record 2's now sorts before record 1's.
  std::vector<uint8_t> r1(bytes_.begin() + TensorAt(1), bytes_.begin() + TensorAt(1) + 8);
  std::copy(bytes_.begin() + TensorAt(2), bytes_.begin() + TensorAt(2) + 8,
            bytes_.begin() + TensorAt(1));
  std::copy(r1.begin(), r1.end(), bytes_.begin() + TensorAt(2));
  ExpectProtocolError(Decoded(),
                      "tensor 2 'layers.0.attn.k': names out of ascending byte order (after "
                      "'layers.0.attn.q')");
}

TEST_F(ManifestTest, EncoderOrdersRecordsByName) {
  std::vector<TensorEntry> reversed(tensors_.rbegin(), tensors_.rend());
  auto bytes = EncodeManifest(Tier::kGpu, allocs_, reversed);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(*bytes, bytes_);  // the same bytes as from the ordered input
}

// A sealed memfd holding `bytes` (what a daemon hands out).
UniqueFd SealedManifest(const std::vector<uint8_t>& bytes) {
  auto fd = CreateManifestMemfd(bytes, "manifest_test");
  EXPECT_TRUE(fd.ok()) << fd.status().ToString();
  return fd.ok() ? std::move(fd).value() : UniqueFd();
}

TEST_F(ManifestTest, MapsASealedManifestMemfd) {
  UniqueFd fd = SealedManifest(bytes_);
  EXPECT_TRUE(os::CheckSealedReadOnly(fd.get()).ok());
  auto m = MapManifestMemfd(fd.get(), bytes_.size());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  fd.Reset();  // the mapping outlives the fd
  ASSERT_EQ(m->tensor_count(), 3u);
  EXPECT_EQ(m->tensor(2).name, "layers.0.attn.q");
  EXPECT_EQ(m->tensor(2).checksum, 1002u);
  EXPECT_TRUE(std::equal(m->bytes().begin(), m->bytes().end(), bytes_.begin(), bytes_.end()));
}

TEST_F(ManifestTest, DeferredRecordChecksRunOnceWhenAsked) {
  std::vector<uint8_t> bad = bytes_;
  wire::SetU64(bad, DimAt(2), 31);  // tensor 0's first stride
  UniqueFd fd = SealedManifest(bad);
  // The header is fine: a deferred decode accepts it, and no record is readable yet.
  auto m = MapManifestMemfd(fd.get(), bad.size(), RecordCheck::kDeferred);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_FALSE(m->records_validated());
  EXPECT_EQ(m->tensor_count(), 3u);
  EXPECT_EQ(m->allocation_sizes(), allocs_);
  ExpectProtocolError(m->ValidateRecords(), "tensor 0 'embed.weight': strides are not");
  ExpectProtocolError(m->ValidateRecords(), "tensor 0 'embed.weight': strides are not");
  EXPECT_FALSE(m->records_validated());
  // The same bytes decoded at once fail at once.
  ExpectProtocolError(MapManifestMemfd(fd.get(), bad.size()).status(), "strides are not");

  UniqueFd good_fd = SealedManifest(bytes_);
  auto good = MapManifestMemfd(good_fd.get(), bytes_.size(), RecordCheck::kDeferred);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  ASSERT_TRUE(good->ValidateRecords().ok());
  EXPECT_TRUE(good->records_validated());
  EXPECT_EQ(good->record(1).name, "layers.0.attn.k");
}

TEST_F(ManifestTest, ManifestMemfdMustBeSealedAndExactlyTheAnnouncedSize) {
  // Not sealed: a writer could change the records after they were checked.
  auto unsealed = os::CreateMemfd("unsealed", bytes_.size());
  ASSERT_TRUE(unsealed.ok());
  auto m = MapManifestMemfd(unsealed->get(), bytes_.size());
  EXPECT_EQ(m.status().code(), StatusCode::kPermissionDenied) << m.status().ToString();
  EXPECT_NE(m.status().message().find("attach manifest memfd"), std::string::npos);
  EXPECT_NE(m.status().message().find("F_SEAL_WRITE"), std::string::npos);

  UniqueFd fd = SealedManifest(bytes_);
  ExpectProtocolError(MapManifestMemfd(fd.get(), bytes_.size() - 1).status(),
                      "memfd holds " + std::to_string(bytes_.size()) + " bytes, the reply says " +
                          std::to_string(bytes_.size() - 1));
  ExpectProtocolError(MapManifestMemfd(fd.get(), kMaxManifestSize + 1).status(),
                      "announced size of " + std::to_string(kMaxManifestSize + 1) +
                          " bytes is outside 32-" + std::to_string(kMaxManifestSize));
  ExpectProtocolError(MapManifestMemfd(fd.get(), 3).status(), "announced size of 3 bytes");

  // Sealed and sized right, but invalid content is still rejected (untrusted).
  std::vector<uint8_t> bad = bytes_;
  bad[4] = 7;
  UniqueFd bad_fd = SealedManifest(bad);
  ExpectProtocolError(MapManifestMemfd(bad_fd.get(), bad.size()).status(), "unknown tier code 7");
}

}  // namespace
}  // namespace weightcache::protocol
