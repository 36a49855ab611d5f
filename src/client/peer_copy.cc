#include "client/peer_copy.h"

#include <algorithm>
#include <mutex>
#include <thread>
#include <utility>

#include "cuda/imported_arena.h"
#include "cuda/upload_resources.h"
#include "identity/device_inventory.h"
#include "os/memfd.h"
#include "os/read_file.h"

namespace weightcache::client {
namespace {

// The copy's pieces: progress is reported and the cancel flag polled between them. The host
// tier's are smaller: its threads share the pieces out.
constexpr uint64_t kPieceBytes = uint64_t{256} << 20;
constexpr uint64_t kHostPieceBytes = uint64_t{64} << 20;
constexpr size_t kHostCopyThreads = 8;

bool Cancelled(const PeerCopyTarget& target) {
  return target.cancel != nullptr && target.cancel->load();
}

uint64_t TotalBytes(const PeerCopyTarget& target) {
  uint64_t total = 0;
  for (const auto& a : target.allocations) total += a.size();
  return total;
}

// Host tier: the peer's sealed memfds mapped read-only, written into our memfds by threads
// taking pieces in turn. pwrite, not a copy into our mappings: shmem gets its pages inside the
// write (PeerFillRequest::fds), which measured twice the copy's rate on a 2-core VM.
Status CopyHostPeer(const PeerCopyTarget& target, DaemonSession& session) {
  if (target.fds.size() != target.allocations.size()) {
    return InternalError("seed: the host tier's fill request lacks its memfds");
  }
  const std::vector<uint64_t>& sizes = session.reply.manifest.allocation_sizes();
  std::vector<os::MappedRegion> theirs;
  for (size_t a = 0; a < sizes.size(); ++a) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion region,
                                 os::MapReadOnly(session.reply.fds[a].get(), sizes[a]));
    theirs.push_back(std::move(region));
  }
  struct Piece {
    size_t allocation;
    uint64_t offset;
    uint64_t bytes;
  };
  std::vector<Piece> pieces;
  for (size_t a = 0; a < sizes.size(); ++a) {
    for (uint64_t at = 0; at < sizes[a]; at += kHostPieceBytes) {
      pieces.push_back({a, at, std::min(kHostPieceBytes, sizes[a] - at)});
    }
  }
  const uint64_t total = TotalBytes(target);
  std::atomic<size_t> next{0};
  std::mutex mu;  // done, error
  uint64_t done = 0;
  Status error;
  const auto work = [&] {
    for (size_t p = next++; p < pieces.size() && !Cancelled(target); p = next++) {
      const Piece& piece = pieces[p];
      Status written =
          os::PwriteAll(target.fds[piece.allocation],
                        static_cast<const uint8_t*>(theirs[piece.allocation].data()) + piece.offset,
                        piece.bytes, piece.offset);
      std::lock_guard<std::mutex> lock(mu);
      if (!written.ok()) {
        if (error.ok()) {
          error = written.Context("seed: writing allocation " + std::to_string(piece.allocation));
        }
        next = pieces.size();  // the others stop at their next piece
        return;
      }
      done += piece.bytes;
      target.progress(done, total);
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min(kHostCopyThreads, pieces.size()); ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  WEIGHTCACHE_RETURN_IF_ERROR(error);
  if (Cancelled(target)) return Status(StatusCode::kUnavailable, "seed: cancelled");
  return Status::Ok();
}

// Gpu tier, before the peer is attached: whether our `device` can read the memory of the
// peer's GPU (PeerCopier::Create).
Status CheckPeerAccess(const cuda::DriverApi* api, const identity::DeviceInfo& ours,
                       CUdevice device, const PeerCache& peer) {
  if (peer.device_key == ours.uuid || !identity::IsValidDeviceUuid(peer.device_key)) {
    return Status::Ok();
  }
  identity::DeviceInfo peer_device;
  peer_device.uuid = peer.device_key;
  WEIGHTCACHE_ASSIGN_OR_RETURN(peer_device.cuda_ordinal,
                               identity::FindCudaOrdinal(api, peer.device_key));
  if (peer_device.cuda_ordinal < 0) {
    return Status(StatusCode::kUnavailable,
                  "the peer's GPU " + peer.device_key +
                      " is not visible to this daemon (CUDA_VISIBLE_DEVICES), so its memory "
                      "cannot be mapped here");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(CUdevice theirs, identity::CudaDevice(api, peer_device));
  int can = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceCanAccessPeer(&can, device, theirs),
                                 "seed: cuDeviceCanAccessPeer");
  if (can == 0) {
    return Status(StatusCode::kUnavailable,
                  ours.uuid + " has no peer access to " + peer.device_key +
                      " (cuDeviceCanAccessPeer: no NVLink or PCIe peer-to-peer path between "
                      "them)");
  }
  return Status::Ok();
}

// Gpu tier: the peer's allocations mapped in our context (current on this, the loader's,
// thread) with access for our `device`, then copied device to device piece by piece.
Status CopyDevicePeer(const cuda::DriverApi* api, CUdevice device, const std::string& device_key,
                      const PeerCopyTarget& target, DaemonSession& session) {
  auto imported = cuda::ImportedArena::Import(api, device, std::move(session.reply.fds),
                                              session.reply.manifest.allocation_sizes());
  if (!imported.ok()) {
    return Status(imported.status())
        .Context("mapping the peer's memory for " + device_key +
                 " (another GPU's needs peer access to it)");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::CudaStream stream, cuda::CudaStream::Create(api));
  const uint64_t total = TotalBytes(target);
  uint64_t done = 0;
  const auto theirs = imported->allocations();
  for (size_t a = 0; a < theirs.size(); ++a) {
    const auto ours = reinterpret_cast<CUdeviceptr>(target.allocations[a].data());
    for (uint64_t at = 0; at < theirs[a].size; at += kPieceBytes) {
      if (Cancelled(target)) return Status(StatusCode::kUnavailable, "seed: cancelled");
      const uint64_t n = std::min(kPieceBytes, theirs[a].size - at);
      CUresult rc = api->cuMemcpyDtoDAsync(ours + at, theirs[a].ptr + at, n, stream.get());
      if (rc == CUDA_SUCCESS) rc = api->cuStreamSynchronize(stream.get());
      if (rc != CUDA_SUCCESS) return cuda::DriverError(api, rc, "seed: cuMemcpyDtoDAsync");
      done += n;
      target.progress(done, total);
    }
  }
  return Status::Ok();
}

}  // namespace

Result<PeerCopier> PeerCopier::Create(const ResolvedIdentity& identity, Tier tier,
                                      const PeerCache& peer, const identity::Env& env) {
  PeerCopier copier(tier, identity.device_key);
  if (tier != Tier::kGpu) return copier;
  if (!identity.device) return InternalError("seed: a gpu-tier cache without its device");
  WEIGHTCACHE_ASSIGN_OR_RETURN(copier.api_, env.load_driver());
  WEIGHTCACHE_ASSIGN_OR_RETURN(copier.device_, identity::CudaDevice(copier.api_, *identity.device));
  WEIGHTCACHE_RETURN_IF_ERROR(CheckPeerAccess(copier.api_, *identity.device, copier.device_, peer));
  return copier;
}

Status PeerCopier::Copy(DaemonSession& session, const PeerCopyTarget& target) const {
  return tier_ == Tier::kGpu ? CopyDevicePeer(api_, device_, device_key_, target, session)
                             : CopyHostPeer(target, session);
}

}  // namespace weightcache::client
