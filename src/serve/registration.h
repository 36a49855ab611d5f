// Serve's part in the fleet (docs/fleet.md): the registration of its cache in the fleet registry,
// the fill from other nodes before the disk, and the fill source it serves them once ready —
// all from serve::FleetOptions.
//
// One header for both builds (the optional-feature pattern, docs/design.md "Target layout"):
// CMake compiles registration.cc where the fleet is built (WEIGHTCACHE_FLEET: libcurl and UCX),
// else registration_not_built.cc, which refuses every fleet option that is set with kUnavailable
// naming the option and what the build lacked, before anything starts. Their library,
// wc_serve_process, is linked by the CLI and the fleet's tests, never by weightcache_core (UCX's
// hooks must stay out of the SDK and the extension: docs/fleet.md "UCX in the process").
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "daemon/daemon.h"
#include "identity/resolve.h"
#include "serve/fleet_options.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::serve {

// Whether this build has the fleet (the flag table says so in each flag's help when not).
bool FleetBuilt();

// kUnavailable: `what` needs the fleet, which this build lacks (the one message of it, naming
// what the build needs). Defined only in registration_not_built.cc: its callers (and
// CheckFleetOptions there) are compiled only in a build without the fleet.
Status FleetNotBuilt(std::string_view what);

// The rules between the options, for serve and for launch before it starts any daemon:
// kInvalidArgument naming the flag (--fill-from neither "registry" (which needs --registry) nor
// a HOST:PORT list, --fill-serve without --fill-allow or the reverse, a bad allow-list,
// --fill-trust without --fill-from, a wildcard --fill-serve registered without --advertise, …).
// Without the fleet: kUnavailable for the first option set.
Status CheckFleetOptions(const FleetOptions& options);

// The options of the daemon of job rank `rank` of a launch: the TLS and anchor files made
// absolute (the daemons need not share our working directory), --advertise, --fill-serve and
// each source --fill-from lists made PORT + rank (launcher::AddrForRank): rank r of a source node
// serves at its PORT + r. CheckFleetOptions's refusals first.
Result<FleetOptions> FleetOptionsForRank(const FleetOptions& options, int rank);

// Serve's registration of its cache: Ready() registers it (and a promotion back to the gpu
// tier), Moved() follows a demotion or promotion, Draining() and the destructor withdraw it.
// Every method only hands the entry to the registrar's thread: none waits for etcd, so the
// daemon's event loop never does. Thread-safe. Without --registry (the fill options alone:
// listed sources, an unregistered source) nothing is registered.
//
// With --fill-serve, Ready() also starts the fill source (a fleet::ArenaServer, the daemon's
// manifest as its blob) and advertises its endpoint (--advertise overrides it); Draining() and
// the destructor stop it after the entry is withdrawn. It serves read-only mappings of the
// store's sealed memfds (host tier), or the store's VMM allocations mapped into the device's
// primary context (gpu tier: from their creating handles where the store kept them, else an
// import of its fds; the context is held while it serves). A gpu-tier source stops serving
// when its cache is demoted (Moved to the host tier, before the ledger stops counting the GPU
// memory it mapped) and serves again once it is promoted back. An upgrade stops it before the
// successor starts (HandingOver) and starts it again if the upgrade fails (HandoverFailed).
// With --fill-from, Filler() is the load's fill (weight_store.h), of host or device memory as
// the tier is.
class Registration {
 public:
  // nullptr without --registry and --fill-from/--fill-serve. CheckFleetOptions's refusals, and
  // kInvalidArgument for a bad URL, TLS file, node name or --advertise. `model_dir`: the
  // checkpoint the daemon serves, whose content anchor goes into the fleet key (its source is
  // logged).
  static Result<std::unique_ptr<Registration>> Create(const FleetOptions& options,
                                                      const identity::ResolvedIdentity& id,
                                                      const std::string& model_dir);
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

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
  bool ServesFill() const;

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

  class Impl;  // registration.cc's (registration_not_built.cc never makes one)

 private:
  explicit Registration(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightcache::serve
