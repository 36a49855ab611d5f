// Publishing on the gpu tier with the real driver (docs/publish.md, "The gpu tier"): a real
// `weightcache serve --tier gpu --source published:<tag>` daemon, publishers and an attaching
// client as separate processes (gpu_publish_helper: a CUDA context must not cross a fork).
//
//  * Tensors copied in from device memory by one process are the bytes a second process
//    attaches (read back with cuMemcpyDtoH, compared byte for byte).
//  * A publisher SIGKILLed mid-copy leaves the daemon `awaiting` with its GPU memory returned:
//    cuMemGetInfo's free bytes (from fresh helper processes) while the arena is out are at least
//    the arena below those before, and after the kill within the arena's size of them again;
//    then a new publisher is accepted.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_e2e_support.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

constexpr const char* kModelId = "gpu-publish-test";
// The helper's plan: tensor i is 512 << (i % 7) rows of 1024 BF16.
uint64_t PlanBytes(int n) {
  uint64_t total = 0;
  for (int i = 0; i < n; ++i) total += (uint64_t{512} << (i % 7)) * 1024 * 2;
  return total;
}

class PublishGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const GpuSetup& gpus = ProbeGpus();
    if (!gpus.skip_reason.empty()) GTEST_SKIP() << gpus.skip_reason;
    uuid_ = gpus.uuids[0];
  }
  std::string runtime() const { return dir_.Join("rt"); }

  std::unique_ptr<Daemon> Serve(const std::string& tag) {
    auto d = Daemon::Start({"--source", "published:" + tag, "--model-id", kModelId, "--tier", "gpu",
                            "--device", uuid_, "--runtime-dir", runtime()},
                           {}, dir_.Join(tag + ".log"));
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    if (!d.ok()) return nullptr;
    // Awaiting: its socket answers Status, and the device's context is made for the publisher
    // before one comes (its memory then does not move the free-memory readings below). No
    // deadline here: ctest's bounds a hang.
    for (;;) {
      for (const std::string& s : SocketsUnder(runtime(), "default", uuid_)) {
        auto st = StatusOf(s);
        if (socket_.empty() && st.ok() && st->pid == (*d)->pid()) {
          EXPECT_EQ(st->state, protocol::CacheState::kAwaiting);
          socket_ = s;
        }
      }
      if (!socket_.empty() &&
          (*d)->Log().find("the device's CUDA context is ready for the publisher") !=
              std::string::npos) {
        return std::move(d).value();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  std::vector<std::string> Helper(std::vector<std::string> args) const {
    args.insert(args.begin(), WEIGHTCACHE_GPU_PUBLISH_HELPER);
    return args;
  }

  uint64_t FreeBytes() {
    JsonRun run = RunJson(Helper({"free", "0"}));
    EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
    return run.json.value("free", uint64_t{0});
  }

  TempDir dir_;
  std::string uuid_;
  std::string socket_;
};

TEST_F(PublishGpuTest, DeviceTensorsPublishedByOneProcessAreTheBytesAnotherAttaches) {
  auto daemon = Serve("e2e");
  ASSERT_NE(daemon, nullptr);
  JsonRun published = RunJson(Helper({"publish", runtime(), "e2e", uuid_, "9", "7"}));
  ASSERT_EQ(published.exit_code, 0) << published.out << published.err << daemon->Log();
  EXPECT_EQ(published.json.value("published", 0), 9);
  EXPECT_EQ(published.json.value("bytes", uint64_t{0}), PlanBytes(9));
  auto status = StatusOf(socket_);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, protocol::CacheState::kReady);
  EXPECT_EQ(status->tensor_count, 9u);
  JsonRun attached = RunJson(Helper({"attach", runtime(), "e2e", uuid_, "9", "7"}));
  ASSERT_EQ(attached.exit_code, 0) << attached.out << attached.err;
  EXPECT_EQ(attached.json.value("equal", 0), 9) << attached.out;
  // The arena was made in the context the daemon had ready, and is logged with its time.
  EXPECT_NE(daemon->Log().find(" allocation(s) made in "), std::string::npos) << daemon->Log();
}

TEST_F(PublishGpuTest, APublisherKilledMidCopyLeavesTheDaemonAwaitingWithItsMemoryReturned) {
  auto daemon = Serve("kill");
  ASSERT_NE(daemon, nullptr);
  const int n = 14;  // ~254 MiB
  const uint64_t arena = PlanBytes(n);
  const uint64_t before = FreeBytes();
  auto publisher =
      PipedChild::Spawn(Helper({"publish", runtime(), "kill", uuid_, std::to_string(n), "3", "5"}),
                        {}, dir_.Join("publisher.log"));
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  auto copying = (*publisher)->ReadJson(std::chrono::seconds(120));
  ASSERT_TRUE(copying.ok()) << copying.status().ToString() << (*publisher)->StderrLog();
  ASSERT_EQ(copying->value("copying", 0), 5) << copying->dump();
  const uint64_t during = FreeBytes();
  EXPECT_LE(during + arena, before) << "the arena is not visible in cuMemGetInfo";
  ASSERT_EQ(::kill((*publisher)->pid(), SIGKILL), 0);
  (*publisher)->Wait(std::chrono::seconds(60));
  // The daemon frees the arena when it sees the connection close; poll until the device's free
  // memory is back within the arena's size (ctest's timeout bounds a leak that never returns).
  uint64_t after = FreeBytes();
  while (after + arena <= before) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = FreeBytes();
  }
  EXPECT_GT(after + arena, before);
  auto status = StatusOf(socket_);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, protocol::CacheState::kAwaiting);
  EXPECT_NE(daemon->Log().find("publish abandoned"), std::string::npos) << daemon->Log();
  // A new publisher is accepted and its bytes attach.
  JsonRun published = RunJson(Helper({"publish", runtime(), "kill", uuid_, "4", "9"}));
  ASSERT_EQ(published.exit_code, 0) << published.out << published.err;
  JsonRun attached = RunJson(Helper({"attach", runtime(), "kill", uuid_, "4", "9"}));
  EXPECT_EQ(attached.json.value("equal", 0), 4) << attached.out << attached.err;
}

}  // namespace
}  // namespace weightcache::testing
