// Discovery against a scripted in-process daemon speaking the real protocol over a real
// socket with the real identity lock: the docs/design.md "Discovery outcomes" rows a well-behaved
// daemon rarely shows on demand — `loading` past the wait timeout, `failed`, a peer that speaks
// garbage, and a ready daemon whose attach manifest is hostile.
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "client/discovery.h"
#include "os/fd_passing.h"
#include "os/lock_file.h"
#include "os/memfd.h"
#include "os/unix_socket.h"
#include "protocol/frame.h"
#include "protocol/manifest.h"
#include "protocol/messages.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/client/scripted_daemon.h"
#include "weightcache/client.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

class ClientDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 4, 1, 9, "f32", 256, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    options_.identity.model_dir = ref_.dir;
    options_.identity.model_id = "scripted";
    options_.identity.runtime_dir = dir_.Join("run");
    options_.identity.tier = Tier::kHost;
    options_.wait_timeout = 200ms;
    auto id = identity::ResolveIdentity(options_.identity);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    id_ = *id;
    ASSERT_TRUE(identity::EnsureCacheDirs(id_.paths).ok());
  }
  std::vector<uint8_t> Hello(protocol::CacheState state, std::string reason = "") {
    protocol::HelloReply r;
    r.state = state;
    r.bytes_done = 10;
    r.bytes_total = 100;
    r.failure_reason = std::move(reason);
    if (state == protocol::CacheState::kFailed) r.failure_code = StatusCode::kInvalidCheckpoint;
    r.match = true;
    r.daemon_config = id_.config.ToJson();
    return protocol::EncodeHelloReply(r).value();
  }
  // A daemon whose config this client cannot read (another build's): the client falls back
  // on the daemon's own list of differences.
  std::vector<uint8_t> UnreadableMismatch(std::vector<protocol::ConfigDifference> differences) {
    protocol::HelloReply r;
    r.state = protocol::CacheState::kReady;
    r.match = false;
    r.daemon_config = {{"format_version", 99}};
    r.differences = std::move(differences);
    return protocol::EncodeHelloReply(r).value();
  }
  std::vector<uint8_t> Loading() {
    protocol::StatusReply s;
    s.state = protocol::CacheState::kLoading;
    s.bytes_done = 10;
    s.bytes_total = 100;
    s.config_digest = id_.config.Digest();
    s.device_uuid = "host";
    s.model_id = "scripted";
    return protocol::EncodeStatusReply(s).value();
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  AttachOptions options_;
  client::ResolvedIdentity id_;
};

TEST_F(ClientDiscoveryTest, LoadingPastTheWaitTimeoutIsTimeoutOrFallback) {
  // As the real daemon: the Attach pipelined behind the Hello is refused while loading
  // (kUnavailable, connection kept), and Status polls say loading.
  ScriptedDaemon daemon(id_.paths, [&](const protocol::Frame& f) {
    if (f.type == protocol::MessageType::kHello) return Hello(protocol::CacheState::kLoading);
    if (f.type == protocol::MessageType::kAttach) {
      return protocol::EncodeError(Status(StatusCode::kUnavailable, "cache is loading")).value();
    }
    return Loading();
  });
  options_.on_missing = OnMissing::kError;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kTimeout);
  EXPECT_NE(a.status().message().find("still loading after 200 ms (10 of 100 bytes)"),
            std::string::npos)
      << a.status().ToString();

  options_.on_missing = OnMissing::kFallback;
  auto b = Attachment::Attach(options_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->source(), AttachSource::kFallback);
  EXPECT_NE(b->source_reason().find("still loading"), std::string::npos) << b->source_reason();
  EXPECT_EQ(CompareWithReference(*b, ref_), "");
}

// A failed daemon is absent for the fallback; with on_missing=error the client fails with the
// daemon's own failure code (HelloReply.failure_code), not "no daemon".
TEST_F(ClientDiscoveryTest, FailedDaemonIsMissingWithItsReasonAndItsCode) {
  ScriptedDaemon daemon(id_.paths, [&](const protocol::Frame&) {
    return Hello(protocol::CacheState::kFailed, "shard 2 is truncated");
  });
  options_.on_missing = OnMissing::kError;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_NE(a.status().message().find("failed: shard 2 is truncated"), std::string::npos)
      << a.status().ToString();

  options_.on_missing = OnMissing::kFallback;
  auto b = Attachment::Attach(options_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->source(), AttachSource::kFallback);
}

TEST_F(ClientDiscoveryTest, APeerSpeakingGarbageIsAProtocolErrorNotAFallback) {
  ScriptedDaemon daemon(id_.paths, [](const protocol::Frame&) {
    std::vector<uint8_t> junk(64, 0x5a);  // no WCPF magic
    return junk;
  });
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kProtocol) << a.status().ToString();
  EXPECT_NE(a.status().message().find(id_.paths.socket), std::string::npos)
      << a.status().ToString();
}

TEST_F(ClientDiscoveryTest, AnErrorReplyKeepsTheDaemonsCodeAndMessage) {
  ScriptedDaemon daemon(id_.paths, [](const protocol::Frame&) {
    return protocol::EncodeError(PermissionDenied("uid 4242 is not allowed")).value();
  });
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(a.status().message().find("uid 4242 is not allowed"), std::string::npos)
      << a.status().ToString();
}

// The structured outcome (AttachDiagnostics) of each kind of mismatch a scripted daemon can
// show, and of the other outcomes.
TEST_F(ClientDiscoveryTest, AMismatchFromTheDaemonsOwnListIsDataDecodedAndAsTheMessageShowsIt) {
  // The daemon's values are texts as its CacheConfig::FieldText spells them (strings quoted).
  const std::string daemon_rev = R"j("r1 \"beta\", a=b; (c)")j";
  ScriptedDaemon daemon(id_.paths, [&](const protocol::Frame& f) {
    if (f.type != protocol::MessageType::kHello) return std::vector<uint8_t>{};
    return UnreadableMismatch({{"revision", daemon_rev, R"("")"}, {"tp_rank", "1", "0"}});
  });
  AttachDiagnostics why;
  auto a = Attachment::Attach(options_, &why);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kMismatch) << a.status().ToString();
  EXPECT_EQ(why.code, StatusCode::kMismatch);
  EXPECT_EQ(why.socket_path, id_.paths.socket);
  EXPECT_EQ(why.device_key, "host");
  ASSERT_TRUE(why.mismatch.has_value());
  const std::vector<ConfigFieldDiff> expected = {{.field = "revision",
                                                  .client_text = R"("")",
                                                  .daemon_text = daemon_rev,
                                                  .client_value = "",
                                                  .daemon_value = R"(r1 "beta", a=b; (c))"},
                                                 {.field = "tp_rank",
                                                  .client_text = "0",
                                                  .daemon_text = "1",
                                                  .client_value = "0",
                                                  .daemon_value = "1"}};
  EXPECT_EQ(why.mismatch->fields, expected);
  EXPECT_EQ(why.mismatch->daemon_socket, id_.paths.socket);
  EXPECT_EQ(why.mismatch->daemon_pid, ::getpid());  // the scripted daemon is this process
  EXPECT_EQ(a.status().message(), "daemon at " + id_.paths.socket + " (pid " +
                                      std::to_string(::getpid()) +
                                      ") holds a different config (revision, tp_rank): "
                                      "revision: ours=\"\" theirs=" +
                                      daemon_rev + "; tp_rank: ours=0 theirs=1");

  // on_mismatch=fallback: the attach succeeds from disk and still says what it ignored.
  options_.on_mismatch = OnMismatch::kFallback;
  auto b = Attachment::Attach(options_, &why);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->source(), AttachSource::kFallback);
  EXPECT_EQ(why.code, StatusCode::kOk);
  ASSERT_TRUE(why.mismatch.has_value());
  EXPECT_EQ(why.mismatch->fields, expected);
}

TEST_F(ClientDiscoveryTest, AMismatchErrorFrameNamesTheDaemonButNoField) {
  ScriptedDaemon daemon(id_.paths, [](const protocol::Frame&) {
    return protocol::EncodeError(Status(StatusCode::kMismatch, "config differs")).value();
  });
  AttachDiagnostics why;
  auto a = Attachment::Attach(options_, &why);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kMismatch) << a.status().ToString();
  EXPECT_EQ(why.code, StatusCode::kMismatch);
  ASSERT_TRUE(why.mismatch.has_value());
  EXPECT_TRUE(why.mismatch->fields.empty());
  EXPECT_EQ(why.mismatch->daemon_socket, id_.paths.socket);
  EXPECT_EQ(why.mismatch->daemon_pid, 0);
}

TEST_F(ClientDiscoveryTest, OtherOutcomesCarryTheirCodeAndWhereButNoMismatch) {
  ScriptedDaemon daemon(id_.paths, [&](const protocol::Frame&) {
    return Hello(protocol::CacheState::kFailed, "shard 2 is truncated");
  });
  options_.on_missing = OnMissing::kError;
  AttachDiagnostics why;
  why.mismatch.emplace();  // stale content is reset by the call
  auto a = Attachment::Attach(options_, &why);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(why.code, StatusCode::kInvalidCheckpoint);
  EXPECT_EQ(why.socket_path, id_.paths.socket);
  EXPECT_EQ(why.device_key, "host");
  EXPECT_FALSE(why.mismatch.has_value());

  options_.on_missing = OnMissing::kFallback;
  auto b = Attachment::Attach(options_, &why);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(why.code, StatusCode::kOk);
  EXPECT_EQ(why.socket_path, id_.paths.socket);
  EXPECT_FALSE(why.mismatch.has_value());

  // An identity that does not resolve: the code, and no socket or device.
  options_.identity.tp_rank = 3;
  options_.identity.tp_size = 2;
  auto c = Attachment::Attach(options_, &why);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(why.code, StatusCode::kInvalidArgument) << c.status().ToString();
  EXPECT_EQ(why.socket_path, "");
  EXPECT_EQ(why.device_key, "");
  EXPECT_FALSE(why.mismatch.has_value());
}

// Issue 39 §5.7: a daemon that goes away at any point of an attach (before its HelloReply, in
// the middle of a frame, between the HelloReply and the AttachReply, after the AttachReply's
// header and fds, during a loading daemon's Status polls) is a missing daemon: on_missing=
// fallback loads from disk and says which daemon went away, on_missing=error is kNoDaemon.
// Each case is a scripted daemon that closes the connection at that point ({} closes).
TEST_F(ClientDiscoveryTest, ADaemonThatGoesAwayAtAnyPointOfTheAttachIsMissing) {
  const std::vector<uint8_t> ready = Hello(protocol::CacheState::kReady);
  const std::vector<uint8_t> cut_hello(ready.begin(), ready.begin() + ready.size() / 2);
  const std::vector<uint8_t> cut_header(ready.begin(), ready.begin() + 10);
  auto memory = os::CreateMemfd("gone-memory", 4096);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  const std::vector<uint8_t> attach_header = [] {
    std::vector<uint8_t> reply = protocol::EncodeAttachReply(4096, 1).value();
    reply.resize(protocol::kFrameHeaderSize);  // the fds ride on it; its payload never comes
    return reply;
  }();
  struct Case {
    std::string where;
    Script script;
    FdScript fds;
    CloseAfter close_after = {};
  };
  using protocol::MessageType;
  const std::vector<uint8_t> none;
  const std::vector<Case> cases = {
      {"before its HelloReply", [&](const protocol::Frame&) { return none; }, {}},
      {"inside the HelloReply's header",
       [&](const protocol::Frame& f) { return f.type == MessageType::kHello ? cut_header : none; },
       {}},
      {"inside the HelloReply's payload",
       [&](const protocol::Frame& f) { return f.type == MessageType::kHello ? cut_hello : none; },
       {}},
      {"between the HelloReply and the AttachReply",
       [&](const protocol::Frame& f) { return f.type == MessageType::kHello ? ready : none; },
       {}},
      {"after the AttachReply's header and fds",
       [&](const protocol::Frame& f) {
         return f.type == MessageType::kHello ? ready : attach_header;
       },
       [&](const protocol::Frame& f) {
         if (f.type != MessageType::kAttach) return std::vector<int>{};
         return std::vector<int>{memory->get(), memory->get()};
       },
       [](const protocol::Frame& f) { return f.type == MessageType::kAttach; }},
      {"during a loading daemon's Status poll",
       [&](const protocol::Frame& f) {
         if (f.type == MessageType::kHello) return Hello(protocol::CacheState::kLoading);
         if (f.type == MessageType::kAttach) {
           return protocol::EncodeError(Status(StatusCode::kUnavailable, "cache is loading"))
               .value();
         }
         return none;  // the first Status
       },
       {}},
  };
  options_.wait_timeout = 30s;  // a hang would show as a timeout, not as the outcome asserted
  for (const Case& c : cases) {
    SCOPED_TRACE("the daemon goes away " + c.where);
    ScriptedDaemon daemon(id_.paths, c.script, c.fds, c.close_after);
    options_.on_missing = OnMissing::kFallback;
    auto a = Attachment::Attach(options_);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (a.ok()) {
      EXPECT_EQ(a->source(), AttachSource::kFallback);
      EXPECT_NE(
          a->source_reason().find("daemon at " + id_.paths.socket + " (pid " +
                                  std::to_string(::getpid()) + ") went away during the attach"),
          std::string::npos)
          << a->source_reason();
      EXPECT_EQ(CompareWithReference(*a, ref_), "");
    }

    options_.on_missing = OnMissing::kError;
    AttachDiagnostics why;
    auto b = Attachment::Attach(options_, &why);
    EXPECT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kNoDaemon) << b.status().ToString();
    EXPECT_EQ(why.code, StatusCode::kNoDaemon);
    EXPECT_NE(b.status().message().find("went away during the attach"), std::string::npos)
        << b.status().ToString();
  }
}

// A ready, matching daemon whose manifest passes the header checks (which run when the reply
// arrives) but not a record check (which runs while the table is built, deferred so that it
// overlaps the gpu tier's VMM import): the attach fails with kProtocol naming the daemon and
// the tensor, and never falls back to disk.
class HostileManifestTest : public ClientDiscoveryTest {
 protected:
  // `corrupt` edits the encoded manifest of one 4-byte F32 tensor "w" (shape {1}, strides {1}).
  Status AttachWith(const std::function<void(std::vector<uint8_t>&)>& corrupt,
                    std::string dtype = "F32", Tier tier = Tier::kHost,
                    AttachDiagnostics* why = nullptr) {
    protocol::TensorEntry t;
    t.name = "w";
    t.dtype = dtype;
    t.ndim = 1;
    t.shape = {1};
    t.nbytes = 4;
    const std::vector<uint64_t> allocations = {4096};
    auto bytes = protocol::EncodeManifest(tier, allocations, {&t, 1});
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    corrupt(*bytes);
    auto manifest = protocol::CreateManifestMemfd(*bytes, "hostile-manifest");
    auto memory = os::CreateMemfd("hostile-memory", 4096);
    EXPECT_TRUE(manifest.ok() && memory.ok());
    EXPECT_TRUE(os::SealReadOnly(memory->get()).ok());
    const std::vector<int> fds = {manifest->get(), memory->get()};
    const uint64_t manifest_size = bytes->size();
    ScriptedDaemon daemon(
        id_.paths,
        [&](const protocol::Frame& f) {
          if (f.type == protocol::MessageType::kHello) return Hello(protocol::CacheState::kReady);
          return protocol::EncodeAttachReply(manifest_size, 1).value();
        },
        [&](const protocol::Frame& f) {
          return f.type == protocol::MessageType::kAttach ? fds : std::vector<int>{};
        });
    auto a = Attachment::Attach(options_, why);
    if (a.ok()) return Status::Ok();
    EXPECT_NE(a.status().message().find(id_.paths.socket), std::string::npos)
        << a.status().ToString();
    return a.status();
  }
  // The dims section starts after the 32-byte header, one allocation and one record.
  static constexpr size_t kDims = protocol::kManifestHeaderSize + 8 + protocol::kManifestTensorSize;
};

TEST_F(HostileManifestTest, AWellFormedManifestAttaches) {
  EXPECT_TRUE(AttachWith([](std::vector<uint8_t>&) {}).ok());
}

TEST_F(HostileManifestTest, ABadStrideIsAProtocolErrorNamingTheTensor) {
  Status s = AttachWith([](std::vector<uint8_t>& b) { b[kDims + 8] = 2; });  // strides[0] = 2
  EXPECT_EQ(s.code(), StatusCode::kProtocol) << s.ToString();
  EXPECT_NE(s.message().find("tensor 0 'w': strides are not the contiguous row-major ones"),
            std::string::npos)
      << s.ToString();
}

TEST_F(HostileManifestTest, AMissingNulIsAProtocolError) {
  // The string table follows the 2 dims: "w\0F32\0".
  Status s = AttachWith([](std::vector<uint8_t>& b) { b[kDims + 16 + 1] = 'x'; });
  EXPECT_EQ(s.code(), StatusCode::kProtocol) << s.ToString();
  EXPECT_NE(s.message().find("name is not followed by a NUL"), std::string::npos) << s.ToString();
}

TEST_F(HostileManifestTest, DtypeSemanticsAreTheClientsToCheck) {
  Status unknown = AttachWith([](std::vector<uint8_t>&) {}, "Q7");
  EXPECT_EQ(unknown.code(), StatusCode::kProtocol) << unknown.ToString();
  EXPECT_NE(unknown.message().find("tensor w has unknown dtype \"Q7\""), std::string::npos)
      << unknown.ToString();
  Status size = AttachWith([](std::vector<uint8_t>&) {}, "BF16");  // 4 bytes for 1 element
  EXPECT_EQ(size.code(), StatusCode::kProtocol) << size.ToString();
  EXPECT_NE(size.message().find("tensor w claims 4 bytes for 1 elements of BF16"),
            std::string::npos)
      << size.ToString();
}

// The tier is a CacheConfig field, so a matching Hello implies it; a manifest of the other
// tier behind one is still caught, before anything is mapped, as the mismatch of `tier`.
TEST_F(HostileManifestTest, AManifestOfTheOtherTierIsAMismatchOfTheTierField) {
  AttachDiagnostics why;
  Status s = AttachWith([](std::vector<uint8_t>&) {}, "F32", Tier::kGpu, &why);
  EXPECT_EQ(s.code(), StatusCode::kMismatch) << s.ToString();
  EXPECT_NE(s.message().find(R"(holds a different config (tier): tier: ours="host" theirs="gpu")"),
            std::string::npos)
      << s.ToString();
  EXPECT_EQ(why.code, StatusCode::kMismatch);
  ASSERT_TRUE(why.mismatch.has_value());
  const std::vector<ConfigFieldDiff> expected = {{.field = "tier",
                                                  .client_text = R"("host")",
                                                  .daemon_text = R"("gpu")",
                                                  .client_value = "host",
                                                  .daemon_value = "gpu"}};
  EXPECT_EQ(why.mismatch->fields, expected);
  EXPECT_EQ(why.mismatch->daemon_socket, id_.paths.socket);
  EXPECT_EQ(why.mismatch->daemon_pid, ::getpid());
}

}  // namespace
}  // namespace weightcache::testing
