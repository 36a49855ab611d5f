// Publishing (docs/publish.md), host tier: a real `weightcache serve --source published:<tag>`
// process, publishers through weightcache::Publisher (in this process, or in forked children
// that are SIGKILLed at each step), raw protocol frames for the hostile plans, and attaches
// through the client library. Every test runs its daemon on its own TempDir runtime dir.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "common/checksum.h"
#include "identity/resolve.h"
#include "integration/daemon_process.h"
#include "os/memfd.h"
#include "protocol/connection.h"
#include "support/test_env.h"
#include "weightcache/client.h"
#include "weightcache/publisher.h"

extern "C" int wc_c_publish_then_attach(const char* runtime_dir, char* msg, size_t len);

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;
using ::testing::HasSubstr;

void ExpectError(const Status& status, StatusCode code, const std::string& substring) {
  EXPECT_EQ(status.code(), code) << status.ToString();
  EXPECT_THAT(status.message(), HasSubstr(substring));
}

// The memfds (arenas and manifests) a daemon process holds open, by /proc/<pid>/fd.
int DaemonMemfds(pid_t pid) {
  int count = 0;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (target.find("memfd:weightcache") != std::string::npos) ++count;
  }
  return count;
}

// A plan and the bytes to publish for it: F32 tensors of a few shapes, bytes from `seed`.
struct Weights {
  std::vector<PublishTensor> plan;
  std::vector<std::vector<uint8_t>> bytes;
};

Weights MakeWeights(int seed, int count = 5) {
  Weights w;
  std::mt19937 rng(seed);
  for (int i = 0; i < count; ++i) {
    // Includes a tensor larger than a page and one larger than a checksum chunk (256 KiB).
    const uint64_t rows = i == 0 ? 300 : 3 + i;
    const uint64_t cols = i == 0 ? 256 : 17;
    PublishTensor t{
        "layers." + std::to_string(i) + ".qkv_proj.weight", "F32", {rows, cols}, rows * cols * 4};
    std::vector<uint8_t> b(t.nbytes);
    for (auto& byte : b) byte = static_cast<uint8_t>(rng());
    w.plan.push_back(std::move(t));
    w.bytes.push_back(std::move(b));
  }
  return w;
}

class PublishTest : public ::testing::Test {
 protected:
  void SetUp() override { runtime_ = dir_.Join("run"); }

  IdentityOptions Identity() const {
    IdentityOptions id;
    id.source = "published:engine-v1";
    id.model_id = "fused-llama";
    id.tier = Tier::kHost;
    id.runtime_dir = runtime_;
    return id;
  }
  std::unique_ptr<ServeProcess> Start(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "--source", "published:engine-v1", "--model-id", "fused-llama", "--tier",
        "host",     "--runtime-dir",       runtime_};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = ServeProcess::Start(args, dir_.Join("serve.log"));
    EXPECT_NE(p, nullptr);
    if (p == nullptr) return p;
    auto socket = WaitForState(*p, runtime_, CacheState::kAwaiting);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString() << "\n" << p->Log();
    if (socket.ok()) socket_ = *socket;
    return p;
  }
  PublishOptions Options() const {
    PublishOptions o;
    o.identity = Identity();
    o.metadata = "test engine 1.0";
    o.timeout = 10s;
    return o;
  }
  static void Fill(Publisher& publisher, const Weights& w, size_t upto = SIZE_MAX) {
    for (size_t i = 0; i < w.plan.size() && i < upto; ++i) {
      std::span<uint8_t> dest = publisher.Data(i);
      ASSERT_EQ(dest.size(), w.bytes[i].size());
      std::memcpy(dest.data(), w.bytes[i].data(), dest.size());
    }
  }
  Status Publish(const Weights& w) {
    auto publisher = Publisher::Begin(Options(), w.plan);
    if (!publisher.ok()) return publisher.status();
    Fill(*publisher, w);
    return publisher->Commit();
  }
  Result<Attachment> Attach(std::chrono::milliseconds wait = 10s,
                            bool wait_for_publisher = true) const {
    AttachOptions o;
    o.identity = Identity();
    o.on_missing = OnMissing::kError;
    o.wait_timeout = wait;
    o.wait_for_publisher = wait_for_publisher;
    return Attachment::Attach(o);
  }
  static void ExpectBytes(const Attachment& a, const Weights& w) {
    ASSERT_EQ(a.source(), AttachSource::kDaemon);
    ASSERT_EQ(a.tensors().size(), w.plan.size());
    for (size_t i = 0; i < w.plan.size(); ++i) {
      const Tensor* t = a.Find(w.plan[i].name);
      ASSERT_NE(t, nullptr) << w.plan[i].name;
      EXPECT_EQ(t->dtype, "F32");
      ASSERT_EQ(t->shape.size(), 2u);
      EXPECT_EQ(static_cast<uint64_t>(t->shape[0]), w.plan[i].shape[0]);
      ASSERT_EQ(t->nbytes, w.bytes[i].size());
      EXPECT_EQ(std::memcmp(t->host_ptr(), w.bytes[i].data(), t->nbytes), 0) << t->name;
      EXPECT_EQ(t->checksum, TensorChecksum(w.bytes[i].data(), w.bytes[i].size()));
    }
  }
  CacheState State() const {
    auto status = QueryStatus(socket_);
    EXPECT_TRUE(status.ok()) << status.status().ToString();
    return status.ok() ? status->state : CacheState::kFailed;
  }
  // Polls until the daemon holds `want` memfds (it learns of a dead publisher from its
  // connection's EOF, asynchronously); the count it ended with.
  static int WaitForMemfds(pid_t daemon, int want) {
    int held = DaemonMemfds(daemon);
    for (int attempt = 0; held != want && attempt < 200; ++attempt) {
      std::this_thread::sleep_for(50ms);
      held = DaemonMemfds(daemon);
    }
    return held;
  }
  // A raw connection that said Hello with the published identity's config.
  protocol::Connection RawPublisher() const {
    auto id = identity::ResolveIdentity(Identity());
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    auto conn = protocol::Connection::Connect(socket_, 2s);
    EXPECT_TRUE(conn.ok()) << conn.status().ToString();
    protocol::Hello hello;
    hello.config = id->config.ToJson();
    hello.client_pid = ::getpid();
    auto reply = conn->SendHello(hello, os::Deadline::After(5s));
    EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    EXPECT_TRUE(reply->match);
    return std::move(conn).value();
  }
  static Result<protocol::Frame> SendPlan(protocol::Connection& conn,
                                          const protocol::PublishBegin& plan) {
    auto frame = protocol::EncodePublishBegin(plan);
    if (!frame.ok()) return frame.status();
    return conn.Call(*frame, protocol::MessageType::kPublishArena, os::Deadline::After(5s));
  }

  TempDir dir_;
  std::string runtime_;
  std::string socket_;
};

TEST_F(PublishTest, AwaitingUntilPublishedThenAttachMapsThePublishedBytes) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  EXPECT_EQ(State(), CacheState::kAwaiting);
  // Attach to an awaiting cache waits like for a loading one, then says why.
  auto early = Attach(300ms);
  ASSERT_FALSE(early.ok());
  ExpectError(early.status(), StatusCode::kTimeout, "awaiting its publisher");
  // `ls` shows the state.
  CommandResult ls = RunCommand({CliPath(), "ls", "--runtime-dir", runtime_});
  EXPECT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_THAT(ls.out, HasSubstr("awaiting"));

  const Weights w = MakeWeights(1);
  ASSERT_TRUE(Publish(w).ok());
  EXPECT_EQ(State(), CacheState::kReady);
  auto status = QueryStatus(socket_);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->tensor_count, w.plan.size());
  EXPECT_EQ(status->origin, "published");
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, w);
}

// Tied weights: an alias is placed at its target's bytes (written once), and every attach
// maps both names onto the one region; the publisher's metadata blob reaches the client.
TEST_F(PublishTest, AnAliasSharesItsTargetsRegionAndTheMetadataIsServed) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  Weights w = MakeWeights(8, 2);
  PublishTensor tied = w.plan[1];
  tied.name = "lm_head.weight";
  tied.alias_of = w.plan[1].name;
  w.plan.push_back(tied);
  auto publisher = Publisher::Begin(Options(), w.plan);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  EXPECT_EQ(publisher->Data(2).data(), publisher->Data(1).data());
  EXPECT_EQ(publisher->DataByName("lm_head.weight").size(), w.plan[1].nbytes);
  w.bytes.push_back(w.bytes[1]);
  Fill(*publisher, w, 2);  // the alias's bytes are its target's
  ASSERT_TRUE(publisher->Commit().ok());

  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, w);
  EXPECT_EQ(attached->Find("lm_head.weight")->host_ptr(),
            attached->Find(w.plan[1].name)->host_ptr());
  EXPECT_NE(attached->Find(w.plan[0].name)->host_ptr(), attached->Find(w.plan[1].name)->host_ptr());
  EXPECT_EQ(attached->metadata(), "test engine 1.0");
}

TEST_F(PublishTest, AnAliasOfAnUnknownTensorIsRefusedBeforeSending) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  Weights w = MakeWeights(9, 1);
  PublishTensor tied = w.plan[0];
  tied.name = "lm_head.weight";
  tied.alias_of = "embed_tokens.weight";
  w.plan.push_back(tied);
  auto publisher = Publisher::Begin(Options(), w.plan);
  ASSERT_FALSE(publisher.ok());
  ExpectError(publisher.status(), StatusCode::kInvalidArgument,
              "tensor 1 'lm_head.weight': alias_of 'embed_tokens.weight' names no tensor");
  EXPECT_EQ(State(), CacheState::kAwaiting);
}

TEST_F(PublishTest, CliPublishesTheTensorsOfASafetensorsFile) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  const std::string model = MakeCheckpoint(dir_.Join("model"), 12, 1, 5, 4096);
  auto ckpt = checkpoint::Checkpoint::Open(model);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  CommandResult r = RunCommand({CliPath(), "publish", "--source", "published:engine-v1",
                                "--model-id", "fused-llama", "--tier", "host", "--runtime-dir",
                                runtime_, ckpt->shards()[0].path});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("published 12 tensors"));
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ASSERT_EQ(attached->tensors().size(), ckpt->tensors().size());
  for (const checkpoint::TensorInfo& t : ckpt->tensors()) {
    const Tensor* mine = attached->Find(t.name);
    ASSERT_NE(mine, nullptr) << t.name;
    std::vector<uint8_t> expected(t.nbytes);
    ASSERT_EQ(
        ::pread(ckpt->shard_fd(t.shard), expected.data(), t.nbytes, static_cast<off_t>(t.offset)),
        static_cast<ssize_t>(t.nbytes));
    EXPECT_EQ(std::memcmp(mine->host_ptr(), expected.data(), t.nbytes), 0) << t.name;
  }
  // A second publish without --replace: exit 7 (already served).
  CommandResult again = RunCommand({CliPath(), "publish", "--source", "published:engine-v1",
                                    "--model-id", "fused-llama", "--tier", "host", "--runtime-dir",
                                    runtime_, ckpt->shards()[0].path});
  EXPECT_EQ(again.exit_code, 7) << again.err;
  EXPECT_THAT(again.err, HasSubstr("--replace"));
}

enum class KillAt { kAfterPlan, kMidCopy, kBeforeCommit };

class PublisherKilledTest : public PublishTest, public ::testing::WithParamInterface<KillAt> {};

TEST_P(PublisherKilledTest, DaemonStaysAwaitingAndTakesTheNextPublisher) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  const Weights partial = MakeWeights(2);
  int ready_pipe[2];
  ASSERT_EQ(::pipe(ready_pipe), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The publisher: begins, writes as far as its step, says so, and waits to be killed.
    ::close(ready_pipe[0]);
    auto publisher = Publisher::Begin(Options(), partial.plan);
    if (!publisher.ok()) ::_exit(3);
    const KillAt at = GetParam();
    if (at != KillAt::kAfterPlan) {
      Fill(*publisher, partial, at == KillAt::kMidCopy ? partial.plan.size() / 2 : SIZE_MAX);
    }
    const char one = 1;
    if (::write(ready_pipe[1], &one, 1) != 1) ::_exit(4);
    for (;;) ::pause();
  }
  ::close(ready_pipe[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready_pipe[0], &byte, 1), 1) << "the publisher child exited early";
  ::close(ready_pipe[0]);
  EXPECT_EQ(State(), CacheState::kAwaiting);
  // The arena (one allocation here) and its manifest are held for the publisher.
  EXPECT_EQ(DaemonMemfds(serve->pid()), 2);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus));

  // Never ready with the dead publisher's bytes: an attach finds it awaiting.
  EXPECT_EQ(State(), CacheState::kAwaiting);
  auto none = Attach(200ms);
  ASSERT_FALSE(none.ok());
  ExpectError(none.status(), StatusCode::kTimeout, "awaiting its publisher");

  // Its arena is freed: the daemon holds no memfd any more.
  EXPECT_EQ(WaitForMemfds(serve->pid(), 0), 0);
  const Weights full = MakeWeights(3);
  auto next = Publisher::Begin(Options(), full.plan);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  Fill(*next, full);
  ASSERT_TRUE(next->Commit().ok());
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, full);
  EXPECT_THAT(serve->Log(), HasSubstr("closed the connection before PublishCommit"));
}

INSTANTIATE_TEST_SUITE_P(EachStep, PublisherKilledTest,
                         ::testing::Values(KillAt::kAfterPlan, KillAt::kMidCopy,
                                           KillAt::kBeforeCommit),
                         [](const ::testing::TestParamInfo<KillAt>& info) {
                           switch (info.param) {
                             case KillAt::kAfterPlan:
                               return std::string("AfterPlan");
                             case KillAt::kMidCopy:
                               return std::string("MidCopy");
                             case KillAt::kBeforeCommit:
                               return std::string("BeforeCommit");
                           }
                           return std::string("Unknown");
                         });

// A publisher that stops (SIGSTOP) between its plan and its commit: after --publish-timeout
// the daemon frees its arena, closes its connection and takes the next publisher; the stopped
// one, continued, finds its commit refused.
TEST_F(PublishTest, AStoppedPublisherLosesItsArenaAfterThePublishTimeout) {
  auto serve = Start({"--publish-timeout", "1"});
  ASSERT_NE(serve, nullptr);
  const Weights partial = MakeWeights(4);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto publisher = Publisher::Begin(Options(), partial.plan);
    if (!publisher.ok()) ::_exit(3);
    Fill(*publisher, partial, partial.plan.size() / 2);
    ::raise(SIGSTOP);  // stalls mid-copy until the parent continues it
    Fill(*publisher, partial, SIZE_MAX);
    const Status committed = publisher->Commit();
    ::_exit(committed.ok() ? 1 : 0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(wstatus)) << "the publisher child exited early: " << wstatus;

  // Its arena is freed once the timeout passes although the publisher still lives.
  EXPECT_EQ(WaitForMemfds(serve->pid(), 0), 0);
  EXPECT_EQ(State(), CacheState::kAwaiting);
  EXPECT_THAT(serve->Log(), HasSubstr("did not commit within 1000 ms of its PublishBegin "
                                      "(--publish-timeout)"));
  const Weights full = MakeWeights(5);
  ASSERT_TRUE(Publish(full).ok());
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, full);

  ASSERT_EQ(::kill(child, SIGCONT), 0);
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus)) << wstatus;
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "the timed-out publisher's commit was accepted";
}

// A client that publishes after its own load (the engine plugins) is not kept waiting by a
// cache nobody publishes to: at the Hello, and when the publisher it waited for dies. One whose
// publisher is filling the arena is waited for, and attaches the published bytes.
TEST_F(PublishTest, AClientThatWouldPublishItselfWaitsOnlyForAPublicationInProgress) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  // Nobody publishes: absent at once, not "still awaiting … after 600000 ms".
  auto unpublished = Attach(600s, /*wait_for_publisher=*/false);
  ASSERT_FALSE(unpublished.ok());
  ExpectError(unpublished.status(), StatusCode::kNoDaemon,
              "awaits its publisher, and none is publishing");

  // A publisher in the middle of its copy: waited for, then the published bytes.
  const Weights w = MakeWeights(6);
  auto publisher = Publisher::Begin(Options(), w.plan);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  std::optional<Result<Attachment>> waited;
  std::thread attacher([&] { waited.emplace(Attach(60s, /*wait_for_publisher=*/false)); });
  std::this_thread::sleep_for(200ms);  // the attacher polls; the publisher is mid-copy
  Fill(*publisher, w);
  ASSERT_TRUE(publisher->Commit().ok());
  attacher.join();
  ASSERT_TRUE(waited->ok()) << waited->status().ToString();
  ExpectBytes(**waited, w);
}

TEST_F(PublishTest, AClientThatWouldPublishItselfStopsWaitingWhenThePublisherDies) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  const Weights w = MakeWeights(7);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto publisher = Publisher::Begin(Options(), w.plan);
    if (!publisher.ok()) ::_exit(3);
    ::raise(SIGSTOP);  // holds its arena, mid-publish, until killed
    ::_exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(wstatus)) << "the publisher child exited early: " << wstatus;
  std::optional<Result<Attachment>> waited;
  std::thread attacher([&] { waited.emplace(Attach(600s, /*wait_for_publisher=*/false)); });
  std::this_thread::sleep_for(200ms);  // the attacher waits on the publication
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  attacher.join();
  ASSERT_FALSE(waited->ok());
  ExpectError(waited->status(), StatusCode::kNoDaemon,
              "awaits its publisher, and none is publishing");
  EXPECT_EQ(State(), CacheState::kAwaiting);
}

TEST_F(PublishTest, ASecondConcurrentPublisherIsRefusedNamingTheFirst) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  const Weights w = MakeWeights(4);
  auto first = Publisher::Begin(Options(), w.plan);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = Publisher::Begin(Options(), w.plan);
  ASSERT_FALSE(second.ok());
  ExpectError(second.status(), StatusCode::kUnavailable,
              "is being published by pid " + std::to_string(::getpid()));
  EXPECT_THAT(second.status().message(), HasSubstr("one publisher at a time"));
  Fill(*first, w);
  ASSERT_TRUE(first->Commit().ok());
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, w);
}

TEST_F(PublishTest, HostilePlansAreRefusedAndTheConnectionStaysUsable) {
  auto serve = Start({"--memory-budget", "1M"});
  ASSERT_NE(serve, nullptr);
  protocol::Connection conn = RawPublisher();
  using protocol::PlannedTensor;
  const auto refused = [&](std::vector<PlannedTensor> tensors, StatusCode code,
                           const std::string& what) {
    protocol::PublishBegin plan;
    plan.tensors = std::move(tensors);
    auto reply = SendPlan(conn, plan);
    ASSERT_FALSE(reply.ok()) << what;
    ExpectError(reply.status(), code, what);
  };
  refused({}, StatusCode::kInvalidArgument, "publish plan: no tensors");
  refused({{"a", "F32", {2}, 8}, {"a", "F32", {2}, 8}}, StatusCode::kInvalidArgument,
          "tensor 1 'a': duplicate name");
  refused({{"", "F32", {2}, 8}}, StatusCode::kInvalidArgument, "tensor 0 '': empty name");
  refused({{"a", "F17", {2}, 8}}, StatusCode::kInvalidArgument,
          "tensor 0 'a': unknown dtype \"F17\"");
  refused({{"a", "BF16", {2, 3}, 10}}, StatusCode::kInvalidArgument,
          "tensor 0 'a': nbytes 10 but the shape and dtype make 12");
  refused({{"a", "F32", {uint64_t{1} << 32, uint64_t{1} << 32, 4}, 0}},
          StatusCode::kInvalidArgument, "tensor 0 'a': element count of the shape overflows");
  refused({{"a", "F64", {uint64_t{1} << 61}, 0}}, StatusCode::kInvalidArgument,
          "tensor 0 'a': size of 2305843009213693952 elements of F64 overflows");
  // Five tensors of 2^60 bytes each: each valid, together over the 2^62 the arena allows.
  std::vector<PlannedTensor> huge;
  for (const char* name : {"a", "b", "c", "d", "e"}) {
    huge.push_back({name, "U8", {uint64_t{1} << 60}, uint64_t{1} << 60});
  }
  refused(huge, StatusCode::kInvalidArgument, "tensor 4 'e': the plan's total size overflows");
  refused({{"a", "U8", {2 << 20}, 2 << 20}}, StatusCode::kOutOfMemory,
          "over the memory budget of 1048576 bytes");
  protocol::PublishBegin big_metadata;
  big_metadata.tensors = {{"a", "U8", {1}, 1}};
  big_metadata.metadata.assign(protocol::kMaxPublishMetadataBytes + 1, 'm');
  auto meta = SendPlan(conn, big_metadata);
  ASSERT_FALSE(meta.ok());
  ExpectError(meta.status(), StatusCode::kInvalidArgument, "metadata of 65537 bytes");

  // The Publisher checks the same rules before it sends anything.
  std::vector<PublishTensor> dup = {{"a", "F32", {2}, 8}, {"a", "F32", {2}, 8}};
  auto local = Publisher::Begin(Options(), dup);
  ASSERT_FALSE(local.ok());
  ExpectError(local.status(), StatusCode::kInvalidArgument, "tensor 1 'a': duplicate name");

  // The daemon is still awaiting, and the same connection may still publish a good plan.
  EXPECT_EQ(State(), CacheState::kAwaiting);
  protocol::PublishBegin good;
  good.tensors = {{"a", "F32", {2}, 8}};
  auto arena = SendPlan(conn, good);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  EXPECT_EQ(arena->fds.size(), 2u);  // the manifest memfd and one allocation
  EXPECT_TRUE(serve->Running());
}

TEST_F(PublishTest, CommitIsRefusedForAWrongChecksumOrAWritableMapping) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  const Weights w = MakeWeights(5, 2);
  protocol::PublishBegin plan;
  for (const PublishTensor& t : w.plan)
    plan.tensors.push_back({t.name, t.dtype, t.shape, t.nbytes});
  const auto commit = [](protocol::Connection& conn, std::vector<uint64_t> checksums) {
    auto frame = protocol::EncodePublishCommit({std::move(checksums)});
    EXPECT_TRUE(frame.ok());
    return conn.Call(*frame, protocol::MessageType::kPublishCommitted, os::Deadline::After(5s));
  };
  // Fills the arena of `reply` with the weights; returns the writable mapping (kept when
  // `keep` so that the seal fails).
  const auto fill = [&](protocol::Frame frame, bool keep) {
    auto arena = protocol::DecodePublishArena(std::move(frame));
    EXPECT_TRUE(arena.ok()) << arena.status().ToString();
    auto region = os::MapReadWrite(arena->fds[0].get(), arena->manifest.allocation_sizes()[0]);
    EXPECT_TRUE(region.ok());
    for (size_t r = 0; r < arena->manifest.tensor_count(); ++r) {
      const protocol::TensorRecord rec = arena->manifest.record(r);
      for (size_t i = 0; i < w.plan.size(); ++i) {
        if (w.plan[i].name != rec.name) continue;
        std::memcpy(static_cast<uint8_t*>(region->data()) + rec.offset, w.bytes[i].data(),
                    rec.nbytes);
      }
    }
    if (!keep) *region = os::MappedRegion();
    return std::move(region).value();
  };
  std::vector<uint64_t> right;
  for (const auto& b : w.bytes) right.push_back(TensorChecksum(b.data(), b.size()));

  {
    protocol::Connection conn = RawPublisher();
    auto arena = SendPlan(conn, plan);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    fill(std::move(arena).value(), false);
    std::vector<uint64_t> wrong = right;
    wrong[1] ^= 1;
    auto reply = commit(conn, wrong);
    ASSERT_FALSE(reply.ok());
    ExpectError(reply.status(), StatusCode::kInvalidArgument,
                "tensor '" + w.plan[1].name + "' (plan index 1)");
    EXPECT_EQ(State(), CacheState::kAwaiting);
    EXPECT_EQ(DaemonMemfds(serve->pid()), 0);  // the refused arena is freed
  }
  {
    // The arena was freed at the refusal: the next publisher gets a fresh one at once.
    protocol::Connection conn = RawPublisher();
    auto arena = SendPlan(conn, plan);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    os::MappedRegion still_mapped = fill(std::move(arena).value(), true);
    auto reply = commit(conn, right);
    ASSERT_FALSE(reply.ok());
    ExpectError(reply.status(), StatusCode::kIo, "unmap the arena before PublishCommit");
    EXPECT_EQ(State(), CacheState::kAwaiting);
  }
  {
    protocol::Connection conn = RawPublisher();
    auto arena = SendPlan(conn, plan);
    ASSERT_TRUE(arena.ok()) << arena.status().ToString();
    fill(std::move(arena).value(), false);
    auto reply = commit(conn, right);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    auto done = protocol::DecodePublishCommitted(reply->payload);
    ASSERT_TRUE(done.ok());
    EXPECT_EQ(done->tensor_count, 2u);
  }
  EXPECT_EQ(State(), CacheState::kReady);
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, w);
}

TEST_F(PublishTest, PublishIntoAReadyCacheIsRefusedWithoutReplace) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  ASSERT_TRUE(Publish(MakeWeights(6)).ok());
  Status again = Publish(MakeWeights(7));
  ExpectError(again, StatusCode::kAlreadyServed, "is already ready (published by pid");
  EXPECT_THAT(again.message(), HasSubstr("--replace"));
  auto attached = Attach();
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ExpectBytes(*attached, MakeWeights(6));
}

TEST_F(PublishTest, ReplaceKeepsOldClientsOnTheOldBytesAndServesTheNewOnes) {
  auto serve = Start({"--replace"});
  ASSERT_NE(serve, nullptr);
  const Weights old_weights = MakeWeights(8);
  ASSERT_TRUE(Publish(old_weights).ok());
  auto old_client = Attach();
  ASSERT_TRUE(old_client.ok()) << old_client.status().ToString();

  const Weights new_weights = MakeWeights(9, 3);
  ASSERT_TRUE(Publish(new_weights).ok());
  EXPECT_EQ(State(), CacheState::kReady);
  auto new_client = Attach();
  ASSERT_TRUE(new_client.ok()) << new_client.status().ToString();
  ExpectBytes(*new_client, new_weights);
  ExpectBytes(*old_client, old_weights);  // its mappings are the old, sealed memfds
}

TEST_F(PublishTest, OutOfSequencePublishRequestsCloseOnlyThatConnection) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  {
    // PublishCommit with no PublishBegin on its connection.
    protocol::Connection conn = RawPublisher();
    auto frame = protocol::EncodePublishCommit({{1}});
    ASSERT_TRUE(frame.ok());
    auto reply =
        conn.Call(*frame, protocol::MessageType::kPublishCommitted, os::Deadline::After(5s));
    ASSERT_FALSE(reply.ok());
    ExpectError(reply.status(), StatusCode::kProtocol,
                "PublishCommit without a PublishBegin on this connection");
    EXPECT_FALSE(conn.QueryStatus(os::Deadline::After(5s)).ok());  // closed by the daemon
  }
  {
    // PublishBegin before any Hello.
    auto conn = protocol::Connection::Connect(socket_, 2s);
    ASSERT_TRUE(conn.ok());
    protocol::PublishBegin plan;
    plan.tensors = {{"a", "F32", {2}, 8}};
    auto reply = SendPlan(*conn, plan);
    ASSERT_FALSE(reply.ok());
    ExpectError(reply.status(), StatusCode::kProtocol, "PublishBegin before a Hello");
  }
  // Everyone else is unaffected: a publisher still publishes.
  const Weights w = MakeWeights(10, 2);
  ASSERT_TRUE(Publish(w).ok());
  EXPECT_EQ(State(), CacheState::kReady);
}

TEST_F(PublishTest, TheCAbiPublishesAndAttaches) {
  auto serve = Start();
  ASSERT_NE(serve, nullptr);
  char msg[512] = {};
  EXPECT_EQ(wc_c_publish_then_attach(runtime_.c_str(), msg, sizeof(msg)), 0) << msg;
  EXPECT_STREQ(msg, "published and attached 3 tensors");
}

TEST_F(PublishTest, APublishedIdentityNeverFallsBackToDisk) {
  AttachOptions o;
  o.identity = Identity();
  o.on_missing = OnMissing::kFallback;
  auto attached = Attachment::Attach(o);
  ASSERT_FALSE(attached.ok());
  ExpectError(attached.status(), StatusCode::kNoDaemon,
              "source published:engine-v1 has no checkpoint to load from disk (no daemon at");
}

TEST_F(PublishTest, ADiskCacheRefusesPublishing) {
  const std::string model = MakeCheckpoint(dir_.Join("model"), 4, 1, 5, 1024);
  auto serve = ServeProcess::Start(
      {"--model", model, "--model-id", "tiny", "--tier", "host", "--runtime-dir", runtime_},
      dir_.Join("disk.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  auto conn = protocol::Connection::Connect(*socket, 2s);
  ASSERT_TRUE(conn.ok());
  protocol::Hello hello;
  hello.config = ConfigFor(model, "tiny").ToJson();
  ASSERT_TRUE(conn->SendHello(hello, os::Deadline::After(5s)).ok());
  protocol::PublishBegin plan;
  plan.tensors = {{"a", "F32", {2}, 8}};
  auto reply = SendPlan(*conn, plan);
  ASSERT_FALSE(reply.ok());
  ExpectError(reply.status(), StatusCode::kInvalidArgument, "has source \"disk\"");
}

}  // namespace
}  // namespace weightcache::testing
