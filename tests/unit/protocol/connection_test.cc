#include "protocol/connection.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "os/unix_socket.h"
#include "support/test_env.h"

namespace weightcache::protocol {
namespace {

using std::chrono::milliseconds;

// A one-connection server on a real listening socket: answers each request with the frame
// `respond` builds, using the non-blocking FrameReader/FrameWriter path a daemon uses.
class ToyServer {
 public:
  using Responder = std::function<Result<std::vector<uint8_t>>(const Frame&)>;

  ToyServer(const std::string& path, Responder respond) {
    auto listener = os::ListenUnix(path);
    EXPECT_TRUE(listener.ok()) << listener.status().ToString();
    listener_ = std::move(listener).value();
    thread_ = std::thread([this, respond] { Serve(respond); });
  }
  ~ToyServer() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits for the server to finish; returns why it stopped reading (OK if it never failed).
  Status Join() {
    thread_.join();
    return last_error_;
  }

 private:
  void Serve(const Responder& respond) {
    EXPECT_TRUE(
        os::WaitFor(listener_.get(), POLLIN, os::Deadline::After(std::chrono::seconds(5))).ok());
    auto conn = os::AcceptConnection(listener_.get());
    ASSERT_TRUE(conn.ok() && conn->has_value());
    int fd = (*conn)->get();
    FrameReader reader(Expect::kRequest);
    while (true) {
      auto frame = reader.ReadAvailable(fd);
      if (!frame.ok()) {
        last_error_ = frame.status();
        return;
      }
      if (!frame->has_value()) {
        if (!os::WaitFor(fd, POLLIN, os::Deadline::After(std::chrono::seconds(5))).ok()) return;
        continue;
      }
      auto reply = respond(**frame);
      if (!reply.ok()) return;  // hang up without answering
      FrameWriter writer(std::move(reply).value(), {});
      while (true) {
        auto done = writer.Flush(fd);
        ASSERT_TRUE(done.ok());
        if (*done) break;
        ASSERT_TRUE(os::WaitFor(fd, POLLOUT, os::Deadline::Never()).ok());
      }
    }
  }

  UniqueFd listener_;
  Status last_error_;
  std::thread thread_;
};

os::Deadline Soon() { return os::Deadline::After(std::chrono::seconds(5)); }

TEST(ConnectionTest, HelloAndStatusOverARealSocket) {
  weightcache::testing::TempDir dir;
  std::string path = dir.Join("d.sock");
  ToyServer server(path, [](const Frame& f) -> Result<std::vector<uint8_t>> {
    if (f.type == MessageType::kHello) {
      auto hello = DecodeHello(f.payload);
      if (!hello.ok()) return EncodeError(hello.status());
      HelloReply reply;
      reply.state = CacheState::kReady;
      reply.match = hello->client_name == "engine";
      reply.daemon_config = hello->config;
      return EncodeHelloReply(reply);
    }
    StatusReply s;
    s.state = CacheState::kReady;
    s.pid = 99;
    return EncodeStatusReply(s);
  });
  auto conn = Connection::Connect(path, milliseconds(1000));
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  Hello hello;
  hello.client_name = "engine";
  hello.config = {{"model_id", "m"}};
  auto reply = conn->SendHello(hello, Soon());
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_TRUE(reply->match);
  EXPECT_EQ(reply->daemon_config, hello.config);
  auto status = conn->QueryStatus(Soon());
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->pid, 99);
}

TEST(ConnectionTest, ErrorReplyBecomesTheDaemonsStatus) {
  weightcache::testing::TempDir dir;
  std::string path = dir.Join("e.sock");
  ToyServer server(path, [](const Frame&) {
    return EncodeError(Status(StatusCode::kMismatch, "config differs in tp_rank"));
  });
  auto conn = Connection::Connect(path, milliseconds(1000));
  ASSERT_TRUE(conn.ok());
  auto r = conn->Attach(Soon());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kMismatch);
  EXPECT_EQ(r.status().message(), "daemon: config differs in tp_rank");
}

TEST(ConnectionTest, WrongReplyTypeIsProtocolError) {
  weightcache::testing::TempDir dir;
  std::string path = dir.Join("w.sock");
  ToyServer server(path, [](const Frame&) { return EncodeStopReply(StopReply{}); });
  auto conn = Connection::Connect(path, milliseconds(1000));
  ASSERT_TRUE(conn.ok());
  auto r = conn->QueryStatus(Soon());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
  EXPECT_NE(r.status().message().find("expected StatusReply in reply, got StopReply"),
            std::string::npos);
}

TEST(ConnectionTest, SilentDaemonTimesOutAndHangupIsUnavailable) {
  weightcache::testing::TempDir dir;
  std::string path = dir.Join("s.sock");
  {
    ToyServer server(path, [](const Frame&) -> Result<std::vector<uint8_t>> {
      std::this_thread::sleep_for(milliseconds(200));
      return InternalError("hang up");
    });
    auto conn = Connection::Connect(path, milliseconds(1000));
    ASSERT_TRUE(conn.ok());
    auto r = conn->Stop(os::Deadline::After(milliseconds(30)));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kTimeout);
    auto again = conn->Stop(Soon());  // the server hangs up after 200 ms
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  }
}

TEST(ConnectionTest, ServerRejectsABadFrameAndClosesOnlyThatConnection) {
  weightcache::testing::TempDir dir;
  std::string path = dir.Join("b.sock");
  ToyServer server(path, [](const Frame&) { return EncodeStopReply(StopReply{}); });
  auto fd = os::ConnectUnix(path, milliseconds(1000));
  ASSERT_TRUE(fd.ok());
  std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(os::SendMessage(
                  fd->get(), {reinterpret_cast<const uint8_t*>(garbage.data()), garbage.size()}, {})
                  .ok());
  uint8_t byte;
  // The server gives up on this connection: we see EOF (it closed), never a reply.
  auto r = os::RecvMessage(fd->get(), {&byte, 1}, 0, Soon());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  Status why = server.Join();
  EXPECT_EQ(why.code(), StatusCode::kProtocol);
  EXPECT_NE(why.message().find("bad frame magic 0x20544547"), std::string::npos) << why.message();
}

}  // namespace
}  // namespace weightcache::protocol
