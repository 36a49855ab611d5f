// Peer caches (docs/seeding.md): the caches of the same identity on the other devices of this
// node, which a new cache can be seeded from instead of reading its checkpoint (`serve
// --seed-from auto`). A peer has our config exactly (the same digest: model, files, ranks,
// dtype, tier…) and lives in the same runtime dir and namespace, under another device key:
//
//   <runtime>/<namespace>/<other device key>/<our digest[:16]>.sock
//
// The namespace is part of it on purpose: two jobs in different namespaces never see each
// other's caches, so they never seed from each other either.
//
// Contract: PeerCacheSockets only lists paths (sorted by device key; our own device key never
// among them); it trusts nothing it finds. ConnectPeer runs the client's discovery against one
// of them (client/discovery.h: the socket's owner, the lock, the daemon's credentials, our own
// comparison of its config, its readiness) and returns its attach, or why not — a peer of
// another config is kMismatch naming every field, a dead or loading one is kNoDaemon/kTimeout.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "client/discovery.h"
#include "identity/env.h"
#include "identity/resolve.h"
#include "weightcache/status.h"

namespace weightcache::client {

struct PeerCache {
  std::string device_key;  // "GPU-…", "MIG-…" or "host"
  std::string socket;
};

// The sockets named as our cache under every other device key of our namespace that exist
// (whatever they are: ConnectPeer checks). Empty for an explicit --socket identity (it has no
// layout to look in). An unreadable namespace dir is an error naming it.
Result<std::vector<PeerCache>> PeerCacheSockets(const ResolvedIdentity& identity);

// Our identity with the peer's paths: what discovery needs to reach `peer` and check it.
ResolvedIdentity PeerIdentity(const ResolvedIdentity& identity, const PeerCache& peer);

// Discovery of `peer` with our config, within `wait`. A peer that is not ready (loading,
// demoted to host RAM, draining) is kUnavailable without an attach, so that seeding never
// promotes a demoted peer. The session holds the peer's attach (manifest and allocation fds):
// ours to map.
Result<DaemonSession> ConnectPeer(const ResolvedIdentity& identity, const PeerCache& peer,
                                  std::chrono::milliseconds wait,
                                  const identity::Env& env = identity::Env::Default());

}  // namespace weightcache::client
