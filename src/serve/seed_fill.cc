#include "serve/seed_fill.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "client/peer_caches.h"
#include "client/peer_copy.h"
#include "common/logging.h"
#include "common/test_hooks.h"
#include "identity/paths.h"
#include "os/read_file.h"
#include "weightcache/tier.h"

namespace weightcache::serve {
namespace {

bool Cancelled(const daemon::PeerFillRequest& request) {
  return request.cancel != nullptr && request.cancel->load();
}

uint64_t TotalBytes(const daemon::PeerFillRequest& request) {
  uint64_t total = 0;
  for (const auto& a : request.allocations) total += a.size();
  return total;
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
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      const client::PeerCopier copier,
      client::PeerCopier::Create(
          identity, request.memory == daemon::FillMemory::kDevice ? Tier::kGpu : Tier::kHost, peer,
          env));
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
  WEIGHTCACHE_RETURN_IF_ERROR(
      copier.Copy(session, {request.allocations, request.fds, request.progress, request.cancel}));
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

}  // namespace weightcache::serve
