#include "client/peer_caches.h"

#include <sys/stat.h>

#include <utility>

#include "identity/paths.h"

namespace weightcache::client {

Result<std::vector<PeerCache>> PeerCacheSockets(const ResolvedIdentity& identity) {
  std::vector<PeerCache> peers;
  const identity::CachePaths& paths = identity.paths;
  if (paths.namespace_dir.empty()) return peers;  // an explicit --socket: no layout
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> keys,
                               identity::ListDeviceKeys(paths.namespace_dir));
  const std::string name = identity.config.ShortDigest() + ".sock";
  for (const std::string& key : keys) {
    if (key == paths.device_key) continue;
    const std::string socket = paths.namespace_dir + "/" + key + "/" + name;
    struct stat st {};
    if (::lstat(socket.c_str(), &st) != 0) continue;  // no such cache there
    peers.push_back({key, socket});
  }
  return peers;
}

ResolvedIdentity PeerIdentity(const ResolvedIdentity& identity, const PeerCache& peer) {
  ResolvedIdentity theirs = identity;
  theirs.device_key = peer.device_key;
  theirs.paths.device_key = peer.device_key;
  theirs.paths.device_dir = peer.socket.substr(0, peer.socket.rfind('/'));
  theirs.paths.socket = peer.socket;
  theirs.paths.lock = identity::LockPathFor(peer.socket);
  theirs.paths.keeper_socket.clear();
  theirs.paths.keeper_lock.clear();
  return theirs;
}

Result<DaemonSession> ConnectPeer(const ResolvedIdentity& identity, const PeerCache& peer,
                                  std::chrono::milliseconds wait, const identity::Env& env) {
  DiscoveryPolicy policy;
  policy.wait_timeout = wait;
  policy.client_name = "weightcache-seed";
  WEIGHTCACHE_ASSIGN_OR_RETURN(Discovery found,
                               Discover(PeerIdentity(identity, peer), policy, nullptr, env));
  if (!found.session) {
    return Status(found.missing_code, "peer cache " + peer.socket + ": " + found.missing_reason);
  }
  return std::move(*found.session);
}

}  // namespace weightcache::client
