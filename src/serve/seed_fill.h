// `serve --seed-from auto|SOCKET` (docs/seeding.md): the load's fill (daemon::PeerFill) from a
// peer cache — the same identity on another device of this node (client/peer_caches.h) —
// instead of the checkpoint. The loader checks what it brings exactly as it checks a fill from
// the fleet (daemon/peer_fill.h: the peer's manifest against our plan, every tensor's checksum
// over our own memory, a sample of our own checkpoint, the gaps zeroed) and reads the disk when
// anything fails.
//
// How the bytes move, tier by tier, is client/peer_copy.h (PeerCopier): the driver is called
// there, never here. What is left here joins the daemon's fill (daemon::PeerFill) to the
// client's discovery, siblings that include neither the other: the composition root above both
// (docs/design.md "Target layout") does that.
//
// Contract: "auto" tries every peer cache in device-key order until one seeds us; SOCKET tries
// that one (a cache of our exact config, e.g. in another runtime dir). A peer that is missing,
// loading past the wait, of another config (kMismatch) or whose copy fails is skipped, with its
// reason in the error when none is left. Every input is the peer's and untrusted: its config is
// compared by discovery, its manifest by accept(), its bytes by the loader's checks.
#pragma once

#include <chrono>
#include <string>

#include "daemon/weight_store.h"
#include "identity/env.h"
#include "identity/resolve.h"
#include "weightcache/status.h"

namespace weightcache::serve {

// kInvalidArgument unless `seed_from` is "", "auto" or an absolute socket path.
Status CheckSeedFrom(const std::string& seed_from);

// The load's fill from peer caches; empty for an empty `seed_from`. `wait`: how long a peer
// that is still loading is waited for.
daemon::PeerFill SeedFiller(const identity::ResolvedIdentity& identity, std::string seed_from,
                            std::chrono::milliseconds wait,
                            identity::Env env = identity::Env::Default());
// (`env` gives the CUDA driver too: a test's fake, tests/unit/daemon/gpu_seed_test.cc.)

// `first`, and when it fails (logged) `second`: seeding before the fleet's fill. The manifest
// `first` accepted is forgotten before `second` runs (PeerFillRequest::forget_accepted). Either
// may be empty; both empty gives an empty fill.
daemon::PeerFill FirstFillOf(daemon::PeerFill first, daemon::PeerFill second);

}  // namespace weightcache::serve
