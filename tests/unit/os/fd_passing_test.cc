#include "os/fd_passing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <vector>

#include "os/unix_socket.h"
#include "unit/os/fd_test_util.h"

namespace weightcache::os {
namespace {

using weightcache::testing::CountOpenFds;
using weightcache::testing::FaultySysCalls;
using weightcache::testing::MemfdWith;
using weightcache::testing::ReadAll;

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

class FdPassingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pair = SocketPair();
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    a_ = std::move(pair->first);
    b_ = std::move(pair->second);
  }
  UniqueFd a_, b_;
};

TEST_F(FdPassingTest, BytesAndMemfdsRoundTrip) {
  UniqueFd m1 = MemfdWith("first allocation");
  UniqueFd m2 = MemfdWith("second");
  int fds[] = {m1.get(), m2.get()};
  std::string payload = "hello with two fds";
  ASSERT_TRUE(SendMessage(a_.get(), Bytes(payload), fds).ok());

  std::vector<uint8_t> buf(payload.size());
  auto got = RecvMessage(b_.get(), buf, 4, Deadline::After(std::chrono::seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(std::string(buf.begin(), buf.end()), payload);
  ASSERT_EQ(got->size(), 2u);
  // Distinct fds in this process that read back the sender's contents, and are CLOEXEC.
  EXPECT_NE((*got)[0].get(), m1.get());
  EXPECT_EQ(ReadAll((*got)[0].get()), "first allocation");
  EXPECT_EQ(ReadAll((*got)[1].get()), "second");
  EXPECT_TRUE(::fcntl((*got)[0].get(), F_GETFD) & FD_CLOEXEC);
}

TEST_F(FdPassingTest, MoreFdsThanAllowedIsCtruncAndLeaksNothing) {
  std::vector<UniqueFd> memfds;
  std::vector<int> raw;
  for (int i = 0; i < 8; ++i) {
    memfds.push_back(MemfdWith("x"));
    raw.push_back(memfds.back().get());
  }
  ASSERT_TRUE(SendMessage(a_.get(), Bytes("m"), raw).ok());
  int before = CountOpenFds();
  uint8_t buf[1];
  auto got = RecvMessage(b_.get(), buf, 2, Deadline::After(std::chrono::seconds(5)));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kProtocol);
  EXPECT_NE(got.status().message().find("control data truncated"), std::string::npos)
      << got.status().message();
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(FdPassingTest, UnexpectedFdsAreClosedAndReported) {
  UniqueFd m = MemfdWith("surprise");
  int fds[] = {m.get()};
  ASSERT_TRUE(SendMessage(a_.get(), Bytes("abc"), fds).ok());
  int before = CountOpenFds();
  uint8_t buf[3];
  auto got = RecvMessage(b_.get(), buf, 0, Deadline::After(std::chrono::seconds(5)));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kProtocol);
  EXPECT_NE(got.status().message().find("1 unexpected fds"), std::string::npos)
      << got.status().message();
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(FdPassingTest, ShortWritesAndEintrAreRetried) {
  FaultySysCalls sys;
  sys.send_eintr = 2;
  sys.max_send = 64;  // every sendmsg accepts at most 64 bytes
  UniqueFd m = MemfdWith("payload fd");
  int fds[] = {m.get()};
  std::string payload(1000, 'z');
  payload[0] = 'a';
  payload[999] = 'q';
  ASSERT_TRUE(SendMessage(a_.get(), Bytes(payload), fds, Deadline::Never(), sys).ok());
  EXPECT_EQ(sys.send_calls, 2 + 16);

  FaultySysCalls rsys;
  rsys.recv_eintr = 3;
  rsys.recv_eagain = 2;
  rsys.max_recv = 7;
  std::vector<uint8_t> buf(payload.size());
  auto got = RecvMessage(b_.get(), buf, 1, Deadline::After(std::chrono::seconds(5)), rsys);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(std::string(buf.begin(), buf.end()), payload);
  ASSERT_EQ(got->size(), 1u);  // the fd came once, with the first byte
  EXPECT_EQ(ReadAll((*got)[0].get()), "payload fd");
}

TEST_F(FdPassingTest, TruncatedControlDataViaSeamIsProtocolError) {
  UniqueFd m1 = MemfdWith("1"), m2 = MemfdWith("2"), m3 = MemfdWith("3");
  int fds[] = {m1.get(), m2.get(), m3.get()};
  ASSERT_TRUE(SendMessage(a_.get(), Bytes("hdr"), fds).ok());
  FaultySysCalls sys;
  sys.control_limit = CMSG_SPACE(sizeof(int));  // room for one fd (two with padding)
  int before = CountOpenFds();
  uint8_t buf[3];
  auto got = RecvMessage(b_.get(), buf, 3, Deadline::After(std::chrono::seconds(5)), sys);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kProtocol);
  EXPECT_NE(got.status().message().find("control data truncated"), std::string::npos);
  EXPECT_EQ(CountOpenFds(), before);
}

TEST_F(FdPassingTest, NonBlockingVariantsReportWouldBlockDistinctly) {
  uint8_t buf[16];
  auto chunk = RecvSome(b_.get(), buf, 0);
  ASSERT_TRUE(chunk.ok());
  EXPECT_TRUE(chunk->would_block);
  EXPECT_FALSE(chunk->eof);
  EXPECT_EQ(chunk->bytes, 0u);

  // Fill the socket buffer until sendmsg would block.
  std::vector<uint8_t> big(1 << 16, 0x5a);
  bool blocked = false;
  for (int i = 0; i < 10000 && !blocked; ++i) {
    auto p = SendSome(a_.get(), big, {});
    ASSERT_TRUE(p.ok());
    blocked = p->would_block;
  }
  EXPECT_TRUE(blocked);
}

TEST_F(FdPassingTest, DeadlineOnSilentPeerIsTimeout) {
  uint8_t buf[4];
  auto got = RecvMessage(b_.get(), buf, 0, Deadline::After(std::chrono::milliseconds(20)));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kTimeout);
  EXPECT_NE(got.status().message().find("receiving 4-byte message (0 received)"), std::string::npos)
      << got.status().message();
}

// A peer that closes is gone whether or not its message began (issue 39 §5.7: a daemon killed
// mid-frame is a fallback for the client): kUnavailable both times, the message saying how much
// of it arrived.
TEST_F(FdPassingTest, PeerClosingBeforeOrDuringMessageIsUnavailableSayingHowMuchArrived) {
  ASSERT_TRUE(SendMessage(a_.get(), Bytes("ab"), {}).ok());
  a_.Reset();
  uint8_t buf[4];
  auto partial = RecvMessage(b_.get(), buf, 0, Deadline::After(std::chrono::seconds(5)));
  ASSERT_FALSE(partial.ok());
  EXPECT_EQ(partial.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(partial.status().message().find("after 2 of 4 bytes (truncated message)"),
            std::string::npos)
      << partial.status().message();

  auto closed = RecvMessage(b_.get(), buf, 0, Deadline::After(std::chrono::seconds(5)));
  ASSERT_FALSE(closed.ok());
  EXPECT_EQ(closed.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(closed.status().message().find("peer closed the connection"), std::string::npos);
}

TEST_F(FdPassingTest, SendingToClosedPeerIsUnavailableWithEpipeNotSignal) {
  b_.Reset();
  Status s = SendMessage(a_.get(), Bytes("x"), {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("peer closed the connection"), std::string::npos);
  EXPECT_EQ(s.sys_errno(), EPIPE);
}

TEST_F(FdPassingTest, TooManyFdsForOneSendIsRejectedBeforeTheSyscall) {
  std::vector<int> fds(kMaxFdsPerMessage + 1, a_.get());
  Status s = SendMessage(a_.get(), Bytes("x"), fds);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("254 fds"), std::string::npos);
}

}  // namespace
}  // namespace weightcache::os
