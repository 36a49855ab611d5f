// Copying a peer cache's memory into ours (`serve --seed-from`, docs/seeding.md): the bytes of
// a seed, once the peer is attached (client/peer_caches.h: ConnectPeer) and its manifest
// accepted. What the copy brings is checked by the loader afterwards, exactly as a fill from
// the fleet is (daemon/peer_fill.h); nothing here trusts the peer beyond the sizes of its
// attach.
//
// How the bytes move:
//  * gpu tier: the peer's allocations (the fds of its attach) are imported and mapped in our
//    device's primary context — peer access when the peer is another GPU, asked of the driver
//    (cuDeviceCanAccessPeer) by Create(), before the peer is attached — and copied device to
//    device (cuMemcpyDtoDAsync: NVLink or PCIe peer-to-peer, or one device's own copy engines
//    when the peer is a cache of the same GPU);
//  * host tier: the peer's sealed memfds are mapped read-only and pwritten into ours by threads
//    (shmem allocates inside the write, no page fault per page).
//
// Contract: a PeerCopier is for one peer and one copy; it holds no resource (the driver table
// is the Env's). Copy() runs on the loader's thread (gpu tier: our context current there),
// reports progress and polls the cancel flag between pieces; a cancelled copy is kUnavailable
// "seed: cancelled", and an error leaves our allocations holding partial data.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>

#include "client/discovery.h"
#include "client/peer_caches.h"
#include "cuda/driver_api.h"
#include "identity/env.h"
#include "identity/resolve.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache::client {

// What a copy from a peer writes, and how it reports and stops (the load's fill request,
// daemon::PeerFillRequest, in the client's terms; its references must outlive Copy()).
struct PeerCopyTarget {
  // Our allocations in this process: device addresses (gpu tier) or our mappings (host tier),
  // parallel to the peer's.
  std::span<const std::span<uint8_t>> allocations;
  // Host tier: each allocation's memfd, written with pwrite. Empty on the gpu tier.
  std::span<const int> fds;
  // The bytes copied so far, of all allocations, from a copying thread.
  const std::function<void(uint64_t done, uint64_t total)>& progress;
  const std::atomic<bool>* cancel = nullptr;  // or null: once true the copy stops and fails
};

class PeerCopier {
 public:
  // Before `peer` is attached. Host tier: nothing to check. Gpu tier: our device (the driver
  // from `env`, the device of `identity`, resolved once), and whether it can read the memory
  // of the peer's GPU, which its device key names: our own GPU can; another needs peer access
  // (cuDeviceCanAccessPeer: NVLink or PCIe P2P) and must be visible to this process; a key
  // that is no GPU UUID (an explicit socket outside the runtime dir's layout) is left to the
  // mapping. kUnavailable naming both GPUs when they cannot reach each other (there is no
  // staged copy through host memory: it is the peer's skip reason, docs/seeding.md);
  // kInternal for a gpu-tier identity without its device.
  static Result<PeerCopier> Create(const ResolvedIdentity& identity, Tier tier,
                                   const PeerCache& peer, const identity::Env& env);

  // The peer's bytes (`session`'s attach, its allocations as many as `target`'s; the fds are
  // taken on the gpu tier) into `target`, piece by piece.
  Status Copy(DaemonSession& session, const PeerCopyTarget& target) const;

 private:
  PeerCopier(Tier tier, std::string device_key) : tier_(tier), device_key_(std::move(device_key)) {}

  Tier tier_ = Tier::kHost;
  std::string device_key_;                // ours: what a failed mapping names
  const cuda::DriverApi* api_ = nullptr;  // gpu tier
  CUdevice device_ = 0;                   // gpu tier: ours
};

}  // namespace weightcache::client
