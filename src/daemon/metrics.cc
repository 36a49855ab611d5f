#include "daemon/metrics.h"

#include <charconv>
#include <cmath>
#include <utility>

namespace weightcache::daemon {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

// Every state a daemon reports, in the order the one-hot gauge lists them.
constexpr std::array<protocol::CacheState, 6> kStates = {
    protocol::CacheState::kLoading,  protocol::CacheState::kAwaiting,
    protocol::CacheState::kReady,    protocol::CacheState::kFailed,
    protocol::CacheState::kDraining, protocol::CacheState::kDemoted};

uint64_t ToNanos(double seconds) {
  if (!(seconds > 0)) return 0;  // negative, zero and NaN alike
  double ns = std::round(seconds * 1e9);
  return ns >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(ns);
}

double NanosToSeconds(uint64_t ns) { return static_cast<double>(ns) / 1e9; }

// Appends the HELP and TYPE lines of one metric family.
void Family(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += EscapeHelp(help);
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

// Appends one sample line; `labels` is the already escaped `{a="b",...}` or empty.
void Sample(std::string& out, std::string_view name, std::string_view labels, double value) {
  out += name;
  out += labels;
  out += ' ';
  out += FormatSampleValue(value);
  out += '\n';
}

std::string Label(std::string_view name, std::string_view value) {
  return std::string(name) + "=\"" + EscapeLabelValue(value) + "\"";
}

}  // namespace

std::string_view AttachResultName(AttachResult result) {
  switch (result) {
    case AttachResult::kDaemon:
      return "daemon";
    case AttachResult::kMismatch:
      return "mismatch";
    case AttachResult::kUnavailable:
      return "unavailable";
    case AttachResult::kError:
      return "error";
  }
  return "error";
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatSampleValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Integers below 2^53 are exact in a double: print them without an exponent.
  if (value == std::trunc(value) && std::fabs(value) < 9007199254740992.0) {
    return std::to_string(static_cast<int64_t>(value));
  }
  // The shortest round-tripping digits, without an exponent in the range people read
  // ("0.0001", not "1e-04"), as Prometheus' own clients print bucket bounds.
  const double magnitude = std::fabs(value);
  const auto format =
      magnitude >= 1e-6 && magnitude < 1e15 ? std::chars_format::fixed : std::chars_format::general;
  std::array<char, 64> buffer{};
  auto [end, ec] = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value, format);
  return std::string(buffer.data(), ec == std::errc() ? end : buffer.data());
}

DaemonMetrics::DaemonMetrics(MetricsIdentity identity) : identity_(std::move(identity)) {}

void DaemonMetrics::RecordAttach(AttachResult result, double seconds) {
  attaches_.at(static_cast<size_t>(result)).fetch_add(1, kRelaxed);
  if (result == AttachResult::kMismatch || result == AttachResult::kUnavailable) {
    misses_.fetch_add(1, kRelaxed);
  }
  if (result != AttachResult::kDaemon) return;
  hits_.fetch_add(1, kRelaxed);
  size_t bucket = 0;
  while (bucket < kAttachBuckets.size() && seconds > kAttachBuckets.at(bucket)) ++bucket;
  attach_buckets_.at(bucket).fetch_add(1, kRelaxed);
  attach_sum_ns_.fetch_add(ToNanos(seconds), kRelaxed);
  auto now = std::chrono::system_clock::now().time_since_epoch();
  last_attach_unix_ms_.store(std::chrono::duration_cast<std::chrono::milliseconds>(now).count(),
                             kRelaxed);
}

void DaemonMetrics::SetClients(uint64_t clients) { clients_.store(clients, kRelaxed); }

void DaemonMetrics::SetState(protocol::CacheState state) {
  state_.store(static_cast<uint8_t>(state), kRelaxed);
}

void DaemonMetrics::SetCacheBytes(uint64_t bytes, bool demoted_to_host) {
  cache_bytes_.store((bytes & ~kDemotedBit) | (demoted_to_host ? kDemotedBit : 0), kRelaxed);
}

void DaemonMetrics::SetLoadProgress(uint64_t done, uint64_t total) {
  load_done_.store(done, kRelaxed);
  load_total_.store(total, kRelaxed);
}

void DaemonMetrics::RecordLoadDone(uint64_t bytes, double seconds) {
  load_done_.store(bytes, kRelaxed);
  load_total_.store(bytes, kRelaxed);
  load_duration_ns_.store(ToNanos(seconds), kRelaxed);
  double rate = seconds > 0 ? static_cast<double>(bytes) / seconds : 0;
  load_bytes_per_second_.store(rate >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(rate), kRelaxed);
}

void DaemonMetrics::RecordEviction() { evictions_.fetch_add(1, kRelaxed); }
void DaemonMetrics::RecordDemotion() { demotions_.fetch_add(1, kRelaxed); }
void DaemonMetrics::RecordPromotion() { promotions_.fetch_add(1, kRelaxed); }

uint64_t DaemonMetrics::attaches(AttachResult result) const {
  return attaches_.at(static_cast<size_t>(result)).load(kRelaxed);
}

std::string DaemonMetrics::Render() const {
  std::string out;
  auto as_double = [](const std::atomic<uint64_t>& a) {
    return static_cast<double>(a.load(kRelaxed));
  };

  Family(out, "weightcache_cache_bytes", "gauge",
         "Bytes of weights the cache holds, by device, model and tier.");
  const uint64_t held = cache_bytes_.load(kRelaxed);
  const auto bytes = static_cast<double>(held & ~kDemotedBit);
  const bool on_host = (held & kDemotedBit) != 0 || identity_.tier != Tier::kGpu;
  auto cache_bytes = [&](Tier tier, double value) {
    Sample(out, "weightcache_cache_bytes",
           "{" + Label("device", identity_.device) + "," + Label("model", identity_.model) + "," +
               Label("tier", TierName(tier)) + "}",
           value);
  };
  if (identity_.tier == Tier::kGpu) cache_bytes(Tier::kGpu, on_host ? 0 : bytes);
  cache_bytes(Tier::kHost, on_host ? bytes : 0);

  Family(out, "weightcache_attaches_total", "counter",
         "Attach attempts seen by the daemon, by result (fallback and timeout are counted by "
         "clients).");
  for (size_t i = 0; i < kAttachResultCount; ++i) {
    auto result = static_cast<AttachResult>(i);
    Sample(out, "weightcache_attaches_total", "{" + Label("result", AttachResultName(result)) + "}",
           as_double(attaches_.at(i)));
  }

  Family(out, "weightcache_attach_duration_seconds", "histogram",
         "Seconds from a client's Hello to its AttachReply queued, for attaches served.");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kAttachBuckets.size(); ++i) {
    cumulative += attach_buckets_.at(i).load(kRelaxed);
    Sample(out, "weightcache_attach_duration_seconds_bucket",
           "{" + Label("le", FormatSampleValue(kAttachBuckets.at(i))) + "}",
           static_cast<double>(cumulative));
  }
  cumulative += attach_buckets_.back().load(kRelaxed);
  Sample(out, "weightcache_attach_duration_seconds_bucket", "{le=\"+Inf\"}",
         static_cast<double>(cumulative));
  Sample(out, "weightcache_attach_duration_seconds_sum", "",
         NanosToSeconds(attach_sum_ns_.load(kRelaxed)));
  Sample(out, "weightcache_attach_duration_seconds_count", "", static_cast<double>(cumulative));

  Family(out, "weightcache_hits_total", "counter", "Attaches served from the cache.");
  Sample(out, "weightcache_hits_total", "", as_double(hits_));
  Family(out, "weightcache_misses_total", "counter",
         "Attach attempts the cache could not serve (config mismatch, cache not ready).");
  Sample(out, "weightcache_misses_total", "", as_double(misses_));

  Family(out, "weightcache_clients", "gauge", "Clients attached now.");
  Sample(out, "weightcache_clients", "", as_double(clients_));

  Family(out, "weightcache_daemon_state", "gauge",
         "The daemon's state: 1 for the current one, 0 for the others.");
  auto state = static_cast<protocol::CacheState>(state_.load(kRelaxed));
  for (auto s : kStates) {
    Sample(out, "weightcache_daemon_state", "{" + Label("state", protocol::CacheStateName(s)) + "}",
           s == state ? 1 : 0);
  }

  // A gauge takes no _total suffix (that is a counter's), and the unit goes last: done / size
  // is the fraction loaded (promtool check metrics, issue 39 §12).
  Family(out, "weightcache_load_done_bytes", "gauge", "Bytes loaded so far by the current load.");
  Sample(out, "weightcache_load_done_bytes", "", as_double(load_done_));
  Family(out, "weightcache_load_size_bytes", "gauge", "Bytes the current load reads in all.");
  Sample(out, "weightcache_load_size_bytes", "", as_double(load_total_));
  Family(out, "weightcache_load_duration_seconds", "gauge",
         "Seconds the last completed load took.");
  Sample(out, "weightcache_load_duration_seconds", "",
         NanosToSeconds(load_duration_ns_.load(kRelaxed)));
  Family(out, "weightcache_load_bytes_per_second", "gauge",
         "Bytes per second of the last completed load.");
  Sample(out, "weightcache_load_bytes_per_second", "", as_double(load_bytes_per_second_));

  Family(out, "weightcache_evictions_total", "counter",
         "Caches stopped to make room under the device's memory budget.");
  Sample(out, "weightcache_evictions_total", "", as_double(evictions_));
  Family(out, "weightcache_demotions_total", "counter",
         "Times the cache was demoted from the gpu tier to host memory.");
  Sample(out, "weightcache_demotions_total", "", as_double(demotions_));
  Family(out, "weightcache_promotions_total", "counter",
         "Times the cache was promoted from host memory back to the gpu tier.");
  Sample(out, "weightcache_promotions_total", "", as_double(promotions_));
  return out;
}

}  // namespace weightcache::daemon
