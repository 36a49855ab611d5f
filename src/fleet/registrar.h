// Registrar — keeps one cache's RegistryEntry in etcd under a lease, from its own thread
// (docs/fleet.md, "Registry").
//
// Publish(entry) starts it: a lease of `ttl` is granted, the entry put with it, and the lease
// renewed every ttl/3. A later Publish (a state change: demoted, ready again, draining) puts
// the new value under the same lease. Withdraw() asks the thread to revoke the lease (the
// entry is gone at once) and end; Stop() also waits for it. A process killed -9 leaves the
// entry to the lease's expiry, at most `ttl` later.
//
// A registry problem never stops or delays the cache: every etcd call runs on the
// registrar's thread, bounded by the client's timeout. When etcd is unreachable it logs a
// warning (once per outage), retries with a backoff (250 ms doubling, at most ttl/3), and when
// etcd answers that the lease is gone (it expired during the outage) it grants a new one and
// puts the entry again; an etcd restarted on its data dir keeps its leases, and the old one is
// simply renewed. Publish and Withdraw only take a mutex and notify.
//
// Thread-safety: every public method may be called from any thread. The destructor Stop()s.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "fleet/etcd_client.h"
#include "fleet/registry_entry.h"
#include "weightcache/status.h"

namespace weightcache::fleet {

struct RegistrarOptions {
  std::string prefix = std::string(kDefaultRegistryPrefix);
  std::chrono::seconds ttl{10};
  std::chrono::milliseconds min_backoff{250};
};

class Registrar {
 public:
  // kInvalidArgument for a bad prefix or a TTL below 1 s. Starts no thread and calls no etcd.
  static Result<std::unique_ptr<Registrar>> Create(EtcdClient client, RegistrarOptions options);
  ~Registrar();
  Registrar(const Registrar&) = delete;
  Registrar& operator=(const Registrar&) = delete;

  // Registers `entry` (the first call starts the thread) or replaces the registered value.
  // kInvalidArgument when the entry does not Validate(), or names another key than the first
  // one published (fleet key, node and digest are fixed for a registrar's life).
  Status Publish(RegistryEntry entry);
  // The thread revokes the lease and ends; returns at once. Publish is ignored afterwards.
  void Withdraw();
  // Withdraw, then wait for the thread (its last etcd call is bounded by the client timeout).
  void Stop();

  // The lease the entry is under now, 0 when none (not yet registered, or lost): for tests
  // and logs.
  int64_t lease() const { return lease_.load(); }

 private:
  Registrar(EtcdClient client, RegistrarOptions options)
      : client_(std::move(client)), options_(std::move(options)) {}
  void Run();

  const EtcdClient client_;
  const RegistrarOptions options_;

  Mutex mu_;
  std::condition_variable_any wake_;  // over mu_: Publish, Withdraw
  RegistryEntry entry_ WEIGHTCACHE_GUARDED_BY(mu_);
  std::string key_ WEIGHTCACHE_GUARDED_BY(mu_);
  uint64_t version_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;  // bumped by each Publish
  bool withdraw_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> lease_{0};
  std::thread thread_ WEIGHTCACHE_GUARDED_BY(mu_);  // started by the first Publish
};

}  // namespace weightcache::fleet
