#include "support/etcd_server.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "common/unique_fd.h"
#include "support/test_env.h"

namespace weightcache::testing {

std::string EtcdBinary() {
  for (const char* candidate : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (::access(candidate, X_OK) == 0) return candidate;
  }
  return "";
}

int FreeLoopbackPort() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return 0;
  }
  return ntohs(addr.sin_port);
}

Result<std::unique_ptr<EtcdServer>> EtcdServer::Start(EtcdTransport transport) {
  if (EtcdBinary().empty()) {
    return Status(StatusCode::kUnavailable, "etcd is not installed (/usr/bin/etcd, etcd-server)");
  }
  std::unique_ptr<EtcdServer> server(new EtcdServer());
  if (transport == EtcdTransport::kTls) {
    if (::access("/usr/bin/openssl", X_OK) != 0) {
      return Status(StatusCode::kUnavailable,
                    "the openssl CLI is not installed (/usr/bin/openssl)");
    }
    server->tls_ = true;
    WEIGHTCACHE_RETURN_IF_ERROR(server->MakeCertificates());
  }
  server->client_port_ = FreeLoopbackPort();
  server->peer_port_ = FreeLoopbackPort();
  if (server->client_port_ == 0 || server->peer_port_ == 0) {
    return InternalError("no free loopback port for etcd");
  }
  server->endpoint_ = (server->tls_ ? "https://" : "http://") + server->host_port();
  WEIGHTCACHE_RETURN_IF_ERROR(server->Spawn());
  return server;
}

fleet::EtcdClient EtcdServer::Client() const {
  fleet::EtcdOptions options;
  options.endpoints = {endpoint_};
  options.tls = tls_files_;
  return *fleet::EtcdClient::Create(options);
}

Status EtcdServer::MakeCertificates() {
  const std::string d = dir_.path() + "/";
  // clientAuth too: etcd's gateway dials its own gRPC port with the server's certificate.
  WriteFile(d + "server.ext",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n");
  WriteFile(d + "client.ext", "extendedKeyUsage=clientAuth\n");
  const std::string openssl = "/usr/bin/openssl";
  const std::vector<std::vector<std::string>> steps = {
      {openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d + "ca.key", "-out",
       d + "ca.pem", "-days", "2", "-subj", "/CN=weightcache-test-ca"},
      {openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", d + "server.key", "-out",
       d + "server.csr", "-subj", "/CN=127.0.0.1"},
      {openssl, "x509", "-req", "-in", d + "server.csr", "-CA", d + "ca.pem", "-CAkey",
       d + "ca.key", "-CAcreateserial", "-out", d + "server.pem", "-days", "2", "-extfile",
       d + "server.ext"},
      {openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", d + "client.key", "-out",
       d + "client.csr", "-subj", "/CN=node-a"},
      {openssl, "x509", "-req", "-in", d + "client.csr", "-CA", d + "ca.pem", "-CAkey",
       d + "ca.key", "-CAcreateserial", "-out", d + "client.pem", "-days", "2", "-extfile",
       d + "client.ext"},
  };
  for (const auto& step : steps) {
    const CommandResult r = RunCommand(step);
    if (r.exit_code != 0) return InternalError("openssl " + step[1] + " failed: " + r.err);
  }
  tls_files_ = {d + "ca.pem", d + "client.pem", d + "client.key"};
  return Status::Ok();
}

std::string EtcdServer::Log() const { return child_ ? child_->Log() : ""; }

Status EtcdServer::Spawn() {
  const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  ChildSpec spec;
  spec.argv = {EtcdBinary(),
               "--name=t",
               "--data-dir=" + dir_.Join("data"),
               "--listen-client-urls=" + endpoint_,
               "--advertise-client-urls=" + endpoint_,
               "--listen-peer-urls=" + peer,
               "--initial-advertise-peer-urls=" + peer,
               "--initial-cluster=t=" + peer};
  if (tls_) {
    const std::string d = dir_.path() + "/";
    spec.argv.insert(spec.argv.end(),
                     {"--cert-file=" + d + "server.pem", "--key-file=" + d + "server.key",
                      "--trusted-ca-file=" + d + "ca.pem", "--client-cert-auth"});
  }
  // The Debian package reads ETCD_* variables too: none of the host's may leak in.
  spec.env_overrides = {
      "ETCD_UNSUPPORTED_ARCH=", "http_proxy=", "https_proxy=", "HTTP_PROXY=", "HTTPS_PROXY="};
  spec.log_path = dir_.Join("etcd.log");
  WEIGHTCACHE_ASSIGN_OR_RETURN(TestChild child, TestChild::Spawn(spec));
  child_ = std::make_unique<TestChild>(std::move(child));
  const fleet::EtcdClient client = Client();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  Status last;
  while (std::chrono::steady_clock::now() < until) {
    auto up = client.RangePrefix("/");
    if (up.ok()) return Status::Ok();
    last = up.status();
    if (auto code = child_->WaitExit(std::chrono::milliseconds(50)); code.has_value()) {
      return InternalError("etcd exited (" + child_->DescribeExit() + "): " + child_->Log());
    }
  }
  return Status(StatusCode::kTimeout,
                "etcd did not answer within 30 s: " + last.ToString() + "\n" + child_->Log());
}

void EtcdServer::Kill() {
  if (child_) child_->Kill();
  child_.reset();
}

Status EtcdServer::Restart() {
  Kill();
  return Spawn();
}

std::unique_ptr<EtcdServer> StartEtcdOrSkip(EtcdTransport transport) {
  auto server = EtcdServer::Start(transport);
  if (server.ok()) return std::move(server).value();
  if (server.status().code() == StatusCode::kUnavailable && !ToolsRequired()) {
    // GTEST_SKIP returns (void) from its function: a lambda records the skip, we return null.
    [&] {
      GTEST_SKIP() << "needs the etcd binary (Debian etcd-server): " << server.status().message();
    }();
    return nullptr;
  }
  ADD_FAILURE() << server.status().ToString();
  return nullptr;
}

}  // namespace weightcache::testing
