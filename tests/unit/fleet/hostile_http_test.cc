// EtcdClient against a hostile HTTP endpoint (a fault-injection seam; the real registry is
// etcd): a thread on 127.0.0.1 answers every request with one canned misbehaviour. Each must
// end in a clear error within the client's timeout, never a hang or a crash.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "common/unique_fd.h"
#include "fleet/etcd_client.h"
#include "unit/fleet/fleet_test_util.h"

namespace weightcache::fleet {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

enum class Misbehaviour {
  kNotHttp,       // a line of junk, then close
  kNotJson,       // 200 with a body that is no JSON
  kHuge,          // 200 announcing 1 GiB and streaming it
  kSilent,        // accepts, reads, never answers
  kWrongTypes,    // 200 with JSON whose fields have the wrong types
  kEtcdNotFound,  // 404 with etcd's error JSON (gRPC code 5)
  kHtmlError,     // 500 with an HTML page
};

class HostileServer {
 public:
  explicit HostileServer(Misbehaviour how) : how_(how) {
    listen_.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listen_.get(), 16), 0);
    EXPECT_EQ(::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
    int p[2];
    EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
    stop_read_.Reset(p[0]);
    stop_write_.Reset(p[1]);
    thread_ = std::thread([this] { Serve(); });
  }
  ~HostileServer() {
    stop_write_.Reset();  // EOF on the stop pipe wakes every poll
    thread_.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  // Waits for `fd` to be ready for `events`; false when the test is tearing down.
  bool WaitFor(int fd, short events) {
    pollfd fds[2] = {{fd, events, 0}, {stop_read_.get(), POLLIN, 0}};
    while (::poll(fds, 2, -1) < 0) {
    }
    return (fds[1].revents & (POLLIN | POLLHUP)) == 0;
  }

  void Serve() {
    while (WaitFor(listen_.get(), POLLIN)) {
      UniqueFd conn(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn.valid()) continue;
      std::string request;
      char buf[4096];
      while (request.find("\r\n\r\n") == std::string::npos && WaitFor(conn.get(), POLLIN)) {
        const ssize_t n = ::read(conn.get(), buf, sizeof(buf));
        if (n <= 0) break;
        request.append(buf, static_cast<size_t>(n));
      }
      Answer(conn.get());
    }
  }

  void Send(int fd, const std::string& data) {
    size_t off = 0;
    while (off < data.size() && WaitFor(fd, POLLOUT)) {
      const ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }

  static std::string Response(int code, const std::string& body) {
    return "HTTP/1.1 " + std::to_string(code) + " X\r\nContent-Type: application/json\r\n" +
           "Content-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
           body;
  }

  void Answer(int fd) {
    switch (how_) {
      case Misbehaviour::kNotHttp:
        Send(fd, "SSH-2.0-OpenSSH_9.2\r\n");
        return;
      case Misbehaviour::kNotJson:
        Send(fd, Response(200, "<<<not json>>>"));
        return;
      case Misbehaviour::kHuge: {
        Send(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n");
        const std::string chunk(1 << 16, '{');
        for (int i = 0; i < (1 << 14); ++i) {  // until the client hangs up (send fails)
          const size_t before = chunk.size();
          if (!WaitFor(fd, POLLOUT)) return;
          if (::send(fd, chunk.data(), before, MSG_NOSIGNAL) <= 0) return;
        }
        return;
      }
      case Misbehaviour::kSilent:
        WaitFor(fd, POLLRDHUP);  // until the client gives up and closes
        return;
      case Misbehaviour::kWrongTypes:
        Send(fd, Response(200, R"({"kvs":"nope","ID":{"x":1},"TTL":[1],"deleted":"many"})"));
        return;
      case Misbehaviour::kEtcdNotFound:
        Send(fd, Response(404, R"({"error":"etcdserver: requested lease not found","code":5,)"
                               R"("message":"etcdserver: requested lease not found"})"));
        return;
      case Misbehaviour::kHtmlError:
        Send(fd, Response(500, "<html>Internal Server Error</html>"));
        return;
    }
  }

  Misbehaviour how_;
  UniqueFd listen_;
  UniqueFd stop_read_;
  UniqueFd stop_write_;
  int port_ = 0;
  std::thread thread_;
};

EtcdClient ClientOf(const HostileServer& server) {
  EtcdOptions options;
  options.endpoints = {server.endpoint()};
  options.timeout = std::chrono::milliseconds(1000);
  options.max_response_bytes = 1 << 20;
  return *EtcdClient::Create(options);
}

TEST(HostileHttpTest, NotHttpIsAnErrorNamingTheEndpoint) {
  HostileServer server(Misbehaviour::kNotHttp);
  EXPECT_THAT(
      ClientOf(server).Put("/k", "v"),
      StatusIs(StatusCode::kUnavailable, HasSubstr("etcd " + server.endpoint() + " /v3/kv/put")));
}

TEST(HostileHttpTest, ABodyThatIsNoJsonIsAProtocolError) {
  HostileServer server(Misbehaviour::kNotJson);
  EXPECT_THAT(ClientOf(server).RangePrefix("/"),
              StatusIs(StatusCode::kProtocol, HasSubstr("not valid JSON")));
}

TEST(HostileHttpTest, AHugeBodyIsCutOffAtTheCap) {
  HostileServer server(Misbehaviour::kHuge);
  EXPECT_THAT(ClientOf(server).RangePrefix("/"),
              StatusIs(StatusCode::kProtocol, HasSubstr("larger than 1048576 bytes")));
}

TEST(HostileHttpTest, ASilentEndpointTimesOut) {
  HostileServer server(Misbehaviour::kSilent);
  EXPECT_THAT(ClientOf(server).LeaseGrant(5),
              StatusIs(StatusCode::kTimeout, AnyOf(HasSubstr("timeout 1000 ms"))));
}

TEST(HostileHttpTest, WrongFieldTypesAreProtocolErrors) {
  HostileServer server(Misbehaviour::kWrongTypes);
  const EtcdClient client = ClientOf(server);
  EXPECT_THAT(client.RangePrefix("/"),
              StatusIs(StatusCode::kProtocol, HasSubstr("\"kvs\" is not a list")));
  EXPECT_THAT(client.LeaseGrant(5),
              StatusIs(StatusCode::kProtocol, HasSubstr("field ID is not an integer")));
  EXPECT_THAT(client.DeletePrefix("/"),
              StatusIs(StatusCode::kProtocol, HasSubstr("field deleted")));
  EXPECT_THAT(client.LeaseKeepAlive(7), StatusIs(StatusCode::kProtocol, HasSubstr("\"result\"")));
}

TEST(HostileHttpTest, EtcdErrorsAreQuoted) {
  HostileServer not_found(Misbehaviour::kEtcdNotFound);
  EXPECT_THAT(ClientOf(not_found).Put("/k", "v", 7),
              StatusIs(StatusCode::kNotFound, HasSubstr("requested lease not found")));
  HostileServer html(Misbehaviour::kHtmlError);
  EXPECT_THAT(ClientOf(html).Put("/k", "v"),
              StatusIs(StatusCode::kUnavailable, HasSubstr("HTTP 500 without etcd's error")));
}

}  // namespace
}  // namespace weightcache::fleet
