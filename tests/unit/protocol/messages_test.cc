#include "protocol/messages.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "os/unix_socket.h"
#include "protocol/wire.h"
#include "support/test_env.h"
#include "unit/os/fd_test_util.h"
#include "unit/protocol/protocol_test_util.h"

namespace weightcache::protocol {
namespace {

using nlohmann::json;

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// Every message goes through a real socketpair: encode, WriteFrame, ReadFrame, decode.
class MessagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pair = os::SocketPair();
    ASSERT_TRUE(pair.ok());
    a_ = std::move(pair->first);
    b_ = std::move(pair->second);
  }
  Frame Transfer(const Result<std::vector<uint8_t>>& frame, Expect expect,
                 std::span<const int> fds = {}) {
    EXPECT_TRUE(frame.ok()) << frame.status().ToString();
    EXPECT_TRUE(WriteFrame(a_.get(), *frame, fds, os::Deadline::Never()).ok());
    auto r = ReadFrame(b_.get(), expect, os::Deadline::After(std::chrono::seconds(5)));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : Frame();
  }
  UniqueFd a_, b_;
};

TEST_F(MessagesTest, HelloRoundTrips) {
  Hello hello;
  hello.config = json{{"model_id", "llama"}, {"tp_size", 8}, {"nested", {{"a", {1, 2}}}}};
  hello.client_pid = 4242;
  hello.client_name = "sglang-worker";
  Frame f = Transfer(EncodeHello(hello), Expect::kRequest);
  ASSERT_EQ(f.type, MessageType::kHello);
  auto d = DecodeHello(f.payload);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->protocol_version, kProtocolVersion);
  EXPECT_EQ(d->config, hello.config);
  EXPECT_EQ(d->client_pid, 4242);
  EXPECT_EQ(d->client_name, "sglang-worker");
}

TEST_F(MessagesTest, HelloReplyRoundTripsWithDifferences) {
  HelloReply reply;
  reply.state = CacheState::kLoading;
  reply.bytes_done = 123456789012;
  reply.bytes_total = 987654321098;
  reply.match = false;
  reply.daemon_config = json{{"tp_rank", 1}};
  reply.differences = {{"tp_rank", "1", "0"}, {"revision", "abc", "def"}};
  Frame f = Transfer(EncodeHelloReply(reply), Expect::kReply);
  auto d = DecodeHelloReply(f.payload);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->state, CacheState::kLoading);
  EXPECT_EQ(d->bytes_done, reply.bytes_done);
  EXPECT_EQ(d->bytes_total, reply.bytes_total);
  EXPECT_FALSE(d->match);
  EXPECT_EQ(d->daemon_config, reply.daemon_config);
  EXPECT_EQ(d->differences, reply.differences);

  reply.state = CacheState::kFailed;
  reply.failure_reason = "shard 3: truncated file";
  reply.failure_code = StatusCode::kInvalidCheckpoint;
  reply.differences.clear();
  Frame g = Transfer(EncodeHelloReply(reply), Expect::kReply);
  auto e = DecodeHelloReply(g.payload);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->state, CacheState::kFailed);
  EXPECT_EQ(e->failure_reason, "shard 3: truncated file");
  EXPECT_EQ(e->failure_code, StatusCode::kInvalidCheckpoint);
}

// The failed load's code is data on the wire: an error code exactly when the state is failed.
TEST_F(MessagesTest, FailureCodeIsAnErrorCodeExactlyWhenFailed) {
  const auto hello_reply = [](const std::string& state, const std::string& code) {
    return DecodeHelloReply(Bytes(R"({"state":")" + state +
                                  R"(","bytes_done":0,"bytes_total":0,"failure_reason":"r",)"
                                  R"("failure_code":)" +
                                  code + R"(,"match":true,"config":{},"differences":[]})"))
        .status();
  };
  EXPECT_TRUE(hello_reply("failed", "13").ok());
  ExpectProtocolError(hello_reply("failed", "0"),
                      "HelloReply: field 'failure_code' must be an error code (1 … 14) when the "
                      "state is failed");
  ExpectProtocolError(hello_reply("failed", "15"),
                      "HelloReply: field 'failure_code' must be an error code (1 … 14)");
  ExpectProtocolError(hello_reply("ready", "4"),
                      "HelloReply: field 'failure_code' must be 0 unless the state is failed");

  StatusReply s;
  s.state = CacheState::kFailed;
  s.failure_reason = "out of memory: over the memory budget";
  s.failure_code = StatusCode::kOutOfMemory;
  s.config_digest = std::string(64, 'a');
  Frame f = Transfer(EncodeStatusReply(s), Expect::kReply);
  auto d = DecodeStatusReply(f.payload);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->failure_code, StatusCode::kOutOfMemory);
}

TEST_F(MessagesTest, StatusReplyRoundTrips) {
  StatusReply s;
  s.state = CacheState::kReady;
  s.bytes_done = s.bytes_total = 16ull << 30;
  s.tier = Tier::kGpu;
  s.device_uuid = "GPU-12345678-1234-1234-1234-123456789abc";
  s.model_id = "meta/llama";
  s.tensor_count = 1000;
  s.bytes = 16ull << 30;
  s.clients = 3;
  s.pid = 777;
  s.config_digest = std::string(64, 'f');
  s.origin = "peer GPU-12345678-1234-1234-1234-123456789abd";
  Frame f = Transfer(EncodeStatusReply(s), Expect::kReply);
  auto d = DecodeStatusReply(f.payload);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->origin, s.origin);
  EXPECT_EQ(d->state, CacheState::kReady);
  EXPECT_EQ(d->tier, Tier::kGpu);
  EXPECT_EQ(d->device_uuid, s.device_uuid);
  EXPECT_EQ(d->model_id, s.model_id);
  EXPECT_EQ(d->tensor_count, 1000u);
  EXPECT_EQ(d->bytes, s.bytes);
  EXPECT_EQ(d->clients, 3u);
  EXPECT_EQ(d->pid, 777);
  EXPECT_EQ(d->config_digest, s.config_digest);
}

TEST_F(MessagesTest, EmptyRequestsRoundTripAndRejectPayload) {
  for (auto [encoded, type] : {std::pair{EncodeStatusRequest(), MessageType::kStatus},
                               std::pair{EncodeAttachRequest(), MessageType::kAttach},
                               std::pair{EncodeStopRequest(), MessageType::kStop}}) {
    Frame f = Transfer(encoded, Expect::kRequest);
    EXPECT_EQ(f.type, type);
    EXPECT_TRUE(DecodeEmptyRequest(f.type, f.payload).ok());
  }
  ExpectProtocolError(DecodeEmptyRequest(MessageType::kStop, Bytes("{}")),
                      "Stop request carries 2 unexpected payload bytes");
}

TEST_F(MessagesTest, StopReplyAndErrorRoundTrip) {
  Frame f = Transfer(EncodeStopReply(StopReply{5}), Expect::kReply);
  auto stop = DecodeStopReply(f.payload);
  ASSERT_TRUE(stop.ok());
  EXPECT_EQ(stop->clients, 5u);

  Frame e = Transfer(EncodeError(Status(StatusCode::kMismatch, "tp_rank differs")), Expect::kReply);
  EXPECT_EQ(e.type, MessageType::kError);
  auto err = DecodeError(e.payload);
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(err->code, StatusCode::kMismatch);
  EXPECT_EQ(err->message, "tp_rank differs");
}

TEST_F(MessagesTest, MetricsAndItsReplyRoundTripAndRefuseNegativeCounters) {
  Frame req = Transfer(EncodeMetricsRequest(), Expect::kRequest);
  EXPECT_EQ(req.type, MessageType::kMetrics);
  EXPECT_TRUE(req.payload.empty());
  MetricsReply m;
  m.hits = 7;
  m.misses = 2;
  m.attaches_daemon = 7;
  m.attaches_mismatch = 1;
  m.attaches_unavailable = 1;
  m.attaches_error = 3;
  m.last_attach_unix_ms = 1'700'000'000'123;
  m.clients = 4;
  Frame f = Transfer(EncodeMetricsReply(m), Expect::kReply);
  EXPECT_EQ(f.type, MessageType::kMetricsReply);
  auto back = DecodeMetricsReply(f.payload);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->hits, 7u);
  EXPECT_EQ(back->misses, 2u);
  EXPECT_EQ(back->attaches_daemon, 7u);
  EXPECT_EQ(back->attaches_mismatch, 1u);
  EXPECT_EQ(back->attaches_unavailable, 1u);
  EXPECT_EQ(back->attaches_error, 3u);
  EXPECT_EQ(back->last_attach_unix_ms, 1'700'000'000'123u);
  EXPECT_EQ(back->clients, 4u);
  ExpectProtocolError(
      DecodeMetricsReply(Bytes(R"({"hits":-1,"misses":0,"attaches_daemon":0,)"
                               R"("attaches_mismatch":0,"attaches_unavailable":0,)"
                               R"("attaches_error":0,"last_attach_unix_ms":0,"clients":0})"))
          .status(),
      "MetricsReply: field 'hits' must be a non-negative integer");
  EXPECT_EQ(MessageTypeName(MessageType::kMetrics), "Metrics");
  EXPECT_EQ(MessageTypeName(MessageType::kMetricsReply), "MetricsReply");
}

TEST_F(MessagesTest, UpgradeAndItsReplyRoundTripAndRefuseWhatIsNoPathOrNoPid) {
  Frame u =
      Transfer(EncodeUpgradeRequest(UpgradeRequest{"/opt/wc/bin/weightcache"}), Expect::kRequest);
  EXPECT_EQ(u.type, MessageType::kUpgrade);
  auto request = DecodeUpgradeRequest(u.payload);
  ASSERT_TRUE(request.ok()) << request.status().ToString();
  EXPECT_EQ(request->binary, "/opt/wc/bin/weightcache");
  ExpectProtocolError(DecodeUpgradeRequest(Bytes(R"({"binary":"a\u0000b"})")).status(),
                      "Upgrade: field 'binary' is not a path");
  ExpectProtocolError(DecodeUpgradeRequest(Bytes(R"({"binary":"x","extra":1})")).status(), "extra");

  Frame r = Transfer(EncodeUpgradeReply(UpgradeReply{4242, 27074}), Expect::kReply);
  EXPECT_EQ(r.type, MessageType::kUpgradeReply);
  auto reply = DecodeUpgradeReply(r.payload);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->successor_pid, 4242);
  EXPECT_EQ(reply->handover_us, 27074u);
  ExpectProtocolError(DecodeUpgradeReply(Bytes(R"({"successor_pid":0,"handover_us":1})")).status(),
                      "UpgradeReply: successor_pid must be positive");
}

TEST_F(MessagesTest, AttachReplyCarriesManifestMemfdAndAllocationMemfds) {
  auto m0 = weightcache::testing::MemfdWith(std::string(64, 'A'));
  auto m1 = weightcache::testing::MemfdWith(std::string(32, 'B'));
  std::vector<uint64_t> allocs = {64, 32};
  std::vector<TensorEntry> tensors(2);
  tensors[0].name = "w1";  // out of order on purpose: the encoder sorts
  tensors[0].dtype = "F32";
  tensors[0].ndim = 1;
  tensors[0].shape = {8};
  tensors[0].allocation = 1;
  tensors[0].nbytes = 32;
  tensors[0].checksum = 0xdeadbeef;
  tensors[1].name = "w0";
  tensors[1].dtype = "BF16";
  tensors[1].ndim = 2;
  tensors[1].shape = {4, 8};
  tensors[1].nbytes = 64;
  auto manifest = EncodeManifest(Tier::kHost, allocs, tensors);
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  auto manifest_fd = CreateManifestMemfd(*manifest, "messages_test");
  ASSERT_TRUE(manifest_fd.ok()) << manifest_fd.status().ToString();
  auto frame = EncodeAttachReply(manifest->size(), 2);
  ASSERT_TRUE(frame.ok());
  // A fixed 16-byte payload whatever the tensor count: the manifest is not in the frame.
  EXPECT_EQ(frame->size(), kFrameHeaderSize + kAttachReplyPayloadSize);
  int fds[] = {manifest_fd->get(), m0.get(), m1.get()};
  int before = weightcache::testing::CountOpenFds();
  Frame f = Transfer(std::move(frame), Expect::kReply, fds);
  auto reply = DecodeAttachReply(std::move(f));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  // The received manifest fd is closed once mapped; the two allocation fds are kept.
  EXPECT_EQ(weightcache::testing::CountOpenFds(), before + 2);
  ASSERT_EQ(reply->fds.size(), 2u);
  EXPECT_EQ(weightcache::testing::ReadAll(reply->fds[0].get()), std::string(64, 'A'));
  EXPECT_EQ(weightcache::testing::ReadAll(reply->fds[1].get()), std::string(32, 'B'));
  ASSERT_EQ(reply->manifest.tensor_count(), 2u);
  EXPECT_EQ(reply->manifest.tensor(0).name, "w0");
  EXPECT_EQ(reply->manifest.tensor(1).name, "w1");
  EXPECT_EQ(reply->manifest.tensor(1).dtype, "F32");
  EXPECT_EQ(reply->manifest.tensor(1).checksum, 0xdeadbeefu);
}

TEST_F(MessagesTest, AttachReplyWithFdCountNotMatchingAllocationsIsRejected) {
  // A frame that carries 2 fds but announces 2 allocations (which need 1 + 2).
  std::vector<uint8_t> payload;
  wire::PutU64(payload, 100);
  wire::PutU32(payload, 2);
  wire::PutU32(payload, 0);
  auto m0 = weightcache::testing::MemfdWith("x");
  auto m1 = weightcache::testing::MemfdWith("y");
  int fds[] = {m0.get(), m1.get()};
  Frame f = Transfer(EncodeFrame(MessageType::kAttachReply, payload, 2), Expect::kReply, fds);
  int before = weightcache::testing::CountOpenFds();
  auto reply = DecodeAttachReply(std::move(f));
  ExpectProtocolError(reply.status(),
                      "AttachReply: 2 allocations need 3 fds (manifest first) but 2 arrived");
  EXPECT_EQ(weightcache::testing::CountOpenFds(), before - 2);  // the received fds were closed
}

TEST_F(MessagesTest, AttachReplyManifestMustBeASealedMemfd) {
  // A plain (unsealed) memfd in the manifest's place: its content could change after checks.
  std::vector<uint64_t> allocs = {64};
  auto manifest = EncodeManifest(Tier::kHost, allocs, {});
  ASSERT_TRUE(manifest.ok());
  auto unsealed = weightcache::testing::MemfdWith(std::string(manifest->begin(), manifest->end()));
  auto m0 = weightcache::testing::MemfdWith(std::string(64, 'A'));
  int fds[] = {unsealed.get(), m0.get()};
  Frame f = Transfer(EncodeAttachReply(manifest->size(), 1), Expect::kReply, fds);
  auto reply = DecodeAttachReply(std::move(f));
  EXPECT_EQ(reply.status().code(), StatusCode::kPermissionDenied) << reply.status().ToString();
  EXPECT_NE(reply.status().message().find("attach manifest memfd"), std::string::npos);
}

TEST_F(MessagesTest, AttachReplyAllocationCountMustMatchTheManifest) {
  std::vector<uint64_t> allocs = {64, 32};
  auto manifest = EncodeManifest(Tier::kHost, allocs, {});
  ASSERT_TRUE(manifest.ok());
  auto manifest_fd = CreateManifestMemfd(*manifest, "messages_test");
  ASSERT_TRUE(manifest_fd.ok());
  auto m0 = weightcache::testing::MemfdWith("x");
  int fds[] = {manifest_fd->get(), m0.get()};
  Frame f = Transfer(EncodeAttachReply(manifest->size(), 1), Expect::kReply, fds);
  ExpectProtocolError(DecodeAttachReply(std::move(f)).status(),
                      "AttachReply: manifest lists 2 allocations but the reply announces 1");
  EXPECT_EQ(EncodeAttachReply(10, 253).status().code(), StatusCode::kInvalidArgument);
}

TEST(MessageDecodeTest, StrictFieldChecking) {
  ExpectProtocolError(DecodeHello(Bytes("not json")).status(), "Hello: payload is not JSON");
  ExpectProtocolError(DecodeHello(Bytes("[1,2]")).status(), "Hello: payload is not a JSON object");
  ExpectProtocolError(
      DecodeHello(Bytes(R"({"protocol_version":1,"config":{},"client_name":"x"})")).status(),
      "Hello: field 'client_pid' missing");
  ExpectProtocolError(DecodeHello(Bytes(R"({"protocol_version":1,"config":{},"client_pid":"7",)"
                                        R"("client_name":"x"})"))
                          .status(),
                      "Hello: field 'client_pid' must be an integer");
  ExpectProtocolError(DecodeHello(Bytes(R"({"protocol_version":1,"config":[],"client_pid":7,)"
                                        R"("client_name":"x"})"))
                          .status(),
                      "Hello: field 'config' must be an object");
  ExpectProtocolError(DecodeHello(Bytes(R"({"protocol_version":1,"config":{},"client_pid":7,)"
                                        R"("client_name":"x","extra":true})"))
                          .status(),
                      "Hello: unknown field 'extra'");
  ExpectProtocolError(DecodeHello(Bytes(R"({"protocol_version":9,"config":{},"client_pid":7,)"
                                        R"("client_name":"x"})"))
                          .status(),
                      "Hello: client speaks protocol version 9, this build speaks 8");
  ExpectProtocolError(DecodeStopReply(Bytes(R"({"clients":-1})")).status(),
                      "StopReply: field 'clients' must be a non-negative integer");
  ExpectProtocolError(DecodeStopReply(Bytes(R"({"clients":4294967296})")).status(),
                      "StopReply: field 'clients' must be a 32-bit integer");
  ExpectProtocolError(DecodeError(Bytes(R"({"code":99,"message":"x"})")).status(),
                      "Error: field 'code' 99 is not an error code");
  ExpectProtocolError(
      DecodeHelloReply(Bytes(R"({"state":"sleeping"})")).status(),
      "HelloReply: field 'state' must be one of loading, ready, failed, draining, awaiting, "
      "demoted");
  ExpectProtocolError(
      DecodeHelloReply(Bytes(R"({"state":"ready","bytes_done":1,"bytes_total":1,)"
                             R"("failure_reason":"","failure_code":0,"match":false,"config":{},)"
                             R"("differences":[{"field":"tp","daemon":"1"}]})"))
          .status(),
      "HelloReply: differences[0]: field 'client' missing");
}

TEST(MessageDecodeTest, DeepNestingIsRejected) {
  std::string deep = R"({"protocol_version":1,"client_pid":1,"client_name":"x","config":)";
  deep += std::string(5000, '[') + std::string(5000, ']') + "}";
  ExpectProtocolError(DecodeHello(Bytes(deep)).status(), "Hello: JSON nested deeper than 16");
}

// Two values for one key are ambiguous (nlohmann would keep the last): refused, at any depth,
// by the one strict reader every decoder goes through.
TEST(MessageDecodeTest, DuplicateKeysAreRejected) {
  ExpectProtocolError(DecodeStopReply(Bytes(R"({"clients":1,"clients":2})")).status(),
                      "StopReply: duplicate key \"clients\"");
  ExpectProtocolError(
      DecodeHello(Bytes(R"({"protocol_version":8,"config":{"tp":1,"tp":2},"client_pid":7,)"
                        R"("client_name":"x"})"))
          .status(),
      "Hello: duplicate key \"tp\"");
}

// Every field of a message goes out and comes back through its one field list.
TEST(MessageDecodeTest, EveryReplyRoundTripsThroughItsFieldList) {
  StatusReply status;
  status.state = CacheState::kFailed;
  status.failure_code = StatusCode::kIo;
  status.failure_reason = "disk";
  status.tier = Tier::kGpu;
  status.device_uuid = "GPU-1";
  status.model_id = "m";
  status.tensor_count = 3;
  status.bytes = 1ull << 40;
  status.clients = 2;
  status.pid = 77;
  status.config_digest = std::string(64, 'f');
  status.origin = "disk";
  const auto payload = [](Result<std::vector<uint8_t>> frame) {
    EXPECT_TRUE(frame.ok()) << frame.status().ToString();
    return std::vector<uint8_t>(frame->begin() + kFrameHeaderSize, frame->end());
  };
  auto s = DecodeStatusReply(payload(EncodeStatusReply(status)));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->state, CacheState::kFailed);
  EXPECT_EQ(s->failure_code, StatusCode::kIo);
  EXPECT_EQ(s->tier, Tier::kGpu);
  EXPECT_EQ(s->bytes, 1ull << 40);
  EXPECT_EQ(s->pid, 77);
  EXPECT_EQ(s->origin, "disk");
  MetricsReply metrics{1, 2, 3, 4, 5, 6, 7, 8};
  auto m = DecodeMetricsReply(payload(EncodeMetricsReply(metrics)));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->attaches_error, 6u);
  EXPECT_EQ(m->last_attach_unix_ms, 7u);
  EXPECT_EQ(m->clients, 8u);
  auto e = DecodeEvictReply(payload(EncodeEvictReply({true, 4, "demoted to host"})));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_TRUE(e->evicted);
  EXPECT_EQ(e->clients, 4u);
  EXPECT_EQ(e->reason, "demoted to host");
  ExpectProtocolError(
      DecodeStatusReply(Bytes(R"({"state":"ready","bytes_done":0,"bytes_total":0,)"
                              R"("failure_reason":"","failure_code":0,"tier":"tpu"})"))
          .status(),
      "StatusReply: field 'tier' must be gpu or host");
}

TEST(MessageDecodeTest, InvalidUtf8IsReplacedWhenEncoding) {
  Hello hello;
  hello.client_name = "bad\xff name";
  auto frame = EncodeHello(hello);
  ASSERT_TRUE(frame.ok());
  auto d = DecodeHello(std::span(*frame).subspan(kFrameHeaderSize));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->client_name, "bad\xEF\xBF\xBD name");
}

// The fuzz seeds come from an independent Python encoder written from docs/protocol.md
// (tests/fuzz/make_frame_corpus.py): the C++ codec must read every one of them.
TEST(MessageDecodeTest, FramesFromTheDocumentedLayoutDecode) {
  std::string dir = weightcache::testing::SourceDir() + "/tests/fuzz/corpus/frame_fuzzer/";
  auto payload_of = [&](const std::string& name, MessageType type, uint32_t fds) {
    std::string bytes = weightcache::testing::ReadFile(dir + name);
    auto header =
        DecodeFrameHeader(Bytes(bytes), IsRequest(type) ? Expect::kRequest : Expect::kReply);
    EXPECT_TRUE(header.ok()) << name << ": " << header.status().ToString();
    EXPECT_EQ(header->type, type);
    EXPECT_EQ(header->fd_count, fds);
    EXPECT_EQ(header->payload_length + kFrameHeaderSize, bytes.size());
    return bytes.substr(kFrameHeaderSize);
  };
  EXPECT_TRUE(DecodeHello(Bytes(payload_of("hello", MessageType::kHello, 0))).ok());
  auto hr = DecodeHelloReply(Bytes(payload_of("hello_reply", MessageType::kHelloReply, 0)));
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  EXPECT_EQ(hr->differences.size(), 1u);
  EXPECT_TRUE(
      DecodeStatusReply(Bytes(payload_of("status_reply", MessageType::kStatusReply, 0))).ok());
  EXPECT_TRUE(DecodeStopReply(Bytes(payload_of("stop_reply", MessageType::kStopReply, 0))).ok());
  auto err = DecodeError(Bytes(payload_of("error", MessageType::kError, 0)));
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(err->code, StatusCode::kMismatch);
  std::string manifest = weightcache::testing::ReadFile(dir + "manifest");
  std::string attach_reply = payload_of("attach_reply", MessageType::kAttachReply, 3);
  ASSERT_EQ(attach_reply.size(), kAttachReplyPayloadSize);
  EXPECT_EQ(wire::GetU64(Bytes(attach_reply).data()), manifest.size());
  auto m = Manifest::Decode(Bytes(manifest));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->tensor_count(), 2u);
  EXPECT_EQ(m->tensor(1).name, "lm_head");
  EXPECT_EQ(m->tensor(1).dtype, "F8_E4M3");
  EXPECT_EQ(m->tensor(1).allocation, 1u);
  EXPECT_EQ(m->tensor(1).checksum, 8u);
  EXPECT_EQ(m->metadata(), "engine 1.0");
  auto plan = DecodePublishBegin(Bytes(payload_of("publish_begin", MessageType::kPublishBegin, 0)));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->tensors.size(), 2u);
  EXPECT_EQ(plan->tensors[1].alias_of, "w");
  EXPECT_TRUE(ValidatePublishPlan(*plan).ok());
}

// ---- publishing (docs/publish.md) ----

TEST_F(MessagesTest, PublishMessagesRoundTrip) {
  PublishBegin begin;
  begin.tensors = {
      {"qkv", "BF16", {3, 4}, 24}, {"scale", "F32", {}, 4}, {"tied", "F32", {}, 4, "scale"}};
  begin.metadata = "engine 1.2";
  Frame f = Transfer(EncodePublishBegin(begin), Expect::kRequest);
  ASSERT_EQ(f.type, MessageType::kPublishBegin);
  auto b = DecodePublishBegin(f.payload);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ(b->tensors.size(), 3u);
  EXPECT_EQ(b->tensors[0].name, "qkv");
  EXPECT_EQ(b->tensors[0].alias_of, "");
  EXPECT_EQ(b->tensors[2].alias_of, "scale");
  EXPECT_EQ(b->tensors[0].dtype, "BF16");
  EXPECT_EQ(b->tensors[0].shape, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(b->tensors[0].nbytes, 24u);
  EXPECT_TRUE(b->tensors[1].shape.empty());
  EXPECT_EQ(b->metadata, "engine 1.2");
  EXPECT_TRUE(ValidatePublishPlan(*b).ok());

  Frame c = Transfer(EncodePublishCommit({{7, uint64_t{1} << 63}}), Expect::kRequest);
  ASSERT_EQ(c.type, MessageType::kPublishCommit);
  auto commit = DecodePublishCommit(c.payload);
  ASSERT_TRUE(commit.ok()) << commit.status().ToString();
  EXPECT_EQ(commit->checksums, (std::vector<uint64_t>{7, uint64_t{1} << 63}));

  Frame d = Transfer(EncodePublishCommitted({2, 8192}), Expect::kReply);
  ASSERT_EQ(d.type, MessageType::kPublishCommitted);
  auto done = DecodePublishCommitted(d.payload);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->tensor_count, 2u);
  EXPECT_EQ(done->bytes, 8192u);
}

TEST_F(MessagesTest, AwaitingIsAState) {
  StatusReply reply;
  reply.state = CacheState::kAwaiting;
  reply.config_digest = std::string(64, 'a');
  Frame f = Transfer(EncodeStatusReply(reply), Expect::kReply);
  auto d = DecodeStatusReply(f.payload);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->state, CacheState::kAwaiting);
  EXPECT_EQ(CacheStateName(CacheState::kAwaiting), "awaiting");
}

TEST(MessageDecodeTest, PublishBeginIsStrict) {
  ExpectProtocolError(DecodePublishBegin(Bytes(R"({"tensors":[]})")).status(),
                      "PublishBegin: field 'metadata' missing");
  ExpectProtocolError(
      DecodePublishBegin(Bytes(R"({"tensors":[{"name":"a","dtype":"F32","shape":[-1],)"
                               R"("nbytes":4,"alias_of":""}],"metadata":""})"))
          .status(),
      "PublishBegin: tensors[0]: field 'shape' must hold non-negative integers");
  ExpectProtocolError(
      DecodePublishBegin(Bytes(R"({"tensors":[{"name":"a","dtype":"F32","shape":[1],)"
                               R"("nbytes":4}],"metadata":""})"))
          .status(),
      "PublishBegin: tensors[0]: field 'alias_of' missing");
  ExpectProtocolError(
      DecodePublishBegin(Bytes(R"({"tensors":[{"name":"a","dtype":"F32","shape":[1,1,1,1,1,1,)"
                               R"(1,1,1],"nbytes":4,"alias_of":""}],"metadata":""})"))
          .status(),
      "PublishBegin: tensors[0]: field 'shape' has 9 dimensions; at most 8");
  ExpectProtocolError(
      DecodePublishBegin(Bytes(R"({"tensors":[{"name":"a","dtype":"F32","shape":[1],)"
                               R"("nbytes":4,"alias_of":"","extra":1}],"metadata":""})"))
          .status(),
      "PublishBegin: tensors[0]: unknown field 'extra'");
  ExpectProtocolError(DecodePublishCommit(Bytes(R"({"checksums":[1,"x"]})")).status(),
                      "PublishCommit: field 'checksums' must hold non-negative integers");
}

TEST(PublishPlanTest, EachRuleHasItsOwnError) {
  const auto error = [](std::vector<PlannedTensor> tensors, std::string metadata = "") {
    PublishBegin plan{std::move(tensors), std::move(metadata)};
    Status s = ValidatePublishPlan(plan);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    return s.message();
  };
  EXPECT_EQ(error({}), "publish plan: no tensors (at least 1 needed)");
  EXPECT_EQ(error({{"a", "F32", {2}, 8}, {"a", "F32", {2}, 8}}),
            "publish plan: tensor 1 'a': duplicate name");
  EXPECT_EQ(error({{std::string(4097, 'n'), "U8", {1}, 1}}).substr(0, 29),
            "publish plan: tensor 0 'nnnnn");
  EXPECT_NE(error({{std::string(4097, 'n'), "U8", {1}, 1}}).find("name of 4097 bytes"),
            std::string::npos);
  EXPECT_NE(error({{std::string("a\0b", 3), "U8", {1}, 1}}).find("': name contains a NUL byte"),
            std::string::npos);
  EXPECT_EQ(error({{"a", "bf16", {1}, 2}}), "publish plan: tensor 0 'a': unknown dtype \"bf16\"");
  EXPECT_EQ(error({{"a", "F4", {3}, 2}}),
            "publish plan: tensor 0 'a': size of 3 elements of F4 overflows or is not a whole "
            "number of bytes");
  EXPECT_EQ(error({{"a", "U8", {1}, 1}}, std::string(kMaxPublishMetadataBytes + 1, 'm')),
            "publish plan: metadata of 65537 bytes, over the limit of 65536");
  // Aliases: a tensor with bytes of its own, of the same dtype, shape and nbytes.
  EXPECT_EQ(error({{"a", "U8", {1}, 1}, {"b", "U8", {1}, 1, "c"}}),
            "publish plan: tensor 1 'b': alias_of 'c' names no tensor of the plan");
  EXPECT_EQ(error({{"a", "U8", {1}, 1, "a"}}),
            "publish plan: tensor 0 'a': alias_of 'a' names the tensor itself");
  EXPECT_EQ(error({{"a", "U8", {1}, 1}, {"b", "U8", {1}, 1, "a"}, {"c", "U8", {1}, 1, "b"}}),
            "publish plan: tensor 2 'c': alias_of 'b' is itself an alias (alias the tensor with "
            "the bytes)");
  EXPECT_EQ(error({{"a", "U8", {2}, 2}, {"b", "U8", {1, 2}, 2, "a"}}),
            "publish plan: tensor 1 'b': alias_of 'a' differs in dtype, shape or nbytes (an "
            "alias shares its target's bytes)");
  PublishBegin tied{{{"b", "F32", {2}, 8, "a"}, {"a", "F32", {2}, 8}}, ""};
  EXPECT_TRUE(ValidatePublishPlan(tied).ok());
  // A zero dimension makes the count 0 whatever the others, even ones whose product overflows.
  PublishBegin empty{{{"e", "F32", {0, uint64_t{1} << 40, uint64_t{1} << 40}, 0}}, ""};
  EXPECT_TRUE(ValidatePublishPlan(empty).ok());
}

}  // namespace
}  // namespace weightcache::protocol
