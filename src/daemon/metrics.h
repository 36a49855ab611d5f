// DaemonMetrics — the counters, gauges and histogram one daemon keeps about its cache, and
// their rendering in the Prometheus text exposition format 0.0.4 (docs/metrics.md lists every
// metric, its labels and units).
//
// Contract:
//  * Thread-safety: every recording method and Render may be called from any thread at any
//    time (the event loop records attaches and clients, the loader records progress, the
//    metrics server's thread renders). Each value is one atomic; a scrape reads each value
//    once, so the rendering is a consistent snapshot of each series, not of all of them
//    together (Prometheus' own client libraries give the same guarantee).
//  * The identity labels (device, model, tier) are fixed at construction; label values are
//    escaped per the format (backslash, double quote, newline), so any model id is safe.
//    weightcache_cache_bytes says where the bytes are now: a gpu-tier cache has a `tier="gpu"`
//    and a `tier="host"` series, the bytes in the one it is resident in (host while demoted)
//    and 0 in the other, so a sum by tier is right at every moment; a host-tier cache has only
//    `tier="host"`.
//  * Eviction, demotion and promotion counters exist from the start and stay 0 until the
//    budget ledger records them.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "protocol/messages.h"
#include "weightcache/tier.h"

namespace weightcache::daemon {

// The daemon-side outcome of one client's attempt to attach (docs/metrics.md). A client's own
// fallback and timeout never reach the daemon; clients count those.
enum class AttachResult : uint8_t {
  kDaemon,       // an AttachReply with the cache's fds was sent
  kMismatch,     // the Hello's config differs from this cache's
  kUnavailable,  // the cache is loading, awaiting its publisher, failed or draining
  kError,        // a malformed or out-of-sequence request closed the connection
};
inline constexpr size_t kAttachResultCount = 4;
// "daemon", "mismatch", "unavailable", "error": the `result` label.
std::string_view AttachResultName(AttachResult result);

// Upper bounds, in seconds, of the attach duration histogram's buckets (+Inf is implicit).
// Attaching costs O(allocations) on the daemon: tens of microseconds to a few milliseconds.
inline constexpr std::array<double, 12> kAttachBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0};

// Escapes a label value for the exposition format: \ → \\, " → \", newline → \n.
std::string EscapeLabelValue(std::string_view value);
// Escapes HELP text: \ → \\, newline → \n.
std::string EscapeHelp(std::string_view text);
// A sample value as the format spells it: integers exactly, others in the shortest
// round-tripping form, "+Inf", "-Inf", "NaN".
std::string FormatSampleValue(double value);

struct MetricsIdentity {
  std::string device;      // the device UUID, or "host"
  std::string model;       // the config's model id
  Tier tier = Tier::kGpu;  // the configured tier; its label value is TierName()
};

class DaemonMetrics {
 public:
  explicit DaemonMetrics(MetricsIdentity identity);
  DaemonMetrics(const DaemonMetrics&) = delete;
  DaemonMetrics& operator=(const DaemonMetrics&) = delete;

  // An attach attempt's outcome. `seconds`: from the client's Hello to the AttachReply queued
  // (observed in the histogram for kDaemon only). kDaemon counts a hit; kMismatch and
  // kUnavailable count a miss.
  void RecordAttach(AttachResult result, double seconds = 0);
  void SetClients(uint64_t clients);
  void SetState(protocol::CacheState state);
  // The bytes the cache holds and whether they are in host RAM now (a demoted gpu-tier cache).
  void SetCacheBytes(uint64_t bytes, bool demoted_to_host = false);
  // A load in progress: bytes done and the total (gauges).
  void SetLoadProgress(uint64_t done, uint64_t total);
  // A load that ended `ready`: its duration and rate.
  void RecordLoadDone(uint64_t bytes, double seconds);
  // Budget ledger events (docs/metrics.md: 0 until the ledger records them).
  void RecordEviction();
  void RecordDemotion();
  void RecordPromotion();

  // Snapshot accessors (the Metrics protocol reply, tests).
  uint64_t attaches(AttachResult result) const;
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  uint64_t clients() const { return clients_.load(std::memory_order_relaxed); }
  // Unix time (milliseconds) of the last attach served, 0 if none.
  int64_t last_attach_unix_ms() const {
    return last_attach_unix_ms_.load(std::memory_order_relaxed);
  }

  // The whole exposition, every line ending in '\n'.
  std::string Render() const;

  const MetricsIdentity& identity() const { return identity_; }

 private:
  const MetricsIdentity identity_;
  std::array<std::atomic<uint64_t>, kAttachResultCount> attaches_{};
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
  // Histogram: per-bucket (non-cumulative) counts, the +Inf overflow, the sum in nanoseconds.
  std::array<std::atomic<uint64_t>, kAttachBuckets.size() + 1> attach_buckets_{};
  std::atomic<uint64_t> attach_sum_ns_{0};
  std::atomic<int64_t> last_attach_unix_ms_{0};
  std::atomic<uint64_t> clients_{0};
  std::atomic<uint8_t> state_{static_cast<uint8_t>(protocol::CacheState::kLoading)};
  // The bytes, with kDemotedBit set while they are in host RAM: one atomic, so a scrape never
  // pairs one tier's bytes with the other's label.
  static constexpr uint64_t kDemotedBit = uint64_t{1} << 63;
  std::atomic<uint64_t> cache_bytes_{0};
  std::atomic<uint64_t> load_done_{0};
  std::atomic<uint64_t> load_total_{0};
  std::atomic<uint64_t> load_duration_ns_{0};
  std::atomic<uint64_t> load_bytes_per_second_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> demotions_{0};
  std::atomic<uint64_t> promotions_{0};
};

}  // namespace weightcache::daemon
