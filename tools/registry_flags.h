// The fleet registry's flags (docs/fleet.md) — one table for `serve`, `launch` and
// `fleet ls` — and ServeRegistration, serve's link from its daemon's events to a
// fleet::Registrar.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/content_anchor.h"
#include "common/mutex.h"
#include "daemon/daemon.h"
#include "fleet/arena_transfer.h"
#include "fleet/etcd_client.h"
#include "fleet/registrar.h"
#include "fleet/registry_entry.h"
#include "identity/cache_config.h"
#include "identity/resolve.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::cli {

// --fill-trust (docs/fleet.md "Fill"): "content" (the default) proves every filled file against
// our own checkpoint's SHA-256s (its content anchor) before ready, and fills nothing without an
// anchor or where the cache holds slices of tensors; "fleet" trusts the sources' checksums, with
// the disk sample the only check of the content (the behaviour before the anchor).
inline constexpr std::string_view kFillTrustContent = "content";
inline constexpr std::string_view kFillTrustFleet = "fleet";

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
  // The fill (docs/fleet.md "Fill"), either tier:
  std::string fill_from;   // --fill-from registry|HOST:PORT[,...]: fill before the disk
  std::string fill_serve;  // --fill-serve HOST:PORT: serve our arena to fillers once ready
  std::string fill_allow;  // --fill-allow ADDR|CIDR[,...]: who may fill from us
  // --fill-trust content|fleet: what a fill's bytes are proven against before ready (FillTrust).
  std::string fill_trust = std::string(kFillTrustContent);
  // --fill-content-sha256 FILE: the shards' SHA-256s pinned by the operator (sha256sum lines),
  // the content anchor of a checkpoint laid out other than a hub cache or a --local-dir download.
  std::string fill_content_sha256;
};

// kLaunch: serve's flags, which `launch` forwards to every daemon (RegistryServeArgs).
enum class RegistryFlagScope { kServe, kLaunch, kList };
// --registry --registry-ca --registry-cert --registry-key --registry-prefix
// --registry-timeout, and for kServe and kLaunch --registry-ttl --advertise --node-name
// --fill-from --fill-serve --fill-allow --fill-trust, and for every scope
// --fill-content-sha256 (it is part of the fleet key `fleet ls --model` computes).
void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope scope);

// The serve arguments of `flags` for the daemon of job rank `rank` of a launch:
// every flag given, TLS files made absolute, --advertise, --fill-serve and each source
// --fill-from lists made PORT + rank (launcher::AddrForRank): rank r of a source node serves
// at its PORT + r. Empty without any fleet flag. kInvalidArgument for what
// serve would refuse among the flags themselves (the rules of ServeRegistration::Create),
// so that launch refuses it before any daemon starts.
Result<std::vector<std::string>> RegistryServeArgs(const RegistryFlags& flags, int rank);

// The content anchor the fleet key holds and a fill proves against
// (checkpoint/content_anchor.h): --fill-content-sha256 when given, else what the checkpoint at
// `model_dir` records; none for a published cache (no checkpoint is read). `why_none` says why
// there is none. kInvalidArgument for a bad --fill-content-sha256 (or one given for a
// published cache).
struct FleetAnchor {
  std::shared_ptr<const checkpoint::ContentAnchor> anchor;  // null: none
  std::string why_none;
};
Result<FleetAnchor> LookUpFleetAnchor(const RegistryFlags& flags, const std::string& model_dir,
                                      const identity::CacheConfig& config);
// The fleet key of `config` with `anchor` (CacheConfig::FleetDigest of the anchor's digest).
std::string FleetKey(const identity::CacheConfig& config, const FleetAnchor& anchor);

// The etcd client the flags describe. kInvalidArgument for a bad URL or TLS combination.
Result<fleet::EtcdClient> RegistryClient(const RegistryFlags& flags);

// The registry's entries that a fill of `tier` on node `node` pulls from: the ready entries of
// that tier with an endpoint, other than the node's own, in the registry's order; when more
// than fleet::kMaxFetchSources are, that many chosen at random with `rng`, so that the joining
// nodes spread over the sources and no writer of the registry makes a filler connect to all of
// its entries. Empty when none is.
std::vector<fleet::RegistryEntry> ChooseFillSources(std::vector<fleet::RegistryEntry> entries,
                                                    Tier tier, std::string_view node,
                                                    std::mt19937_64& rng);

// Serve's registration of its cache (docs/fleet.md): Ready() registers it (and a promotion
// back to the gpu tier), Moved() follows a demotion or promotion, Draining() and the
// destructor withdraw it. Every method only hands the entry to the registrar's thread: none
// waits for etcd, so the daemon's event loop never does. Thread-safe. Without --registry
// (the fill flags alone: listed sources, an unregistered source) nothing is registered.
//
// With --fill-serve, Ready() also starts the fill source (a fleet::ArenaServer, the daemon's
// manifest as its blob) and advertises its endpoint (--advertise overrides it); Draining() and
// the destructor stop it after the entry is withdrawn. It serves read-only mappings of the
// store's sealed memfds (host tier), or the store's VMM allocations mapped into the device's
// primary context (gpu tier: from their creating handles where the store kept them, else an
// import of its fds; the context is held while it serves). A gpu-tier source stops
// serving when its cache is demoted (Moved to the host tier, before the ledger stops counting
// the GPU memory it mapped) and serves again once it is promoted back. An upgrade stops it
// before the successor starts (HandingOver) and starts it again if the upgrade fails
// (HandoverFailed). With --fill-from,
// Filler() is the load's fill (weight_store.h), of host or device memory as the tier is.
class ServeRegistration {
 public:
  // nullptr without --registry and --fill-from/--fill-serve. kInvalidArgument for bad flags
  // (URL, TLS files, TTL, prefix, node name, --advertise, --fill-from neither "registry"
  // (which needs --registry) nor a HOST:PORT list, --fill-serve without --fill-allow or the
  // reverse, a bad allow-list).
  // `model_dir`: the checkpoint the daemon serves, whose content anchor goes into the fleet key
  // (LookUpFleetAnchor; the anchor's source is logged).
  static Result<std::unique_ptr<ServeRegistration>> Create(const RegistryFlags& flags,
                                                           const identity::ResolvedIdentity& id,
                                                           const std::string& model_dir);
  ~ServeRegistration();

  // --fill-from registry: looks up ready sources of our fleet key and tier (not this node);
  // --fill-from HOST:PORT,...: those; and pulls from them with fleet::FetchArena into host or
  // device memory. Empty without --fill-from. Under --fill-trust content its outcome carries
  // our content anchor (the loader proves the bytes against it before ready), and it fails at
  // once, contacting nobody, with kUnavailable "not attempted" saying why and naming the ways
  // out, when there is no anchor or the load holds slices of tensors
  // (PeerFillRequest::holds_whole_files): the loader logs it and reads the disk.
  daemon::PeerFill Filler() const;

  // Whether Ready() starts a fill source (--fill-serve): the load then keeps the gpu tier's
  // creating handles (daemon::LoadOptions::keep_creating_handles).
  bool ServesFill() const { return !flags_.fill_serve.empty(); }

  // `fds`: the store's allocation fds (Daemon::StoreFds), borrowed for the call; the fill
  // source maps them. `creating_handles` (Daemon::StoreCreatingHandles, borrowed; empty when
  // the store keeps none): a gpu-tier source maps those instead, so that UCX's cuda_ipc can
  // export its memory to a peer on this host (an import of the fds cannot be exported again:
  // docs/fleet.md "Two daemons on one GPU").
  void Ready(const daemon::StoreSummary& summary, std::span<const int> fds,
             std::span<const CUmemGenericAllocationHandle> creating_handles = {});
  // The cache's memory is now in `tier` (--demote host), in `fds` (borrowed for the call).
  void Moved(Tier tier, std::span<const int> fds);
  void Draining();
  // An upgrade: the fill source stops before the successor starts (it binds the same
  // --fill-serve address: a fixed port would be taken), and starts again over `fds` when the
  // successor did not take over. The entry is the successor's to publish.
  void HandingOver();
  void HandoverFailed(std::span<const int> fds,
                      std::span<const CUmemGenericAllocationHandle> creating_handles = {});

  // The fill source's server and the memory it serves (defined in registry_flags.cc).
  struct FillSource;

 private:
  ServeRegistration(std::unique_ptr<fleet::Registrar> registrar, fleet::RegistryEntry entry,
                    Tier configured, std::optional<identity::DeviceInfo> device,
                    RegistryFlags flags, fleet::PeerAllowList allow, FleetAnchor anchor);
  void PublishLocked() WEIGHTCACHE_REQUIRES(mu_);
  // Starts the fill source over `fds` when --fill-serve is given and none runs (a failure is
  // logged: the cache serves on without one).
  void StartFillSourceLocked(std::span<const int> fds,
                             std::span<const CUmemGenericAllocationHandle> creating_handles)
      WEIGHTCACHE_REQUIRES(mu_);
  void StopFillSource();

  std::unique_ptr<fleet::Registrar> registrar_;
  const RegistryFlags flags_;
  const fleet::PeerAllowList allow_;
  mutable Mutex mu_;
  // The fill source (--fill-serve) once ready.
  std::unique_ptr<FillSource> fill_ WEIGHTCACHE_GUARDED_BY(mu_);
  fleet::RegistryEntry entry_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool ready_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  // The ready store's encoded manifest (what the fill source sends in its hello), kept for a
  // gpu-tier source started again after a promotion.
  std::vector<uint8_t> manifest_ WEIGHTCACHE_GUARDED_BY(mu_);
  const Tier configured_;
  const std::optional<identity::DeviceInfo> device_;  // the gpu tier's device
  const FleetAnchor anchor_;                          // in the fleet key; a fill proves it
};

}  // namespace weightcache::cli
