#include "common/hash.h"

#include <gtest/gtest.h>

namespace weightcache {
namespace {

TEST(HashTest, Sha256KnownVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(HashTest, Sha256IncrementalEqualsOneShot) {
  Sha256 h;
  h.Update("a");
  h.Update("bc");
  EXPECT_EQ(h.FinalHex(), Sha256Hex("abc"));
}

TEST(HashTest, Xxh64KnownVectors) {
  EXPECT_EQ(Xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(Hex64(Xxh64("abc", 3)), "44bc2cf5ad770999");
}

}  // namespace
}  // namespace weightcache
