// `serve --fill-from registry` against a real etcd and the fleet transport over loopback TCP
// (docs/fleet.md "Fill"): two "nodes" are two daemons with their own runtime dirs. Node A
// serves its host-tier arena (--fill-serve, --fill-allow); node B fills from it with equal
// bytes and never reads the tensor data from its disk; no source, a source killed mid-transfer
// and a poisoned source all end with B loading from its disk, ready with correct bytes.
// The checkpoint is laid out as a Hugging Face hub cache snapshot (support/hub_cache.h), so it
// carries a content anchor and B proves what it pulls (--fill-trust content, the default); a
// source that lies consistently about other bytes under our headers is caught by that proof.
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

#include "common/test_hooks.h"
#include "common/unique_fd.h"
#include "integration/daemon_process.h"
#include "support/etcd_server.h"
#include "support/hub_cache.h"
#include "support/test_env.h"
#include "unit/sharding/sharding_fixture.h"

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
    // A hub cache snapshot: every shard's SHA-256 is its blob's name (the content anchor).
    model_ = LayOutAsHubCache(MakeCheckpoint(dir_.Join("model"), 8, 1, 5, 65536), dir_.Join("hub"));
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

  // Node B filling from the registry (serving `model`, default ours), `more` flags after.
  std::unique_ptr<ServeProcess> StartFiller(std::string model = "",
                                            const std::vector<std::string>& more = {},
                                            const std::string& log = "serve-b.log") {
    if (model.empty()) model = model_;
    std::vector<std::string> extra = Registry("node-b");
    extra.insert(extra.end(), {"--fill-from", "registry"});
    extra.insert(extra.end(), more.begin(), more.end());
    return ServeProcess::Start(HostServeArgs(model, dir_.Join("run-b"), extra), dir_.Join(log));
  }

  // A copy of the checkpoint file `file` at `out` (a plain directory: no anchor) with every
  // byte of its data section from `from` on (default all) XORed with 0x5a: the same header,
  // other weights.
  static void WriteOtherWeights(const std::string& file, const std::string& out,
                                uint64_t from_end = 0) {
    std::filesystem::create_directories(std::filesystem::path(out).parent_path());
    std::ifstream in(file, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GE(bytes.size(), 8u);
    uint64_t header = 0;
    std::memcpy(&header, bytes.data(), sizeof(header));  // little-endian, as on x86 and arm
    const size_t first = from_end == 0 ? 8 + header : bytes.size() - from_end;
    ASSERT_GE(first, 8 + header);
    for (size_t i = first; i < bytes.size(); ++i) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
    std::ofstream f(out, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good()) << out;
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

  // `attach --verify --json` on node B's cache (of `model`, default ours): every tensor's
  // checksum against the files.
  void ExpectVerifiedOnB(std::string model = "", int tensors = 8) {
    if (model.empty()) model = model_;
    const CommandResult r =
        RunCommand({CliPath(), "attach", "--model", model, "--model-id", "tiny", "--tier", "host",
                    "--runtime-dir", dir_.Join("run-b"), "--verify", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["source"], "daemon") << r.out;
    EXPECT_EQ(j["tensors"], tensors);
    EXPECT_EQ(j["verify"]["ok"], true) << r.out;
    EXPECT_EQ(j["verify"]["tensors"], tensors) << r.out;
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
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
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
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
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
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
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

TEST_F(FleetFillTest, UnderFleetTrustASourceOfOtherWeightsWithEqualHeadersIsCaughtByTheSample) {
  // Another fine-tune: the same headers, other tensor bytes, both in plain directories (no
  // content anchor: the same fleet key, which then holds the headers only). Its manifest's
  // checksums are its own bytes'; under --fill-trust fleet only B's sample of its own
  // checkpoint tells them apart (every byte differs: the sample cannot miss).
  const std::string ours = dir_.Join("plain-ours/model.safetensors");
  const std::string other = dir_.Join("plain-other/model.safetensors");
  std::filesystem::create_directories(dir_.Join("plain-ours"));
  std::filesystem::copy_file(model_ + "/model.safetensors", ours);
  WriteOtherWeights(ours, other);
  const std::string b_model = dir_.Join("plain-ours");
  ASSERT_EQ(ConfigFor(dir_.Join("plain-other"), "tiny").FleetDigest(),
            ConfigFor(b_model, "tiny").FleetDigest());
  auto a = StartSource(dir_.Join("plain-other"));
  ASSERT_NE(a, nullptr);
  auto b = StartFiller(b_model, {"--fill-trust", "fleet"});
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "fill: pulling into host memory from 1 source(s): node-a")) << log;
  EXPECT_TRUE(Contains(log, "differ from the checkpoint's")) << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB(b_model);
}

// The issue's repro (issue 39 §5): a source whose checkpoint differs from ours in one 4 KiB
// run of one tensor, under the same header, and which claims our content anchor
// (--fill-content-sha256 with our file's SHA-256: it lies, consistently, so it registers under
// our fleet key and its manifest's checksums are its own bytes'). The run is the last 4 KiB of
// a tensor of 260 KiB among 64 MiB: the 16 x 256 KiB sample sees that 4 KiB block with
// probability 16 x 4 KiB / 64 MiB ~ 0.1%, so under the old checks B became ready with the
// source's bytes; the SHA-256 of the filled file against B's own anchor (the hub cache's blob
// name) fails every time, and B loads from its disk.
TEST_F(FleetFillTest, ASourceThatLiesConsistentlyIsCaughtByTheSha256AndBLoadsFromDisk) {
  const std::string spec = dir_.Join("spec.json");
  std::ofstream(spec) << R"([{"name": "big.0", "shape": [16777216], "dtype": "u8"},
    {"name": "big.1", "shape": [16777216], "dtype": "u8"},
    {"name": "big.2", "shape": [16777216], "dtype": "u8"},
    {"name": "big.3", "shape": [16777216], "dtype": "u8"},
    {"name": "tail", "shape": [266240], "dtype": "u8"}])";
  const CommandResult made =
      RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out",
                  dir_.Join("big"), "--spec", spec, "--seed", "7"});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  // The last 4 KiB of the file are the last 4 KiB of "tail" (the writer orders by name).
  WriteOtherWeights(dir_.Join("big/model.safetensors"), dir_.Join("liar/model.safetensors"), 4096);
  const std::string ours_sha = FileSha256(dir_.Join("big/model.safetensors"));
  const std::string theirs_sha = FileSha256(dir_.Join("liar/model.safetensors"));
  ASSERT_NE(ours_sha, theirs_sha);
  const std::string b_model = LayOutAsHubCache(dir_.Join("big"), dir_.Join("hub-big"));
  std::ofstream(dir_.Join("lie.sha256")) << ours_sha << "  model.safetensors\n";

  std::vector<std::string> extra = Registry("node-a");
  extra.insert(extra.end(), {"--fill-serve", "127.0.0.1:0", "--fill-allow", "127.0.0.1",
                             "--fill-content-sha256", dir_.Join("lie.sha256")});
  auto a = ServeProcess::Start(HostServeArgs(dir_.Join("liar"), dir_.Join("run-node-a"), extra),
                               dir_.Join("serve-node-a.log"));
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(WaitForState(*a, dir_.Join("run-node-a"), CacheState::kReady).ok()) << a->Log();
  ASSERT_TRUE(WaitSourceEndpoint("node-a")) << last_ls_ << "\n" << a->Log();
  EXPECT_TRUE(Contains(a->Log(), "(1 file(s), --fill-content-sha256) in the fleet key"))
      << a->Log();

  auto b = StartFiller(b_model);
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b, 60s);
  EXPECT_TRUE(Contains(log, "(1 file(s), hub cache blob name) in the fleet key")) << log;
  // A was picked (the same fleet key) and its bytes passed its own checksums...
  EXPECT_TRUE(Contains(log, "fill: pulling into host memory from 1 source(s): node-a")) << log;
  EXPECT_FALSE(Contains(log, "differs from the source's manifest")) << log;
  // ...and failed the proof against B's own anchor, which names the file and both digests.
  EXPECT_TRUE(Contains(log,
                       "shard model.safetensors: the SHA-256 of the filled bytes under our "
                       "header is " +
                           theirs_sha + ", our checkpoint's is " + ours_sha +
                           " (hub cache blob name); loading from disk"))
      << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  EXPECT_FALSE(Contains(log, "filled from")) << log;
  ExpectVerifiedOnB(b_model, 5);
}

// With the anchor in the fleet key, an honest node serving other files under our headers (its
// own hub cache: its blob is named by its own SHA-256) registers under another key: B's lookup
// finds no entry at all, and B loads from disk without contacting it.
TEST_F(FleetFillTest, AnHonestSourceOfOtherFilesHasAnotherFleetKeyAndIsNeverPicked) {
  WriteOtherWeights(model_ + "/model.safetensors", dir_.Join("other/model.safetensors"));
  const std::string other = LayOutAsHubCache(dir_.Join("other"), dir_.Join("hub-other"));
  // The headers are equal: without the anchor the keys would be too.
  ASSERT_EQ(ConfigFor(other, "tiny").FleetDigest(), ConfigFor(model_, "tiny").FleetDigest());
  auto a = StartSource(other);
  ASSERT_NE(a, nullptr);
  auto b = StartFiller();
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log,
                       "no ready host-tier source with an endpoint among the registry's 0 "
                       "entries of fleet key"))
      << log;
  EXPECT_FALSE(Contains(log, "fill: pulling")) << log;
  EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
  ExpectVerifiedOnB();
}

// Without an anchor (plain directories) the default policy fills nothing: B says why and how to
// give one, contacts no source and loads from disk. --fill-trust fleet, chosen explicitly,
// fills from the same source as before the anchor existed.
TEST_F(FleetFillTest, WithoutAnAnchorOnlyFleetTrustFills) {
  std::filesystem::create_directories(dir_.Join("plain"));
  std::filesystem::copy_file(model_ + "/model.safetensors", dir_.Join("plain/model.safetensors"));
  const std::string plain = dir_.Join("plain");
  auto a = StartSource(plain);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(Contains(a->Log(),
                       "fleet: no content anchor ('model.safetensors': no SHA-256 "
                       "recorded"))
      << a->Log();
  {
    auto b = StartFiller(plain);
    ASSERT_NE(b, nullptr);
    const std::string log = ReadyLogOfB(*b);
    EXPECT_TRUE(Contains(log,
                         "fill: unavailable: fill not attempted: --fill-trust content "
                         "proves the filled bytes against our own checkpoint's SHA-256s, and "
                         "it records none ('model.safetensors': no SHA-256 recorded"))
        << log;
    EXPECT_TRUE(Contains(log,
                         "or --fill-content-sha256 FILE; or trust the fleet's checksums with "
                         "--fill-trust fleet; loading from disk"))
        << log;
    EXPECT_FALSE(Contains(log, "fill: pulling")) << log;
    EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
    ExpectVerifiedOnB(plain);
    b->Signal(SIGTERM);
    EXPECT_EQ(b->WaitExit(30s), 0) << b->Log();
  }
  auto b = StartFiller(plain, {"--fill-trust", "fleet"}, "serve-b-fleet.log");
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "filled from 1 source(s) (node-a 127.0.0.1:")) << log;
  EXPECT_FALSE(Contains(log, "loading from disk")) << log;
  ExpectVerifiedOnB(plain);
}

// A TP rank of the built-in rules (a Llama-shaped checkpoint with its config.json, a hub cache
// snapshot: it has an anchor) holds slices of tensors, which whole-file SHA-256s cannot prove:
// under the default B attempts nothing, says why and which flag trusts the fleet, and loads
// from disk; with --fill-trust fleet it fills from A's rank as before.
TEST_F(FleetFillTest, ASlicedRankIsNotFilledUnderContentTrustOnlyUnderFleetTrust) {
  const sharding::testing::DenseModel dense;
  nlohmann::json spec = nlohmann::json::array();
  for (const auto& t : dense.Tensors()) {
    spec.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}});
  }
  std::ofstream(dir_.Join("dense.spec.json")) << spec.dump();
  const CommandResult made =
      RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out",
                  dir_.Join("dense"), "--spec", dir_.Join("dense.spec.json")});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  std::ofstream(dir_.Join("dense/config.json")) << dense.Config().dump();
  const std::string model = LayOutAsHubCache(dir_.Join("dense"), dir_.Join("hub-dense"));
  const std::vector<std::string> rank = {"--tp-size", "2", "--tp-rank", "1"};

  std::vector<std::string> extra = Registry("node-a");
  extra.insert(extra.end(), {"--fill-serve", "127.0.0.1:0", "--fill-allow", "127.0.0.1"});
  extra.insert(extra.end(), rank.begin(), rank.end());
  auto a = ServeProcess::Start(HostServeArgs(model, dir_.Join("run-node-a"), extra),
                               dir_.Join("serve-node-a.log"));
  ASSERT_NE(a, nullptr);
  ASSERT_TRUE(WaitForState(*a, dir_.Join("run-node-a"), CacheState::kReady).ok()) << a->Log();
  ASSERT_TRUE(WaitSourceEndpoint("node-a")) << last_ls_ << "\n" << a->Log();

  const auto verify = [&] {
    std::vector<std::string> argv = {
        CliPath(), "attach",        "--model",          model,      "--model-id", "tiny", "--tier",
        "host",    "--runtime-dir", dir_.Join("run-b"), "--verify", "--json"};
    argv.insert(argv.end(), rank.begin(), rank.end());
    const CommandResult r = RunCommand(argv);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["source"], "daemon") << r.out;
    EXPECT_EQ(j["verify"]["ok"], true) << r.out;
    EXPECT_EQ(j["verify"]["tensors"], j["tensors"]) << r.out;
  };
  {
    auto b = StartFiller(model, rank);
    ASSERT_NE(b, nullptr);
    const std::string log = ReadyLogOfB(*b);
    EXPECT_TRUE(Contains(log,
                         "fill: unavailable: fill not attempted: this cache holds slices of "
                         "tensors (a rank of sharding rules), which --fill-trust content "
                         "cannot prove against the files' SHA-256s; --fill-trust fleet "
                         "trusts the sources' checksums and the disk sample instead; "
                         "loading from disk"))
        << log;
    EXPECT_FALSE(Contains(log, "fill: pulling")) << log;
    EXPECT_TRUE(Contains(log, "loaded from disk")) << log;
    verify();
    b->Signal(SIGTERM);
    EXPECT_EQ(b->WaitExit(30s), 0) << b->Log();
  }
  std::vector<std::string> fleet = rank;
  fleet.insert(fleet.end(), {"--fill-trust", "fleet"});
  auto b = StartFiller(model, fleet, "serve-b-fleet.log");
  ASSERT_NE(b, nullptr);
  const std::string log = ReadyLogOfB(*b);
  EXPECT_TRUE(Contains(log, "filled from 1 source(s) (node-a 127.0.0.1:")) << log;
  EXPECT_FALSE(Contains(log, "loading from disk")) << log;
  verify();
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
      {{"--fill-from", "10.0.0.1:7400", "--fill-trust", "checksums"}, "--fill-trust"},
      {{"--registry", etcd_->url(), "--fill-trust", "fleet"},
       "--fill-trust is how --fill-from checks what it pulls: give --fill-from too"},
      {{"--fill-content-sha256", dir_.Join("none.sha256")},
       "--fill-content-sha256 anchors the fleet key and the fill: give --registry"},
      {{"--registry", etcd_->url(), "--fill-content-sha256", dir_.Join("none.sha256")},
       "--fill-content-sha256 " + dir_.Join("none.sha256") + ": "},
  };
  for (const auto& c : cases) {
    const CommandResult r = serve(c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.error << ": " << r.err;
    EXPECT_TRUE(Contains(r.err, c.error)) << r.err;
  }
}

}  // namespace
}  // namespace weightcache::testing
