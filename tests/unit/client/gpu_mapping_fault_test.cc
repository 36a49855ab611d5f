// The client's GPU mapping in process: a gpu-tier daemon (InProcessDaemon) and the client's
// attach share one fake CUDA driver through their Env, so the whole attach — resolving the
// device, importing, reserving, mapping and enabling access to every allocation — runs without
// a GPU. Each driver call of a successful attach fails in turn (FakeDriver::FailStep): the
// attach returns that CUDA error and leaves nothing behind (handles, reservations, mappings,
// context references, received fds); the daemon keeps serving the next attach.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <set>
#include <string>

#include "client/attachment_impl.h"
#include "identity/device_inventory.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"
#include "unit/daemon/in_process_daemon.h"

namespace weightcache::testing {
namespace {

using cuda::testing::FakeDriver;

// Open fds of this process that are not sockets: received VMM fds (memfds in the fake) that
// leaked would show here; the daemon's own connection sockets, which it closes on its thread
// in its own time, do not.
int CountNonSocketFds() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    char target[256] = {};
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    // An fd closed between readdir and readlink (the daemon thread closing a connection) is
    // gone: not counted.
    if (n <= 0 || std::string(target, static_cast<size_t>(n)).starts_with("socket:")) continue;
    ++count;
  }
  ::closedir(dir);
  return count - 1;  // the directory's own fd
}

struct Books {
  int handles, reservations, mappings, context_refs, violations, fds;
  bool operator==(const Books&) const = default;
};

std::string Describe(const Books& b) {
  return "handles=" + std::to_string(b.handles) +
         " reservations=" + std::to_string(b.reservations) +
         " mappings=" + std::to_string(b.mappings) +
         " context_refs=" + std::to_string(b.context_refs) +
         " violations=" + std::to_string(b.violations) + " fds=" + std::to_string(b.fds);
}

bool IsRelease(const std::string& function) {
  for (const char* word : {"Release", "Free", "Unmap", "Destroy", "Unload", "Unregister"}) {
    if (function.find(word) != std::string::npos) return true;
  }
  return false;
}

class GpuMappingFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 6, 2, 5, "f32,bf16", 2048, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    fake_ = std::make_unique<FakeDriver>();
    env_ = identity::Env::Default();
    env_.load_driver = [fake = fake_.get()]() -> Result<const cuda::DriverApi*> {
      return fake->api();
    };
    env_.lookup = identity::MapEnv({});
    options_.identity.model_dir = ref_.dir;
    options_.identity.model_id = "gpu-faults";
    options_.identity.runtime_dir = dir_.Join("run");
    options_.identity.tier = Tier::kGpu;
    options_.identity.device = "1";
    options_.on_missing = OnMissing::kError;
    auto started = InProcessDaemon::StartLoaded(options_.identity, env_);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    daemon_ = std::move(started).value();
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_TRUE(daemon_->Stop().ok());
    }
    daemon_.reset();
    fake_.reset();
  }

  Books BooksNow() const {
    return Books{fake_->live_handles(),       fake_->live_reservations(), fake_->live_mappings(),
                 fake_->total_context_refs(), fake_->violations(),        CountNonSocketFds()};
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::unique_ptr<FakeDriver> fake_;
  identity::Env env_;
  AttachOptions options_;
  std::unique_ptr<InProcessDaemon> daemon_;
};

TEST_F(GpuMappingFaultTest, MapsTheDaemonsAllocationsIntoTheResolvedDevice) {
  const Books before = BooksNow();
  {
    auto a = client::Attach(options_, env_);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->source(), AttachSource::kDaemon);
    EXPECT_EQ(a->device_key(), identity::FormatGpuUuid(FakeDriver::UuidOf(1)));
    EXPECT_EQ(a->cuda_device(), 1);
    EXPECT_EQ(a->tensors().size(), ref_.tensors.size());
    EXPECT_GT(fake_->live_mappings(), before.mappings);
  }
  EXPECT_EQ(Describe(BooksNow()), Describe(before));
}

TEST_F(GpuMappingFaultTest, EveryStepThatFailsGivesItsCudaErrorAndLeavesNothingBehind) {
  Books before = BooksNow();
  int total = 0;
  // Each attach starts on a thread with no current context (a mapping leaves the primary one
  // current when the caller had none), so every run makes the same calls.
  fake_->set_current_context(nullptr);
  {
    const int start = fake_->steps();
    auto a = client::Attach(options_, env_);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    total = fake_->steps() - start;
  }
  ASSERT_EQ(Describe(BooksNow()), Describe(before));
  EXPECT_GT(total, 10);
  int failures = 0;
  std::set<std::string> failed_calls;  // the calls whose failure failed the attach
  for (int step = 1; step <= total; ++step) {
    SCOPED_TRACE("failing step " + std::to_string(step) + " of " + std::to_string(total));
    fake_->set_current_context(nullptr);
    const int start = fake_->steps();
    fake_->FailStep(start + step, CUDA_ERROR_UNKNOWN);
    std::string failed;
    bool release = false;
    {
      AttachDiagnostics diagnostics;
      auto a = client::Attach(options_, env_, &diagnostics);
      fake_->FailStep(0, CUDA_SUCCESS);
      ASSERT_GE(fake_->calls().size(), static_cast<size_t>(start + step));
      failed = fake_->calls()[static_cast<size_t>(start + step - 1)];
      release = IsRelease(failed);
      SCOPED_TRACE("the failed call: " + failed);
      if (!a.ok()) {
        ++failures;
        failed_calls.insert(failed);
        EXPECT_EQ(a.status().code(), StatusCode::kCuda) << a.status().ToString();
        EXPECT_NE(a.status().message().find("CUDA_ERROR_UNKNOWN"), std::string::npos)
            << a.status().ToString();
        EXPECT_EQ(diagnostics.code, StatusCode::kCuda);
      } else {
        EXPECT_EQ(a->source(), AttachSource::kDaemon);
      }
    }
    SCOPED_TRACE("the failed call: " + failed);
    if (release) {
      // A refused release stays in the fake's books (the driver kept it): the next steps are
      // measured from here.
      before = BooksNow();
      continue;
    }
    EXPECT_EQ(Describe(BooksNow()), Describe(before));
  }
  EXPECT_GT(failures, 0);
  // The sweep went through the device lookup and every step of the mapping.
  for (const char* call : {"cuDeviceGet", "cuDeviceGetUuid", "cuMemImportFromShareableHandle",
                           "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"}) {
    EXPECT_EQ(failed_calls.count(call), 1u) << call;
  }
  // The daemon kept serving.
  auto again = client::Attach(options_, env_);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->source(), AttachSource::kDaemon);
}

}  // namespace
}  // namespace weightcache::testing
