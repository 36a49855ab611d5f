// The real-daemon side of the launcher: lock-based socket discovery (the stale sweep is
// daemon/stale_files.h's, tests/unit/daemon/stale_files_test.cc), on
// real files, real sockets and real flocks. The daemons' command lines: launch_flags_test.cc.
#include "launcher/serve_daemons.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "support/test_env.h"

namespace weightcache::launcher {
namespace {

using weightcache::testing::TempDir;
using weightcache::testing::WriteFile;

constexpr const char* kGpu0 = "GPU-1a2b3c4d-0000-4000-8000-000000000000";

TEST(LockPathForTest, SwapsTheSocketSuffix) {
  EXPECT_EQ(LockPathFor("/r/ns/GPU-x/0123456789abcdef.sock"), "/r/ns/GPU-x/0123456789abcdef.lock");
  EXPECT_EQ(LockPathFor("/tmp/custom"), "/tmp/custom.lock");
}

class NamespaceDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dev_dir_ = dir_.Join("ns/") + kGpu0;
    ASSERT_EQ(::mkdir(dir_.Join("ns").c_str(), 0700), 0);
    ASSERT_EQ(::mkdir(dev_dir_.c_str(), 0700), 0);
  }
  // A published socket (a real listening socket) and its lock file, locked or not.
  std::string Publish(const std::string& stem, std::optional<os::LockFile>* lock) {
    const std::string sock = dev_dir_ + "/" + stem + ".sock";
    if (lock != nullptr) {
      auto l = os::LockFile::TryAcquire(dev_dir_ + "/" + stem + ".lock");
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      lock->emplace(std::move(l).value());
    } else {
      WriteFile(dev_dir_ + "/" + stem + ".lock", "999999\n");
    }
    auto fd = os::ListenUnix(sock);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    listeners_.push_back(std::move(fd).value());
    return sock;
  }
  TempDir dir_;
  std::string dev_dir_;
  std::vector<UniqueFd> listeners_;
};

TEST_F(NamespaceDirTest, LocateFindsTheSocketWhoseHeldLockNamesThePid) {
  std::optional<os::LockFile> held;
  const std::string stale = Publish("bbbbbbbbbbbbbbbb", nullptr);  // names pid 999999, unlocked
  const std::string live = Publish("aaaaaaaaaaaaaaaa", &held);     // records our pid
  auto found = LocatePublishedSocket(dir_.path(), "ns", ::getpid());
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->socket, live);
  EXPECT_EQ(found->lock, LockPathFor(live));
  EXPECT_FALSE(LocatePublishedSocket(dir_.path(), "ns", 999999).has_value())
      << "a recorded owner without the flock is a previous holder";
  EXPECT_FALSE(LocatePublishedSocket(dir_.path(), "other-ns", ::getpid()).has_value());
  (void)stale;
}

TEST(LaunchSummaryJsonTest, CarriesEveryDaemonsIdentityAndOutcome) {
  LaunchReport r;
  r.status = Status(StatusCode::kTimeout, "daemons not ready after 2 s");
  r.failed_index = 0;
  DaemonSnapshot d;
  d.name = "tp0-pp0";
  d.placement.local_gpu_id = 4;
  d.placement.device_uuid = kGpu0;
  d.socket_path = "/r/ns/x.sock";
  d.log_path = "/r/ns/logs/j-tp0-pp0.log";
  d.pid = 1234;
  d.state = DaemonState::kStopped;
  d.bytes_done = 5;
  d.bytes_total = 10;
  d.seconds = 2.0;
  d.exit = ExitInfo{.exit_code = -1, .signal = 15};
  r.daemons.push_back(d);
  auto j = nlohmann::json::parse(LaunchSummaryJson(r, 6));
  EXPECT_EQ(j["status"], "timeout") << j.dump();
  EXPECT_EQ(j["exit_code"], 6);
  ASSERT_EQ(j["daemons"].size(), 1u);
  const auto& e = j["daemons"][0];
  EXPECT_EQ(e["device_uuid"], kGpu0);
  EXPECT_EQ(e["local_gpu_id"], 4);
  EXPECT_EQ(e["pid"], 1234);
  EXPECT_EQ(e["state"], "stopped");
  EXPECT_EQ(e["bytes_done"], 5);
  EXPECT_EQ(e["bytes_total"], 10);
  EXPECT_EQ(e["socket"], "/r/ns/x.sock");
  EXPECT_EQ(e["exit"]["signal"], 15);
  EXPECT_EQ(e["failed"], true);
}

}  // namespace
}  // namespace weightcache::launcher
