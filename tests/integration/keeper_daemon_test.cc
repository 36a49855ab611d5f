// The daemon and its keeper (docs/keeper.md): real `weightcache serve` processes killed with
// SIGKILL at each point of their lifecycle, then restarted. A cache that was ready is
// re-adopted from the keeper with equal bytes and without reading the checkpoint; one that was
// not, or whose checkpoint changed, or whose kept memory fails a check, is loaded again.
//
// "Without reading the checkpoint" is proved by the daemon's own /proc/PID/io rchar (every
// byte its read/pread calls returned, whatever the file): a daemon that loads reads at least
// the checkpoint's tensor bytes, so the same measure on a loading daemon is the control (it
// must be at least the tensor bytes), and an adopted daemon's must stay below a quarter of
// them. The sealed memory the adopted daemon checksums is mapped, not read, so it does not
// count; nothing can make a load pass this by accident.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/test_hooks.h"
#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "os/memfd.h"
#include "protocol/connection.h"
#include "support/sealed_cache.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

constexpr auto kTimeout = std::chrono::milliseconds(10'000);

// The memfds process `pid` holds open (/proc/PID/fd links to "/memfd:…"): a host-tier daemon
// holds its store's (the manifest and one per allocation), and an fd of a withdrawal that
// leaked would be one more. Sockets are not counted: a client's connection may still be
// closing when the test looks.
size_t OpenMemfds(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    ADD_FAILURE() << "cannot list " << dir;
    return 0;
  }
  size_t n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char target[256] = {};
    const std::string link = dir + "/" + e->d_name;
    if (::readlink(link.c_str(), target, sizeof(target) - 1) > 0 &&
        std::strncmp(target, "/memfd:", 7) == 0) {
      ++n;
    }
  }
  ::closedir(d);
  return n;
}

keeper::KeeperPaths KeeperOf(const std::string& socket) {
  const std::string k = identity::KeeperSocketFor(socket);
  return {k, identity::LockPathFor(k)};
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// An attached client: the AttachReply's mappings, kept for as long as the test wants.
struct Attached {
  protocol::AttachReply reply;
  std::vector<os::MappedRegion> maps;
};

class KeeperDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 12 tensors of up to 1 MiB (f32): a few MiB, so a load's rchar stands far above the
    // daemon's other reads.
    model_ = MakeCheckpoint(dir_.Join("model"), 12, 2, 7, 262144);
    runtime_ = dir_.Join("run");
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    tensor_bytes_ = ckpt->total_bytes();
  }
  void TearDown() override {
    // Whatever a test left: its keepers go (they would also exit once the dir is removed).
    DropAllKeepers(runtime_, kTimeout);
  }

  std::vector<std::string> Args(std::vector<std::string> extra = {}) const {
    return HostServeArgs(model_, runtime_, std::move(extra));
  }
  std::unique_ptr<ServeProcess> Start(const std::string& log, std::vector<std::string> extra = {}) {
    auto p = ServeProcess::Start(Args(std::move(extra)), dir_.Join(log));
    EXPECT_NE(p, nullptr);
    return p;
  }
  // Starts a daemon and waits for `ready`; its socket.
  std::string StartReady(std::unique_ptr<ServeProcess>& serve, const std::string& log,
                         std::vector<std::string> extra = {}) {
    serve = Start(log, std::move(extra));
    if (serve == nullptr) return "";
    auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString() << "\n" << serve->Log();
    return socket.ok() ? *socket : "";
  }
  void Kill(ServeProcess& serve) {
    serve.Signal(SIGKILL);
    ASSERT_EQ(serve.WaitExit(kTimeout), 128 + SIGKILL);
  }

  // Attaches to `socket` and maps every allocation.
  Attached Attach(const std::string& socket) {
    Attached a;
    auto conn = protocol::Connection::Connect(socket, 2s);
    EXPECT_TRUE(conn.ok()) << conn.status().ToString();
    if (!conn.ok()) return a;
    protocol::Hello hello;
    hello.config = ConfigFor(model_, "tiny").ToJson();
    hello.client_name = "keeper_daemon_test";
    auto hr = conn->SendHello(hello, os::Deadline::After(5s));
    EXPECT_TRUE(hr.ok() && hr->match);
    auto reply = conn->Attach(os::Deadline::After(5s));
    EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    if (!reply.ok()) return a;
    a.reply = std::move(reply).value();
    for (size_t i = 0; i < a.reply.fds.size(); ++i) {
      auto map = os::MapReadOnly(a.reply.fds[i].get(), a.reply.manifest.allocation_sizes()[i]);
      EXPECT_TRUE(map.ok()) << map.status().ToString();
      if (map.ok()) a.maps.push_back(std::move(map).value());
    }
    return a;
  }
  // Every tensor of `a` equals the checkpoint's bytes (read here, by the test).
  void ExpectEqualBytes(const Attached& a) {
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    ASSERT_TRUE(ckpt.ok());
    const protocol::Manifest& m = a.reply.manifest;
    ASSERT_EQ(m.tensor_count(), ckpt->tensors().size());
    ASSERT_EQ(a.maps.size(), m.allocation_sizes().size());
    for (size_t i = 0; i < m.tensor_count(); ++i) {
      const protocol::TensorEntry e = m.tensor(i);
      const auto* info = ckpt->Find(e.name);
      ASSERT_NE(info, nullptr) << e.name;
      std::vector<uint8_t> expected(info->nbytes);
      ASSERT_TRUE(checkpoint::ReadTensor(*ckpt, *info, expected.data()).ok());
      const auto* mapped = static_cast<const uint8_t*>(a.maps[e.allocation].data()) + e.offset;
      EXPECT_EQ(std::memcmp(mapped, expected.data(), expected.size()), 0) << e.name;
    }
  }
  void ExpectEqualBytes(const std::string& socket) { ExpectEqualBytes(Attach(socket)); }

  // The daemon adopted (its ready line says so, and it read less than a quarter of the
  // tensor bytes).
  void ExpectAdopted(ServeProcess& serve) {
    EXPECT_NE(serve.Log().find("ready: adopted"), std::string::npos) << serve.Log();
    EXPECT_LT(ProcessReadChars(serve.pid()), tensor_bytes_ / 4) << serve.Log();
  }
  // The daemon loaded (no adoption, and it read at least every tensor byte).
  void ExpectLoaded(ServeProcess& serve) {
    EXPECT_EQ(serve.Log().find("ready: adopted"), std::string::npos) << serve.Log();
    EXPECT_GE(ProcessReadChars(serve.pid()), tensor_bytes_) << serve.Log();
  }

  // A keeper for the cache at `socket` that holds memory claiming that cache, but whose first
  // tensor does not have its manifest's checksum (a corrupted deposit); its pid.
  void KeepACorruptCache(const std::string& socket, pid_t* keeper_pid) {
    keeper::SpawnOptions spawn;
    spawn.program = CliPath();
    spawn.socket = KeeperOf(socket).socket;
    auto pid = keeper::SpawnKeeper(spawn);
    ASSERT_TRUE(pid.ok()) << pid.status().ToString();
    *keeper_pid = *pid;
    auto corrupt = MakeSealedCache({1 << 16, 1 << 16}, 3, /*corrupt=*/0);
    ASSERT_TRUE(corrupt.ok()) << corrupt.status().ToString();
    ASSERT_TRUE(keeper::DepositToKeeper(
                    KeeperOf(socket).socket, corrupt->Info(ConfigFor(model_, "tiny").Digest()),
                    corrupt->manifest_fd.get(), corrupt->allocation_fds(), kTimeout)
                    .ok());
  }

  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_;
  uint64_t tensor_bytes_ = 0;
};

TEST_F(KeeperDaemonTest, KilledWhenReadyIdleIsReadoptedWithEqualBytesWithoutReadingTheCheckpoint) {
  std::unique_ptr<ServeProcess> first;
  const std::string socket = StartReady(first, "first.log");
  ASSERT_FALSE(socket.empty());
  ExpectLoaded(*first);  // the control of the rchar measure
  EXPECT_EQ(QueryStatus(socket)->origin, "disk");
  const size_t loaded_fds = OpenMemfds(first->pid());
  EXPECT_GE(loaded_fds, 2u);  // the manifest and at least one allocation
  Kill(*first);

  // The keeper outlived its daemon and holds the cache.
  auto held = keeper::QueryKeeper(KeeperOf(socket), kTimeout);
  ASSERT_TRUE(held.ok() && held->has_value()) << held.status().ToString();
  EXPECT_EQ((*held)->state, protocol::KeeperState::kHolding);
  EXPECT_EQ((*held)->depositor_pid, first->pid());
  EXPECT_EQ((*held)->config_digest, ConfigFor(model_, "tiny").Digest());

  std::unique_ptr<ServeProcess> second;
  ASSERT_EQ(StartReady(second, "second.log"), socket);
  ExpectAdopted(*second);
  EXPECT_EQ(QueryStatus(socket)->origin, "adopted");  // what `ls` shows
  EXPECT_NE(second->Log().find("checksums of all 12 tensors verified"), std::string::npos)
      << second->Log();
  ExpectEqualBytes(socket);
  // The adopted daemon holds what the loading one held: no fd of the withdrawal leaked.
  EXPECT_EQ(OpenMemfds(second->pid()), loaded_fds);
  // The same keeper stays (it was not re-deposited: the loader's pid is still the first's).
  auto after = keeper::QueryKeeper(KeeperOf(socket), kTimeout);
  ASSERT_TRUE(after.ok() && after->has_value());
  EXPECT_EQ((*after)->keeper_pid, (*held)->keeper_pid);

  // A deliberate stop frees the memory: the keeper is dropped, exits, its socket is gone.
  const CommandResult stop = Cli({"stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_EQ(second->WaitExit(kTimeout), 0);
  EXPECT_FALSE(os::IsLockHeld(KeeperOf(socket).lock));
  EXPECT_FALSE(Exists(KeeperOf(socket).socket));
}

TEST_F(KeeperDaemonTest, KilledMidAttachIsReadoptedAndTheAttachedClientKeepsEqualBytes) {
  std::unique_ptr<ServeProcess> first;
  const std::string socket = StartReady(first, "first.log");
  ASSERT_FALSE(socket.empty());
  const Attached client = Attach(socket);  // holds its mappings through the crash
  Kill(*first);
  ExpectEqualBytes(client);

  std::unique_ptr<ServeProcess> second;
  ASSERT_EQ(StartReady(second, "second.log", {"--adopt-verify", "full"}), socket);
  ExpectAdopted(*second);
  ExpectEqualBytes(client);
  ExpectEqualBytes(socket);
}

TEST_F(KeeperDaemonTest, KilledWhileLoadingLeavesNothingToAdoptAndTheRestartLoads) {
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
  // The daemon's test seam holds its loader on this FIFO after the last byte is read, before
  // the load returns (daemon_loader.cc, PauseAfterLoadForTest): the kill lands mid-load for sure.
  const std::string fifo = dir_.Join("loaded.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto first = SpawnServe(Args(), {"WEIGHTCACHE_TEST_LOADED_FIFO=" + fifo}, dir_.Join("first.log"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  UniqueFd writer;
  while (!writer) {
    writer = UniqueFd(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (writer) break;
    ASSERT_EQ(errno, ENXIO);
    ASSERT_FALSE(first->WaitExit(10ms).has_value()) << first->Log();
  }
  const std::vector<std::string> sockets = FindSockets(runtime_);
  ASSERT_EQ(sockets.size(), 1u);
  auto loading = QueryStatus(sockets[0]);
  ASSERT_TRUE(loading.ok());
  EXPECT_EQ(loading->state, CacheState::kLoading);
  // The keeper started with the load (its exec may still be under way) and waits for its
  // deposit. It takes its lock before it binds its socket: until both, a query finds no
  // keeper (kNotFound), which is not yet the answer (seen under ASan in CI).
  const keeper::KeeperPaths kept = KeeperOf(sockets[0]);
  const auto started_by = std::chrono::steady_clock::now() + kTimeout;
  auto waiting = keeper::QueryKeeper(kept, kTimeout);
  while ((!waiting.ok() || !waiting->has_value()) &&
         std::chrono::steady_clock::now() < started_by) {
    std::this_thread::sleep_for(5ms);
    waiting = keeper::QueryKeeper(kept, kTimeout);
  }
  ASSERT_TRUE(waiting.ok()) << waiting.status().ToString();
  ASSERT_TRUE(waiting->has_value()) << first->Log();
  EXPECT_EQ((*waiting)->state, protocol::KeeperState::kWaiting);
  ASSERT_TRUE(first->Signal(SIGKILL).ok());
  ASSERT_EQ(first->WaitExit(kTimeout), 128 + SIGKILL);
  writer.Reset();
  // Nothing was deposited, and the keeper left with its depositor (its pipe closed): nothing
  // holds or waits for this cache.
  const auto deadline = std::chrono::steady_clock::now() + kTimeout;
  while (os::IsLockHeld(kept.lock) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_FALSE(os::IsLockHeld(kept.lock)) << "the keeper outlived a daemon killed mid-load";
  auto held = keeper::QueryKeeper(kept, kTimeout);
  ASSERT_TRUE(held.ok());
  EXPECT_FALSE(held->has_value());

  std::unique_ptr<ServeProcess> second;
  ASSERT_EQ(StartReady(second, "second.log"), sockets[0]);
  ExpectLoaded(*second);
  ExpectEqualBytes(sockets[0]);
}

TEST_F(KeeperDaemonTest, AChangedCheckpointIsLoadedNotAdoptedAndTheOldKeeperIsAnOrphanStopFrees) {
  std::unique_ptr<ServeProcess> first;
  const std::string old_socket = StartReady(first, "first.log");
  ASSERT_FALSE(old_socket.empty());
  Kill(*first);
  // Leave one cache socket for WaitForState; the orphan is then known by its keeper only.
  ASSERT_EQ(::unlink(old_socket.c_str()), 0);
  MakeCheckpoint(dir_.Join("model"), 12, 2, 8, 262144);  // other bytes, same names
  auto changed = checkpoint::Checkpoint::Open(model_);
  ASSERT_TRUE(changed.ok()) << changed.status().ToString();
  tensor_bytes_ = changed->total_bytes();

  std::unique_ptr<ServeProcess> second;
  const std::string socket = StartReady(second, "second.log");
  ASSERT_FALSE(socket.empty());
  EXPECT_NE(socket, old_socket);  // another checkpoint, another identity
  ExpectLoaded(*second);
  ExpectEqualBytes(socket);  // the new checkpoint's bytes

  // `ls` shows the old cache's keeper as an orphan, with the bytes it holds.
  auto old_keeper = keeper::QueryKeeper(KeeperOf(old_socket), kTimeout);
  ASSERT_TRUE(old_keeper.ok() && old_keeper->has_value());
  const CommandResult ls = Cli({"ls", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  const auto listing = nlohmann::json::parse(ls.out);
  bool orphan_listed = false;
  for (const auto& row : listing["caches"]) {
    if (row["socket"] == old_socket) {
      orphan_listed = true;
      EXPECT_EQ(row["state"], "orphan") << row.dump();
      EXPECT_EQ(row["bytes"], (*old_keeper)->bytes) << row.dump();
      EXPECT_EQ(row["keeper"]["pid"], (*old_keeper)->keeper_pid) << row.dump();
    } else {
      EXPECT_EQ(row["socket"], socket);
      EXPECT_EQ(row["state"], "ready") << row.dump();
      EXPECT_EQ(row["adopted"], false) << row.dump();
    }
  }
  EXPECT_TRUE(orphan_listed) << ls.out;
  const CommandResult text = Cli({"ls", "--runtime-dir", runtime_});
  EXPECT_NE(text.out.find("orphan"), std::string::npos) << text.out;

  // `stop` on the orphan (by socket) frees it: the keeper exits, its socket is gone.
  const CommandResult stop = Cli({"stop", "--socket", old_socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_NE(stop.err.find("no daemon; its keeper"), std::string::npos) << stop.err;
  EXPECT_FALSE(os::IsLockHeld(KeeperOf(old_socket).lock));
  EXPECT_FALSE(Exists(KeeperOf(old_socket).socket));
  EXPECT_TRUE(second->Running());  // the other cache is not touched
}

// `--adopt-verify behind`: the restart is ready on the kept memory before its checksums are
// checked, then checks every tensor and says so; the bytes are the checkpoint's.
TEST_F(KeeperDaemonTest, AdoptVerifyBehindIsReadyFirstThenVerifiesEveryTensor) {
  std::unique_ptr<ServeProcess> first;
  const std::string socket = StartReady(first, "first.log");
  ASSERT_FALSE(socket.empty());
  Kill(*first);
  std::unique_ptr<ServeProcess> second;
  ASSERT_EQ(StartReady(second, "second.log", {"--adopt-verify", "behind"}), socket);
  ExpectAdopted(*second);
  EXPECT_NE(second->Log().find("checksums of all 12 tensors to be checked behind ready ("),
            std::string::npos)
      << second->Log();
  const auto deadline = std::chrono::steady_clock::now() + kTimeout;
  while (second->Log().find("verified behind ready") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_NE(second->Log().find("the adopted memory is verified behind ready: checksums of all 12 "
                               "tensors match"),
            std::string::npos)
      << second->Log();
  ExpectEqualBytes(socket);
  EXPECT_TRUE(second->Running());
}

// The same with a kept entry whose checksums do not match: served at first, then the daemon
// finds the mismatch, drains, drops the keeper (nobody may adopt that memory again) and exits
// non-zero naming it.
TEST_F(KeeperDaemonTest, AdoptVerifyBehindFindingAMismatchDrainsAndDropsTheKeeper) {
  std::unique_ptr<ServeProcess> probe;
  const std::string socket = StartReady(probe, "probe.log", {"--no-keeper"});
  ASSERT_FALSE(socket.empty());
  probe->Signal(SIGTERM);
  ASSERT_EQ(probe->WaitExit(kTimeout), 0);
  pid_t keeper_pid = 0;
  KeepACorruptCache(socket, &keeper_pid);
  if (HasFatalFailure()) return;

  auto serve = Start("serve.log", {"--adopt-verify", "behind"});
  ASSERT_NE(serve, nullptr);
  const std::optional<int> exit = serve->WaitExit(kTimeout);
  ASSERT_TRUE(exit.has_value()) << serve->Log();
  EXPECT_EQ(*exit, 1) << serve->Log();  // kProtocol: the memory is not what its manifest says
  // (Whether it announced `ready` first depends on which the event loop saw first: the
  // adoption or the check's failure; a failure it saw first is never served.)
  const std::string log = serve->Log();
  EXPECT_NE(log.find("the adopted memory failed its verification behind ready: "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("checksum"), std::string::npos) << log;
  EXPECT_NE(log.find("keeper dropped"), std::string::npos) << log;
  EXPECT_FALSE(os::IsLockHeld(KeeperOf(socket).lock));
}

TEST_F(KeeperDaemonTest, AKeptEntryWhoseChecksumsDoNotMatchIsDroppedAndTheCacheLoaded) {
  // The cache's keeper holds memory that claims this cache but whose first tensor does not
  // have its manifest's checksum (a corrupted deposit).
  std::unique_ptr<ServeProcess> probe;
  const std::string socket = StartReady(probe, "probe.log", {"--no-keeper"});
  ASSERT_FALSE(socket.empty());
  EXPECT_NE(probe->Log().find("no keeper (--no-keeper)"), std::string::npos) << probe->Log();
  const size_t loaded_fds = OpenMemfds(probe->pid());
  EXPECT_GE(loaded_fds, 2u);
  probe->Signal(SIGTERM);
  ASSERT_EQ(probe->WaitExit(kTimeout), 0);
  EXPECT_FALSE(Exists(KeeperOf(socket).socket));  // --no-keeper: none was started

  pid_t keeper_pid = 0;
  KeepACorruptCache(socket, &keeper_pid);
  if (HasFatalFailure()) return;

  std::unique_ptr<ServeProcess> serve;
  ASSERT_EQ(StartReady(serve, "serve.log"), socket);
  const std::string log = serve->Log();
  EXPECT_NE(log.find("not adopting the kept cache"), std::string::npos) << log;
  EXPECT_NE(log.find("checksum"), std::string::npos) << log;
  ExpectLoaded(*serve);
  ExpectEqualBytes(socket);
  // The bad keeper was dropped; the daemon deposited its own load with a new one.
  auto held = keeper::QueryKeeper(KeeperOf(socket), kTimeout);
  ASSERT_TRUE(held.ok() && held->has_value());
  EXPECT_NE((*held)->keeper_pid, keeper_pid);
  EXPECT_EQ((*held)->depositor_pid, serve->pid());
  // No fd of the refused withdrawal stays in the daemon.
  EXPECT_EQ(OpenMemfds(serve->pid()), loaded_fds);
}

}  // namespace
}  // namespace weightcache::testing
