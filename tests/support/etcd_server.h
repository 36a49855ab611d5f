// EtcdServer — a real etcd (Debian's etcd-server) that a test starts on 127.0.0.1, on free
// ports, with its data in a temp dir, and kills at teardown (docs/fleet.md's tests).
//
//  * EtcdServer::Start(): spawned, then polled (a range request every 50 ms, at most 30 s)
//    until it answers; kUnavailable "etcd is not installed" when /usr/bin/etcd (or `etcd` on
//    PATH) is absent, so that a test can GTEST_SKIP naming the binary.
//  * Kill() SIGKILLs it; Restart() starts it again on the same ports and data dir (leases and
//    keys survive, as on a real restart).
//  * Not thread-safe: one test drives it.
#pragma once

#include <memory>
#include <string>

#include "fleet/etcd_client.h"
#include "support/child_process.h"
#include "support/test_env.h"

namespace weightcache::testing {

// The etcd binary, or "" when it is not installed.
std::string EtcdBinary();

// A TCP port on 127.0.0.1 that was free a moment ago (bound to :0, read, closed).
int FreeLoopbackPort();

// kTls: https with a test CA made by the openssl CLI, a server certificate for 127.0.0.1 and
// client certificates required (--client-cert-auth); tls_files() names them.
enum class EtcdTransport { kPlain, kTls };

class EtcdServer {
 public:
  // kUnavailable (naming the binary) when etcd, or for kTls the openssl CLI, is absent.
  static Result<std::unique_ptr<EtcdServer>> Start(EtcdTransport transport = EtcdTransport::kPlain);
  ~EtcdServer() = default;

  const std::string& endpoint() const { return endpoint_; }  // "http(s)://127.0.0.1:PORT"
  std::string host_port() const { return "127.0.0.1:" + std::to_string(client_port_); }
  std::string url() const { return (tls_ ? "etcds://" : "etcd://") + host_port(); }
  // The test CA, and a client certificate and key it signed (kTls).
  const fleet::EtcdTls& tls_files() const { return tls_files_; }
  // A client of this server (with the client certificate for kTls).
  fleet::EtcdClient Client() const;
  std::string Log() const;

  void Kill();
  Status Restart();

 private:
  EtcdServer() = default;
  Status Spawn();
  Status MakeCertificates();

  TempDir dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  std::string endpoint_;
  bool tls_ = false;
  fleet::EtcdTls tls_files_;
  std::unique_ptr<TestChild> child_;
};

// For a fixture's SetUp or a test body: the started server; nullptr after a GTEST_SKIP naming
// the binary when etcd (or, for kTls, openssl) is not installed, or after a test failure when
// it is installed but does not start. With WEIGHTCACHE_REQUIRE_TOOLS set (ToolsRequired(),
// test_env.h), a missing binary is a failure too, so CI can never skip these tests.
std::unique_ptr<EtcdServer> StartEtcdOrSkip(EtcdTransport transport = EtcdTransport::kPlain);

}  // namespace weightcache::testing
