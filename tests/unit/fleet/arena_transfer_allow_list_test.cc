#include "fleet/arena_transfer_allow_list.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

namespace weightcache::fleet {
namespace {

using ::testing::HasSubstr;

sockaddr_storage V4(const char* text) {
  sockaddr_storage s{};
  auto* in = reinterpret_cast<sockaddr_in*>(&s);
  in->sin_family = AF_INET;
  in->sin_port = htons(4242);
  EXPECT_EQ(inet_pton(AF_INET, text, &in->sin_addr), 1);
  return s;
}
sockaddr_storage V6(const char* text) {
  sockaddr_storage s{};
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&s);
  in6->sin6_family = AF_INET6;
  in6->sin6_port = htons(4242);
  EXPECT_EQ(inet_pton(AF_INET6, text, &in6->sin6_addr), 1);
  return s;
}
bool Allows(const PeerAllowList& list, const sockaddr_storage& s) {
  return list.Allows(reinterpret_cast<const sockaddr*>(&s));
}

TEST(PeerAllowListTest, AddressesAndPrefixesMatchExactlyWhatTheySay) {
  auto list = PeerAllowList::Parse(" 10.1.0.0/16, 127.0.0.1 ,fd00::/8,::1");
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(list->ToString(), "10.1.0.0/16,127.0.0.1/32,fd00::/8,::1/128");
  EXPECT_TRUE(Allows(*list, V4("10.1.200.3")));
  EXPECT_FALSE(Allows(*list, V4("10.2.0.1")));
  EXPECT_TRUE(Allows(*list, V4("127.0.0.1")));
  EXPECT_FALSE(Allows(*list, V4("127.0.0.2")));
  EXPECT_TRUE(Allows(*list, V6("fd12:3456::1")));
  EXPECT_FALSE(Allows(*list, V6("fe80::1")));
  EXPECT_TRUE(Allows(*list, V6("::1")));
  // A dual-stack listener reports IPv4 peers as v4-mapped IPv6 addresses.
  EXPECT_TRUE(Allows(*list, V6("::ffff:10.1.2.3")));
  EXPECT_FALSE(Allows(*list, V6("::ffff:10.9.2.3")));
}

// An entry written in the mapped form (as a refusal logs a dual-stack peer) is the IPv4 entry:
// before, it parsed as IPv6 and matched nobody, since Allows() matches mapped peers as IPv4.
TEST(PeerAllowListTest, AnIpv4MappedEntryIsTheIpv4Entry) {
  auto list = PeerAllowList::Parse("::ffff:10.0.0.5,::ffff:192.168.0.0/112");
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(list->ToString(), "10.0.0.5/32,192.168.0.0/16");
  EXPECT_TRUE(Allows(*list, V4("10.0.0.5")));
  EXPECT_TRUE(Allows(*list, V6("::ffff:10.0.0.5")));
  EXPECT_FALSE(Allows(*list, V4("10.0.0.6")));
  EXPECT_TRUE(Allows(*list, V6("::ffff:192.168.77.1")));
  EXPECT_FALSE(Allows(*list, V4("192.169.0.1")));
  auto short_prefix = PeerAllowList::Parse("::ffff:0.0.0.0/80");
  ASSERT_FALSE(short_prefix.ok());
  EXPECT_THAT(short_prefix.status().message(), HasSubstr("has host bits set past its prefix"));
}

TEST(PeerAllowListTest, PrefixesThatEndInsideAByte) {
  auto list = PeerAllowList::Parse("192.168.4.0/22");
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(Allows(*list, V4("192.168.7.255")));
  EXPECT_FALSE(Allows(*list, V4("192.168.8.0")));
  EXPECT_FALSE(Allows(*list, V4("192.168.3.255")));
}

TEST(PeerAllowListTest, AnEmptyListAllowsNobodyAndEveryoneIsSpelledOut) {
  auto empty = PeerAllowList::Parse("");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_FALSE(Allows(*empty, V4("127.0.0.1")));
  auto everyone = PeerAllowList::Parse("0.0.0.0/0,::/0");
  ASSERT_TRUE(everyone.ok());
  EXPECT_TRUE(Allows(*everyone, V4("203.0.113.9")));
  EXPECT_TRUE(Allows(*everyone, V6("2001:db8::1")));
  EXPECT_FALSE(PeerAllowList().Allows(nullptr));
}

TEST(PeerAllowListTest, BadEntriesAreRefusedByName) {
  const std::pair<const char*, const char*> cases[] = {
      {"*", "'*' is not an IPv4/IPv6 address"},
      {"10.0.0.0/33", "'10.0.0.0/33': the prefix length must be 0..32"},
      {"::/129", "the prefix length must be 0..128"},
      {"10.0.0.0/", "the prefix length"},
      {"10.0.0.0/8x", "the prefix length"},
      {"10.0.0.1/8", "'10.0.0.1/8' has host bits set"},
      {"host.example", "is not an IPv4/IPv6 address"},
      {"127.0.0.1,300.1.1.1", "'300.1.1.1' is not"},
  };
  for (const auto& [text, expected] : cases) {
    auto list = PeerAllowList::Parse(text);
    ASSERT_FALSE(list.ok()) << text;
    EXPECT_EQ(list.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(list.status().message(), HasSubstr(expected)) << text;
  }
}

TEST(PeerAllowListTest, FormatsAddressesWithTheirPorts) {
  const sockaddr_storage v4 = V4("10.0.0.7");
  const sockaddr_storage v6 = V6("fd00::7");
  EXPECT_EQ(FormatSockaddr(reinterpret_cast<const sockaddr*>(&v4)), "10.0.0.7:4242");
  EXPECT_EQ(FormatSockaddr(reinterpret_cast<const sockaddr*>(&v6)), "[fd00::7]:4242");
}

}  // namespace
}  // namespace weightcache::fleet
