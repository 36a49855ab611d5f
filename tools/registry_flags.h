// The fleet registry's flags (docs/fleet.md, docs/cli.md) — one table for `serve` and
// `fleet ls` — and ServeRegistration, serve's link from its daemon's events to a
// fleet::Registrar.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "daemon/daemon.h"
#include "fleet/etcd_client.h"
#include "fleet/registrar.h"
#include "fleet/registry_entry.h"
#include "identity/resolve.h"
#include "weightcache/status.h"

namespace weightcache::cli {

struct RegistryFlags {
  std::string url;  // --registry etcd://HOST:PORT[,...] | etcds://...; "" = no registry
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string prefix = std::string(fleet::kDefaultRegistryPrefix);
  double timeout_s = 3;
  // serve only:
  int ttl_s = 10;
  std::string advertise;  // HOST:PORT of the transport; "" until one serves
  std::string node_name;  // "" = the hostname
};

enum class RegistryFlagScope { kServe, kList };
// --registry --registry-ca --registry-cert --registry-key --registry-prefix
// --registry-timeout, and for kServe --registry-ttl --advertise --node-name.
void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope scope);

// The etcd client the flags describe. kInvalidArgument for a bad URL or TLS combination.
Result<fleet::EtcdClient> RegistryClient(const RegistryFlags& flags);

// Serve's registration of its cache (docs/fleet.md): Ready() registers it (and a promotion
// back to the gpu tier), Moved() follows a demotion or promotion, Draining() and the
// destructor withdraw it. Every method only hands the entry to the registrar's thread: none
// waits for etcd, so the daemon's event loop never does. Thread-safe.
class ServeRegistration {
 public:
  // nullptr when flags.url is empty. kInvalidArgument for bad flags (URL, TLS files, TTL,
  // prefix, node name, --advertise).
  static Result<std::unique_ptr<ServeRegistration>> Create(const RegistryFlags& flags,
                                                           const identity::ResolvedIdentity& id);
  ~ServeRegistration();

  void Ready(const daemon::StoreSummary& summary);
  void Moved(Tier tier);  // the cache's memory is now in `tier` (--demote host)
  void Draining();

 private:
  ServeRegistration(std::unique_ptr<fleet::Registrar> registrar, fleet::RegistryEntry entry,
                    Tier configured)
      : registrar_(std::move(registrar)), entry_(std::move(entry)), configured_(configured) {}
  void PublishLocked() WEIGHTCACHE_REQUIRES(mu_);

  std::unique_ptr<fleet::Registrar> registrar_;
  Mutex mu_;
  fleet::RegistryEntry entry_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool ready_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  const Tier configured_;
};

}  // namespace weightcache::cli
