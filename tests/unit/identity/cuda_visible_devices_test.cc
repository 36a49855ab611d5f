#include "identity/cuda_visible_devices.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "unit/identity/test_devices.h"

namespace weightcache::identity {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using testing::TestUuid;
using testing::TestUuids;

VisibleSelection Select(std::optional<std::string> value, int n = 8) {
  return SelectVisibleDevices(value, TestUuids(n));
}

TEST(CudaVisibleDevicesTest, UnsetShowsEveryDeviceInOrder) {
  VisibleSelection sel = Select(std::nullopt);
  EXPECT_THAT(sel.ordinals, ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_EQ(sel.note, "");
}

TEST(CudaVisibleDevicesTest, EmptyStringShowsNoDevice) {
  VisibleSelection sel = Select("");
  EXPECT_THAT(sel.ordinals, IsEmpty());
  EXPECT_THAT(sel.note, HasSubstr("empty string"));
}

TEST(CudaVisibleDevicesTest, IndicesArePermutedInListOrder) {
  EXPECT_THAT(Select("5,3").ordinals, ElementsAre(5, 3));
  EXPECT_THAT(Select("7,0,6").ordinals, ElementsAre(7, 0, 6));
  EXPECT_EQ(Select("5,3").note, "");
}

TEST(CudaVisibleDevicesTest, WhitespaceAroundEntriesIsIgnored) {
  EXPECT_THAT(Select(" 1 ,\t2 ").ordinals, ElementsAre(1, 2));
  EXPECT_THAT(Select(" GPU-3 , GPU-4").ordinals, ElementsAre(3, 4));
}

TEST(CudaVisibleDevicesTest, IndicesParseLikeStrtoul) {
  // The driver reads "1gpu2" as 1 (trailing characters ignored), as PyTorch models it.
  EXPECT_THAT(Select("1gpu2,2ampere").ordinals, ElementsAre(1, 2));
  EXPECT_THAT(Select("+3").ordinals, ElementsAre(3));
}

TEST(CudaVisibleDevicesTest, InvalidIndexEndsTheListKeepingEarlierDevices) {
  // The guide's own example: "0,2,-1,1" shows devices 0 and 2 only.
  VisibleSelection sel = Select("0,2,-1,1");
  EXPECT_THAT(sel.ordinals, ElementsAre(0, 2));
  EXPECT_THAT(sel.note, HasSubstr("entry 2 \"-1\" is not a device index"));

  VisibleSelection out_of_range = Select("4,8,1");
  EXPECT_THAT(out_of_range.ordinals, ElementsAre(4));
  EXPECT_THAT(out_of_range.note, HasSubstr("entry 1 \"8\" is out of range (8 devices)"));

  EXPECT_THAT(Select("3,,4").ordinals, ElementsAre(3));
  EXPECT_THAT(Select("x").ordinals, IsEmpty());
}

TEST(CudaVisibleDevicesTest, FullUuidsAndUniquePrefixesSelectThoseDevices) {
  EXPECT_THAT(Select(TestUuid(6) + "," + TestUuid(2)).ordinals, ElementsAre(6, 2));
  EXPECT_THAT(Select("GPU-55555555").ordinals, ElementsAre(5));
  EXPECT_THAT(Select("GPU-5,GPU-1").ordinals, ElementsAre(5, 1));
}

TEST(CudaVisibleDevicesTest, AmbiguousOrUnknownUuidPrefixEndsTheList) {
  std::vector<std::string> uuids = {"GPU-abcd0000-1111-2222-3333-444444444444",
                                    "GPU-abcd1111-1111-2222-3333-444444444444",
                                    "GPU-ef000000-1111-2222-3333-444444444444"};
  VisibleSelection ambiguous = SelectVisibleDevices("GPU-ef,GPU-abcd,GPU-abcd1", uuids);
  EXPECT_THAT(ambiguous.ordinals, ElementsAre(2));
  EXPECT_THAT(ambiguous.note, HasSubstr("entry 1 \"GPU-abcd\" is an ambiguous UUID prefix"));

  VisibleSelection unknown = Select("GPU-3,GPU-9,GPU-4");
  EXPECT_THAT(unknown.ordinals, ElementsAre(3));
  EXPECT_THAT(unknown.note, HasSubstr("\"GPU-9\" matches no device UUID"));
}

TEST(CudaVisibleDevicesTest, TheFirstEntryDecidesTheKindOfTheList) {
  EXPECT_THAT(Select("3,GPU-4").ordinals, ElementsAre(3));
  VisibleSelection sel = Select("GPU-4,3");
  EXPECT_THAT(sel.ordinals, ElementsAre(4));
  EXPECT_THAT(sel.note, HasSubstr("does not start with \"GPU-\""));
}

TEST(CudaVisibleDevicesTest, UuidWithoutGpuPrefixIsReadAsAnIndex) {
  // "55555555-1111-…" parses as index 55555555: out of range, so nothing is visible.
  VisibleSelection sel = Select("55555555-1111");
  EXPECT_THAT(sel.ordinals, IsEmpty());
  EXPECT_THAT(sel.note, HasSubstr("out of range"));
  // ... and a UUID starting with a small digit silently means that index.
  EXPECT_THAT(Select("3a").ordinals, ElementsAre(3));
}

TEST(CudaVisibleDevicesTest, ADuplicateDeviceHidesEveryDevice) {
  VisibleSelection by_index = Select("1,2,1");
  EXPECT_THAT(by_index.ordinals, IsEmpty());
  EXPECT_THAT(by_index.note, HasSubstr("names device 1 a second time"));
  // Two spellings of one UUID are a duplicate too.
  EXPECT_THAT(Select("GPU-2," + TestUuid(2)).ordinals, IsEmpty());
}

TEST(CudaVisibleDevicesTest, MigUuidsSelectMigInstances) {
  std::vector<std::string> uuids = {"MIG-0a1b2c3d-1111-2222-3333-444444444444",
                                    "MIG-9f8e7d6c-1111-2222-3333-444444444444",
                                    "MIG-GPU-11111111-1111-2222-3333-000000000001/1/0"};
  EXPECT_THAT(SelectVisibleDevices("MIG-9f8e", uuids).ordinals, ElementsAre(1));
  EXPECT_THAT(
      SelectVisibleDevices("MIG-9f8e7d6c-1111-2222-3333-444444444444,MIG-0a", uuids).ordinals,
      ElementsAre(1, 0));
  EXPECT_THAT(
      SelectVisibleDevices("MIG-GPU-11111111-1111-2222-3333-000000000001/1/0", uuids).ordinals,
      ElementsAre(2));
  // A GPU- entry after MIG- entries ends the list.
  EXPECT_THAT(SelectVisibleDevices("MIG-0a,GPU-1", uuids).ordinals, ElementsAre(0));
}

}  // namespace
}  // namespace weightcache::identity
