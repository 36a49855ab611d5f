// Demotion and promotion copies (cuda/tier_copy.h), both strategies (staged through pinned
// buffers, and the memfds' registered mappings), against the fault-injecting FakeDriver with
// backed VMM memory: a promotion from sealed memfds puts their exact bytes into a new exported
// arena of the same layout, a demotion of that arena gives sealed memfds with the same bytes,
// and a failure at any driver call returns the error and releases everything (no handle,
// reservation, mapping, context reference, registration, stream, event or fd left behind).
#include "cuda/tier_copy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "os/memfd.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"

namespace weightcache::cuda {
namespace {

using testing::CountOpenFds;
using testing::FakeDriver;

using weightcache::testing::kMiB;
constexpr CUdevice kDevice = 1;
const std::vector<uint64_t> kSizes = {2 * kMiB, 4 * kMiB};

// Staged: two workers with 1 MiB buffers, so each copies three pieces through both buffers.
TierCopyOptions Options(TierCopyStrategy strategy) {
  TierCopyOptions o;
  o.strategy = strategy;
  o.threads = 2;
  o.staging_bytes = kMiB;
  return o;
}

std::string Name(TierCopyStrategy strategy) {
  return strategy == TierCopyStrategy::kStaged ? "staged" : "registered";
}

constexpr TierCopyStrategy kStrategies[] = {TierCopyStrategy::kStaged,
                                            TierCopyStrategy::kRegistered};

std::string Pattern(uint64_t size, int seed) {
  std::string bytes(size, '\0');
  const uint64_t offset = static_cast<uint64_t>(seed) * 7;
  for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<char>((i * 131 + offset) % 251);
  return bytes;
}

std::string ReadAll(int fd, uint64_t size) {
  std::string bytes(size, '\0');
  if (::pread(fd, bytes.data(), size, 0) != static_cast<ssize_t>(size)) return "";
  return bytes;
}

// Sealed memfds holding Pattern(size, a) for allocation a: what a demotion leaves.
std::vector<UniqueFd> HostCopy() {
  std::vector<UniqueFd> fds;
  for (size_t a = 0; a < kSizes.size(); ++a) {
    auto fd = os::CreateMemfd("tier-copy-test", kSizes[a]);
    EXPECT_TRUE(fd.ok());
    const std::string bytes = Pattern(kSizes[a], static_cast<int>(a));
    EXPECT_EQ(::pwrite(fd->get(), bytes.data(), bytes.size(), 0),
              static_cast<ssize_t>(bytes.size()));
    EXPECT_TRUE(os::SealReadOnly(fd->get()).ok());
    fds.push_back(std::move(fd).value());
  }
  return fds;
}

std::vector<int> Borrow(const std::vector<UniqueFd>& fds) {
  std::vector<int> out;
  out.reserve(fds.size());
  for (const auto& fd : fds) out.push_back(fd.get());
  return out;
}

// Nothing the copies took is still held in the fake (the exported memory objects themselves
// live while their fds do, by design).
void ExpectNothingLive(const FakeDriver& fake) {
  EXPECT_EQ(fake.live_handles(), 0);
  EXPECT_EQ(fake.live_reservations(), 0);
  EXPECT_EQ(fake.live_mappings(), 0);
  EXPECT_EQ(fake.total_context_refs(), 0);
  EXPECT_EQ(fake.live_host_registrations(), 0);
  EXPECT_EQ(fake.live_streams(), 0);
  EXPECT_EQ(fake.live_events(), 0);
  EXPECT_EQ(fake.pending_copies(), 0u);
  EXPECT_EQ(fake.violations(), 0) << ::testing::PrintToString(fake.violation_log());
}

TEST(TierCopy, PromotionThenDemotionKeepsEveryByteAndTheLayout) {
  const int fds_before = CountOpenFds();
  for (const TierCopyStrategy strategy : kStrategies) {
    SCOPED_TRACE(Name(strategy));
    const TierCopyOptions options = Options(strategy);
    FakeDriver fake;
    fake.BackVmmMemory();
    const std::vector<UniqueFd> host = HostCopy();
    TierCopyReport promoted_report;
    auto device =
        CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, &promoted_report, options);
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    ASSERT_EQ(device->size(), kSizes.size());
    EXPECT_EQ(promoted_report.bytes, 6 * kMiB);
    // Registered: one chunk per allocation; staged: one piece per MiB.
    EXPECT_EQ(promoted_report.chunks, strategy == TierCopyStrategy::kStaged ? 6u : 2u);
    EXPECT_EQ(promoted_report.unregistered, 0u);
    for (size_t a = 0; a < kSizes.size(); ++a) {
      EXPECT_EQ(fake.ExportedBytes((*device)[a].get(), 0, kSizes[a]),
                Pattern(kSizes[a], static_cast<int>(a)))
          << "allocation " << a;
    }
    ExpectNothingLive(fake);

    TierCopyReport demoted_report;
    auto memfds = CopyDeviceToMemfds(fake.api(), kDevice, Borrow(*device), kSizes,
                                     "weightcache:test:demoted", &demoted_report, options);
    ASSERT_TRUE(memfds.ok()) << memfds.status().ToString();
    // Two threads for 6 MiB: segments of at most 3 MiB, none crossing an allocation's end.
    const std::vector<uint64_t> segment_sizes = {2 * kMiB, 3 * kMiB, kMiB};
    ASSERT_EQ(memfds->size(), segment_sizes.size());
    EXPECT_EQ(demoted_report.segments, segment_sizes.size());
    EXPECT_EQ(demoted_report.bytes, 6 * kMiB);
    EXPECT_EQ(demoted_report.chunks, strategy == TierCopyStrategy::kStaged ? 6u : 3u);
    std::string held;
    for (size_t i = 0; i < memfds->size(); ++i) {
      EXPECT_TRUE(os::CheckSealedReadOnly((*memfds)[i].get()).ok()) << "memfd " << i;
      EXPECT_EQ(*os::FileSize((*memfds)[i].get()), segment_sizes[i]) << "memfd " << i;
      held += ReadAll((*memfds)[i].get(), segment_sizes[i]);
    }
    EXPECT_EQ(held, Pattern(kSizes[0], 0) + Pattern(kSizes[1], 1));
    ExpectNothingLive(fake);

    // And back again from the segments: the same bytes in a new arena of the same layout.
    auto again = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(*memfds), kSizes, nullptr, options);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    for (size_t a = 0; a < kSizes.size(); ++a) {
      EXPECT_EQ(fake.ExportedBytes((*again)[a].get(), 0, kSizes[a]),
                Pattern(kSizes[a], static_cast<int>(a)))
          << "allocation " << a;
    }
    ExpectNothingLive(fake);
  }
  EXPECT_EQ(CountOpenFds(), fds_before);
}

TEST(TierCopy, MismatchedFdsAndSizesAreRefusedBeforeAnyDriverCall) {
  FakeDriver fake;
  const std::vector<UniqueFd> host = HostCopy();
  const std::vector<int> one = {host[0].get()};
  auto promoted = CopyMemfdsToDevice(fake.api(), kDevice, one, kSizes);
  ASSERT_FALSE(promoted.ok());
  EXPECT_EQ(promoted.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(promoted.status().message().find(
                "promotion: 1 memfd(s) end in allocation 1 of 2 (its bytes from 0 on"),
            std::string::npos)
      << promoted.status().ToString();
  auto demoted = CopyDeviceToMemfds(fake.api(), kDevice, one, kSizes, "x");
  ASSERT_FALSE(demoted.ok());
  EXPECT_EQ(demoted.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fake.steps(), 0);
}

TEST(TierCopy, AStagedCopyWithoutThreadsOrBuffersIsRefusedBeforeAnyDriverCall) {
  FakeDriver fake;
  const std::vector<UniqueFd> host = HostCopy();
  for (const bool no_threads : {true, false}) {
    TierCopyOptions options;
    options.threads = no_threads ? 0 : 2;
    options.staging_bytes = no_threads ? kMiB : 0;
    auto promoted = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr, options);
    ASSERT_FALSE(promoted.ok());
    EXPECT_EQ(promoted.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(promoted.status().message().find(
                  "promotion: a staged copy needs threads and staging bytes"),
              std::string::npos)
        << promoted.status().ToString();
    auto demoted =
        CopyDeviceToMemfds(fake.api(), kDevice, Borrow(host), kSizes, "x", nullptr, options);
    ASSERT_FALSE(demoted.ok());
    EXPECT_EQ(demoted.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(fake.steps(), 0);
}

// Segments that do not tile the allocations exactly are refused before any driver call, naming
// the first that does not fit: one crossing an allocation's end, one too many, an empty one.
TEST(TierCopy, SegmentsThatDoNotTileTheAllocationsAreRefusedBeforeAnyDriverCall) {
  FakeDriver fake;
  auto memfd = [](uint64_t size) {
    auto fd = os::CreateMemfd("tier-copy-test", size);
    EXPECT_TRUE(fd.ok());
    return std::move(fd).value();
  };
  struct Case {
    std::vector<uint64_t> segments;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{kMiB, 2 * kMiB, 3 * kMiB},
       "promotion: memfd 1 of 3 holds 2097152 bytes, which do not fit the 1048576 bytes left of "
       "allocation 0"},
      {{2 * kMiB, 4 * kMiB, kMiB},
       "promotion: memfd 2 of 3 holds 1048576 bytes, which do not fit any allocation (all are "
       "filled)"},
      {{2 * kMiB, 0, 4 * kMiB},
       "promotion: memfd 1 of 3 holds 0 bytes, which do not fit the 4194304 bytes left of "
       "allocation 1"},
  };
  for (const Case& c : cases) {
    std::vector<UniqueFd> fds;
    for (uint64_t size : c.segments) fds.push_back(memfd(size));
    auto promoted = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(fds), kSizes);
    ASSERT_FALSE(promoted.ok());
    EXPECT_EQ(promoted.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(promoted.status().message(), c.expected);
  }
  EXPECT_EQ(fake.steps(), 0);
}

// A segment size that is not a whole number of pages is refused before any driver call.
TEST(TierCopy, ASegmentSizeOfPartPagesIsRefused) {
  FakeDriver fake;
  const std::vector<UniqueFd> host = HostCopy();
  TierCopyOptions options;
  options.segment_bytes = kMiB + 100;
  auto demoted =
      CopyDeviceToMemfds(fake.api(), kDevice, Borrow(host), kSizes, "x", nullptr, options);
  ASSERT_FALSE(demoted.ok());
  EXPECT_EQ(demoted.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(demoted.status().message().find(
                "demotion: a segment of 1048676 bytes is not a whole number of pages"),
            std::string::npos)
      << demoted.status().ToString();
  EXPECT_EQ(fake.steps(), 0);
}

// segment_bytes caps each memfd: 1 MiB segments make one memfd per MiB, written by two threads.
TEST(TierCopy, ADemotionIntoOneMiBSegmentsKeepsEveryByte) {
  FakeDriver fake;
  fake.BackVmmMemory();
  const std::vector<UniqueFd> host = HostCopy();
  TierCopyOptions options = Options(TierCopyStrategy::kStaged);
  options.segment_bytes = kMiB;
  auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr, options);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  TierCopyReport report;
  auto memfds =
      CopyDeviceToMemfds(fake.api(), kDevice, Borrow(*device), kSizes, "x", &report, options);
  ASSERT_TRUE(memfds.ok()) << memfds.status().ToString();
  ASSERT_EQ(memfds->size(), 6u);
  EXPECT_EQ(report.segments, 6u);
  std::string held;
  for (const UniqueFd& fd : *memfds) {
    EXPECT_EQ(*os::FileSize(fd.get()), kMiB);
    held += ReadAll(fd.get(), kMiB);
  }
  EXPECT_EQ(held, Pattern(kSizes[0], 0) + Pattern(kSizes[1], 1));
  ExpectNothingLive(fake);
}

// A memfd shorter than its allocation is refused before the arena is made, in both strategies.
TEST(TierCopy, AShortMemfdIsRefusedAndNothingIsLeft) {
  for (const TierCopyStrategy strategy : kStrategies) {
    SCOPED_TRACE(Name(strategy));
    FakeDriver fake;
    fake.BackVmmMemory();
    std::vector<UniqueFd> host = HostCopy();
    auto small = os::CreateMemfd("tier-copy-test", kMiB);
    ASSERT_TRUE(small.ok());
    host[1] = std::move(small).value();
    auto device =
        CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr, Options(strategy));
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument) << device.status().ToString();
    ExpectNothingLive(fake);
  }
}

// Staged: a staging buffer the driver refuses to pin is an error (kCuda naming it), and
// everything is released.
TEST(TierCopy, AStagedCopyWhoseBufferCannotBePinnedFailsAndReleasesEverything) {
  FakeDriver fake;
  fake.BackVmmMemory();
  const std::vector<UniqueFd> host = HostCopy();
  fake.FailCall("cuMemHostRegister", 2, CUDA_ERROR_OUT_OF_MEMORY);
  auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr,
                                   Options(TierCopyStrategy::kStaged));
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kCuda);
  EXPECT_NE(device.status().message().find("pinned staging buffer"), std::string::npos)
      << device.status().ToString();
  ExpectNothingLive(fake);
}

// Staged: a stream that cannot be waited for (both tries fail) is the copy's error, and its
// staging buffers stay pinned (a copy may still reach them); nothing else is left.
TEST(TierCopy, AStagedStreamThatCannotBeWaitedForLeavesItsBuffersPinned) {
  FakeDriver fake;
  fake.BackVmmMemory();
  const std::vector<UniqueFd> host = HostCopy();
  TierCopyOptions options = Options(TierCopyStrategy::kStaged);
  options.threads = 1;
  fake.FailCall("cuStreamSynchronize", 1, CUDA_ERROR_LAUNCH_FAILED);
  fake.FailCall("cuStreamSynchronize", 2, CUDA_ERROR_LAUNCH_FAILED);
  auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr, options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kCuda);
  EXPECT_NE(device.status().message().find("cuStreamSynchronize after the tier copy"),
            std::string::npos)
      << device.status().ToString();
  EXPECT_EQ(fake.live_host_registrations(), 2);
  EXPECT_EQ(fake.live_streams(), 0);
  EXPECT_EQ(fake.live_events(), 0);
  EXPECT_EQ(fake.total_context_refs(), 0);
  fake.ClearHostRegistrations();
}

// A registration the driver refuses is not an error: the chunk is copied pageable.
TEST(TierCopy, ARefusedRegistrationCopiesPageableAndSaysSo) {
  FakeDriver fake;
  fake.BackVmmMemory();
  const std::vector<UniqueFd> host = HostCopy();
  fake.FailCall("cuMemHostRegister", 1, CUDA_ERROR_NOT_SUPPORTED);
  TierCopyReport report;
  auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, &report,
                                   Options(TierCopyStrategy::kRegistered));
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  EXPECT_EQ(report.unregistered, 1u);
  EXPECT_EQ(report.chunks, 1u);
  for (size_t a = 0; a < kSizes.size(); ++a) {
    EXPECT_EQ(fake.ExportedBytes((*device)[a].get(), 0, kSizes[a]),
              Pattern(kSizes[a], static_cast<int>(a)));
  }
  ExpectNothingLive(fake);
}

// Every driver call of a promotion and of a demotion, in turn, fails, in both strategies: the
// copy either ends in that CUDA error or (a refused registration of a memfd's chunk) succeeds
// pageable, and nothing is left behind.
TEST(TierCopy, EveryFailingStepReleasesEverything) {
  const int fds_before = CountOpenFds();
  for (const TierCopyStrategy strategy : kStrategies) {
    const TierCopyOptions options = Options(strategy);
    for (const bool promotion : {true, false}) {
      int total = 0;
      for (int step = 0; step == 0 || step <= total; ++step) {
        SCOPED_TRACE(Name(strategy) + (promotion ? " promotion" : " demotion") +
                     std::string(", failing step ") + std::to_string(step));
        FakeDriver fake;
        fake.BackVmmMemory();
        const std::vector<UniqueFd> host = HostCopy();
        std::vector<UniqueFd> device;
        if (!promotion) {
          auto made =
              CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr, options);
          ASSERT_TRUE(made.ok()) << made.status().ToString();
          device = std::move(made).value();
        }
        const int before = fake.steps();
        if (step > 0) fake.FailStep(before + step, CUDA_ERROR_UNKNOWN);
        Status status;
        {
          auto out = promotion ? CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes,
                                                    nullptr, options)
                               : CopyDeviceToMemfds(fake.api(), kDevice, Borrow(device), kSizes,
                                                    "weightcache:test:demoted", nullptr, options);
          status = out.ok() ? Status::Ok() : out.status();
        }
        if (step == 0) {
          ASSERT_TRUE(status.ok()) << status.ToString();
          total = fake.steps() - before;
          ASSERT_GT(total, 5);
        } else {
          const std::string failed = fake.calls()[static_cast<size_t>(before + step - 1)];
          const bool release = failed.find("Unregister") != std::string::npos ||
                               failed.find("Destroy") != std::string::npos ||
                               failed.find("Release") != std::string::npos ||
                               failed.find("Unmap") != std::string::npos ||
                               failed.find("Free") != std::string::npos;
          // Not errors: a refused registration (the chunk is copied pageable), a failed query of
          // the caller's current context (nothing to restore), a release the driver refused
          // (logged; its resource stays in the fake's books by design).
          // A staging buffer the driver will not pin is an error.
          const bool tolerated =
              (failed == "cuMemHostRegister" && strategy == TierCopyStrategy::kRegistered) ||
              failed == "cuCtxGetCurrent";
          if (release) {
            EXPECT_TRUE(status.ok() || status.code() == StatusCode::kCuda) << status.ToString();
            fake.ClearHostRegistrations();
          } else if (tolerated) {
            EXPECT_TRUE(status.ok()) << failed << ": " << status.ToString();
          } else {
            EXPECT_EQ(status.code(), StatusCode::kCuda) << failed << ": " << status.ToString();
          }
          if (!release) ExpectNothingLive(fake);
        }
      }
    }
  }
  EXPECT_EQ(CountOpenFds(), fds_before);
}

// ---- the pinned host copy (serve --demote host-pinned) ----

TEST(PinnedHostCopy, APromotionFromItKeepsEveryByteAndPinsNothingMore) {
  const int fds_before = CountOpenFds();
  {
    FakeDriver fake;
    fake.BackVmmMemory();
    const std::vector<UniqueFd> host = HostCopy();
    {
      auto pinned = PinnedHostCopy::Pin(fake.api(), kDevice, Borrow(host), 2);
      ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
      EXPECT_EQ(pinned->segments(), kSizes.size());
      EXPECT_EQ(pinned->bytes(), 6 * kMiB);
      EXPECT_EQ(fake.live_host_registrations(), 2);  // each segment's mapping, whole
      EXPECT_EQ(fake.total_context_refs(), 1);       // retained while pinned

      TierCopyOptions options = Options(TierCopyStrategy::kStaged);
      options.pinned = &*pinned;
      const int registered_before = fake.CallCount("cuMemHostRegister");
      TierCopyReport report;
      auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, &report, options);
      ASSERT_TRUE(device.ok()) << device.status().ToString();
      EXPECT_EQ(fake.CallCount("cuMemHostRegister"), registered_before);  // DMA alone
      EXPECT_EQ(report.bytes, 6 * kMiB);
      EXPECT_EQ(report.chunks, 2u);  // one piece (of up to 64 MiB) per segment
      for (size_t a = 0; a < kSizes.size(); ++a) {
        EXPECT_EQ(fake.ExportedBytes((*device)[a].get(), 0, kSizes[a]),
                  Pattern(kSizes[a], static_cast<int>(a)))
            << "allocation " << a;
      }
      // The promotion kept nothing of its own; the pinned copy still holds its registrations.
      EXPECT_EQ(fake.live_host_registrations(), 2);
      EXPECT_EQ(fake.total_context_refs(), 1);

      auto other = PinnedHostCopy::Pin(fake.api(), kDevice, Borrow(host), 1);
      ASSERT_TRUE(other.ok()) << other.status().ToString();
      EXPECT_EQ(fake.live_host_registrations(), 4);
      *pinned = std::move(*other);  // the old copy is unpinned by the assignment
      EXPECT_EQ(fake.live_host_registrations(), 2);
      EXPECT_EQ(fake.total_context_refs(), 1);
    }
    ExpectNothingLive(fake);
  }
  EXPECT_EQ(CountOpenFds(), fds_before);
}

TEST(PinnedHostCopy, APinnedCopyOfOtherSegmentsIsRefusedBeforeAnyDriverCall) {
  FakeDriver fake;
  fake.BackVmmMemory();
  const std::vector<UniqueFd> host = HostCopy();
  auto pinned = PinnedHostCopy::Pin(fake.api(), kDevice, Borrow(host), 2);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  // The same bytes in three segments (a demotion's cut): not the pinned copy's two.
  auto device = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(host), kSizes, nullptr,
                                   Options(TierCopyStrategy::kStaged));
  ASSERT_TRUE(device.ok());
  auto memfds = CopyDeviceToMemfds(fake.api(), kDevice, Borrow(*device), kSizes, "t", nullptr,
                                   Options(TierCopyStrategy::kStaged));
  ASSERT_TRUE(memfds.ok());
  ASSERT_EQ(memfds->size(), 3u);
  TierCopyOptions options = Options(TierCopyStrategy::kStaged);
  options.pinned = &*pinned;
  const int steps_before = fake.steps();
  auto refused = CopyMemfdsToDevice(fake.api(), kDevice, Borrow(*memfds), kSizes, nullptr, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("the pinned host copy has 2 segments, the memfds 3"),
            std::string::npos)
      << refused.status().ToString();
  EXPECT_EQ(fake.steps(), steps_before);
}

TEST(PinnedHostCopy, AnUnsealedOrEmptyMemfdIsRefusedBeforeAnyDriverCall) {
  FakeDriver fake;
  auto open = os::CreateMemfd("tier-copy-test", kMiB);
  ASSERT_TRUE(open.ok());
  const int fds[] = {open->get()};
  auto pinned = PinnedHostCopy::Pin(fake.api(), kDevice, fds, 2);
  ASSERT_FALSE(pinned.ok());
  EXPECT_NE(pinned.status().ToString().find("memfd 0"), std::string::npos)
      << pinned.status().ToString();
  EXPECT_FALSE(PinnedHostCopy::Pin(fake.api(), kDevice, {}, 2).ok());
  EXPECT_EQ(fake.steps(), 0);
}

TEST(PinnedHostCopy, EveryFailingStepReleasesEverything) {
  const int fds_before = CountOpenFds();
  int total = 0;
  for (int step = 0; step == 0 || step <= total; ++step) {
    SCOPED_TRACE("failing step " + std::to_string(step));
    FakeDriver fake;
    fake.BackVmmMemory();
    const std::vector<UniqueFd> host = HostCopy();
    if (step > 0) fake.FailStep(step, CUDA_ERROR_UNKNOWN);
    Status status;
    {
      auto pinned = PinnedHostCopy::Pin(fake.api(), kDevice, Borrow(host), 2);
      status = pinned.ok() ? Status::Ok() : pinned.status();
    }
    if (step == 0) {
      ASSERT_TRUE(status.ok()) << status.ToString();
      total = fake.steps();
      ASSERT_GT(total, 4);
      ExpectNothingLive(fake);
      continue;
    }
    const std::string failed = fake.calls()[static_cast<size_t>(step - 1)];
    if (status.ok()) {
      // The failure hit the teardown (the destructor making the context current, or a
      // release): logged, and its resource stays in the fake's books by design.
      EXPECT_TRUE(failed == "cuCtxSetCurrent" || failed.find("Unregister") != std::string::npos ||
                  failed.find("Release") != std::string::npos)
          << failed;
      continue;
    }
    EXPECT_EQ(status.code(), StatusCode::kCuda) << failed << ": " << status.ToString();
    ExpectNothingLive(fake);
  }
  EXPECT_EQ(CountOpenFds(), fds_before);
}

}  // namespace
}  // namespace weightcache::cuda
