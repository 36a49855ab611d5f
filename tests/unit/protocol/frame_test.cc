#include "protocol/frame.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <string>
#include <thread>
#include <vector>

#include "os/unix_socket.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "unit/os/fd_test_util.h"
#include "unit/protocol/protocol_test_util.h"

namespace weightcache::protocol {
namespace {

using weightcache::testing::CountOpenFds;
using weightcache::testing::FaultySysCalls;
using weightcache::testing::MemfdWith;

std::vector<uint8_t> Header(uint16_t version, uint16_t type, uint32_t flags, uint32_t fds,
                            uint64_t length, const char* magic = "WCPF") {
  std::vector<uint8_t> out(magic, magic + 4);
  wire::PutU16(out, version);
  wire::PutU16(out, type);
  wire::PutU32(out, flags);
  wire::PutU32(out, fds);
  wire::PutU64(out, length);
  return out;
}

Status HeaderError(const std::vector<uint8_t>& bytes, Expect expect) {
  return DecodeFrameHeader(bytes, expect).status();
}

TEST(FrameHeaderTest, EncodeDecodeRoundTripWithExactLayout) {
  std::vector<uint8_t> payload = {1, 2, 3};
  auto frame = EncodeFrame(MessageType::kAttachReply, payload, 2);
  ASSERT_TRUE(frame.ok());
  ASSERT_EQ(frame->size(), kFrameHeaderSize + 3);
  EXPECT_EQ(std::string(frame->begin(), frame->begin() + 4), "WCPF");
  EXPECT_EQ(wire::GetU16(frame->data() + 4), kProtocolVersion);
  EXPECT_EQ(wire::GetU16(frame->data() + 6), 6);
  EXPECT_EQ(wire::GetU32(frame->data() + 12), 2u);
  EXPECT_EQ(wire::GetU64(frame->data() + 16), 3u);
  auto h = DecodeFrameHeader(*frame, Expect::kReply);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->type, MessageType::kAttachReply);
  EXPECT_EQ(h->fd_count, 2u);
  EXPECT_EQ(h->payload_length, 3u);
}

TEST(FrameHeaderTest, EachMalformationHasItsOwnError) {
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 1, 0, 0, 0, "HTTP"), Expect::kRequest),
                      "bad frame magic");
  ExpectProtocolError(HeaderError(Header(9, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 9 (this build speaks version 8)");
  // Version 1 carried the manifest inside AttachReply, version 2 had 112-byte manifest
  // records with names copied by the client, version 3 had no failure_code in HelloReply and
  // StatusReply, version 4 had 48-byte manifest records without the slice, version 5 had no
  // publishing messages and no `awaiting` state, version 6 no manifest metadata section and no
  // plan aliases, version 7 no `origin` in StatusReply; their peers are refused, not misread.
  ExpectProtocolError(HeaderError(Header(1, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 1 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(2, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 2 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(3, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 3 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(4, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 4 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(5, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 5 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(6, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 6 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(7, 1, 0, 0, 0), Expect::kRequest),
                      "unsupported protocol version 7 (this build speaks version 8)");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 77, 0, 0, 0), Expect::kRequest),
                      "unknown message type 77");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 0, 0, 0, 0), Expect::kRequest),
                      "unknown message type 0");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 1, 4, 0, 0), Expect::kRequest),
                      "unknown frame flags 0x00000004");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 2, 0, 0, 0), Expect::kRequest),
                      "unexpected HelloReply frame: expected a request");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 1, 0, 0, 0), Expect::kReply),
                      "unexpected Hello frame: expected a reply");
  ExpectProtocolError(
      HeaderError(Header(kProtocolVersion, 1, 0, 0, kMaxRequestPayload + 1), Expect::kRequest),
      "Hello frame payload of 65537 bytes exceeds the 65536-byte limit");
  ExpectProtocolError(
      HeaderError(Header(kProtocolVersion, 6, 0, 0, uint64_t{1} << 40), Expect::kReply),
      "exceeds the 65536-byte limit");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 1, 0, 1, 2), Expect::kRequest),
                      "Hello frame announces 1 fds; at most 0 allowed");
  ExpectProtocolError(HeaderError(Header(kProtocolVersion, 6, 0, 254, 2), Expect::kReply),
                      "announces 254 fds; at most 253 allowed");
  std::vector<uint8_t> short_header = Header(kProtocolVersion, 1, 0, 0, 0);
  short_header.resize(10);
  ExpectProtocolError(HeaderError(short_header, Expect::kRequest),
                      "frame header truncated: 10 of 24 bytes");
}

TEST(FrameHeaderTest, ErrorFramesOfAnyVersionAreReadable) {
  EXPECT_TRUE(DecodeFrameHeader(Header(9, 9, 0, 0, 10), Expect::kReply).ok());
  ExpectProtocolError(HeaderError(Header(9, 4, 0, 0, 10), Expect::kReply),
                      "unsupported protocol version 9");
}

TEST(FrameHeaderTest, EncoderRefusesWhatThePeerWouldReject) {
  std::vector<uint8_t> big(kMaxRequestPayload + 1);
  auto r = EncodeFrame(MessageType::kHello, big);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  auto f = EncodeFrame(MessageType::kStatusReply, {}, 1);
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
}

class FrameIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pair = os::SocketPair();
    ASSERT_TRUE(pair.ok());
    a_ = std::move(pair->first);
    b_ = std::move(pair->second);
  }
  os::Deadline Soon() { return os::Deadline::After(std::chrono::seconds(5)); }
  void SendRaw(const std::vector<uint8_t>& bytes) {
    ASSERT_TRUE(os::SendMessage(a_.get(), bytes, {}).ok());
  }
  UniqueFd a_, b_;
};

TEST_F(FrameIoTest, OversizeFrameIsRejectedBeforeAllocating) {
  // Announces 2^62 bytes; nothing but the header is ever sent. If the reader allocated first
  // it would die with bad_alloc; instead it names the bound.
  SendRaw(Header(kProtocolVersion, 6, 0, 0, uint64_t{1} << 62));
  auto r = ReadFrame(b_.get(), Expect::kReply, Soon());
  ExpectProtocolError(r.status(), "AttachReply frame payload of 4611686018427387904 bytes");
}

// A frame cut short by the peer's close is the peer going away (kUnavailable, as a close
// between frames), not a malformed frame: the client's discovery falls back on it (issue 39
// §5.7). The message still says how much arrived.
TEST_F(FrameIoTest, APayloadCutShortByTheClosingPeerIsUnavailable) {
  std::vector<uint8_t> bytes = Header(kProtocolVersion, 1, 0, 0, 100);
  bytes.resize(bytes.size() + 40, '{');
  SendRaw(bytes);
  a_.Reset();
  auto r = ReadFrame(b_.get(), Expect::kRequest, Soon());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("peer closed the connection on socket fd"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("after 40 of 100 bytes (truncated message)"),
            std::string::npos)
      << r.status().ToString();
}

TEST_F(FrameIoTest, FdsOnARequestAreClosedAndRejected) {
  auto frame = EncodeFrame(MessageType::kStatus, {});
  ASSERT_TRUE(frame.ok());
  UniqueFd m = MemfdWith("smuggled");
  int fds[] = {m.get()};
  // Bypass WriteFrame's consistency check: a hostile client attaches fds anyway.
  ASSERT_TRUE(os::SendMessage(a_.get(), *frame, fds).ok());
  int before = CountOpenFds();
  auto r = ReadFrame(b_.get(), Expect::kRequest, Soon());
  ExpectProtocolError(r.status(), "1 unexpected fds");
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(FrameIoTest, FewerFdsThanAnnouncedIsRejected) {
  std::vector<uint8_t> manifest_like = {0};
  auto frame = EncodeFrame(MessageType::kAttachReply, manifest_like, 2);
  ASSERT_TRUE(frame.ok());
  UniqueFd m = MemfdWith("only one");
  int fds[] = {m.get()};
  ASSERT_TRUE(os::SendMessage(a_.get(), *frame, fds).ok());
  int before = CountOpenFds();
  auto r = ReadFrame(b_.get(), Expect::kReply, Soon());
  ExpectProtocolError(r.status(), "AttachReply frame announces 2 fds but 1 arrived");
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(FrameIoTest, FramesSurviveShortWritesEintrAndOneByteReads) {
  Hello hello;
  hello.client_pid = 42;
  hello.client_name = std::string(3000, 'n');
  auto frame = EncodeHello(hello);
  ASSERT_TRUE(frame.ok());
  FaultySysCalls send_sys;
  send_sys.send_eintr = 1;
  send_sys.send_eagain = 1;
  send_sys.max_send = 256;
  ASSERT_TRUE(WriteFrame(a_.get(), *frame, {}, Soon(), send_sys).ok());
  ASSERT_TRUE(WriteFrame(a_.get(), *frame, {}, Soon()).ok());  // a second frame behind it

  FaultySysCalls recv_sys;
  recv_sys.recv_eintr = 2;
  recv_sys.max_recv = 1;
  for (int i = 0; i < 2; ++i) {
    auto r = ReadFrame(b_.get(), Expect::kRequest, Soon(), recv_sys);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto decoded = DecodeHello(r->payload);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->client_name, hello.client_name);
  }
}

TEST_F(FrameIoTest, FrameReaderAssemblesIncrementallyAndReportsCleanClose) {
  auto status_frame = EncodeStatusRequest();
  auto hello_frame = EncodeHello(Hello{});
  ASSERT_TRUE(status_frame.ok() && hello_frame.ok());
  FaultySysCalls sys;
  sys.max_recv = 7;
  FrameReader reader(Expect::kRequest, sys);

  auto nothing = reader.ReadAvailable(b_.get());
  ASSERT_TRUE(nothing.ok());
  EXPECT_FALSE(nothing->has_value());

  std::vector<uint8_t> both = *status_frame;
  both.insert(both.end(), hello_frame->begin(), hello_frame->end());
  // First 30 bytes only: the Status frame completes, the Hello frame is pending.
  ASSERT_TRUE(os::SendMessage(a_.get(), std::span(both).first(30), {}).ok());
  auto first = reader.ReadAvailable(b_.get());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->type, MessageType::kStatus);
  auto pending = reader.ReadAvailable(b_.get());
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(pending->has_value());

  ASSERT_TRUE(os::SendMessage(a_.get(), std::span(both).subspan(30), {}).ok());
  auto second = reader.ReadAvailable(b_.get());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_TRUE(second->has_value());
  EXPECT_EQ((*second)->type, MessageType::kHello);
  EXPECT_TRUE(DecodeHello((*second)->payload).ok());

  a_.Reset();
  auto closed = reader.ReadAvailable(b_.get());
  EXPECT_EQ(closed.status().code(), StatusCode::kUnavailable);
}

// The daemon's reader takes a close inside a frame for the peer going away too (kUnavailable:
// it closes the connection, with no Error for a peer that is gone), as ReadFrame does.
TEST_F(FrameIoTest, FrameReaderReportsACloseInsideAFrameAsThePeerGoingAway) {
  auto hello_frame = EncodeHello(Hello{});
  ASSERT_TRUE(hello_frame.ok());
  FrameReader reader(Expect::kRequest);
  ASSERT_TRUE(os::SendMessage(a_.get(), std::span(*hello_frame).first(30), {}).ok());
  auto pending = reader.ReadAvailable(b_.get());
  ASSERT_TRUE(pending.ok()) << pending.status().ToString();
  EXPECT_FALSE(pending->has_value());
  a_.Reset();
  auto closed = reader.ReadAvailable(b_.get());
  ASSERT_FALSE(closed.ok());
  EXPECT_EQ(closed.status().code(), StatusCode::kUnavailable) << closed.status().ToString();
  EXPECT_EQ(closed.status().message(), "peer closed the connection in the middle of a frame");
}

TEST_F(FrameIoTest, FrameWriterResumesAfterWouldBlockWithFdsSentOnce) {
  // An AttachReply is small since protocol version 2: shrink the send buffer (the kernel
  // doubles 4096 to its minimum of a few KiB) so the largest allowed one still blocks.
  const int sndbuf = 4096;
  ASSERT_EQ(::setsockopt(a_.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)), 0);
  std::vector<uint8_t> payload(kMaxAttachReplyPayload, 0x11);  // larger than the send buffer
  auto frame = EncodeFrame(MessageType::kAttachReply, payload, 1);
  ASSERT_TRUE(frame.ok());
  UniqueFd m = MemfdWith("alloc0");
  FrameWriter writer(std::move(frame).value(), {m.get()});
  auto first = writer.Flush(a_.get());
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(*first);  // would block: the reader has not started
  EXPECT_FALSE(writer.Done());

  std::thread reader([&] {
    auto r = ReadFrame(b_.get(), Expect::kReply, os::Deadline::After(std::chrono::seconds(10)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->payload.size(), payload.size());
    ASSERT_EQ(r->fds.size(), 1u);
    EXPECT_EQ(weightcache::testing::ReadAll(r->fds[0].get()), "alloc0");
  });
  while (true) {
    auto done = writer.Flush(a_.get());
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    if (*done) break;
    ASSERT_TRUE(os::WaitFor(a_.get(), POLLOUT, os::Deadline::After(std::chrono::seconds(10))).ok());
  }
  reader.join();
  EXPECT_TRUE(writer.Done());
}

}  // namespace
}  // namespace weightcache::protocol
