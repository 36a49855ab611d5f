// `serve --registry` and `fleet ls` against a real etcd on loopback (docs/fleet.md,
// "Registry"): a ready cache is registered with its fields, `stop` withdraws it at once, a
// kill -9 leaves it to the lease's expiry, and an etcd outage neither stops the cache nor
// loses the entry once etcd is back.
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "integration/daemon_process.h"
#include "support/etcd_server.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

class FleetRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = StartEtcdOrSkip();
    if (etcd_ == nullptr) return;
    model_ = MakeCheckpoint(dir_.Join("model"), 6, 1, 5, 4096);
    runtime_ = dir_.Join("run");
  }

  std::unique_ptr<ServeProcess> Serve(const std::string& node = "node-a") {
    auto p = ServeProcess::Start(
        HostServeArgs(
            model_, runtime_,
            {"--no-keeper", "--registry", etcd_->url(), "--registry-ttl", "2", "--node-name", node,
             "--advertise", "127.0.0.1:7000", "--registry-timeout", "1"}),
        dir_.Join("serve.log"));
    EXPECT_NE(p, nullptr);
    return p;
  }

  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }

  // `fleet ls --json` filtered by the model's identity: its entries.
  nlohmann::json Entries() {
    const CommandResult ls = Cli({"fleet", "ls", "--json", "--registry", etcd_->url(), "--model",
                                  model_, "--model-id", "tiny", "--runtime-dir", runtime_});
    EXPECT_EQ(ls.exit_code, 0) << ls.err;
    if (ls.exit_code != 0) return nlohmann::json::array();
    return nlohmann::json::parse(ls.out)["entries"];
  }

  // Polls `fleet ls` (every 100 ms, at most 30 s) until `done` holds for its entries.
  bool WaitEntries(const std::function<bool(const nlohmann::json&)>& done) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      if (done(Entries())) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
  static bool OneReady(const nlohmann::json& e) {
    return e.size() == 1 && e[0]["state"] == "ready";
  }

  TempDir dir_;
  std::unique_ptr<EtcdServer> etcd_;
  std::string model_, runtime_;
};

TEST_F(FleetRegistryTest, AReadyCacheIsListedWithItsFieldsAndStopWithdrawsIt) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  ASSERT_TRUE(WaitEntries(OneReady)) << serve->Log();
  const nlohmann::json e = Entries()[0];
  const identity::CacheConfig config = ConfigFor(model_, "tiny");
  EXPECT_EQ(e["fleet_key"], config.FleetDigest());
  EXPECT_EQ(e["digest"], config.Digest());
  EXPECT_EQ(e["node"], "node-a");
  EXPECT_EQ(e["endpoint"], "127.0.0.1:7000");
  EXPECT_EQ(e["tier"], "host");
  EXPECT_EQ(e["device"], "host");
  EXPECT_EQ(e["tensors"], 6);
  EXPECT_GT(e["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(e["pid"], serve->pid());
  EXPECT_EQ(e["model_id"], "tiny");
  EXPECT_EQ(e["tp_size"], 1);
  EXPECT_EQ(e["format"], 1);
  EXPECT_EQ(e["manifest_digest"].get<std::string>().size(), 64u);  // the served manifest's

  // The table form names the node and the state too.
  const CommandResult table = Cli({"fleet", "ls", "--registry", etcd_->url()});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_NE(table.out.find("node-a"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("ready"), std::string::npos) << table.out;

  const CommandResult stop = Cli({"stop", "--model", model_, "--model-id", "tiny", "--tier", "host",
                                  "--runtime-dir", runtime_});
  ASSERT_EQ(stop.exit_code, 0) << stop.err;
  ASSERT_EQ(serve->WaitExit(30s), 0) << serve->Log();
  EXPECT_TRUE(Entries().empty()) << "the entry outlived `stop`";  // at once: no poll
}

// Issue 39 §11: the table's columns are as wide as their content. RANKS ("tp0/1 pp0/1 ep0/1",
// 17 characters) and a long node name used to run into the next column.
TEST_F(FleetRegistryTest, TheTableSizesEveryColumnToItsContent) {
  const std::string node = "a-node-name-longer-than-twenty-characters";
  auto serve = Serve(node);
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  ASSERT_TRUE(WaitEntries(OneReady)) << serve->Log();
  const CommandResult table = Cli({"fleet", "ls", "--registry", etcd_->url()});
  ASSERT_EQ(table.exit_code, 0) << table.err;
  const size_t eol = table.out.find('\n');
  ASSERT_NE(eol, std::string::npos) << table.out;
  const std::string header = table.out.substr(0, eol);
  const std::string row = table.out.substr(eol + 1, table.out.find('\n', eol + 1) - eol - 1);
  const auto cell = [&](const std::string& column) {
    const size_t at = header.find(column);
    EXPECT_NE(at, std::string::npos) << header;
    if (at == std::string::npos || at > row.size()) return std::string();
    EXPECT_EQ(row[at - 1], ' ') << "the cell before " << column << " runs into it:\n" << table.out;
    return row.substr(at, row.find("  ", at) - at);
  };
  EXPECT_EQ(cell("NODE"), node);
  EXPECT_EQ(cell("STATE"), "ready");
  EXPECT_EQ(cell("TIER"), "host");
  EXPECT_EQ(cell("RANKS"), "tp0/1 pp0/1 ep0/1");
  EXPECT_EQ(cell("ENDPOINT"), "127.0.0.1:7000");
  EXPECT_EQ(cell("PID"), std::to_string(serve->pid()));
  EXPECT_EQ(cell("MODEL"), "tiny");
}

TEST_F(FleetRegistryTest, AKilledDaemonsEntryExpiresWithItsLease) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  ASSERT_TRUE(WaitEntries(OneReady)) << serve->Log();
  serve->Signal(SIGKILL);
  ASSERT_EQ(serve->WaitExit(10s), 128 + SIGKILL);
  // No one revokes: etcd removes the entry when the 2 s lease runs out.
  EXPECT_TRUE(WaitEntries([](const nlohmann::json& e) { return e.empty(); }))
      << "the entry outlived its lease";
}

TEST_F(FleetRegistryTest, AnEtcdOutageNeitherStopsTheCacheNorLosesTheEntry) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, CacheState::kReady).ok()) << serve->Log();
  ASSERT_TRUE(WaitEntries(OneReady)) << serve->Log();
  etcd_->Kill();
  // The registrar's next renewal fails and says so; the cache serves on.
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (serve->Log().find("the cache serves on, retrying") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_NE(serve->Log().find("the cache serves on, retrying"), std::string::npos) << serve->Log();
  const CommandResult attach = Cli({"attach", "--model", model_, "--model-id", "tiny", "--tier",
                                    "host", "--runtime-dir", runtime_, "--on-missing", "error"});
  EXPECT_EQ(attach.exit_code, 0) << attach.out << attach.err;
  EXPECT_TRUE(serve->Running());

  ASSERT_TRUE(etcd_->Restart().ok()) << etcd_->Log();
  EXPECT_TRUE(WaitEntries([&](const nlohmann::json& e) {
    return OneReady(e) && e[0]["pid"] == serve->pid();
  })) << serve->Log();
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(30s), 0) << serve->Log();
  EXPECT_TRUE(Entries().empty());
}

TEST_F(FleetRegistryTest, BadRegistryFlagsAreUsageErrors) {
  const CommandResult bad_url = Cli({"serve", "--model", model_, "--tier", "host", "--runtime-dir",
                                     runtime_, "--registry", "http://127.0.0.1:1"});
  EXPECT_EQ(bad_url.exit_code, 2) << bad_url.err;
  EXPECT_NE(bad_url.err.find("etcd://HOST:PORT"), std::string::npos) << bad_url.err;
  const CommandResult bad_advertise =
      Cli({"serve", "--model", model_, "--tier", "host", "--runtime-dir", runtime_, "--registry",
           etcd_->url(), "--advertise", "nohost"});
  EXPECT_EQ(bad_advertise.exit_code, 2) << bad_advertise.err;
  EXPECT_NE(bad_advertise.err.find("--advertise"), std::string::npos) << bad_advertise.err;
  const CommandResult tls_without_ca = Cli({"fleet", "ls", "--registry", "etcds://127.0.0.1:1"});
  EXPECT_EQ(tls_without_ca.exit_code, 2) << tls_without_ca.err;
  EXPECT_NE(tls_without_ca.err.find("CA file"), std::string::npos) << tls_without_ca.err;
  const CommandResult down =
      Cli({"fleet", "ls", "--registry", "etcd://127.0.0.1:1", "--registry-timeout", "1"});
  EXPECT_EQ(down.exit_code, 1) << down.err;
  EXPECT_NE(down.err.find("etcd http://127.0.0.1:1"), std::string::npos) << down.err;
}

}  // namespace
}  // namespace weightcache::testing
