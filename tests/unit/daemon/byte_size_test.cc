// --memory-budget parsing: binary units, strict about everything else.
#include "daemon/byte_size.h"

#include <gtest/gtest.h>

namespace weightcache::daemon {
namespace {

TEST(ParseByteSize, AcceptsPlainNumbersAndBinaryUnitsInEverySpelling) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("17B"), 17u);
  EXPECT_EQ(*ParseByteSize("4K"), 4096u);
  EXPECT_EQ(*ParseByteSize("512M"), uint64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("20G"), uint64_t{20} << 30);
  EXPECT_EQ(*ParseByteSize("20gb"), uint64_t{20} << 30);
  EXPECT_EQ(*ParseByteSize("20GiB"), uint64_t{20} << 30);
  EXPECT_EQ(*ParseByteSize("2T"), uint64_t{2} << 40);
  EXPECT_EQ(*ParseByteSize("1P"), uint64_t{1} << 50);
}

TEST(ParseByteSize, RefusesGarbageNamingTheText) {
  for (const char* bad : {"", "G", "-1", "1.5G", "12X", "20 G", "1GiBB"}) {
    auto r = ParseByteSize(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("\"" + std::string(bad) + "\""), std::string::npos)
        << r.status().message();
  }
}

TEST(ParseByteSize, RefusesOverflow) {
  auto digits = ParseByteSize("18446744073709551616");  // 2^64
  ASSERT_FALSE(digits.ok());
  EXPECT_NE(digits.status().message().find("overflows 64 bits"), std::string::npos);
  auto unit = ParseByteSize("16385P");  // > 2^64 after the shift
  ASSERT_FALSE(unit.ok());
  EXPECT_NE(unit.status().message().find("overflows 64 bits"), std::string::npos);
  EXPECT_EQ(*ParseByteSize("18446744073709551615"), UINT64_MAX);
}

TEST(FormatRate, DecimalGigabytesPerSecondAndZeroWithoutTime) {
  EXPECT_EQ(FormatRate(3'000'000'000, 2.0), "1.50 GB/s");
  EXPECT_EQ(FormatRate(16'060'000'000, 0.562), "28.58 GB/s");
  EXPECT_EQ(FormatRate(1'000, 0.0), "0.00 GB/s");
  EXPECT_EQ(FormatRate(0, 1.0), "0.00 GB/s");
}

TEST(FormatBytes, UsesBinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(FormatBytes(17), "17 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{20} << 30), "20.00 GiB");
}

}  // namespace
}  // namespace weightcache::daemon
