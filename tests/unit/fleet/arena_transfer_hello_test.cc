#include "fleet/arena_transfer_hello.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "protocol/wire.h"

namespace weightcache::fleet {
namespace {

using ::testing::HasSubstr;
namespace wire = protocol::wire;

Hello Sample() {
  Hello hello;
  hello.protocol = HelloProtocol::kUcx;
  hello.manifest = {'p', 'l', 'a', 'n'};
  hello.regions.push_back({0x7f0000001000, 3 << 20, {1, 2, 3}});
  hello.regions.push_back({0x7f0000900000, 4096, std::vector<uint8_t>(40, 9)});
  hello.worker_address = {5, 6, 7, 8, 9};
  return hello;
}

std::span<const uint8_t> Body(const std::vector<uint8_t>& frame) {
  return std::span<const uint8_t>(frame).subspan(kHelloHeaderBytes);
}

TEST(HelloTest, RoundTrips) {
  auto frame = EncodeHello(Sample());
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  auto body_bytes = DecodeHelloHeader(std::span(*frame).first(kHelloHeaderBytes));
  ASSERT_TRUE(body_bytes.ok()) << body_bytes.status().ToString();
  EXPECT_EQ(*body_bytes, frame->size() - kHelloHeaderBytes);
  auto hello = DecodeHelloBody(Body(*frame));
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->manifest, Sample().manifest);
  ASSERT_EQ(hello->regions.size(), 2u);
  EXPECT_EQ(hello->regions[0].remote_address, 0x7f0000001000u);
  EXPECT_EQ(hello->regions[0].bytes, 3u << 20);
  EXPECT_EQ(hello->regions[0].rkey, (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(hello->regions[1].rkey.size(), 40u);
  EXPECT_EQ(hello->worker_address, (std::vector<uint8_t>{5, 6, 7, 8, 9}));
}

TEST(HelloTest, TheEncoderRefusesWhatTheDecoderWould) {
  Hello hello = Sample();
  hello.regions[0].rkey.clear();
  EXPECT_THAT(EncodeHello(hello).status().message(), HasSubstr("an rkey of 0 bytes"));
  hello = Sample();
  hello.regions[1].bytes = 0;
  EXPECT_THAT(EncodeHello(hello).status().message(), HasSubstr("a region of 0 bytes"));
  hello = Sample();
  hello.worker_address.clear();
  EXPECT_THAT(EncodeHello(hello).status().message(), HasSubstr("a worker address of 0 bytes"));
  hello = Sample();
  hello.regions.resize(kMaxHelloRegions + 1, hello.regions[0]);
  EXPECT_THAT(EncodeHello(hello).status().message(), HasSubstr("4097 regions"));
}

TEST(HelloTest, HeadersAreCheckedBeforeAnythingIsAllocated) {
  auto frame = EncodeHello(Sample());
  ASSERT_TRUE(frame.ok());
  std::vector<uint8_t> header(frame->begin(), frame->begin() + kHelloHeaderBytes);
  auto bad = header;
  bad[0] ^= 0xFF;
  EXPECT_THAT(DecodeHelloHeader(bad).status().message(), HasSubstr("bad magic"));
  bad = header;
  bad[4] = 1;
  EXPECT_THAT(DecodeHelloHeader(bad).status().message(),
              HasSubstr("version 1, this build speaks 2"));
  bad = header;
  wire::SetU64(bad, 8, kMaxHelloBodyBytes + 1);
  EXPECT_EQ(DecodeHelloHeader(bad).status().code(), StatusCode::kProtocol);
  EXPECT_THAT(DecodeHelloHeader(bad).status().message(), HasSubstr("a body of"));
  wire::SetU64(bad, 8, 15);
  EXPECT_THAT(DecodeHelloHeader(bad).status().message(), HasSubstr("a body of 15 bytes"));
  EXPECT_THAT(DecodeHelloHeader(std::span(header).first(15)).status().message(),
              HasSubstr("a header of 15 bytes"));
}

TEST(HelloTest, EveryTruncationIsAProtocolError) {
  auto frame = EncodeHello(Sample());
  ASSERT_TRUE(frame.ok());
  const auto body = Body(*frame);
  for (size_t n = 0; n < body.size(); ++n) {
    auto hello = DecodeHelloBody(body.first(n));
    ASSERT_FALSE(hello.ok()) << n;
    EXPECT_EQ(hello.status().code(), StatusCode::kProtocol) << n;
  }
  std::vector<uint8_t> longer(body.begin(), body.end());
  longer.push_back(0);
  EXPECT_THAT(DecodeHelloBody(longer).status().message(),
              HasSubstr("1 bytes past the worker address"));
}

// Body offsets of the Sample's fields: counts at 0, the manifest at 16, region 0 at 20.
TEST(HelloTest, EachFieldIsBounded) {
  auto frame = EncodeHello(Sample());
  ASSERT_TRUE(frame.ok());
  const std::vector<uint8_t> body(Body(*frame).begin(), Body(*frame).end());
  struct Case {
    size_t at;
    uint64_t value;
    int width;
    const char* expected;
  };
  const Case cases[] = {
      {0, kMaxManifestBytes + 1, 8, "a manifest of 67108865 bytes"},
      {0, 1000, 8, "truncated at the manifest"},
      {8, 0, 4, "0 regions"},
      {8, kMaxHelloRegions + 1, 4, "4097 regions"},
      {8, 3, 4, "truncated at a region"},
      {12, 0, 4, "protocol 0 (1 tcp, 2 ucx)"},
      {12, 7, 4, "protocol 7 (1 tcp, 2 ucx)"},
      {20, UINT64_MAX - 10, 8, "region 0: its address range wraps around"},
      {28, 0, 8, "region 0 of 0 bytes"},
      {28, kMaxRegionBytes + 1, 8, "region 0 of 1125899906842625 bytes"},
      {36, 0, 4, "region 0: an rkey of 0 bytes"},
      {36, kMaxRkeyBytes + 1, 4, "region 0: an rkey of 4097 bytes"},
      {36, 4000, 4, "truncated at an rkey"},
      {103, 0, 4, "a worker address of 0 bytes"},
      {103, kMaxWorkerAddressBytes + 1, 4, "a worker address of 65537 bytes"},
      {103, 1000, 4, "truncated at the worker address"},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> bad = body;
    for (int i = 0; i < c.width; ++i) bad[c.at + i] = static_cast<uint8_t>(c.value >> (8 * i));
    auto hello = DecodeHelloBody(bad);
    ASSERT_FALSE(hello.ok()) << c.expected;
    EXPECT_EQ(hello.status().code(), StatusCode::kProtocol);
    EXPECT_THAT(hello.status().message(), HasSubstr(c.expected));
  }
  // Two regions whose sizes add up past the bound.
  Hello big = Sample();
  big.regions[0].bytes = kMaxRegionBytes;
  big.regions[1].bytes = kMaxRegionBytes;
  auto big_frame = EncodeHello(big);
  ASSERT_TRUE(big_frame.ok());
  EXPECT_THAT(DecodeHelloBody(Body(*big_frame)).status().message(),
              HasSubstr("the regions add up past"));
}

TEST(HelloTest, RandomBytesNeverCrashTheDecoder) {
  std::mt19937_64 random(19);
  auto frame = EncodeHello(Sample());
  ASSERT_TRUE(frame.ok());
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> body(Body(*frame).begin(), Body(*frame).end());
    // Flip a few bytes of a valid body, or take pure noise of a random length.
    if (round % 2 == 0) {
      for (int k = 0; k < 3; ++k) body[random() % body.size()] = static_cast<uint8_t>(random());
    } else {
      body.resize(random() % 200);
      for (auto& b : body) b = static_cast<uint8_t>(random());
    }
    auto hello = DecodeHelloBody(body);
    if (!hello.ok()) {
      EXPECT_EQ(hello.status().code(), StatusCode::kProtocol);
    }
  }
}

// The tcp protocol's hello: sizes only, no address and no rkey.
TEST(HelloTest, ATcpHelloCarriesNoAddressOrRkey) {
  Hello hello;
  hello.manifest = {'m'};
  hello.regions.push_back({0, 4096, {}});
  auto frame = EncodeHello(hello);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  auto decoded = DecodeHelloBody(Body(*frame));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->protocol, HelloProtocol::kTcp);
  EXPECT_EQ(decoded->regions[0].bytes, 4096u);
  std::vector<uint8_t> bad(Body(*frame).begin(), Body(*frame).end());
  wire::SetU64(bad, 17, 0x1000);  // region 0's address (after the 1-byte manifest)
  EXPECT_THAT(DecodeHelloBody(bad).status().message(),
              HasSubstr("region 0: an address (the tcp protocol has none)"));
  hello.regions[0].rkey = {1};
  EXPECT_EQ(EncodeHello(hello).status().code(), StatusCode::kInvalidArgument);
}

TEST(HelloTest, ARefusalInPlaceOfAHelloSaysWhy) {
  auto full = DecodeHelloHeader(EncodeRefusal(RefusalReason::kFull));
  EXPECT_EQ(full.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(full.status().message(), HasSubstr("the source is full"));
  auto stopping = DecodeHelloHeader(EncodeRefusal(RefusalReason::kStopping));
  EXPECT_THAT(stopping.status().message(), HasSubstr("the source is stopping"));
}

TEST(ReadRequestTest, OnlyReadsWithinTheRegionsDecode) {
  const std::vector<uint64_t> sizes = {4096, 1 << 20};
  auto ok = DecodeReadRequest(EncodeReadRequest({1, 4096, 8192}), sizes);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->region, 1u);
  EXPECT_EQ(ok->offset, 4096u);
  EXPECT_EQ(ok->length, 8192u);
  EXPECT_TRUE(DecodeReadRequest(EncodeReadRequest({0, 0, 4096}), sizes).ok());
  struct Case {
    ReadRequest request;
    const char* expected;
  };
  const Case cases[] = {
      {{0, 1, 4096}, "offset 1 + length 4096 past region 0's 4096 bytes"},
      {{0, 4096, 1}, "offset 4096 + length 1 past region 0's 4096 bytes"},
      {{0, UINT64_MAX, 1}, "offset 18446744073709551615 + length 1 past region 0's"},
      {{0, UINT64_MAX - 4095, 4096}, "past region 0's 4096 bytes"},
      {{0, 0, 8192}, "offset 0 + length 8192 past region 0's"},
      {{2, 0, 1}, "region 2 of 2"},
      {{0xFFFFFFFF, 0, 1}, "region 4294967295 of 2"},
      {{1, 0, 0}, "a length of 0"},
      {{1, 0, kMaxReadBytes + 1}, "a length of 67108865"},
  };
  for (const Case& c : cases) {
    auto decoded = DecodeReadRequest(EncodeReadRequest(c.request), sizes);
    ASSERT_FALSE(decoded.ok()) << c.expected;
    EXPECT_EQ(decoded.status().code(), StatusCode::kProtocol);
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.expected));
  }
  std::vector<uint8_t> put = EncodeReadRequest({0, 0, 8});
  put[0] = 2;
  EXPECT_THAT(DecodeReadRequest(put, sizes).status().message(),
              HasSubstr("opcode 2 (not a read: 1 is the only one)"));
  EXPECT_THAT(DecodeReadRequest(std::span(put).first(23), sizes).status().message(),
              HasSubstr("a read request of 23 bytes"));
}

TEST(ReadRequestTest, RandomFramesNeverDecodeOutOfBounds) {
  std::mt19937_64 random(23);
  const std::vector<uint64_t> sizes = {4096, 12345};
  for (int round = 0; round < 20000; ++round) {
    std::vector<uint8_t> frame(kReadRequestBytes);
    for (auto& b : frame) b = static_cast<uint8_t>(random());
    if (round % 2 == 0) frame[0] = 1, frame[1] = frame[2] = frame[3] = 0;    // a read
    if (round % 4 == 0) std::fill(frame.begin() + 4, frame.begin() + 8, 0);  // region 0
    auto decoded = DecodeReadRequest(frame, sizes);
    if (!decoded.ok()) {
      EXPECT_EQ(decoded.status().code(), StatusCode::kProtocol);
      continue;
    }
    ASSERT_LT(decoded->region, sizes.size());
    ASSERT_GE(decoded->length, 1u);
    ASSERT_LE(decoded->offset + decoded->length, sizes[decoded->region]);
  }
}

}  // namespace
}  // namespace weightcache::fleet
