#include "common/hash.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>

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

// FIPS 180-2 appendix B: a two-block message and one million 'a's (padding that spills into a
// second block, and many blocks).
TEST(HashTest, Sha256FipsVectors) {
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1'000'000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Every split of a message across Update calls gives the one-shot digest, around the block
// (64) and padding (56) boundaries.
TEST(HashTest, Sha256AnySplitEqualsOneShot) {
  std::string message;
  for (int i = 0; i < 200; ++i) message.push_back(static_cast<char>('a' + i % 26));
  for (size_t length : {0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 200}) {
    const std::string m = message.substr(0, length);
    const std::string want = Sha256Hex(m);
    for (size_t split = 0; split <= length; ++split) {
      Sha256 h;
      h.Update(std::string_view(m).substr(0, split));
      h.Update(std::string_view(m).substr(split));
      ASSERT_EQ(h.FinalHex(), want) << "length " << length << " split " << split;
    }
  }
  EXPECT_EQ(Sha256Hex(message.substr(0, 56)),
            "784f623b787495078e93ff28a25b581df0584055a7e71d8cd90c454716b92f51");
}

TEST(HashTest, Xxh64KnownVectors) {
  EXPECT_EQ(Xxh64("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(Hex64(Xxh64("abc", 3)), "44bc2cf5ad770999");
}

}  // namespace
}  // namespace weightcache
