// `weightcache serve` as a real process: lifecycle, ownership, the host tier's bytes, failure
// reporting. Every test runs daemons on its own TempDir runtime dir.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "common/checksum.h"
#include "integration/daemon_process.h"
#include "os/lock_file.h"
#include "os/memfd.h"
#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

class ServeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 24, 2, 7, 65536);
    runtime_ = dir_.Join("run");
  }
  std::vector<std::string> Args(std::vector<std::string> extra = {}) const {
    return HostServeArgs(model_, runtime_, std::move(extra));
  }
  std::unique_ptr<ServeProcess> Start(std::vector<std::string> extra = {},
                                      const std::string& log = "serve.log") {
    auto p = ServeProcess::Start(Args(std::move(extra)), dir_.Join(log));
    EXPECT_NE(p, nullptr);
    return p;
  }
  static std::string LockOf(const std::string& socket) {
    return socket.substr(0, socket.size() - 5) + ".lock";
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_;
};

TEST_F(ServeTest, ReachesReadyAndAttachMapsSealedBytesEqualToTheCheckpoint) {
  auto serve = Start();
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();

  auto checkpoint = checkpoint::Checkpoint::Open(model_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  const identity::CacheConfig config = ConfigFor(model_, "tiny");

  auto status = QueryStatus(*socket);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, CacheState::kReady);
  EXPECT_EQ(status->tensor_count, checkpoint->tensors().size());
  EXPECT_GE(status->bytes, checkpoint->total_bytes());
  EXPECT_EQ(status->bytes_done, checkpoint->total_bytes());
  EXPECT_EQ(status->bytes_total, checkpoint->total_bytes());
  EXPECT_EQ(status->tier, Tier::kHost);
  EXPECT_EQ(status->device_uuid, "host");
  EXPECT_EQ(status->model_id, "tiny");
  EXPECT_EQ(status->pid, serve->pid());
  EXPECT_EQ(status->config_digest, config.Digest());
  EXPECT_EQ(status->clients, 0u);

  auto conn = protocol::Connection::Connect(*socket, 2s);
  ASSERT_TRUE(conn.ok());
  protocol::Hello hello;
  hello.config = config.ToJson();
  hello.client_name = "daemon_serve_test";
  auto hr = conn->SendHello(hello, os::Deadline::After(5s));
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  EXPECT_TRUE(hr->match);
  EXPECT_TRUE(hr->differences.empty());
  auto reply = conn->Attach(os::Deadline::After(5s));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  const auto& manifest = reply->manifest;
  ASSERT_EQ(manifest.tier(), Tier::kHost);
  ASSERT_EQ(reply->fds.size(), manifest.allocation_sizes().size());
  ASSERT_EQ(manifest.tensor_count(), checkpoint->tensors().size());

  std::vector<os::MappedRegion> maps;
  for (size_t a = 0; a < reply->fds.size(); ++a) {
    // Sealed: nobody, the daemon included, can change these bytes any more.
    EXPECT_TRUE(os::CheckSealedReadOnly(reply->fds[a].get()).ok());
    auto map = os::MapReadOnly(reply->fds[a].get(), manifest.allocation_sizes()[a]);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    maps.push_back(std::move(map).value());
  }
  // A writable mapping is refused by the seal.
  void* w = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, reply->fds[0].get(), 0);
  EXPECT_EQ(w, MAP_FAILED);

  for (size_t i = 0; i < manifest.tensor_count(); ++i) {
    const protocol::TensorEntry entry = manifest.tensor(i);
    if (i > 0) {
      EXPECT_LT(manifest.tensor(i - 1).name, entry.name);  // name order
    }
    const auto* info = checkpoint->Find(entry.name);
    ASSERT_NE(info, nullptr) << entry.name;
    ASSERT_EQ(entry.nbytes, info->nbytes) << entry.name;
    std::vector<uint8_t> expected(info->nbytes);
    ASSERT_TRUE(checkpoint::ReadTensor(*checkpoint, *info, expected.data()).ok());
    const auto* mapped = static_cast<const uint8_t*>(maps[entry.allocation].data()) + entry.offset;
    EXPECT_EQ(std::memcmp(mapped, expected.data(), expected.size()), 0) << entry.name;
    EXPECT_EQ(entry.checksum, TensorChecksum(expected.data(), expected.size())) << entry.name;
    EXPECT_EQ(entry.offset % 256, 0u) << entry.name;
  }

  // The attached connection counts as a client until it closes.
  auto attached = QueryStatus(*socket);
  ASSERT_TRUE(attached.ok());
  EXPECT_EQ(attached->clients, 1u);
  conn = Status(StatusCode::kUnavailable, "closed");
  bool zero = false;
  for (int i = 0; i < 500 && !zero; ++i) {
    auto st = QueryStatus(*socket);
    zero = st.ok() && st->clients == 0;
    if (!zero) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(zero) << "clients did not drop to 0 after the attached connection closed";
}

TEST_F(ServeTest, SocketIsOwnerOnlyInsideOwnerOnlyDirectories) {
  auto serve = Start();
  auto socket = WaitForState(*serve, runtime_, std::nullopt);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  struct stat st {};
  ASSERT_EQ(::lstat(socket->c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  for (const std::string& d : {runtime_, runtime_ + "/default", runtime_ + "/default/host"}) {
    ASSERT_EQ(::lstat(d.c_str(), &st), 0) << d;
    EXPECT_TRUE(S_ISDIR(st.st_mode)) << d;
    EXPECT_EQ(st.st_mode & 07777, 0700u) << d;
  }
  EXPECT_EQ(socket->rfind(runtime_ + "/default/host/", 0), 0u) << *socket;
}

TEST_F(ServeTest, SecondDaemonForTheSameIdentityExits7NamingTheOwnerPid) {
  auto first = Start();
  ASSERT_TRUE(WaitForState(*first, runtime_, std::nullopt).ok());
  std::vector<std::string> argv = {CliPath(), "serve"};
  for (const auto& a : Args()) argv.push_back(a);
  const CommandResult second = RunCommand(argv);
  EXPECT_EQ(second.exit_code, 7) << second.err;
  EXPECT_NE(second.err.find("already served"), std::string::npos) << second.err;
  EXPECT_NE(second.err.find(std::to_string(first->pid())), std::string::npos) << second.err;
  // The first daemon is untouched.
  auto st = QueryStatus(FindSockets(runtime_).at(0));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->pid, first->pid());
}

TEST_F(ServeTest, StaleSocketOfAKilledDaemonIsReplacedByTheNextDaemon) {
  auto first = Start({}, "first.log");
  auto socket = WaitForState(*first, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  first->Signal(SIGKILL);
  ASSERT_EQ(first->WaitExit(10s), 128 + SIGKILL);
  struct stat st {};
  ASSERT_EQ(::lstat(socket->c_str(), &st), 0) << "kill -9 should leave the socket behind";
  EXPECT_FALSE(os::IsLockHeld(LockOf(*socket)));

  auto second = Start({}, "second.log");
  auto again = WaitForState(*second, runtime_, CacheState::kReady);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *socket);
  auto status = QueryStatus(*again);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->pid, second->pid());
  EXPECT_NE(second->Log().find("stale socket"), std::string::npos) << second->Log();
}

TEST_F(ServeTest, SigtermRemovesTheSocketReleasesTheLockAndExitsZero) {
  auto serve = Start();
  auto socket = WaitForState(*serve, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  ASSERT_TRUE(os::IsLockHeld(LockOf(*socket)));
  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(10s), 0) << serve->Log();
  struct stat st {};
  EXPECT_NE(::lstat(socket->c_str(), &st), 0) << "socket left behind";
  EXPECT_FALSE(os::IsLockHeld(LockOf(*socket)));
  EXPECT_NE(serve->Log().find("SIGTERM"), std::string::npos) << serve->Log();
}

TEST_F(ServeTest, InvalidCheckpointExits5BeforeCreatingAnything) {
  const std::string bad = dir_.Join("bad");
  ASSERT_EQ(::mkdir(bad.c_str(), 0700), 0);
  // Header length 1000 in a 10-byte file.
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(0xe8);
  bytes[1] = 0x03;
  bytes += "{}";
  WriteFile(bad + "/model.safetensors", bytes);
  const CommandResult r = RunCommand({CliPath(), "serve", "--model", bad, "--model-id", "bad",
                                      "--tier", "host", "--runtime-dir", runtime_});
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_NE(r.err.find("invalid checkpoint"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.safetensors"), std::string::npos) << r.err;
  EXPECT_TRUE(FindSockets(runtime_).empty());
}

TEST_F(ServeTest, PlanOverTheMemoryBudgetReportsFailedWithTheReasonThenExitsNonZero) {
  auto serve = Start({"--memory-budget", "4K", "--failed-linger", "30"});
  auto socket = WaitForState(*serve, runtime_, CacheState::kFailed);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  auto status = QueryStatus(*socket);
  ASSERT_TRUE(status.ok());
  EXPECT_NE(status->failure_reason.find("over the memory budget of 4096 bytes"), std::string::npos)
      << status->failure_reason;
  EXPECT_EQ(status->tensor_count, 0u);

  // Attach on a failed daemon is refused with the reason; the connection stays usable.
  auto conn = protocol::Connection::Connect(*socket, 2s);
  ASSERT_TRUE(conn.ok());
  protocol::Hello hello;
  hello.config = ConfigFor(model_, "tiny").ToJson();
  auto hr = conn->SendHello(hello, os::Deadline::After(5s));
  ASSERT_TRUE(hr.ok());
  EXPECT_EQ(hr->state, CacheState::kFailed);
  EXPECT_TRUE(hr->match);
  auto attach = conn->Attach(os::Deadline::After(5s));
  ASSERT_FALSE(attach.ok());
  EXPECT_EQ(attach.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(attach.status().message().find("memory budget"), std::string::npos);
  conn = Status(StatusCode::kUnavailable, "closed");

  serve->Signal(SIGTERM);
  EXPECT_EQ(serve->WaitExit(10s), 8) << serve->Log();  // kOutOfMemory (docs/design.md "Exit codes")
  EXPECT_NE(serve->Log().find("out of memory"), std::string::npos) << serve->Log();
}

// No linger (0): the daemon exits as soon as its load failed, after the keeper started with
// that load is gone (it would otherwise outlive the daemon by the moment it takes to notice).
TEST_F(ServeTest, FailedDaemonExitsByItselfAfterTheLingerLeavingNoKeeper) {
  auto serve = Start({"--memory-budget", "1", "--failed-linger", "0"});
  EXPECT_EQ(serve->WaitExit(20s), 8) << serve->Log();  // kOutOfMemory (docs/design.md "Exit codes")
  EXPECT_TRUE(FindSockets(runtime_).empty());
  // The keeper started with the load was given up and waited for before the daemon exited:
  // no lock is held and no keeper socket is left, at once.
  size_t keeper_locks = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(runtime_)) {
    const std::string path = e.path().string();
    EXPECT_EQ(path.find(".keeper.sock"), std::string::npos) << path;
    if (e.path().extension() != ".lock") continue;
    EXPECT_FALSE(os::IsLockHeld(path)) << path << "\n" << serve->Log();
    if (path.find(".keeper.lock") != std::string::npos) ++keeper_locks;
  }
  EXPECT_EQ(keeper_locks, 1u) << "a keeper was started with the load";
}

}  // namespace
}  // namespace weightcache::testing
