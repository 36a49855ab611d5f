// The daemon under systemd (docs/keeper.md, "Under systemd"): readiness and status through
// sd_notify, and the cache's fds kept in the service manager's fd store, which outlives the
// daemon as the keeper would. The ServiceManager is the seam over libsystemd; FdStore is the
// policy (what is deposited under which names, how it is re-adopted, when it is removed).
//
// Names in the fd store (one FDSTORE=1 message per fd, FDNAME= naming it):
//   wc-deposit    a sealed memfd holding the keeper's Deposit frame (header and DepositInfo
//                 payload, docs/protocol.md §8): the config digest, the depositor, the counts
//   wc-manifest   the manifest memfd clients attach with
//   wc-alloc-N    allocation N (a sealed memfd on the host tier, a VMM fd on the gpu tier)
//
// Rules (each lives here only):
//  * Only a complete load is deposited, before READY=1: a crash during loading leaves nothing.
//  * Re-adoption (LISTEN_FDS / LISTEN_FDNAMES with those names) rebuilds the Deposit frame from
//    the fds and runs the same checks as the keeper and the upgrade: protocol::DecodeHandoff
//    (fd kinds, sizes, seals, the manifest) and ValidateKeptHandoff (keeper_link.h: identity,
//    checkpoint as it is now, checksums). Any failure sends FDSTOREREMOVE=1 for every wc- name
//    and the daemon loads from the checkpoint (then deposits anew).
//  * A deliberate stop removes them (FDSTOREREMOVE=1): the memory is freed once no client maps
//    it. An upgrade keeps them: the successor serves the same memory.
//  * Fds with other names are closed unread; a name given twice refuses the adoption.
//
// Thread-safety: ServiceManager implementations are thread-safe (each Notify is one datagram).
// FdStore's Adopt runs once, on the loader thread, before any other FdStore call but Notify.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/keeper_link.h"
#include "daemon/weight_store.h"
#include "identity/cache_config.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// One fd the service manager passed at start (LISTEN_FDS), with its LISTEN_FDNAMES name.
struct NamedFd {
  std::string name;
  UniqueFd fd;
};

// The seam over libsystemd.
class ServiceManager {
 public:
  virtual ~ServiceManager() = default;
  // One notification: `state` is newline-separated assignments ("READY=1\nSTATUS=…"), `fds`
  // (borrowed) travel with it. kUnavailable when it cannot be sent.
  virtual Status Notify(std::string_view state, std::span<const int> fds) = 0;
};

// What `serve` finds in its environment (call it once, early, on the main thread):
//  * NOTIFY_SOCKET unset or empty: std::nullopt (no service manager; the keeper is used);
//  * set, built with libsystemd: the manager, and the fds of LISTEN_FDS whose LISTEN_PID is
//    ours (CLOEXEC set, the LISTEN_* variables removed from the environment);
//  * set, built without systemd: kUnavailable "built without systemd (WEIGHTCACHE_SYSTEMD=OFF)".
struct ServiceEnvironment {
  std::shared_ptr<ServiceManager> manager;
  std::vector<NamedFd> listened;
};
Result<std::optional<ServiceEnvironment>> ServiceManagerFromEnvironment();

// True when this build links libsystemd.
bool BuiltWithSystemd();

// The fd store names of a deposit of `allocations` allocations.
inline constexpr std::string_view kFdNameDeposit = "wc-deposit";
inline constexpr std::string_view kFdNameManifest = "wc-manifest";
std::string FdNameAllocation(size_t index);  // "wc-alloc-<index>"

class FdStore {
 public:
  explicit FdStore(ServiceEnvironment env) : env_(std::move(env)) {}

  // The fds the service manager passed, validated (the rules above), or std::nullopt: none
  // passed, or a validation failure (logged; FDSTOREREMOVE sent). `gpu` as for AdoptFromKeeper.
  std::optional<AdoptedStore> Adopt(const identity::CacheConfig& config,
                                    const std::string& model_path, const KeeperLinkOptions& verify,
                                    const GpuAdoptContext* gpu);

  // Deposits a complete store (one FDSTORE=1 message per fd, the deposit description first).
  Status Deposit(const identity::CacheConfig& config, const WeightStore& store);

  // FDSTOREREMOVE=1 for every name this daemon deposited or was passed, and for the names of a
  // store of `allocations` allocations (an upgrade's successor serves a store it neither
  // deposited nor was passed).
  Status Remove(size_t allocations = 0);

  Status Notify(std::string_view state) { return env_.manager->Notify(state, {}); }

 private:
  ServiceEnvironment env_;
  size_t max_allocations_ = 0;  // the highest allocation count deposited or passed
};

}  // namespace weightcache::daemon
