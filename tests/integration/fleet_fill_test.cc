// `serve --fill-from registry` against a real etcd and the fleet transport over loopback TCP
// (docs/fleet.md "Fill"): two "nodes" are two daemons with their own runtime dirs. Node A
// serves its host-tier arena (--fill-serve, --fill-allow); node B fills from it with equal
// bytes and never reads the tensor data from its disk; no source, a source killed mid-transfer
// and a poisoned source all end with B loading from its disk, ready with correct bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "integration/daemon_process.h"
#include "support/etcd_server.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

bool Contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

class FleetFillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = StartEtcdOrSkip();
    if (etcd_ == nullptr) return;
    model_ = MakeCheckpoint(dir_.Join("model"), 8, 1, 5, 65536);
  }
  void TearDown() override {
    ::unsetenv("WEIGHTCACHE_TEST_FILL_POISON");
    ::unsetenv("WEIGHTCACHE_TEST_FILL_STRIPE_BYTES");
    ::unsetenv("WEIGHTCACHE_TEST_FILL_PAUSE_FIFO");
  }

  std::vector<std::string> Registry(const std::string& node) const {
    return {"--no-keeper", "--registry",         etcd_->url(), "--registry-ttl", "2", "--node-name",
            node,          "--registry-timeout", "1"};
  }

  // Node A (serving `model`, default ours): ready and registered with its fill source's
  // endpoint.
  std::unique_ptr<ServeProcess> StartSource(std::string model = "",
                                            const std::string& node = "node-a") {
    if (model.empty()) model = model_;
    std::vector<std::string> extra = Registry(node);
    extra.insert(extra.end(), {"--fill-serve", "127.0.0.1:0", "--fill-allow", "127.0.0.1"});
    auto a = ServeProcess::Start(HostServeArgs(model, dir_.Join("run-" + node), extra),
                                 dir_.Join("serve-" + node + ".log"));
    if (a == nullptr) return nullptr;
    EXPECT_TRUE(WaitForState(*a, dir_.Join("run-" + node), CacheState::kReady).ok()) << a->Log();
    EXPECT_TRUE(WaitSourceEndpoint(node)) << last_ls_ << "\n" << a->Log();
    return a;
  }

  std::unique_ptr<ServeProcess> StartFiller() {
    std::vector<std::string> extra = Registry("node-b");
    extra.insert(extra.end(), {"--fill-from", "registry"});
    return ServeProcess::Start(HostServeArgs(model_, dir_.Join("run-b"), extra),
                               dir_.Join("serve-b.log"));
  }

  // Polls `fleet ls` (every 100 ms, at most 30 s) until `node`'s entry is ready with an
  // endpoint on 127.0.0.1.
  bool WaitSourceEndpoint(const std::string& node) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      const CommandResult ls =
          RunCommand({CliPath(), "fleet", "ls", "--json", "--registry", etcd_->url()});
      last_ls_ = ls.out + ls.err;
      if (ls.exit_code == 0) {
        const nlohmann::json listed = nlohmann::json::parse(ls.out);
        for (const auto& e : listed["entries"]) {
          if (e["node"] == node && e["state"] == "ready" &&
              e["endpoint"].get<std::string>().rfind("127.0.0.1:", 0) == 0 &&
              e["endpoint"] != "127.0.0.1:0") {
            return true;
          }
        }
      }
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }

  // `attach --verify --json` on node B's cache: every tensor's checksum against the files.
  void ExpectVerifiedOnB() {
    const CommandResult r =
        RunCommand({CliPath(), "attach", "--model", model_, "--model-id", "tiny", "--tier", "host",
                    "--runtime-dir", dir_.Join("run-b"), "--verify", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["source"], "daemon") << r.out;
    EXPECT_EQ(j["tensors"], 8);
    EXPECT_EQ(j["verify"]["ok"], true) << r.out;
    EXPECT_EQ(j["verify"]["tensors"], 8) << r.out;
  }

  // Node B started with `--fill-from endpoint` (no registry) fills from it alone, never from
  // its disk, with verified bytes; B is stopped on return.
  void ExpectBFillsFromListed(const std::string& endpoint) {
    auto b = ServeProcess::Start(
        HostServeArgs(model_, dir_.Join("run-b"), {"--no-keeper", "--fill-from", endpoint}),
        dir_.Join("serve-b.log"));
    ASSERT_NE(b, nullptr);
    const std::string log = ReadyLogOfB(*b);
    EXPECT_TRUE(Contains(log, "filled from 1 source(s) (listed " + endpoint + " ")) << log;
    EXPECT_FALSE(Contains(log, "loading from disk")) << log;
    ExpectVerifiedOnB();
  }

  // Node B's log once B is ready; "" (and a failure) when B never is.
  std::string ReadyLogOfB(ServeProcess& b, std::chrono::milliseconds timeout = 30s) {
    const Result<std::string> ready =
        WaitForState(b, dir_.Join("run-b"), CacheState::kReady, timeout);
    if (!ready.ok()) {
      ADD_FAILURE() << "B is not ready: " << ready.status().ToString() << "\n" << b.Log();
      return "";
    }
    return b.Log();
  }

  TempDir dir_;
  std::unique_ptr<EtcdServer> etcd_;
  std::string model_;
  std::string last_ls_;  // the last `fleet ls` of WaitSourceEndpoint, for its failure
};

TEST_F(FleetFillTest, NodeBFillsFromNodeAWithEqualBytes) {
  auto a = StartSource();
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(Contains(a->Log(), "fill source: serving the arena at 127.0.0.1:")) << a->Log();
  auto b = StartFiller();
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  // The ready line says where the bytes came from; the disk's tensor data was never read
  // (only the verification's sample of it): no reader pass, no fallback.
  EXPECT_TRUE(Contains(log, "filled from 1 source(s) (node-a 127.0.0.1:")) << log;
  EXPECT_FALSE(Contains(log, "loading from disk")) << log;
  EXPECT_FALSE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

// No etcd needed: B lists A's endpoint (--fill-from HOST:PORT), A serves without registering.
TEST_F(FleetFillTest, NodeBFillsFromAListedSourceWithoutARegistry) {
  auto a = ServeProcess::Start(
      HostServeArgs(model_, dir_.Join("run-a"),
                    {"--no-keeper", "--fill-serve", "127.0.0.1:0", "--fill-allow", "127.0.0.1"}),
      dir_.Join("serve-a.log"));
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(WaitForState(*a, dir_.Join("run-a"), CacheState::kReady).ok()) << a->Log();
  const std::string a_log = a->Log();
  // The endpoint A bound is in its log ("fill source: serving the arena at 127.0.0.1:P to ...").
  const std::string marker = "fill source: serving the arena at ";
  const size_t at = a_log.find(marker);
  ASSERT_NE(at, std::string::npos) << a_log;
  const std::string endpoint =
      a_log.substr(at + marker.size(), a_log.find(' ', at + marker.size()) - at - marker.size());
  ASSERT_EQ(endpoint.rfind("127.0.0.1:", 0), 0u) << endpoint;
  EXPECT_FALSE(Contains(a_log, "registry:")) << a_log;

  ExpectBFillsFromListed(endpoint);
}

// An upgrade's successor runs with the old daemon's flags, so it binds the same --fill-serve
// address: a fixed port (as launch gives each rank, PORT + rank) must be free by then. The old
// daemon lets go of it before it starts the successor; before, the successor found the port
// taken, logged "fill source: not serving" and served no fills until its own restart.
TEST_F(FleetFillTest, AnUpgradedSourceServesFillsAtItsFixedPort) {
  const int port = FreeLoopbackPort();
  ASSERT_NE(port, 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  auto a = ServeProcess::Start(
      HostServeArgs(model_, dir_.Join("run-a"),
                    {"--no-keeper", "--fill-serve", endpoint, "--fill-allow", "127.0.0.1"}),
      dir_.Join("serve-a.log"));
  ASSERT_NE(a, nullptr);
  const Result<std::string> socket = WaitForState(*a, dir_.Join("run-a"), CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << a->Log();
  const std::string serving = "fill source: serving the arena at " + endpoint + " ";
  ASSERT_TRUE(Contains(a->Log(), serving)) << a->Log();

  const CommandResult up = RunCommand({CliPath(), "upgrade", "--socket", *socket, "--json"});
  ASSERT_EQ(up.exit_code, 0) << up.err << "\n" << a->Log();
  const nlohmann::json reply = nlohmann::json::parse(up.out, nullptr, false);
  ASSERT_TRUE(reply.is_object() && reply.contains("successor_pid")) << up.out;
  const auto successor = reply["successor_pid"].get<pid_t>();
  // The successor shares A's log: it serves at the same endpoint once ready.
  const auto until = std::chrono::steady_clock::now() + 30s;
  auto count = [&] {
    const std::string log = a->Log();
    size_t n = 0;
    for (size_t at = log.find(serving); at != std::string::npos; at = log.find(serving, at + 1)) {
      ++n;
    }
    return n;
  };
  while (count() < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(count(), 2u) << a->Log();
  EXPECT_FALSE(Contains(a->Log(), "fill source: not serving")) << a->Log();

  ExpectBFillsFromListed(endpoint);

  const CommandResult stop = RunCommand({CliPath(), "stop", "--socket", *socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  for (int i = 0; i < 300 && ::kill(successor, 0) == 0; ++i) std::this_thread::sleep_for(100ms);
  if (::kill(successor, 0) == 0) {
    ADD_FAILURE() << "the successor outlived `stop`";
    ::kill(successor, SIGKILL);
  }
}

TEST_F(FleetFillTest, TwoSourcesAreStripedAcross) {
  auto a = StartSource();
  ASSERT_NE(a, nullptr);
  auto c = StartSource("", "node-c");
  ASSERT_NE(c, nullptr);
  ::setenv("WEIGHTCACHE_TEST_FILL_STRIPE_BYTES", "65536", 1);  // 14 stripes, round-robin
  auto b = StartFiller();
  ::unsetenv("WEIGHTCACHE_TEST_FILL_STRIPE_BYTES");
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "filled from 2 source(s) (")) << log;
  EXPECT_TRUE(Contains(log, "node-a 127.0.0.1:")) << log;
  EXPECT_TRUE(Contains(log, "node-c 127.0.0.1:")) << log;
  ExpectVerifiedOnB();
}

TEST_F(FleetFillTest, NoSourceInTheRegistryLoadsFromDisk) {
  auto b = StartFiller();
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "no ready host-tier source with an endpoint")) << log;
  EXPECT_TRUE(Contains(log, "loading from disk")) << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

TEST_F(FleetFillTest, APoisonedSourceIsCaughtByTheChecksumsAndBLoadsFromDisk) {
  ::setenv("WEIGHTCACHE_TEST_FILL_POISON", "1", 1);
  auto a = StartSource();
  ::unsetenv("WEIGHTCACHE_TEST_FILL_POISON");
  ASSERT_NE(a, nullptr);
  auto b = StartFiller();
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "the checksum of the filled bytes differs from the source's manifest"))
      << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

TEST_F(FleetFillTest, ASourceKilledMidTransferLeavesBToItsDisk) {
  auto a = StartSource();
  ASSERT_NE(a, nullptr);
  // B pulls 4 KiB stripes one at a time and, after its first, waits on the FIFO: A is killed
  // while B holds a part of the arena, then B goes on.
  const std::string fifo = dir_.Join("pause.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << errno;
  ::setenv("WEIGHTCACHE_TEST_FILL_STRIPE_BYTES", "4096", 1);
  ::setenv("WEIGHTCACHE_TEST_FILL_PAUSE_FIFO", fifo.c_str(), 1);
  auto b = StartFiller();
  ::unsetenv("WEIGHTCACHE_TEST_FILL_STRIPE_BYTES");
  ::unsetenv("WEIGHTCACHE_TEST_FILL_PAUSE_FIFO");
  ASSERT_NE(b, nullptr);
  // Opening the FIFO's write end without blocking succeeds once B has opened its read end.
  UniqueFd writer;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (!writer && std::chrono::steady_clock::now() < until && b->Running()) {
    writer = UniqueFd(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (!writer) std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(writer) << "B never paused mid-transfer\n" << b->Log();
  // The pull is the load's progress: B is loading, one 4 KiB stripe of ~0.5 MB in.
  const std::vector<std::string> sockets = FindSockets(dir_.Join("run-b"));
  ASSERT_EQ(sockets.size(), 1u);
  const auto status = QueryStatus(sockets[0]);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, CacheState::kLoading);
  EXPECT_GT(status->bytes_done, 0u);
  EXPECT_LT(status->bytes_done, status->bytes_total / 10);
  a->Signal(SIGKILL);
  ASSERT_EQ(a->WaitExit(10s), 128 + SIGKILL);
  writer.Reset();  // B reads EOF and goes on: its next read from A fails
  // At worst A is noticed by the stripe timeout (30 s), then the disk load.
  const std::string log = ReadyLogOfB(*b, 120s);
  EXPECT_TRUE(Contains(log, "fill: unavailable: arena fetch: every source failed")) << log;
  EXPECT_TRUE(Contains(log, "loading from disk")) << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

TEST_F(FleetFillTest, ASourceOfOtherWeightsWithEqualHeadersIsCaughtByTheDiskSample) {
  // Another fine-tune: the same headers (so the same fleet key, which leaves out the files),
  // other tensor bytes. Its manifest's checksums are its own bytes': only B's sample of its
  // own checkpoint tells them apart.
  const std::string other = dir_.Join("other");
  std::filesystem::copy(model_, other, std::filesystem::copy_options::recursive);
  for (const auto& file : std::filesystem::directory_iterator(other)) {
    if (file.path().extension() != ".safetensors") continue;
    std::fstream f(file.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_GE(bytes.size(), 8u);
    uint64_t header = 0;
    std::memcpy(&header, bytes.data(), sizeof(header));  // little-endian, as on x86 and arm
    for (size_t i = 8 + header; i < bytes.size(); ++i)
      bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
    f.seekp(0);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good()) << file.path();
  }
  ASSERT_EQ(ConfigFor(other, "tiny").FleetDigest(), ConfigFor(model_, "tiny").FleetDigest());
  auto a = StartSource(other);
  ASSERT_NE(a, nullptr);
  auto b = StartFiller();
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "differ from the checkpoint's")) << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

// `launch` forwards the fleet flags to every daemon. A TP=4 job over two nodes (--nnodes 2,
// two fake GPUs each): nodes a0 and a1 (node ranks 0 and 1) serve their ranks' arenas; node b
// joins as node rank 1 and fills each of its ranks (tp 2 and 3) from a1's daemon of the same
// rank, never from a0 (the fleet key holds the ranks) and never from its disk.
class FleetLaunchTest : public FleetFillTest {
 protected:
  void SetUp() override {
    FleetFillTest::SetUp();
    if (IsSkipped()) return;
    WriteFakeInventory(dir_.Join("inventory.json"), 2);
    std::ofstream(dir_.Join("rules.json"))
        << R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]})";
  }
  void TearDown() override {
    // The daemons of a launch outlive it (and are not our children): stop them and wait.
    for (pid_t pid : started_) ::kill(pid, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + 10s;
    for (pid_t pid : started_) {
      while (::kill(pid, 0) == 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(20ms);
      }
      EXPECT_NE(::kill(pid, 0), 0) << "daemon " << pid << " ignored SIGTERM";
    }
    FleetFillTest::TearDown();
  }

  // `launch` of node rank `node_rank` of the TP=4 job, as node `node`, under its own runtime
  // dir; `extra` after the rest. Returns the exit code; `json` gets the summary.
  int Launch(const std::string& node, int node_rank, std::vector<std::string> extra,
             nlohmann::json* json = nullptr, std::string* err = nullptr) {
    std::vector<std::string> argv = {CliPath(),
                                     "launch",
                                     "--model",
                                     model_,
                                     "--model-id",
                                     "tiny",
                                     "--tier",
                                     "host",
                                     "--tp-size",
                                     "4",
                                     "--shard-rules",
                                     dir_.Join("rules.json"),
                                     "--nnodes",
                                     "2",
                                     "--node-rank",
                                     std::to_string(node_rank),
                                     "--runtime-dir",
                                     dir_.Join("run-" + node),
                                     "--device-inventory",
                                     dir_.Join("inventory.json"),
                                     "--threads",
                                     "2",
                                     "--ready-timeout",
                                     "60",
                                     "--json",
                                     "--registry",
                                     etcd_->url(),
                                     "--registry-ttl",
                                     "2",
                                     "--registry-timeout",
                                     "1",
                                     "--node-name",
                                     node};
    if (std::find(extra.begin(), extra.end(), "--tier") != extra.end()) {
      argv.erase(argv.begin() + 6, argv.begin() + 8);  // "--tier", "host": the extra one's
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    // The daemons inherit launch's environment: their info lines (the fill's) in their logs,
    // whatever the test runner's level (tests/CMakeLists.txt sets warn).
    const CommandResult r = RunCommand(argv, {"WEIGHTCACHE_LOG_LEVEL=info"});
    if (err != nullptr) *err = r.err;
    const nlohmann::json summary = nlohmann::json::parse(r.out, nullptr, false);
    if (r.exit_code == 0 && !summary.is_discarded()) {
      for (const auto& d : summary["daemons"]) started_.push_back(d["pid"].get<pid_t>());
    }
    if (json != nullptr) *json = summary;
    return r.exit_code;
  }

  // The `fleet ls --json` entries of `node` that are ready with a bound endpoint, by tp rank.
  std::map<int, std::string> ReadyEndpoints(const std::string& node) {
    std::map<int, std::string> endpoints;
    const CommandResult ls =
        RunCommand({CliPath(), "fleet", "ls", "--json", "--registry", etcd_->url()});
    last_ls_ = ls.out + ls.err;
    if (ls.exit_code != 0) return endpoints;
    const nlohmann::json listed = nlohmann::json::parse(ls.out);
    for (const auto& e : listed["entries"]) {
      const std::string endpoint = e["endpoint"];
      if (e["node"] == node && e["state"] == "ready" && endpoint.rfind("127.0.0.1:", 0) == 0 &&
          endpoint != "127.0.0.1:0") {
        endpoints[e["tp_rank"].get<int>()] = endpoint;
      }
    }
    return endpoints;
  }
  std::map<int, std::string> WaitReadyEndpoints(const std::string& node, size_t count) {
    const auto until = std::chrono::steady_clock::now() + 30s;
    std::map<int, std::string> endpoints = ReadyEndpoints(node);
    while (endpoints.size() < count && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(100ms);
      endpoints = ReadyEndpoints(node);
    }
    return endpoints;
  }

  static std::string ReadLog(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  std::vector<pid_t> started_;
};

TEST_F(FleetLaunchTest, AJoiningNodeFillsEveryRankFromTheNodeHoldingThatRank) {
  const std::vector<std::string> serve_fill = {"--fill-serve", "127.0.0.1:0", "--fill-allow",
                                               "127.0.0.1"};
  nlohmann::json a0;
  nlohmann::json a1;
  ASSERT_EQ(Launch("a0", 0, serve_fill, &a0), 0) << a0.dump();
  ASSERT_EQ(Launch("a1", 1, serve_fill, &a1), 0) << a1.dump();
  const std::map<int, std::string> a0_endpoints = WaitReadyEndpoints("a0", 2);
  ASSERT_EQ(a0_endpoints.size(), 2u) << last_ls_;
  const std::map<int, std::string> a1_endpoints = WaitReadyEndpoints("a1", 2);
  ASSERT_EQ(a1_endpoints.size(), 2u) << last_ls_;
  EXPECT_EQ(a0_endpoints.begin()->first, 0);
  EXPECT_EQ(a1_endpoints.begin()->first, 2);

  nlohmann::json b;
  std::string err;
  ASSERT_EQ(Launch("b", 1, {"--fill-from", "registry"}, &b, &err), 0) << b.dump() << err;
  ASSERT_EQ(b["daemons"].size(), 2u) << b.dump();
  for (const auto& d : b["daemons"]) {
    const int tp_rank = d["tp_rank"];
    const std::string log = ReadLog(d["log"]);
    // Every fleet flag reached the daemon, and its bytes came from a1's daemon of its rank.
    EXPECT_TRUE(Contains(log, "--fill-from registry")) << log;
    EXPECT_TRUE(Contains(log, "--node-name b")) << log;
    EXPECT_TRUE(Contains(log, "--registry-ttl 2")) << log;
    EXPECT_TRUE(Contains(log, "filled from 1 source(s) (a1 " + a1_endpoints.at(tp_rank)))
        << "tp " << tp_rank << ":\n"
        << log;
    EXPECT_FALSE(Contains(log, "(a0 ")) << log;
    EXPECT_FALSE(Contains(log, "loading from disk")) << log;

    const CommandResult r = RunCommand({CliPath(),
                                        "attach",
                                        "--model",
                                        model_,
                                        "--model-id",
                                        "tiny",
                                        "--tier",
                                        "host",
                                        "--tp-size",
                                        "4",
                                        "--tp-rank",
                                        std::to_string(tp_rank),
                                        "--shard-rules",
                                        dir_.Join("rules.json"),
                                        "--runtime-dir",
                                        dir_.Join("run-b"),
                                        "--device-inventory",
                                        dir_.Join("inventory.json"),
                                        "--device",
                                        d["device_uuid"],
                                        "--on-missing",
                                        "error",
                                        "--verify",
                                        "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto attached = nlohmann::json::parse(r.out);
    EXPECT_EQ(attached["source"], "daemon") << r.out;
    EXPECT_EQ(attached["verify"]["ok"], true) << r.out;
    EXPECT_EQ(attached["verify"]["tensors"], 8) << r.out;
  }
}

TEST_F(FleetLaunchTest, BadFleetFlagsStopTheLaunchBeforeAnyDaemonStarts) {
  const struct {
    std::vector<std::string> flags;
    std::string error;
  } cases[] = {
      // Rank 3 (node rank 1's second) would serve on port 65536.
      {{"--fill-serve", "127.0.0.1:65533", "--fill-allow", "127.0.0.1"},
       "--fill-serve 127.0.0.1:65533: the daemon of rank 3 would get port 65536"},
      {{"--fill-serve", "/run/fill.sock", "--fill-allow", "127.0.0.1"}, "not HOST:PORT"},
      {{"--advertise", "10.0.0.5"}, "--advertise 10.0.0.5: not HOST:PORT"},
      {{"--fill-serve", "127.0.0.1:0"}, "needs --fill-allow"},
      {{"--fill-from", "disk"}, "is neither \"registry\" nor HOST:PORT"},
      // Rank 3 would pull from port 65536 of the listed source.
      {{"--fill-from", "10.0.0.1:65533"},
       "--fill-from 10.0.0.1:65533: the daemon of rank 3 would get port 65536"},
  };
  for (const auto& c : cases) {
    std::string err;
    EXPECT_EQ(Launch("b", 1, c.flags, nullptr, &err), 2) << c.error << ": " << err;
    EXPECT_TRUE(Contains(err, c.error)) << err;
  }
  EXPECT_TRUE(FindSockets(dir_.Join("run-b")).empty()) << "a daemon was started";
}

TEST_F(FleetFillTest, BadFillFlagsAreUsageErrors) {
  const auto serve = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {CliPath(), "serve"};
    for (auto& a : HostServeArgs(model_, dir_.Join("run-b"), std::move(extra))) {
      args.push_back(std::move(a));
    }
    return RunCommand(args);
  };
  const struct {
    std::vector<std::string> flags;
    std::string error;
  } cases[] = {
      {{"--fill-from", "registry"}, "--fill-from registry needs --registry"},
      {{"--registry", etcd_->url(), "--fill-from", "disk"},
       "--fill-from: \"disk\" is neither \"registry\" nor HOST:PORT[,HOST:PORT...]"},
      {{"--fill-from", "10.0.0.1:7400,10.0.0.2"}, "(\"10.0.0.2\" is not HOST:PORT)"},
      {{"--fill-from", "10.0.0.1:7400,"}, "(\"\" is not HOST:PORT)"},
      {{"--registry", etcd_->url(), "--fill-serve", "127.0.0.1:0"}, "needs --fill-allow"},
      {{"--fill-allow", "127.0.0.1"}, "--fill-allow is the peer list of --fill-serve"},
      {{"--registry", etcd_->url(), "--fill-serve", "127.0.0.1:0", "--fill-allow", "10.0.0.1/8"},
       "--fill-allow"},
      {{"--registry", etcd_->url(), "--fill-serve", "0.0.0.0:7400", "--fill-allow", "127.0.0.1"},
       "listens on every address, and the registry entry needs one other nodes can reach: give "
       "--advertise HOST:PORT"},
  };
  for (const auto& c : cases) {
    const CommandResult r = serve(c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.error << ": " << r.err;
    EXPECT_TRUE(Contains(r.err, c.error)) << r.err;
  }
}

}  // namespace
}  // namespace weightcache::testing
