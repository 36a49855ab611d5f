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

class EtcdServer {
 public:
  static Result<std::unique_ptr<EtcdServer>> Start();
  ~EtcdServer() = default;

  const std::string& endpoint() const { return endpoint_; }  // "http://127.0.0.1:PORT"
  std::string host_port() const { return "127.0.0.1:" + std::to_string(client_port_); }
  std::string url() const { return "etcd://" + host_port(); }  // for --registry
  fleet::EtcdClient Client() const;
  std::string Log() const;

  void Kill();
  Status Restart();

 private:
  EtcdServer() = default;
  Status Spawn();

  TempDir dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  std::string endpoint_;
  std::unique_ptr<TestChild> child_;
};

}  // namespace weightcache::testing
