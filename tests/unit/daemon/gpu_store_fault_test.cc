// The gpu store load (LoadGpuStore) over the one fake CUDA driver, failing at every step: each
// driver call of a successful load, in turn, fails (FakeDriver::FailStep). Every failure is a
// CUDA error naming the injected result, and releases everything the load took: VMM handles,
// reservations, mappings, context references, pinned buffers, streams, events, fds. The device
// comes resolved (identity::ResolveIdentity over the fake driver), as `serve` hands it over.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "daemon/weight_store.h"
#include "identity/resolve.h"
#include "protocol/connection.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/cuda/fake_driver.h"
#include "unit/daemon/in_process_daemon.h"

namespace weightcache::testing {
namespace {

using cuda::testing::CountOpenFds;
using cuda::testing::FakeDriver;

// What a load may leave behind in the fake driver and in the process.
struct Live {
  int handles, reservations, mappings, context_refs, host_buffers, host_registrations, streams,
      events, device_allocs, modules, violations, fds;
  bool operator==(const Live&) const = default;
};

Live LiveOf(const FakeDriver& fake) {
  return Live{fake.live_handles(),       fake.live_reservations(), fake.live_mappings(),
              fake.total_context_refs(), fake.live_host_buffers(), fake.live_host_registrations(),
              fake.live_streams(),       fake.live_events(),       fake.live_device_allocs(),
              fake.loaded_modules(),     fake.violations(),        CountOpenFds()};
}

std::string Describe(const Live& l) {
  return "handles=" + std::to_string(l.handles) +
         " reservations=" + std::to_string(l.reservations) +
         " mappings=" + std::to_string(l.mappings) +
         " context_refs=" + std::to_string(l.context_refs) +
         " host_buffers=" + std::to_string(l.host_buffers) +
         " host_registrations=" + std::to_string(l.host_registrations) +
         " streams=" + std::to_string(l.streams) + " events=" + std::to_string(l.events) +
         " device_allocs=" + std::to_string(l.device_allocs) +
         " modules=" + std::to_string(l.modules) + " violations=" + std::to_string(l.violations) +
         " fds=" + std::to_string(l.fds);
}

// A release call that fails leaves its resource in the fake's books by design (the driver
// refused to release it); such steps are checked for a clean status, not for the books.
bool IsRelease(const std::string& function) {
  for (const char* word : {"Release", "Free", "Unmap", "Destroy", "Unload", "Unregister"}) {
    if (function.find(word) != std::string::npos) return true;
  }
  return false;
}

class GpuStoreFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 5, 2, 7, "f32,bf16", 4096, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    auto opened = checkpoint::Checkpoint::Open(ref_.dir);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    checkpoint_.emplace(std::move(opened).value());
  }

  // The environment `serve` would resolve the identity in, with `fake` as the driver.
  static identity::Env FakeEnv(FakeDriver& fake) {
    identity::Env env = identity::Env::Default();
    env.load_driver = [&fake]() -> Result<const cuda::DriverApi*> { return fake.api(); };
    env.lookup = identity::MapEnv({});
    return env;
  }
  // The checkpoint's gpu-tier identity on the fake's device 1.
  IdentityOptions GpuIdentity() {
    IdentityOptions identity;
    identity.model_dir = ref_.dir;
    identity.tier = Tier::kGpu;
    identity.device = "1";
    identity.runtime_dir = dir_.Join("run");
    return identity;
  }

  // What `serve` hands the gpu loader for `device` over `fake`, with 2 reader threads.
  static daemon::LoadOptions LoadOptionsOn(FakeDriver& fake, const identity::DeviceInfo& device) {
    daemon::LoadOptions options;
    options.threads = 2;
    options.device = device;
    options.driver = fake.api();
    options.cache_name = "weightcache:test";
    return options;
  }

  // One load over a fresh fake whose `fail_step`-th call (0: none) fails, or else (with
  // `fail_function`) the first call of that function the load makes; the store is destroyed
  // before the books are read. *failed gets the function that failed.
  Status Load(int fail_step, int* steps, Live* live, std::string* failed,
              const char* fail_function = nullptr) {
    FakeDriver fake;
    const identity::Env env = FakeEnv(fake);
    const IdentityOptions identity = GpuIdentity();
    auto id = identity::ResolveIdentity(identity, env);
    if (!id.ok()) return id.status().Context("resolving (no failure armed yet)");
    const int before = fake.steps();
    if (fail_step > 0) fake.FailStep(before + fail_step, CUDA_ERROR_UNKNOWN);
    if (fail_function != nullptr) {
      fake.FailCall(fail_function, fake.CallCount(fail_function) + 1, CUDA_ERROR_UNKNOWN);
      *failed = fail_function;
    }
    const daemon::LoadOptions options = LoadOptionsOn(fake, *id->device);
    daemon::LoadControl control;
    control.progress = [](uint64_t, uint64_t) {};
    std::string memory;
    Status status;
    {
      auto store = daemon::LoadGpuStore(*checkpoint_, options, control, &memory);
      status = store.ok() ? Status::Ok() : store.status();
    }
    *steps = fake.steps() - before;
    if (fail_step > 0 && static_cast<size_t>(before + fail_step) <= fake.calls().size()) {
      *failed = fake.calls()[static_cast<size_t>(before + fail_step - 1)];
    }
    *live = LiveOf(fake);
    return status;
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::optional<checkpoint::Checkpoint> checkpoint_;
};

TEST_F(GpuStoreFaultTest, LoadsOntoTheResolvedOrdinalAndReleasesEverythingWithTheStore) {
  const int fds_before = CountOpenFds();
  int steps = 0;
  Live live{};
  std::string failed;
  Status status = Load(0, &steps, &live, &failed);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_GT(steps, 10);
  EXPECT_EQ(Describe(live), Describe(Live{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, fds_before}));
}

TEST_F(GpuStoreFaultTest, EveryStepThatFailsGivesItsCudaErrorAndReleasesEverything) {
  const int fds_before = CountOpenFds();
  int total = 0;
  Live live{};
  std::string failed;
  ASSERT_TRUE(Load(0, &total, &live, &failed).ok());
  const Live clean{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, fds_before};
  int failures = 0;
  std::set<std::string> failed_calls;  // the calls whose failure failed the load
  for (int step = 1; step <= total; ++step) {
    SCOPED_TRACE("failing step " + std::to_string(step) + " of " + std::to_string(total));
    int steps = 0;
    failed.clear();
    Status status = Load(step, &steps, &live, &failed);
    SCOPED_TRACE("the failed call: " + failed);
    if (IsRelease(failed)) continue;  // a refused release: nothing else to check here
    if (!status.ok()) {
      ++failures;
      failed_calls.insert(failed);
      EXPECT_EQ(status.code(), StatusCode::kCuda) << status.ToString();
      EXPECT_NE(status.message().find("CUDA_ERROR_UNKNOWN"), std::string::npos)
          << status.ToString();
    }
    EXPECT_EQ(Describe(live), Describe(clean));
  }
  EXPECT_GT(failures, 0);
  EXPECT_GT(failed_calls.size(), 5u);
  // The pipeline's threads interleave their calls, so the call at a given step differs between
  // runs and the sweep may miss one; the steps of the device, the arena and the pipeline are
  // therefore each failed by name as well.
  for (const char* call : {"cuDeviceGet", "cuDeviceGetUuid", "cuMemCreate",
                           "cuMemExportToShareableHandle", "cuMemHostRegister", "cuStreamCreate"}) {
    SCOPED_TRACE(std::string("failing the first ") + call);
    int steps = 0;
    Status status = Load(0, &steps, &live, &failed, call);
    EXPECT_EQ(status.code(), StatusCode::kCuda) << status.ToString();
    EXPECT_NE(status.message().find(call), std::string::npos) << status.ToString();
    EXPECT_NE(status.message().find("CUDA_ERROR_UNKNOWN (injected by FakeDriver)"),
              std::string::npos)
        << status.ToString();
    EXPECT_EQ(Describe(live), Describe(clean));
  }
}

TEST_F(GpuStoreFaultTest, ADeviceTheDriverDoesNotShowIsNotFoundNamingIt) {
  FakeDriver fake;
  daemon::LoadOptions options;
  options.device.uuid = "GPU-00000000-0000-0000-0000-000000000000";
  options.device.cuda_ordinal = 0;  // the ordinal now names another device
  options.driver = fake.api();
  daemon::LoadControl control;
  control.progress = [](uint64_t, uint64_t) {};
  std::string memory;
  auto store = daemon::LoadGpuStore(*checkpoint_, options, control, &memory);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kNotFound);
  EXPECT_NE(store.status().message().find("gpu tier: device " + options.device.uuid),
            std::string::npos)
      << store.status().ToString();
  EXPECT_EQ(fake.total_context_refs(), 0);
}

// A load given a LoadLeftovers (the daemon's) returns a store that serves from its fds alone,
// and leaves the pipeline, the arena's mappings and the context reference there: nothing of
// it is gone until Release, everything but the store's fds is gone after.
TEST_F(GpuStoreFaultTest, ALoadGivenLeftoversKeepsItsTeardownThereUntilReleased) {
  const int fds_before = CountOpenFds();
  FakeDriver fake;
  const identity::Env env = FakeEnv(fake);
  const IdentityOptions identity = GpuIdentity();
  auto id = identity::ResolveIdentity(identity, env);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  const daemon::LoadOptions options = LoadOptionsOn(fake, *id->device);
  daemon::LoadLeftovers leftovers;
  daemon::LoadControl control;
  control.progress = [](uint64_t, uint64_t) {};
  control.leftovers = &leftovers;
  std::string memory;
  {
    auto store = daemon::LoadGpuStore(*checkpoint_, options, control, &memory);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    ASSERT_FALSE(leftovers.empty());
    // Held until Release: the context (ours and the arena's references), the mappings and
    // VA, the handles, the pinned staging ring, the streams and the events.
    EXPECT_EQ(fake.total_context_refs(), 2);
    EXPECT_GT(fake.live_mappings(), 0);
    EXPECT_GT(fake.live_reservations(), 0);
    EXPECT_GT(fake.live_handles(), 0);
    // The staging ring has as many buffers as the load fills, up to 2 per reader: this small
    // checkpoint is one fill.
    EXPECT_EQ(fake.live_host_registrations(), 1);
    EXPECT_EQ(fake.live_streams(), 4);
    EXPECT_EQ(fake.live_events(), 1);
    leftovers.Release();
    EXPECT_TRUE(leftovers.empty());
    // Only the store's fds are left: one per allocation, nothing in the driver's books.
    EXPECT_EQ(Describe(LiveOf(fake)),
              Describe(Live{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                            fds_before + static_cast<int>(store->fds().size()) + 1}));
  }
  EXPECT_EQ(Describe(LiveOf(fake)), Describe(Live{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, fds_before}));
}

// The daemon announces `ready` before the load's teardown, and serves attaches while it runs:
// the primary context's release is held back by the fake until the test has attached.
TEST_F(GpuStoreFaultTest, TheDaemonIsReadyAndServesWhileItsLoadIsTornDown) {
  FakeDriver fake(4096);
  fake.BackVmmMemory();
  const identity::Env env = FakeEnv(fake);
  const IdentityOptions identity = GpuIdentity();
  auto options = DaemonOptionsFor(identity, env);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  options->keeper.enabled = false;

  std::mutex mu;
  std::condition_variable cv;
  bool entered = false;  // the loader reached the context's release
  bool open = false;     // the test lets it go on
  bool gave_up = false;  // the hook stopped waiting: nobody attached during the teardown
  fake.BeforeCall("cuDevicePrimaryCtxRelease", [&] {
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    // Bounded, so that a daemon that waits for its teardown before `ready` fails the test
    // below rather than hanging it.
    gave_up = !cv.wait_for(lock, std::chrono::seconds(20), [&] { return open; });
  });
  auto started = InProcessDaemon::Start(std::move(options).value());
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  InProcessDaemon& d = **started;
  ASSERT_TRUE(d.WaitReady().ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return entered; }))
        << "the loader never released its context";
    ASSERT_FALSE(gave_up) << "ready came only after the teardown";
  }
  EXPECT_GT(fake.total_context_refs(), 0);  // the teardown is still held back

  auto conn = protocol::Connection::Connect(d.socket(), std::chrono::seconds(5));
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  protocol::Hello hello;
  hello.config = d.options().config.ToJson();
  hello.client_name = "gpu_store_fault_test";
  auto hr = conn->SendHello(hello, os::Deadline::After(std::chrono::seconds(30)));
  ASSERT_TRUE(hr.ok()) << hr.status().ToString();
  EXPECT_EQ(hr->state, protocol::CacheState::kReady);
  auto attached = conn->Attach(os::Deadline::After(std::chrono::seconds(30)));
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  EXPECT_EQ(attached->manifest.tensor_count(), checkpoint_->tensors().size());
  EXPECT_FALSE(attached->fds.empty());
  {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
  }
  cv.notify_all();
  EXPECT_TRUE(d.Stop().ok());
  EXPECT_EQ(fake.total_context_refs(), 0);
  EXPECT_EQ(fake.live_mappings(), 0);
  EXPECT_EQ(fake.live_host_registrations(), 0);
}

}  // namespace
}  // namespace weightcache::testing
