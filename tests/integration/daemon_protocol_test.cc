// The daemon's robustness against hostile or broken peers (docs/design.md "Untrusted input"): every
// bad connection gets an Error frame (where possible) and is closed, alone; everyone else keeps
// being served.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "integration/daemon_process.h"
#include "os/fd_passing.h"
#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;
using protocol::MessageType;

class ProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 8, 1, 3, 4096);
    runtime_ = dir_.Join("run");
  }
  void StartDaemon(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--model", model_, "--model-id",    "tiny",
                                     "--tier",  "host", "--runtime-dir", runtime_};
    args.insert(args.end(), extra.begin(), extra.end());
    serve_ = ServeProcess::Start(args, dir_.Join("serve.log"));
    ASSERT_NE(serve_, nullptr);
    auto socket = WaitForState(*serve_, runtime_, CacheState::kReady);
    ASSERT_TRUE(socket.ok()) << socket.status().ToString();
    socket_ = *socket;
  }
  // A connection that said a matching Hello and attached: it must survive everything else.
  protocol::Connection AttachedClient() {
    auto conn = protocol::Connection::Connect(socket_, 2s);
    EXPECT_TRUE(conn.ok());
    protocol::Hello hello;
    hello.config = ConfigFor(model_, "tiny").ToJson();
    auto hr = conn->SendHello(hello, os::Deadline::After(5s));
    EXPECT_TRUE(hr.ok() && hr->match);
    auto reply = conn->Attach(os::Deadline::After(5s));
    EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    return std::move(conn).value();
  }
  // Sends `bytes` on a fresh raw connection; returns the Error the daemon answered, after
  // checking that it then closed the connection.
  Result<protocol::ErrorReply> SendBad(const std::vector<uint8_t>& bytes) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(int fd, ConnectRaw(socket_));
    UniqueFd owned(fd);
    if (::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(bytes.size())) {
      return IoError("send", errno);
    }
    bool eof = false;
    const std::string got = ReadUntilEof(fd, 5s, &eof);
    if (!eof) return InternalError("the daemon kept the bad connection open");
    return DecodeErrorFrame(got);
  }

  TempDir dir_;
  std::string model_, runtime_, socket_;
  std::unique_ptr<ServeProcess> serve_;
};

// Hello and Attach sent back to back in one write (what the client library does,
// docs/protocol.md §1): a matching Hello gets HelloReply then AttachReply; a non-matching one
// gets HelloReply with the differences, then an Error (kMismatch) that keeps the connection.
TEST_F(ProtocolTest, PipelinedHelloAndAttach) {
  StartDaemon();
  auto send_pipelined = [&](const identity::CacheConfig& config) -> protocol::Connection {
    auto conn = protocol::Connection::Connect(socket_, 2s);
    EXPECT_TRUE(conn.ok()) << conn.status().ToString();
    protocol::Hello hello;
    hello.config = config.ToJson();
    auto bytes = protocol::EncodeHello(hello);
    auto attach = protocol::EncodeAttachRequest();
    EXPECT_TRUE(bytes.ok() && attach.ok());
    bytes->insert(bytes->end(), attach->begin(), attach->end());
    EXPECT_TRUE(os::SendMessage(conn->fd(), *bytes, {}, os::Deadline::After(5s)).ok());
    return std::move(conn).value();
  };
  auto read = [](protocol::Connection& conn) {
    return protocol::ReadFrame(conn.fd(), protocol::Expect::kReply, os::Deadline::After(5s));
  };

  protocol::Connection good = send_pipelined(ConfigFor(model_, "tiny"));
  auto hello_reply = read(good);
  ASSERT_TRUE(hello_reply.ok()) << hello_reply.status().ToString();
  ASSERT_EQ(hello_reply->type, MessageType::kHelloReply);
  EXPECT_TRUE(protocol::DecodeHelloReply(hello_reply->payload)->match);
  auto attach_reply = read(good);
  ASSERT_TRUE(attach_reply.ok()) << attach_reply.status().ToString();
  ASSERT_EQ(attach_reply->type, MessageType::kAttachReply);
  auto decoded = protocol::DecodeAttachReply(std::move(attach_reply).value());
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->manifest.tensor_count(), 8u);

  identity::CacheConfig other = ConfigFor(model_, "tiny");
  other.tp_size = 2;
  protocol::Connection mismatched = send_pipelined(other);
  auto mismatch_reply = read(mismatched);
  ASSERT_TRUE(mismatch_reply.ok()) << mismatch_reply.status().ToString();
  auto hr = protocol::DecodeHelloReply(mismatch_reply->payload);
  ASSERT_TRUE(hr.ok());
  EXPECT_FALSE(hr->match);
  auto refused = read(mismatched);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  ASSERT_EQ(refused->type, MessageType::kError);
  auto error = protocol::DecodeError(refused->payload);
  ASSERT_TRUE(error.ok());
  EXPECT_EQ(error->code, StatusCode::kMismatch);
  EXPECT_NE(error->message.find("Attach refused: the Hello's config does not match"),
            std::string::npos)
      << error->message;
  // An application error: the connection still answers, and did not count as a client.
  auto st = mismatched.QueryStatus(os::Deadline::After(5s));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->clients, 1u);
}

TEST_F(ProtocolTest, MalformedOversizeAndWrongVersionFramesCloseOnlyTheirConnection) {
  StartDaemon();
  protocol::Connection good = AttachedClient();
  const auto status = static_cast<uint16_t>(MessageType::kStatus);

  auto bad_magic = SendBad(RawHeader(protocol::kProtocolVersion, status, 0, 0, 0, "XXXX"));
  ASSERT_TRUE(bad_magic.ok()) << bad_magic.status().ToString();
  EXPECT_EQ(bad_magic->code, StatusCode::kProtocol);
  EXPECT_NE(bad_magic->message.find("magic"), std::string::npos) << bad_magic->message;

  auto oversize =
      SendBad(RawHeader(protocol::kProtocolVersion, static_cast<uint16_t>(MessageType::kHello), 0,
                        0, uint64_t{1} << 30));
  ASSERT_TRUE(oversize.ok()) << oversize.status().ToString();
  EXPECT_EQ(oversize->code, StatusCode::kProtocol);
  EXPECT_NE(oversize->message.find(std::to_string(uint64_t{1} << 30)), std::string::npos)
      << oversize->message;

  const uint16_t next_version = protocol::kProtocolVersion + 1;
  auto version = SendBad(RawHeader(next_version, status, 0, 0, 0));
  ASSERT_TRUE(version.ok()) << version.status().ToString();
  EXPECT_EQ(version->code, StatusCode::kProtocol);
  EXPECT_NE(version->message.find("version " + std::to_string(next_version)), std::string::npos)
      << version->message;

  // A reply type sent to the daemon.
  auto reply_type = SendBad(RawHeader(protocol::kProtocolVersion,
                                      static_cast<uint16_t>(MessageType::kStatusReply), 0, 0, 0));
  ASSERT_TRUE(reply_type.ok()) << reply_type.status().ToString();
  EXPECT_EQ(reply_type->code, StatusCode::kProtocol);

  // A Hello whose payload is not JSON.
  std::vector<uint8_t> garbage =
      RawHeader(protocol::kProtocolVersion, static_cast<uint16_t>(MessageType::kHello), 0, 0, 5);
  for (char c : std::string("{{{{{")) garbage.push_back(static_cast<uint8_t>(c));
  auto not_json = SendBad(garbage);
  ASSERT_TRUE(not_json.ok()) << not_json.status().ToString();
  EXPECT_EQ(not_json->code, StatusCode::kProtocol);

  // Attach without a Hello.
  auto early = SendBad(
      RawHeader(protocol::kProtocolVersion, static_cast<uint16_t>(MessageType::kAttach), 0, 0, 0));
  ASSERT_TRUE(early.ok()) << early.status().ToString();
  EXPECT_EQ(early->code, StatusCode::kProtocol);
  EXPECT_NE(early->message.find("Attach before a Hello"), std::string::npos) << early->message;

  // The attached client was never disturbed, and still counts.
  auto st = good.QueryStatus(os::Deadline::After(5s));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->state, CacheState::kReady);
  EXPECT_EQ(st->clients, 1u);
  EXPECT_TRUE(serve_->Running());
  EXPECT_NE(serve_->Log().find("closing connection of peer pid " + std::to_string(::getpid())),
            std::string::npos)
      << serve_->Log();
}

TEST_F(ProtocolTest, MismatchedHelloNamesEachFieldAndRefusesAttach) {
  StartDaemon();
  auto conn = protocol::Connection::Connect(socket_, 2s);
  ASSERT_TRUE(conn.ok());
  identity::CacheConfig theirs = ConfigFor(model_, "tiny");
  theirs.tp_size = 2;
  theirs.tp_rank = 1;
  theirs.revision = "other";
  protocol::Hello hello;
  hello.config = theirs.ToJson();
  auto hr = conn->SendHello(hello, os::Deadline::After(5s));
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  EXPECT_FALSE(hr->match);
  std::vector<std::string> fields;
  for (const auto& d : hr->differences) fields.push_back(d.field);
  EXPECT_EQ(fields, (std::vector<std::string>{"revision", "tp_rank", "tp_size"}));
  for (const auto& d : hr->differences) {
    if (d.field == "tp_size") {
      EXPECT_EQ(d.daemon, "1");
      EXPECT_EQ(d.client, "2");
    }
  }
  // Refused as an application error (a pipelining client sends Attach before it has seen the
  // HelloReply): kMismatch, and the connection stays usable.
  auto attach = conn->Attach(os::Deadline::After(5s));
  ASSERT_FALSE(attach.ok());
  EXPECT_EQ(attach.status().code(), StatusCode::kMismatch) << attach.status().ToString();
  EXPECT_NE(attach.status().message().find("does not match this cache"), std::string::npos)
      << attach.status().ToString();
  auto st = conn->QueryStatus(os::Deadline::After(5s));
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->clients, 0u);
}

TEST_F(ProtocolTest, ManyClientsAreServedWhileOneStallsMidFrame) {
  StartDaemon();
  // A peer that sends half a header and then nothing must not hold anyone up.
  auto staller = ConnectRaw(socket_);
  ASSERT_TRUE(staller.ok());
  UniqueFd stalled(*staller);
  const auto half =
      RawHeader(protocol::kProtocolVersion, static_cast<uint16_t>(MessageType::kStatus), 0, 0, 0);
  ASSERT_EQ(::send(stalled.get(), half.data(), 10, MSG_NOSIGNAL), 10);

  std::vector<protocol::Connection> conns;
  for (int i = 0; i < 64; ++i) {
    auto c = protocol::Connection::Connect(socket_, 2s);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    conns.push_back(std::move(c).value());
  }
  // All connected at once; each is answered, in an order unrelated to connection order.
  for (int i = 63; i >= 0; --i) {
    auto st = conns[i].QueryStatus(os::Deadline::After(5s));
    ASSERT_TRUE(st.ok()) << i << ": " << st.status().ToString();
    EXPECT_EQ(st->state, CacheState::kReady);
  }
  std::vector<std::thread> threads;
  std::atomic<int> attached{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      auto c = protocol::Connection::Connect(socket_, 2s);
      if (!c.ok()) return;
      protocol::Hello hello;
      hello.config = ConfigFor(model_, "tiny").ToJson();
      auto hr = c->SendHello(hello, os::Deadline::After(5s));
      if (!hr.ok() || !hr->match) return;
      if (c->Attach(os::Deadline::After(5s)).ok()) ++attached;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(attached.load(), 8);
}

// Runs `fn` in a child whose uid and gid are 65534 but which keeps CAP_DAC_OVERRIDE, so it can
// reach the root-owned 0700 directory and 0600 socket: exactly a foreign-uid peer that got
// past the file modes, which is what the SO_PEERCRED check is for. The child writes what it
// read from the socket to a pipe. Returns std::nullopt (with `why`) if that cannot be set up.
std::optional<std::string> ReadAsOtherUid(const std::string& socket,
                                          const std::vector<uint8_t>& request, std::string* why) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    *why = "pipe2";
    return std::nullopt;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(pipe_fds[0]);
    char tag = 'E';  // 'E' = setup failed, 'D' = data follows
    if (::prctl(PR_SET_KEEPCAPS, 1) != 0 || ::setresgid(65534, 65534, 65534) != 0 ||
        ::setresuid(65534, 65534, 65534) != 0) {
      (void)::write(pipe_fds[1], &tag, 1);
      ::_exit(0);
    }
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2] = {};
    if (::syscall(SYS_capget, &header, data) != 0 ||
        (data[0].permitted & (1u << CAP_DAC_OVERRIDE)) == 0) {
      (void)::write(pipe_fds[1], &tag, 1);
      ::_exit(0);
    }
    data[0].effective |= 1u << CAP_DAC_OVERRIDE;
    if (::syscall(SYS_capset, &header, data) != 0) {
      (void)::write(pipe_fds[1], &tag, 1);
      ::_exit(0);
    }
    auto fd = ConnectRaw(socket);
    if (!fd.ok()) {
      (void)::write(pipe_fds[1], &tag, 1);
      ::_exit(0);
    }
    tag = 'D';
    (void)::write(pipe_fds[1], &tag, 1);
    (void)::send(*fd, request.data(), request.size(), MSG_NOSIGNAL);
    bool eof = false;
    const std::string got = ReadUntilEof(*fd, 3s, &eof);
    (void)::write(pipe_fds[1], got.data(), got.size());
    ::_exit(eof ? 0 : 1);
  }
  ::close(pipe_fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipe_fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (out.empty() || out[0] != 'D') {
    *why = "could not become uid 65534 with CAP_DAC_OVERRIDE in a child";
    return std::nullopt;
  }
  return out.substr(1);
}

TEST_F(ProtocolTest, PeerOfAnotherUidIsRefusedUnlessAllowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create a peer of another uid";
  StartDaemon();
  auto request = protocol::EncodeStatusRequest();
  ASSERT_TRUE(request.ok());
  std::string why;
  auto got = ReadAsOtherUid(socket_, *request, &why);
  if (!got) GTEST_SKIP() << why;
  auto error = DecodeErrorFrame(*got);
  ASSERT_TRUE(error.ok()) << error.status().ToString();
  EXPECT_EQ(error->code, StatusCode::kPermissionDenied);
  EXPECT_NE(error->message.find("uid 65534 is not allowed"), std::string::npos) << error->message;
  EXPECT_NE(serve_->Log().find("refused connection from pid"), std::string::npos);
  auto st = QueryStatus(socket_);  // we (same uid) are still served
  ASSERT_TRUE(st.ok());

  // With --allow-uid the same peer is answered (and may not Stop).
  serve_->Signal(SIGTERM);
  ASSERT_EQ(serve_->WaitExit(10s), 0);
  StartDaemon({"--allow-uid", "65534"});
  auto stop = protocol::EncodeStopRequest();
  ASSERT_TRUE(stop.ok());
  auto allowed = ReadAsOtherUid(socket_, *stop, &why);
  ASSERT_TRUE(allowed.has_value()) << why;
  // Stop from another uid: an Error, but the connection is not dropped for it; the child
  // reads until its timeout, so `allowed` holds just the Error frame.
  auto refused = DecodeErrorFrame(*allowed);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->code, StatusCode::kPermissionDenied);
  EXPECT_NE(refused->message.find("may stop it"), std::string::npos) << refused->message;
  EXPECT_TRUE(serve_->Running());
}

}  // namespace
}  // namespace weightcache::testing
