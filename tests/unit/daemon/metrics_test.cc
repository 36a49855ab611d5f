// The exposition renderer (daemon/metrics.h): escaping, number formatting, histogram buckets,
// and the exact lines of a known sequence of events.
#include "daemon/metrics.h"

#include <gtest/gtest.h>

#include <string>

namespace weightcache::daemon {
namespace {

bool HasLine(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(MetricsFormat, EscapesLabelValuesAndHelpPerTheFormat) {
  EXPECT_EQ(EscapeLabelValue(R"(a"b\c)"
                             "\nd"),
            R"(a\"b\\c\nd)");
  EXPECT_EQ(EscapeLabelValue("org/model-7B"), "org/model-7B");
  // HELP escapes backslash and newline, and leaves quotes alone.
  EXPECT_EQ(EscapeHelp("say \"hi\"\\\n"), "say \"hi\"\\\\\\n");
}

TEST(MetricsFormat, FormatsSampleValues) {
  EXPECT_EQ(FormatSampleValue(0), "0");
  EXPECT_EQ(FormatSampleValue(17), "17");
  EXPECT_EQ(FormatSampleValue(1099511627776.0), "1099511627776");
  EXPECT_EQ(FormatSampleValue(0.00025), "0.00025");
  EXPECT_EQ(FormatSampleValue(2.5), "2.5");
  EXPECT_EQ(FormatSampleValue(0.0001), "0.0001");
  EXPECT_EQ(FormatSampleValue(1e-9), "1e-09");
  EXPECT_EQ(FormatSampleValue(1.5e300), "1.5e+300");
  EXPECT_EQ(FormatSampleValue(1.0 / 0.0), "+Inf");
  EXPECT_EQ(FormatSampleValue(-1.0 / 0.0), "-Inf");
  EXPECT_EQ(FormatSampleValue(0.0 / 0.0), "NaN");
}

TEST(DaemonMetrics, RendersTheIdentityLabelsEscaped) {
  DaemonMetrics m({"GPU-1234", "org/\"odd\"\nmodel", Tier::kGpu});
  m.SetCacheBytes(4096);
  std::string text = m.Render();
  EXPECT_TRUE(HasLine(text,
                      "# HELP weightcache_cache_bytes Bytes of weights the cache holds, by "
                      "device, model and tier."))
      << text;
  EXPECT_TRUE(HasLine(text, "# TYPE weightcache_cache_bytes gauge")) << text;
  EXPECT_TRUE(HasLine(
      text,
      R"(weightcache_cache_bytes{device="GPU-1234",model="org/\"odd\"\nmodel",tier="gpu"} 4096)"))
      << text;
  EXPECT_TRUE(HasLine(
      text,
      R"(weightcache_cache_bytes{device="GPU-1234",model="org/\"odd\"\nmodel",tier="host"} 0)"))
      << text;
}

TEST(DaemonMetrics, ADemotedGpuCacheCountsItsBytesOnTheHostTier) {
  DaemonMetrics m({"GPU-1234", "m", Tier::kGpu});
  m.SetCacheBytes(4096, /*demoted_to_host=*/true);
  std::string text = m.Render();
  EXPECT_TRUE(HasLine(text, R"(weightcache_cache_bytes{device="GPU-1234",model="m",tier="gpu"} 0)"))
      << text;
  EXPECT_TRUE(
      HasLine(text, R"(weightcache_cache_bytes{device="GPU-1234",model="m",tier="host"} 4096)"))
      << text;
  // A host-tier cache has the host series only.
  DaemonMetrics host({"host", "m", Tier::kHost});
  host.SetCacheBytes(10);
  text = host.Render();
  EXPECT_TRUE(HasLine(text, R"(weightcache_cache_bytes{device="host",model="m",tier="host"} 10)"))
      << text;
  EXPECT_EQ(text.find(R"(tier="gpu")"), std::string::npos) << text;
}

TEST(DaemonMetrics, CountsAttachesByResultWithHitsAndMisses) {
  DaemonMetrics m({"host", "m", Tier::kHost});
  m.RecordAttach(AttachResult::kDaemon, 0.0002);
  m.RecordAttach(AttachResult::kDaemon, 0.003);
  m.RecordAttach(AttachResult::kMismatch);
  m.RecordAttach(AttachResult::kUnavailable);
  m.RecordAttach(AttachResult::kError);
  EXPECT_EQ(m.hits(), 2u);
  EXPECT_EQ(m.misses(), 2u);
  EXPECT_GT(m.last_attach_unix_ms(), int64_t{1'600'000'000'000});
  std::string text = m.Render();
  EXPECT_TRUE(HasLine(text, "# TYPE weightcache_attaches_total counter")) << text;
  EXPECT_TRUE(HasLine(text, R"(weightcache_attaches_total{result="daemon"} 2)")) << text;
  EXPECT_TRUE(HasLine(text, R"(weightcache_attaches_total{result="mismatch"} 1)")) << text;
  EXPECT_TRUE(HasLine(text, R"(weightcache_attaches_total{result="unavailable"} 1)")) << text;
  EXPECT_TRUE(HasLine(text, R"(weightcache_attaches_total{result="error"} 1)")) << text;
  EXPECT_TRUE(HasLine(text, "weightcache_hits_total 2")) << text;
  EXPECT_TRUE(HasLine(text, "weightcache_misses_total 2")) << text;
}

TEST(DaemonMetrics, HistogramBucketsAreCumulativeWithInfSumAndCount) {
  DaemonMetrics m({"host", "m", Tier::kHost});
  m.RecordAttach(AttachResult::kDaemon, 0.0001);  // on a bound: counted in that bucket (le)
  m.RecordAttach(AttachResult::kDaemon, 0.0003);
  m.RecordAttach(AttachResult::kDaemon, 0.02);
  m.RecordAttach(AttachResult::kDaemon, 5.0);  // beyond the last bound: only +Inf
  m.RecordAttach(AttachResult::kMismatch);     // not an attach served: not observed
  std::string text = m.Render();
  const char* expected[] = {
      "# TYPE weightcache_attach_duration_seconds histogram",
      R"(weightcache_attach_duration_seconds_bucket{le="0.0001"} 1)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.00025"} 1)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.0005"} 2)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.001"} 2)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.0025"} 2)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.005"} 2)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.01"} 2)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.025"} 3)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.05"} 3)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.1"} 3)",
      R"(weightcache_attach_duration_seconds_bucket{le="0.25"} 3)",
      R"(weightcache_attach_duration_seconds_bucket{le="1"} 3)",
      R"(weightcache_attach_duration_seconds_bucket{le="+Inf"} 4)",
      "weightcache_attach_duration_seconds_sum 5.0204",
      "weightcache_attach_duration_seconds_count 4",
  };
  for (const char* line : expected) EXPECT_TRUE(HasLine(text, line)) << line << "\n" << text;
  // The buckets come in order, each once.
  auto first = text.find(R"(_bucket{le="0.0001"})");
  auto inf = text.find(R"(_bucket{le="+Inf"})");
  ASSERT_NE(first, std::string::npos);
  EXPECT_LT(first, inf);
}

TEST(DaemonMetrics, StateIsOneHotAndLoadGaugesFollowTheLoad) {
  DaemonMetrics m({"host", "m", Tier::kHost});
  m.SetLoadProgress(250, 1000);
  std::string loading = m.Render();
  EXPECT_TRUE(HasLine(loading, R"(weightcache_daemon_state{state="loading"} 1)")) << loading;
  EXPECT_TRUE(HasLine(loading, R"(weightcache_daemon_state{state="ready"} 0)")) << loading;
  EXPECT_TRUE(HasLine(loading, "weightcache_load_done_bytes 250")) << loading;
  EXPECT_TRUE(HasLine(loading, "weightcache_load_size_bytes 1000")) << loading;

  m.RecordLoadDone(1000, 0.5);
  m.SetState(protocol::CacheState::kReady);
  m.SetClients(3);
  std::string ready = m.Render();
  for (const char* line : {
           R"(weightcache_daemon_state{state="loading"} 0)",
           R"(weightcache_daemon_state{state="awaiting"} 0)",
           R"(weightcache_daemon_state{state="ready"} 1)",
           R"(weightcache_daemon_state{state="failed"} 0)",
           R"(weightcache_daemon_state{state="draining"} 0)",
           "weightcache_load_done_bytes 1000",
           "weightcache_load_duration_seconds 0.5",
           "weightcache_load_bytes_per_second 2000",
           "weightcache_clients 3",
           "weightcache_evictions_total 0",
           "weightcache_demotions_total 0",
           "weightcache_promotions_total 0",
       }) {
    EXPECT_TRUE(HasLine(ready, line)) << line << "\n" << ready;
  }
}

TEST(DaemonMetrics, EveryFamilyHasHelpAndTypeAndEveryLineEndsInNewline) {
  DaemonMetrics m({"host", "m", Tier::kHost});
  std::string text = m.Render();
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  size_t help = 0;
  size_t type = 0;
  for (size_t pos = 0; (pos = text.find("# HELP ", pos)) != std::string::npos; ++pos) ++help;
  for (size_t pos = 0; (pos = text.find("# TYPE ", pos)) != std::string::npos; ++pos) ++type;
  EXPECT_EQ(help, 14u);
  EXPECT_EQ(type, 14u);
}

}  // namespace
}  // namespace weightcache::daemon
