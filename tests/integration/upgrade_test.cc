// The upgrade handover (docs/upgrade.md) with real processes: a ready `weightcache serve`
// daemon gets `weightcache upgrade`, starts its successor (this build's binary, or a wrapper
// script that misbehaves on purpose), hands it the cache, and exits; the successor serves the
// same memory without reading the checkpoint. A successor that refuses, hangs or dies leaves
// the old daemon serving; an old daemon killed mid-handover leaves the successor serving.
// Clients attaching in a loop through the whole handover never fail.
//
// "Without reading the checkpoint": the successor's /proc/PID/io rchar stays below a quarter
// of the tensor bytes (keeper_daemon_test.cc explains the measure and its control).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "support/test_env.h"
#include "weightcache/client.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

constexpr auto kTimeout = std::chrono::milliseconds(15'000);

// The fds this process has open (of the first 4096).
int OpenFds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) >= 0 ? 1 : 0;
  return n;
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// Waits for a process that is not our child (the successor is the old daemon's) to be gone.
bool WaitGone(pid_t pid, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (Alive(pid)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// Waits until `serve`'s log (which its successor shares) holds `text`.
bool WaitForLog(ServeProcess& serve, const std::string& text) {
  const auto until = std::chrono::steady_clock::now() + kTimeout;
  while (serve.Log().find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// The pid of whoever listens at `socket` (SO_PEERCRED of a fresh connection), or -1.
pid_t ServerPid(const std::string& socket) {
  auto conn = os::ConnectUnix(socket, 2s);
  if (!conn.ok()) return -1;
  auto cred = os::PeerCredentials(conn->get());
  return cred.ok() ? cred->pid : -1;
}

class UpgradeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 12, 2, 7, 262144);
    runtime_ = dir_.Join("run");
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    tensor_bytes_ = ckpt->total_bytes();
  }
  void TearDown() override {
    // Successors are not our children: stop whatever serves, then the keepers.
    for (pid_t pid : successors_) {
      if (Alive(pid)) ::kill(pid, SIGKILL);
    }
    DropAllKeepers(runtime_, kTimeout);
  }

  std::vector<std::string> Args(std::vector<std::string> extra = {}) const {
    return HostServeArgs(model_, runtime_, std::move(extra));
  }
  std::string StartReady(std::unique_ptr<ServeProcess>& serve,
                         std::vector<std::string> extra = {}) {
    serve = ServeProcess::Start(Args(std::move(extra)), dir_.Join("serve.log"));
    if (serve == nullptr) return "";
    auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString() << "\n" << serve->Log();
    return socket.ok() ? *socket : "";
  }
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }
  // `weightcache upgrade --socket S --json [extra]`: the successor's pid (0 on failure).
  pid_t Upgrade(const std::string& socket, CommandResult* result,
                std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"upgrade", "--socket", socket, "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    *result = Cli(args);
    if (result->exit_code != 0) return 0;
    auto j = nlohmann::json::parse(result->out, nullptr, false);
    if (j.is_discarded() || !j.contains("successor_pid")) {
      ADD_FAILURE() << "upgrade --json printed: " << result->out;
      return 0;
    }
    const pid_t pid = j["successor_pid"].get<pid_t>();
    successors_.push_back(pid);
    return pid;
  }
  // A successor binary that runs `prelude` (sh) and then, unless it exits, the real one.
  std::string Wrapper(const std::string& name, const std::string& prelude) {
    std::string path = dir_.Join(name);
    std::ofstream(path) << "#!/bin/sh\n" << prelude << "\nexec '" << CliPath() << "' \"$@\"\n";
    ::chmod(path.c_str(), 0755);
    return path;
  }
  // Attaches through the client library, never falling back; the first tensor's bytes.
  Result<std::string> AttachFirstBytes(const std::string& socket) {
    AttachOptions o;
    o.identity.model_dir = model_;
    o.identity.model_id = "tiny";
    o.identity.tier = Tier::kHost;
    o.identity.runtime_dir = runtime_;
    o.identity.socket = socket;
    o.on_missing = OnMissing::kError;
    o.wait_timeout = 5s;
    WEIGHTCACHE_ASSIGN_OR_RETURN(Attachment a, Attachment::Attach(o));
    if (a.source() != AttachSource::kDaemon) {
      return InternalError("attached from " + a.source_reason());
    }
    const Tensor& t = a.tensors().at(0);
    return std::string(static_cast<const char*>(t.host_ptr()), std::min<uint64_t>(t.nbytes, 64));
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_;
  uint64_t tensor_bytes_ = 0;
  std::vector<pid_t> successors_;
};

TEST_F(UpgradeTest, TheSuccessorServesTheSameMemoryWithoutReadingTheCheckpoint) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  auto before = AttachFirstBytes(socket);
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  const auto held = keeper::QueryKeeper(
      {identity::KeeperSocketFor(socket), identity::LockPathFor(identity::KeeperSocketFor(socket))},
      kTimeout);
  ASSERT_TRUE(held.ok() && held->has_value()) << held.status().ToString();

  CommandResult up;
  const pid_t successor = Upgrade(socket, &up);
  ASSERT_GT(successor, 0) << up.err << "\n" << old->Log();
  EXPECT_NE(successor, old->pid());
  // The old daemon exits cleanly, without dropping the keeper; the successor owns the path
  // and the lock, and serves the same bytes without having read the checkpoint.
  EXPECT_EQ(old->WaitExit(kTimeout), 0) << old->Log();
  EXPECT_EQ(ServerPid(socket), successor);
  EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), successor);
  EXPECT_TRUE(os::IsLockHeld(identity::LockPathFor(socket)));
  EXPECT_LT(ProcessReadChars(successor), tensor_bytes_ / 4) << old->Log();
  EXPECT_TRUE(WaitForLog(*old, "took over from pid " + std::to_string(old->pid()))) << old->Log();
  EXPECT_TRUE(WaitForLog(*old, "ready: adopted 12 tensors")) << old->Log();
  auto after = AttachFirstBytes(socket);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(*after, *before);
  const auto kept = keeper::QueryKeeper(
      {identity::KeeperSocketFor(socket), identity::LockPathFor(identity::KeeperSocketFor(socket))},
      kTimeout);
  ASSERT_TRUE(kept.ok() && kept->has_value());
  EXPECT_EQ((*kept)->keeper_pid, (*held)->keeper_pid);

  // The successor is a daemon like any: `stop` ends it (and its keeper).
  const CommandResult stop = Cli({"stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_TRUE(WaitGone(successor, kTimeout));
  EXPECT_FALSE(os::IsLockHeld(identity::LockPathFor(socket)));
}

TEST_F(UpgradeTest, SigusrTwoStartsTheSameUpgradeAndAnAttachedClientKeepsItsBytes) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  AttachOptions o;
  o.identity.model_dir = model_;
  o.identity.model_id = "tiny";
  o.identity.tier = Tier::kHost;
  o.identity.runtime_dir = runtime_;
  o.identity.socket = socket;
  o.on_missing = OnMissing::kError;
  o.wait_timeout = 5s;
  auto attached = Attachment::Attach(o);  // held through the handover
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ASSERT_EQ(attached->source(), AttachSource::kDaemon) << attached->source_reason();
  auto bytes_of = [](const Attachment& a) {
    std::string all;
    for (const Tensor& t : a.tensors()) {
      all.append(static_cast<const char*>(t.host_ptr()), t.nbytes);
    }
    return all;
  };
  const std::string before = bytes_of(*attached);

  old->Signal(SIGUSR2);
  // The successor is this binary with the old daemon's own arguments; the old one exits 0.
  EXPECT_EQ(old->WaitExit(kTimeout), 0) << old->Log();
  EXPECT_NE(old->Log().find("upgrade requested by SIGUSR2 from pid " + std::to_string(::getpid())),
            std::string::npos)
      << old->Log();
  const pid_t successor = ServerPid(socket);
  ASSERT_GT(successor, 0);
  successors_.push_back(successor);
  EXPECT_NE(successor, old->pid());
  EXPECT_TRUE(WaitForLog(*old, "took over from pid " + std::to_string(old->pid()))) << old->Log();
  EXPECT_LT(ProcessReadChars(successor), tensor_bytes_ / 4) << old->Log();
  // The attached client reads the same bytes through its old mappings, and a new attach
  // (served by the successor) gets them too.
  EXPECT_EQ(bytes_of(*attached), before);
  auto again = Attachment::Attach(o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(bytes_of(*again), before);

  const CommandResult stop = Cli({"stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_TRUE(WaitGone(successor, kTimeout));
}

TEST_F(UpgradeTest, ASuccessorThatExitsLeavesTheOldDaemonServing) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  CommandResult up;
  EXPECT_EQ(Upgrade(socket, &up, {"--binary", Wrapper("exits.sh", "exit 3")}), 0);
  EXPECT_EQ(up.exit_code, 1) << up.err;
  EXPECT_NE(up.err.find("ended the handover without taking over"), std::string::npos) << up.err;
  EXPECT_TRUE(old->Running());
  EXPECT_EQ(ServerPid(socket), old->pid());
  EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), old->pid());
  EXPECT_TRUE(AttachFirstBytes(socket).ok());
  // And a second upgrade, to the real binary, still works.
  const pid_t successor = Upgrade(socket, &up);
  EXPECT_GT(successor, 0) << up.err;
  EXPECT_EQ(old->WaitExit(kTimeout), 0) << old->Log();
}

TEST_F(UpgradeTest, ASuccessorOfAChangedCheckpointRefusesAndTheOldDaemonServesOn) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  // The successor computes its identity from the checkpoint as it is now: a shard rewritten
  // (same bytes, a new file) changes checkpoint_files, so it computes another digest and
  // refuses the cache (exit 4, kMismatch naming both).
  const std::string shard = model_ + "/model-00001-of-00002.safetensors";
  ASSERT_EQ(::system(("cp -p '" + shard + "' '" + shard + ".new' && mv '" + shard + ".new' '" +
                      shard + "' && touch -d '2001-01-01' '" + shard + "'")
                         .c_str()),
            0);
  CommandResult up;
  EXPECT_EQ(Upgrade(socket, &up), 0);
  EXPECT_EQ(up.exit_code, 4) << up.err;
  EXPECT_NE(up.err.find("refused the handover"), std::string::npos) << up.err;
  EXPECT_NE(up.err.find("this successor computes"), std::string::npos) << up.err;
  EXPECT_TRUE(old->Running());
  EXPECT_EQ(ServerPid(socket), old->pid());
  EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), old->pid());
}

TEST_F(UpgradeTest, AHungSuccessorIsKilledAtTheTimeoutAndTheOldDaemonServesOn) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old, {"--upgrade-timeout", "1"});
  ASSERT_FALSE(socket.empty());
  CommandResult up;
  EXPECT_EQ(Upgrade(socket, &up, {"--binary", Wrapper("hangs.sh", "exec sleep 600")}), 0);
  EXPECT_EQ(up.exit_code, 6) << up.err;
  EXPECT_NE(up.err.find("did not take over within 1000 ms"), std::string::npos) << up.err;
  EXPECT_EQ(ServerPid(socket), old->pid());
  EXPECT_TRUE(AttachFirstBytes(socket).ok());
}

TEST_F(UpgradeTest, TheOldDaemonKilledMidHandoverLeavesTheSuccessorServing) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  auto before = AttachFirstBytes(socket);
  ASSERT_TRUE(before.ok());
  // The successor kills its parent (the old daemon) once the handover sits in its channel,
  // then takes over: the lock travels in the channel, so nobody can take it in between.
  const std::string wrapper = Wrapper("kills.sh", "sleep 0.3; kill -9 $PPID");
  const CommandResult up = Cli({"upgrade", "--socket", socket, "--binary", wrapper});
  EXPECT_NE(up.exit_code, 0);  // its daemon died before answering
  EXPECT_EQ(old->WaitExit(kTimeout), 128 + SIGKILL);
  pid_t successor = -1;
  const auto until = std::chrono::steady_clock::now() + kTimeout;
  while (std::chrono::steady_clock::now() < until) {
    successor = ServerPid(socket);
    if (successor > 0 && successor != old->pid()) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_GT(successor, 0) << old->Log();
  successors_.push_back(successor);
  EXPECT_NE(successor, old->pid());
  auto after = AttachFirstBytes(socket);
  ASSERT_TRUE(after.ok()) << after.status().ToString() << "\n" << old->Log();
  EXPECT_EQ(*after, *before);
  EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(socket)), successor);
}

TEST_F(UpgradeTest, SixtyFourClientsAttachingInALoopNeverFailThroughTheHandover) {
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  auto expected = AttachFirstBytes(socket);
  ASSERT_TRUE(expected.ok());
  const int fds_before = OpenFds();
  std::atomic<bool> stop{false};
  std::atomic<int> attaches{0};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::mutex failure_mu;
  std::vector<std::thread> clients;
  clients.reserve(64);
  for (int i = 0; i < 64; ++i) {
    clients.emplace_back([&] {
      while (!stop.load()) {
        auto bytes = AttachFirstBytes(socket);
        if (bytes.ok() && *bytes == *expected) {
          attaches.fetch_add(1);
          continue;
        }
        if (failures.fetch_add(1) == 0) {
          std::lock_guard<std::mutex> lock(failure_mu);
          first_failure = bytes.ok() ? "different bytes" : bytes.status().ToString();
        }
      }
    });
  }
  std::this_thread::sleep_for(300ms);
  const int before_upgrade = attaches.load();
  CommandResult up;
  const pid_t successor = Upgrade(socket, &up);
  EXPECT_GT(successor, 0) << up.err;
  EXPECT_EQ(old->WaitExit(kTimeout), 0) << old->Log();
  const int at_exit = attaches.load();
  std::this_thread::sleep_for(300ms);
  stop.store(true);
  for (auto& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_GT(before_upgrade, 64);
  EXPECT_GT(attaches.load(), at_exit);  // the successor served after the old one exited
  EXPECT_EQ(ServerPid(socket), successor);
  const int fds_after = OpenFds();
  // No fd leaked by 64 threads of attaches; one fewer: the old daemon's pidfd, closed when it
  // was reaped (WaitExit).
  EXPECT_EQ(fds_after, fds_before - 1);
}

TEST_F(UpgradeTest, UpgradeNeedsALiveDaemonAndAnAbsoluteBinary) {
  CommandResult none = Cli({"upgrade", "--socket", dir_.Join("nobody.sock")});
  EXPECT_EQ(none.exit_code, 3) << none.err;
  EXPECT_NE(none.err.find("no live daemon"), std::string::npos) << none.err;
  std::unique_ptr<ServeProcess> old;
  const std::string socket = StartReady(old);
  ASSERT_FALSE(socket.empty());
  CommandResult relative = Cli({"upgrade", "--socket", socket, "--binary", "weightcache"});
  EXPECT_EQ(relative.exit_code, 2) << relative.err;
  EXPECT_NE(relative.err.find("must be an absolute path"), std::string::npos) << relative.err;
  EXPECT_EQ(ServerPid(socket), old->pid());
}

}  // namespace
}  // namespace weightcache::testing
