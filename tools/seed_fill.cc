#include "seed_fill.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "client/peer_caches.h"
#include "common/logging.h"
#include "common/test_hooks.h"
#include "cuda/driver_api.h"
#include "cuda/imported_arena.h"
#include "cuda/upload_resources.h"
#include "identity/device_inventory.h"
#include "identity/paths.h"
#include "os/memfd.h"
#include "os/read_file.h"

namespace weightcache::cli {
namespace {

// The copy's pieces: progress is reported and the cancel flag polled between them. The host
// tier's are smaller: its threads share the pieces out.
constexpr uint64_t kPieceBytes = uint64_t{256} << 20;
constexpr uint64_t kHostPieceBytes = uint64_t{64} << 20;
constexpr size_t kHostCopyThreads = 8;

bool Cancelled(const daemon::PeerFillRequest& request) {
  return request.cancel != nullptr && request.cancel->load();
}

uint64_t TotalBytes(const daemon::PeerFillRequest& request) {
  uint64_t total = 0;
  for (const auto& a : request.allocations) total += a.size();
  return total;
}

// Host tier: the peer's sealed memfds mapped read-only, written into our memfds by threads
// taking pieces in turn. pwrite, not a copy into our mappings: shmem gets its pages inside the
// write (PeerFillRequest::fds), which measured twice the copy's rate on a 2-core VM.
Status CopyHostPeer(const daemon::PeerFillRequest& request, client::DaemonSession& session) {
  if (request.fds.size() != request.allocations.size()) {
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
  const uint64_t total = TotalBytes(request);
  std::atomic<size_t> next{0};
  std::mutex mu;  // done, error
  uint64_t done = 0;
  Status error;
  const auto work = [&] {
    for (size_t p = next++; p < pieces.size() && !Cancelled(request); p = next++) {
      const Piece& piece = pieces[p];
      Status written =
          os::PwriteAll(request.fds[piece.allocation],
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
      request.progress(done, total);
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min(kHostCopyThreads, pieces.size()); ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  WEIGHTCACHE_RETURN_IF_ERROR(error);
  if (Cancelled(request)) return Status(StatusCode::kUnavailable, "seed: cancelled");
  return Status::Ok();
}

// Gpu tier, before the peer is attached: whether our device can read the memory of the peer's
// GPU. Its device key names it (the UUID of the device dir its socket lies in); a key that is
// no GPU UUID (an explicit socket outside the runtime dir's layout) is left to the mapping.
// Our own GPU can; another needs peer access (cuDeviceCanAccessPeer: NVLink or PCIe P2P), and
// must be visible to this process. There is no staged copy through host memory: a pair
// without peer access is the peer's skip reason, and the next peer, the fleet or the disk
// follows (docs/seeding.md).
Status CheckPeerAccess(const cuda::DriverApi* api, const identity::DeviceInfo& ours,
                       CUdevice device, const client::PeerCache& peer) {
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
Status CopyDevicePeer(const cuda::DriverApi* api, CUdevice device,
                      const identity::ResolvedIdentity& identity,
                      const daemon::PeerFillRequest& request, client::DaemonSession& session) {
  auto imported = cuda::ImportedArena::Import(api, device, std::move(session.reply.fds),
                                              session.reply.manifest.allocation_sizes());
  if (!imported.ok()) {
    return Status(imported.status())
        .Context("mapping the peer's memory for " + identity.device_key +
                 " (another GPU's needs peer access to it)");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::CudaStream stream, cuda::CudaStream::Create(api));
  const uint64_t total = TotalBytes(request);
  uint64_t done = 0;
  const auto theirs = imported->allocations();
  for (size_t a = 0; a < theirs.size(); ++a) {
    const auto ours = reinterpret_cast<CUdeviceptr>(request.allocations[a].data());
    for (uint64_t at = 0; at < theirs[a].size; at += kPieceBytes) {
      if (Cancelled(request)) return Status(StatusCode::kUnavailable, "seed: cancelled");
      const uint64_t n = std::min(kPieceBytes, theirs[a].size - at);
      CUresult rc = api->cuMemcpyDtoDAsync(ours + at, theirs[a].ptr + at, n, stream.get());
      if (rc == CUDA_SUCCESS) rc = api->cuStreamSynchronize(stream.get());
      if (rc != CUDA_SUCCESS) return cuda::DriverError(api, rc, "seed: cuMemcpyDtoDAsync");
      done += n;
      request.progress(done, total);
    }
  }
  return Status::Ok();
}

// Test seam (tests/integration/seed_test.cc): with WEIGHTCACHE_TEST_SEED_PAUSE_FIFO naming a
// FIFO, the seed, once it holds the peer's fds and before it copies, opens that FIFO and reads
// it to its end. A test kills the peer there: the fds keep its memory, so the copy goes on.
// Compiled out of release builds (common/test_hooks.h).
void PauseBeforeCopyForTest() {
  const std::optional<std::string> fifo = TestHookValue(TestHook::kSeedPauseFifo);
  if (!fifo) return;
  os::WaitForFifoEof(fifo->c_str());
}

// One peer: its attach, its manifest offered to accept(), its bytes copied. The description
// of what was copied.
Result<daemon::FillOutcome> SeedFromPeer(const identity::ResolvedIdentity& identity,
                                         const client::PeerCache& peer,
                                         const daemon::PeerFillRequest& request,
                                         std::chrono::milliseconds wait, const identity::Env& env) {
  const auto start = std::chrono::steady_clock::now();
  // Gpu tier: our device, once, and whether it can read the peer's before the peer is attached.
  const cuda::DriverApi* api = nullptr;
  CUdevice device = 0;
  if (request.memory == daemon::FillMemory::kDevice) {
    if (!identity.device) return InternalError("seed: a gpu-tier cache without its device");
    WEIGHTCACHE_ASSIGN_OR_RETURN(api, env.load_driver());
    WEIGHTCACHE_ASSIGN_OR_RETURN(device, identity::CudaDevice(api, *identity.device));
    WEIGHTCACHE_RETURN_IF_ERROR(CheckPeerAccess(api, *identity.device, device, peer));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(client::DaemonSession session,
                               client::ConnectPeer(identity, peer, wait, env));
  WEIGHTCACHE_RETURN_IF_ERROR(request.accept(session.reply.manifest.bytes()));
  if (session.reply.fds.size() != request.allocations.size()) {
    return Status(StatusCode::kMismatch, "it has " + std::to_string(session.reply.fds.size()) +
                                             " allocations, we plan " +
                                             std::to_string(request.allocations.size()));
  }
  LOG_INFO << "seed: copying from the peer cache of " << peer.device_key << " (" << peer.socket
           << ", pid " << session.pid << ")";
  PauseBeforeCopyForTest();
  WEIGHTCACHE_RETURN_IF_ERROR(request.memory == daemon::FillMemory::kDevice
                                  ? CopyDevicePeer(api, device, identity, request, session)
                                  : CopyHostPeer(request, session));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const uint64_t bytes = TotalBytes(request);
  char rate[96];
  std::snprintf(rate, sizeof(rate), " in %.3f s, %.2f GB/s", seconds,
                seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0);
  // No content anchor to prove: the peer is a cache of our own config on this node, whose
  // config digest holds the stat identity of the very files we would read.
  return daemon::FillOutcome{"peer " + peer.device_key,
                             "the peer cache of " + peer.device_key + " (" + peer.socket + ", " +
                                 std::to_string(bytes) + " bytes)" + rate,
                             nullptr};
}

}  // namespace

Status CheckSeedFrom(const std::string& seed_from) {
  if (seed_from.empty() || seed_from == "auto" || seed_from.front() == '/') return Status::Ok();
  return InvalidArgument("--seed-from: \"" + seed_from +
                         "\" is neither \"auto\" nor an absolute socket path");
}

daemon::PeerFill SeedFiller(const identity::ResolvedIdentity& identity, std::string seed_from,
                            std::chrono::milliseconds wait, identity::Env env) {
  if (seed_from.empty()) return {};
  return [identity, seed_from = std::move(seed_from), wait, env = std::move(env)](
             const daemon::PeerFillRequest& request) -> Result<daemon::FillOutcome> {
    std::vector<client::PeerCache> peers;
    if (seed_from == "auto") {
      WEIGHTCACHE_ASSIGN_OR_RETURN(peers, client::PeerCacheSockets(identity));
      if (peers.empty()) {
        return Status(StatusCode::kNotFound,
                      "seed: no peer cache of " + identity.config.ShortDigest() +
                          " on another device under " + identity.paths.namespace_dir);
      }
    } else {
      const size_t slash = seed_from.rfind('/');
      const size_t parent = seed_from.rfind('/', slash == 0 ? 0 : slash - 1);
      peers.push_back({seed_from.substr(parent + 1, slash - parent - 1), seed_from});
    }
    std::string skipped;
    for (const client::PeerCache& peer : peers) {
      auto seeded = SeedFromPeer(identity, peer, request, wait, env);
      if (seeded.ok()) return seeded;
      if (Cancelled(request)) return seeded.status();
      LOG_INFO << "seed: not from " << peer.socket << ": " << seeded.status().ToString();
      skipped += (skipped.empty() ? "" : "; ") + peer.socket + ": " + seeded.status().ToString();
    }
    return Status(StatusCode::kUnavailable, "seed: no peer cache could seed us (" + skipped + ")");
  };
}

daemon::PeerFill FirstFillOf(daemon::PeerFill first, daemon::PeerFill second) {
  if (!first) return second;
  if (!second) return first;
  return [first = std::move(first), second = std::move(second)](
             const daemon::PeerFillRequest& request) -> Result<daemon::FillOutcome> {
    auto done = first(request);
    if (done.ok() || (request.cancel != nullptr && request.cancel->load())) return done;
    LOG_WARN << "fill: " << done.status().ToString() << "; trying the fleet";
    if (request.forget_accepted) request.forget_accepted();
    return second(request);
  };
}

}  // namespace weightcache::cli
