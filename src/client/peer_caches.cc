#include "client/peer_caches.h"

#include <sys/stat.h>

#include <string>
#include <utility>

#include "identity/paths.h"
#include "protocol/messages.h"

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
  const ResolvedIdentity theirs = PeerIdentity(identity, peer);
  // A look first, without an Attach (the same trust and config checks): an attach to a demoted
  // peer would promote it back to its GPU, perhaps evicting other caches under its budget, for
  // our copy. Only a ready peer is attached. (A peer demoted between the look and the attach
  // is promoted: the window is one round trip.)
  {
    auto look = ConnectPublisher(theirs, policy, env);
    if (!look.ok()) {
      if (look.status().code() == StatusCode::kNoDaemon) {
        return Status(StatusCode::kNoDaemon, "peer cache " + peer.socket + ": no live daemon");
      }
      return look.status();
    }
    if (look->hello.state != protocol::CacheState::kReady) {
      return Status(StatusCode::kUnavailable,
                    "peer cache " + peer.socket + " is " +
                        std::string(protocol::CacheStateName(look->hello.state)) +
                        ": only a ready cache seeds");
    }
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(Discovery found, Discover(theirs, policy, nullptr, env));
  if (!found.session) {
    return Status(found.missing_code, "peer cache " + peer.socket + ": " + found.missing_reason);
  }
  return std::move(*found.session);
}

}  // namespace weightcache::client
