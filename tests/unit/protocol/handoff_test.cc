#include "protocol/handoff.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "os/unix_socket.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "support/sealed_cache.h"
#include "support/test_env.h"
#include "unit/os/fd_test_util.h"

namespace weightcache::protocol {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::MakeSealedCache;
using weightcache::testing::MemfdWith;
using weightcache::testing::ReadWhole;
using weightcache::testing::SealedCache;
using weightcache::testing::TestDigest;

void ExpectError(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(needle));
}

std::vector<uint8_t> Header(uint16_t version, uint16_t type, uint32_t fds, uint64_t length) {
  std::vector<uint8_t> out = {'W', 'C', 'P', 'F'};
  wire::PutU16(out, version);
  wire::PutU16(out, type);
  wire::PutU32(out, 0);
  wire::PutU32(out, fds);
  wire::PutU64(out, length);
  return out;
}

// Sends `frame` with `fds` over a socket pair and reads it back as a keeper would.
Result<Frame> ThroughSocket(const std::vector<uint8_t>& frame, std::span<const int> fds,
                            Expect expect = Expect::kKeeperRequest) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::SocketPairFds pair, os::SocketPair());
  WEIGHTCACHE_RETURN_IF_ERROR(
      WriteFrame(pair.first.get(), frame, fds, os::Deadline::After(std::chrono::seconds(5))));
  return ReadFrame(pair.second.get(), expect, os::Deadline::After(std::chrono::seconds(5)));
}

std::vector<int> AllFds(const SealedCache& cache) {
  std::vector<int> fds = {cache.manifest_fd.get()};
  for (int fd : cache.allocation_fds()) fds.push_back(fd);
  return fds;
}

TEST(HandoffFrameTest, HandoffTypesCarryTheHandoffVersionAndOnlyAKeeperReadsThem) {
  auto frame = EncodeEmptyHandoff(MessageType::kQuery);
  ASSERT_TRUE(frame.ok());
  EXPECT_EQ(wire::GetU16(frame->data() + 4), kHandoffVersion);
  EXPECT_EQ(wire::GetU16(frame->data() + 6), 36);
  EXPECT_TRUE(DecodeFrameHeader(*frame, Expect::kKeeperRequest).ok());
  // The daemon's reader never takes a handoff frame, and the keeper never a daemon's.
  ExpectError(DecodeFrameHeader(*frame, Expect::kRequest).status(), StatusCode::kProtocol,
              "unexpected Query frame: expected a request");
  ExpectError(DecodeFrameHeader(Header(kProtocolVersion, 1, 0, 0), Expect::kKeeperRequest).status(),
              StatusCode::kProtocol, "unexpected Hello frame: expected a keeper request");
  ExpectError(DecodeFrameHeader(Header(kHandoffVersion, 32, 3, 96), Expect::kRequest).status(),
              StatusCode::kProtocol, "unexpected Deposit frame: expected a request");
  ExpectError(DecodeFrameHeader(Header(kHandoffVersion, 35, 3, 96), Expect::kReply).status(),
              StatusCode::kProtocol, "unexpected WithdrawReply frame: expected a reply");
  // Versions: a handoff frame of another handoff version, whatever kProtocolVersion is.
  ExpectError(DecodeFrameHeader(Header(2, 32, 3, 96), Expect::kKeeperRequest).status(),
              StatusCode::kProtocol,
              "unsupported handoff version 2 in Deposit (this build speaks handoff version 1)");
  ExpectError(
      DecodeFrameHeader(Header(kProtocolVersion, 36, 0, 0), Expect::kKeeperRequest).status(),
      StatusCode::kProtocol,
      "unsupported handoff version " + std::to_string(kProtocolVersion) + " in Query");
  // Bounds: fds only on Deposit among the keeper's requests; 64 KiB payloads.
  ExpectError(DecodeFrameHeader(Header(kHandoffVersion, 36, 1, 0), Expect::kKeeperRequest).status(),
              StatusCode::kProtocol, "Query frame announces 1 fds; at most 0 allowed");
  ExpectError(DecodeFrameHeader(Header(kHandoffVersion, 32, 0, kMaxHandoffPayload + 1),
                                Expect::kKeeperRequest)
                  .status(),
              StatusCode::kProtocol,
              "Deposit frame payload of 65537 bytes exceeds the 65536-byte limit");
  EXPECT_TRUE(DecodeFrameHeader(Header(kHandoffVersion, 32, 253, 96), Expect::kKeeperRequest).ok());
  // The keeper's client reads handoff replies and the frozen Error frame.
  auto error = EncodeError(NotFound("x"));
  ASSERT_TRUE(error.ok());
  EXPECT_TRUE(DecodeFrameHeader(*error, Expect::kKeeperReply).ok());
  ExpectError(DecodeFrameHeader(Header(kProtocolVersion, 4, 0, 2), Expect::kKeeperReply).status(),
              StatusCode::kProtocol, "unexpected StatusReply frame: expected a keeper reply");
}

TEST(HandoffTest, DepositRoundTripKeepsInfoFdsAndBytes) {
  auto cache = MakeSealedCache({8192, 4096 * 3});
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  auto frame = EncodeDeposit(cache->Info());
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  auto received = ThroughSocket(*frame, AllFds(*cache));
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  auto handoff = DecodeHandoff(std::move(received).value());
  ASSERT_TRUE(handoff.ok()) << handoff.status().ToString();
  EXPECT_EQ(handoff->info.config_digest, TestDigest());
  EXPECT_EQ(handoff->info.config_json, R"({"model_id":"test"})");
  EXPECT_EQ(handoff->info.depositor_pid, ::getpid());
  EXPECT_EQ(handoff->tier(), Tier::kHost);
  EXPECT_EQ(handoff->bytes(), 8192u + 4096 * 3);
  ASSERT_EQ(handoff->allocations.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    struct stat mine {
    }, theirs{};
    ASSERT_EQ(::fstat(cache->allocations[i].get(), &mine), 0);
    ASSERT_EQ(::fstat(handoff->allocations[i].get(), &theirs), 0);
    EXPECT_EQ(mine.st_ino, theirs.st_ino) << "allocation " << i << " is the same memfd";
    EXPECT_EQ(ReadWhole(handoff->allocations[i].get()), cache->contents[i]);
  }
  AdoptOptions adopt;
  adopt.expected_digest = TestDigest();
  EXPECT_TRUE(CheckAdoptable(*handoff, adopt).ok()) << CheckAdoptable(*handoff, adopt).ToString();
}

// An upgrade's Handover: the Deposit's payload and fds, then the lock's; decoded into the same
// Handoff with the lock apart. The successor reads it as a keeper request, the old daemon the
// HandoverDone as a keeper reply; a daemon's reader takes neither.
TEST(HandoffTest, HandoverCarriesTheDepositAndTheLockLast) {
  auto cache = MakeSealedCache({8192});
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  weightcache::testing::TempDir dir;
  const UniqueFd lock(::open(dir.Join("x.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  ASSERT_TRUE(lock);
  auto frame = EncodeHandover(cache->Info());
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  EXPECT_EQ(wire::GetU16(frame->data() + 4), kHandoffVersion);
  EXPECT_EQ(wire::GetU16(frame->data() + 6), 40);
  EXPECT_EQ(wire::GetU32(frame->data() + 12), 3u);  // manifest, 1 allocation, the lock
  ExpectError(DecodeFrameHeader(*frame, Expect::kRequest).status(), StatusCode::kProtocol,
              "unexpected Handover frame: expected a request");
  std::vector<int> fds = AllFds(*cache);
  fds.push_back(lock.get());
  auto received = ThroughSocket(*frame, fds);
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  auto handoff = DecodeHandoff(std::move(received).value());
  ASSERT_TRUE(handoff.ok()) << handoff.status().ToString();
  ASSERT_TRUE(handoff->lock);
  struct stat mine {
  }, theirs{};
  ASSERT_EQ(::fstat(lock.get(), &mine), 0);
  ASSERT_EQ(::fstat(handoff->lock.get(), &theirs), 0);
  EXPECT_EQ(mine.st_ino, theirs.st_ino);
  ASSERT_EQ(handoff->allocations.size(), 1u);
  EXPECT_EQ(ReadWhole(handoff->allocations[0].get()), cache->contents[0]);

  // Without the lock the fd count is one short; a memfd for the lock is no lock file.
  auto short_frame = *EncodeHandover(cache->Info());
  short_frame[12] = 2;
  auto without = ThroughSocket(short_frame, AllFds(*cache));
  ASSERT_TRUE(without.ok()) << without.status().ToString();
  ExpectError(DecodeHandoff(std::move(without).value()).status(), StatusCode::kProtocol,
              "Handover carries 2 fds for 1 allocations (expected the manifest memfd + one per "
              "allocation + the lock)");
  std::vector<int> pipe_lock = AllFds(*cache);
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  const UniqueFd read_end(p[0]), write_end(p[1]);
  pipe_lock.push_back(read_end.get());
  auto piped = ThroughSocket(*EncodeHandover(cache->Info()), pipe_lock);
  ASSERT_TRUE(piped.ok());
  ExpectError(DecodeHandoff(std::move(piped).value()).status(), StatusCode::kProtocol,
              "Handover: the lock fd is not a regular file");

  auto done = EncodeEmptyHandoff(MessageType::kHandoverDone);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(DecodeFrameHeader(*done, Expect::kKeeperReply).ok());
  ExpectError(DecodeFrameHeader(*done, Expect::kReply).status(), StatusCode::kProtocol,
              "unexpected HandoverDone frame: expected a reply");
}

// Each hostile deposit is refused by its own check, and nothing of it is held.
class HostileDepositTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cache = MakeSealedCache({8192, 8192});
    ASSERT_TRUE(cache.ok()) << cache.status().ToString();
    cache_ = std::move(cache).value();
  }
  Status Decode(const std::vector<uint8_t>& frame, std::span<const int> fds) {
    auto received = ThroughSocket(frame, fds);
    if (!received.ok()) return received.status();
    return DecodeHandoff(std::move(received).value()).status();
  }
  Status DecodeWithAllocation1(int fd) {
    std::vector<int> fds = AllFds(cache_);
    fds[2] = fd;
    return Decode(*EncodeDeposit(cache_.Info()), fds);
  }
  SealedCache cache_;
};

TEST_F(HostileDepositTest, FdCountOtherThanTheDeclaredAllocations) {
  std::vector<uint8_t> frame = *EncodeDeposit(cache_.Info());
  std::vector<int> fds = AllFds(cache_);
  fds.pop_back();
  frame[12] = 2;  // the header announces the 2 fds it carries; the payload declares 2 allocations
  ExpectError(Decode(frame, fds), StatusCode::kProtocol,
              "Deposit carries 2 fds for 2 allocations (expected the manifest memfd + one per "
              "allocation)");
}

TEST_F(HostileDepositTest, APipeForAnAllocation) {
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd read_end(p[0]), write_end(p[1]);
  ExpectError(DecodeWithAllocation1(read_end.get()), StatusCode::kProtocol,
              "Deposit: allocation 1: the fd is a pipe, not a sealed memfd");
}

TEST_F(HostileDepositTest, AnUnsealedMemfd) {
  UniqueFd open = MemfdWith(cache_.contents[1]);
  ExpectError(DecodeWithAllocation1(open.get()), StatusCode::kPermissionDenied,
              "Deposit: allocation 1: memfd");
  ExpectError(DecodeWithAllocation1(open.get()), StatusCode::kPermissionDenied,
              "is not sealed read-only");
}

TEST_F(HostileDepositTest, AMemfdSmallerThanItsAllocation) {
  UniqueFd small = MemfdWith(std::string(4096, 'x'));
  ASSERT_TRUE(os::SealReadOnly(small.get()).ok());
  ExpectError(DecodeWithAllocation1(small.get()), StatusCode::kProtocol,
              "Deposit: allocation 1: memfd of 4096 bytes is smaller than the allocation's 8192 "
              "bytes");
}

TEST_F(HostileDepositTest, PayloadFieldsAreCheckedOneByOne) {
  const std::vector<int> fds = AllFds(cache_);
  std::vector<uint8_t> frame = *EncodeDeposit(cache_.Info());
  const size_t p = kFrameHeaderSize;
  std::vector<uint8_t> bad = frame;
  bad[p + 12] = 0;  // state: loading
  ExpectError(Decode(bad, fds), StatusCode::kProtocol,
              "Deposit: state 0 is not ready (1): only a completed load is ever handed over");
  bad = frame;
  bad[p + 24] = 'G';
  ExpectError(Decode(bad, fds), StatusCode::kProtocol,
              "Deposit: config_digest that is not 64 lowercase hex characters");
  bad = frame;
  bad[p + 88] += 1;
  ExpectError(Decode(bad, fds), StatusCode::kProtocol, "Deposit: config_json_length 20 but 19");
  bad = frame;
  bad[p + 14] = 1;
  ExpectError(Decode(bad, fds), StatusCode::kProtocol, "Deposit: reserved bytes are not 0");
  bad = frame;
  wire::SetU64(bad, p, cache_.manifest_size + 8);  // the memfd must be exactly this size
  ExpectError(Decode(bad, fds), StatusCode::kProtocol, "Deposit: manifest memfd");
}

TEST(HandoffTest, EncodersRefuseWhatTheDecoderWouldReject) {
  DepositInfo info;
  info.config_digest = "ABC";
  info.manifest_size = 64;
  info.allocation_count = 1;
  info.depositor_pid = 1;
  ExpectError(EncodeDeposit(info).status(), StatusCode::kInvalidArgument,
              "Deposit: config digest is not 64 lowercase hex characters");
  info.config_digest = TestDigest();
  info.allocation_count = kMaxAllocations + 1;
  ExpectError(EncodeDeposit(info).status(), StatusCode::kInvalidArgument,
              "253 allocations; at most 252 fit one frame");
  ExpectError(EncodeWithdraw("xyz").status(), StatusCode::kInvalidArgument,
              "Withdraw: config digest is not 64 lowercase hex characters");
  std::string huge(kMaxHandoffPayload, 'x');
  info.allocation_count = 1;
  info.config_json = huge;
  ExpectError(EncodeDeposit(info).status(), StatusCode::kInvalidArgument, "exceeds the 65536-byte");
}

TEST(HandoffTest, WithdrawCarriesExactlyADigest) {
  auto frame = EncodeWithdraw(TestDigest('b'));
  ASSERT_TRUE(frame.ok());
  std::span<const uint8_t> payload(frame->data() + kFrameHeaderSize,
                                   frame->size() - kFrameHeaderSize);
  auto digest = DecodeWithdraw(payload);
  ASSERT_TRUE(digest.ok());
  EXPECT_EQ(*digest, TestDigest('b'));
  ExpectError(DecodeWithdraw(payload.first(10)).status(), StatusCode::kProtocol,
              "Withdraw: payload of 10 bytes (expected the 64-character config digest)");
}

TEST(HandoffTest, QueryReplyRoundTripsAndAWaitingKeeperReportsNoDeposit) {
  KeeperQuery q;
  q.state = KeeperState::kHolding;
  q.keeper_pid = 42;
  q.age_ms = 1234;
  q.bytes = 1 << 20;
  q.fd_count = 3;
  q.depositor_pid = 41;
  q.config_digest = TestDigest('c');
  q.config_json = "{}";
  auto frame = EncodeQueryReply(q);
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  std::span<const uint8_t> payload(frame->data() + kFrameHeaderSize,
                                   frame->size() - kFrameHeaderSize);
  auto back = DecodeQueryReply(payload);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->state, KeeperState::kHolding);
  EXPECT_EQ(back->keeper_pid, 42);
  EXPECT_EQ(back->age_ms, 1234u);
  EXPECT_EQ(back->bytes, uint64_t{1} << 20);
  EXPECT_EQ(back->fd_count, 3u);
  EXPECT_EQ(back->depositor_pid, 41);
  EXPECT_EQ(back->config_digest, TestDigest('c'));
  EXPECT_EQ(back->config_json, "{}");
  KeeperQuery waiting;
  waiting.config_digest = TestDigest();
  ExpectError(EncodeQueryReply(waiting).status(), StatusCode::kInvalidArgument,
              "a waiting keeper holds no deposit");
  std::vector<uint8_t> bad(payload.begin(), payload.end());
  bad[0] = 9;
  ExpectError(DecodeQueryReply(bad).status(), StatusCode::kProtocol, "unknown keeper state 9");
}

class AdoptTest : public ::testing::Test {
 protected:
  // Four allocations, eight tensors; allocation 1's first tensor ("t1.a", the third name) has
  // a checksum in the manifest that its bytes do not have when `corrupt`.
  Result<Handoff> Withdrawn(bool corrupt) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(cache_,
                                 MakeSealedCache({8192, 8192, 8192, 8192}, 3, corrupt ? 1 : -1));
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> frame, EncodeWithdrawReply(cache_.Info()));
    WEIGHTCACHE_ASSIGN_OR_RETURN(Frame received,
                                 ThroughSocket(frame, AllFds(cache_), Expect::kKeeperReply));
    return DecodeHandoff(std::move(received));
  }
  SealedCache cache_;
};

TEST_F(AdoptTest, AnotherDigestIsRefusedNamingBoth) {
  auto handoff = Withdrawn(false);
  ASSERT_TRUE(handoff.ok()) << handoff.status().ToString();
  AdoptOptions adopt;
  adopt.expected_digest = TestDigest('b');
  ExpectError(CheckAdoptable(*handoff, adopt), StatusCode::kMismatch,
              "keeper holds cache " + TestDigest('a') + ", this daemon serves " + TestDigest('b'));
}

TEST_F(AdoptTest, FullCheckFindsTheCorruptTensorAndTheSampleMissesIt) {
  auto handoff = Withdrawn(true);
  ASSERT_TRUE(handoff.ok()) << handoff.status().ToString();
  AdoptOptions adopt;
  adopt.expected_digest = TestDigest();
  ExpectError(CheckAdoptable(*handoff, adopt), StatusCode::kProtocol,
              "tensor 't1.a' (allocation 1, offset 0): checksum");
  ExpectError(CheckAdoptable(*handoff, adopt), StatusCode::kProtocol, "in the manifest");
  // A sample of 2 checks the first and the last name ("t0.a", "t3.b") only.
  adopt.checksums = ChecksumCheck::kSample;
  adopt.sample_tensors = 2;
  EXPECT_TRUE(CheckAdoptable(*handoff, adopt).ok());
  // A sample as large as the cache is the full check.
  adopt.sample_tensors = 8;
  EXPECT_EQ(CheckAdoptable(*handoff, adopt).code(), StatusCode::kProtocol);
}

TEST_F(AdoptTest, AnIntactCacheIsAdoptable) {
  auto handoff = Withdrawn(false);
  ASSERT_TRUE(handoff.ok()) << handoff.status().ToString();
  AdoptOptions adopt;
  adopt.expected_digest = TestDigest();
  EXPECT_TRUE(CheckAdoptable(*handoff, adopt).ok());
}

}  // namespace
}  // namespace weightcache::protocol
