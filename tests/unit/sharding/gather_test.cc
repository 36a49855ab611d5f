// sharding::ReadHeldBytes against a real checkpoint (written by the safetensors library): the
// held bytes of a copy geometry, read whole, from the middle of a row, across staged rows,
// and a read error in the tensor's context.
#include "sharding/gather.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::sharding {
namespace {

using testing::ShardingFixture;

class GatherTest : public ShardingFixture {
 protected:
  // The file bytes of tensor `name`.
  static std::vector<uint8_t> Full(const checkpoint::Checkpoint& ckpt, const std::string& name) {
    const checkpoint::TensorInfo* t = ckpt.Find(name);
    std::vector<uint8_t> out(t->nbytes);
    EXPECT_TRUE(checkpoint::ReadTensor(ckpt, *t, out.data()).ok());
    return out;
  }
  // What the geometry selects, computed from the full bytes.
  static std::vector<uint8_t> Expected(const std::vector<uint8_t>& full, const CopyGeometry& g) {
    std::vector<uint8_t> out;
    for (uint64_t r = 0; r < g.rows; ++r) {
      const uint8_t* row = full.data() + g.source_offset + r * g.source_pitch;
      out.insert(out.end(), row, row + g.row_bytes);
    }
    return out;
  }
};

TEST_F(GatherTest, ReadsTheHeldBytesOfEveryGeometryFromAnyOffset) {
  const std::string dir = Make("m", {{"w", {64, 48}, "f32"}}, nullptr);
  auto ckpt = checkpoint::Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const checkpoint::TensorInfo& t = *ckpt->Find("w");
  const std::vector<uint8_t> full = Full(*ckpt, "w");

  // Columns [12, 24) of 48 floats (a dim-1 split of 4, rank 1): 64 rows of 48 bytes, 192 apart.
  const CopyGeometry columns{.rows = 64, .row_bytes = 48, .source_pitch = 192, .source_offset = 48};
  // Rows [16, 32) (a dim-0 split): one contiguous run.
  const CopyGeometry rows{
      .rows = 1, .row_bytes = 16 * 192, .source_pitch = 0, .source_offset = 3072};
  for (const CopyGeometry& g : {columns, rows}) {
    const std::vector<uint8_t> expected = Expected(full, g);
    std::unique_ptr<uint8_t[]> stage;
    std::vector<uint8_t> got(expected.size());
    ASSERT_TRUE(ReadHeldBytes(*ckpt, t, g, 0, got.size(), got.data(), stage).ok());
    EXPECT_EQ(got, expected);
    // A piece starting and ending inside rows (as a loader's step boundaries fall).
    const uint64_t at = 70, length = expected.size() - 70 - 29;
    std::vector<uint8_t> part(length);
    ASSERT_TRUE(ReadHeldBytes(*ckpt, t, g, at, length, part.data(), stage).ok());
    EXPECT_EQ(part, std::vector<uint8_t>(expected.begin() + at, expected.begin() + at + length));
  }
}

TEST_F(GatherTest, AGeometryOutsideTheTensorIsAnErrorNamingTheTensor) {
  const std::string dir = Make("short", {{"w", {4, 4}, "f32"}}, nullptr);
  auto ckpt = checkpoint::Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const CopyGeometry past{.rows = 2, .row_bytes = 8, .source_pitch = 1 << 20, .source_offset = 0};
  std::unique_ptr<uint8_t[]> stage;
  std::vector<uint8_t> got(16);
  Status s = ReadHeldBytes(*ckpt, *ckpt->Find("w"), past, 0, 16, got.data(), stage);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(s.message(), ::testing::HasSubstr("tensor w: copy geometry of 2 row(s) of 8 bytes"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("is outside its 64 bytes"));
}

}  // namespace
}  // namespace weightcache::sharding
