// The loaders' memory step (src/daemon/load_memory.h): /proc/self/status is read as the
// kernel splits it, the log line keeps the shape the benches parse, and malloc_trim gives back
// what a finished thread left free in its malloc arena.
#include "daemon/load_memory.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "support/test_env.h"

// The benches' parser of the log line (header-only, outside src/: included by path so that
// the daemon's format and the bench's regex are tested against each other).
#include "../../../bench/proc_memory.h"

namespace weightcache::daemon {
namespace {

using testing::kMiB;

TEST(LoadMemoryTest, ReadsTheKernelsSplitOfRss) {
  const ProcessMemory m = ReadProcessMemory();
  ASSERT_GT(m.rss, 0u);
  EXPECT_GE(m.hwm, m.rss);
  EXPECT_GT(m.file, 0u);  // this test binary's own code is mapped
  // RssAnon + RssFile + RssShmem is VmRSS, up to the kernel's per-cpu counter slack.
  const uint64_t sum = m.anon + m.file + m.shmem;
  EXPECT_LE(sum > m.rss ? sum - m.rss : m.rss - sum, 4 * kMiB) << DescribeProcessMemory(m);
}

TEST(LoadMemoryTest, LogLineParsesBackInTheBench) {
  ProcessMemory m;
  m.rss = 110 * kMiB + kMiB / 2;
  m.anon = 60 * kMiB;
  m.file = 50 * kMiB + kMiB / 2;
  m.shmem = 0;
  m.hwm = 622 * kMiB;
  const std::string line =
      "I 00:00:00.000 weightcache[1] gpu tier: load memory: pipeline=" + DescribeProcessMemory(m) +
      "; released=" + DescribeProcessMemory(m) + "\nI ... ready: 10 tensors\n";
  EXPECT_NE(
      line.find("pipeline=rss 110.5 MiB (anon 60.0, file 50.5, shmem 0.0 MiB), hwm 622.0 MiB"),
      std::string::npos)
      << line;
  const nlohmann::json parsed = bench::ParseLoadMemory(line);
  ASSERT_TRUE(parsed.contains("pipeline")) << parsed.dump();
  ASSERT_TRUE(parsed.contains("released")) << parsed.dump();
  EXPECT_EQ(parsed["released"]["rss"].get<uint64_t>(), m.rss);
  EXPECT_EQ(parsed["released"]["anon"].get<uint64_t>(), m.anon);
  EXPECT_EQ(parsed["released"]["file"].get<uint64_t>(), m.file);
  EXPECT_EQ(parsed["released"]["shmem"].get<uint64_t>(), 0u);
  EXPECT_EQ(parsed["pipeline"]["hwm"].get<uint64_t>(), m.hwm);
}

// The case a load leaves behind: a thread (a reader, or the loader itself) allocated many
// small blocks in its own arena and freed them, but one block still alive above them keeps
// glibc from shrinking the arena's heap on free. The pages stay resident until malloc_trim.
// What is measured here is glibc malloc's arenas; a sanitizer build replaces malloc with its
// own allocator, on which malloc_trim has nothing to return.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

TEST(LoadMemoryTest, ReleaseReturnsAFinishedThreadsFreeArenaPages) {
  if (kSanitizerAllocator) {
    GTEST_SKIP() << "a sanitizer's allocator replaces glibc malloc, whose arenas this measures";
  }
  constexpr size_t kBlock = 2048;
  constexpr size_t kBlocks = (64 * kMiB) / kBlock;
  void* pin = nullptr;
  std::thread([&] {
    std::vector<char*> blocks;
    blocks.reserve(kBlocks);
    for (size_t i = 0; i < kBlocks; ++i) {
      auto* b = static_cast<char*>(std::malloc(kBlock));
      ASSERT_NE(b, nullptr);
      for (size_t at = 0; at < kBlock; at += 512) b[at] = 1;  // resident
      blocks.push_back(b);
    }
    pin = std::malloc(64);
    for (char* b : blocks) std::free(b);
  }).join();
  const uint64_t before = ReadProcessMemory().anon;
  ReleaseLoadMemory();
  const uint64_t after = ReadProcessMemory().anon;
  std::free(pin);
  EXPECT_GE(before, after + 48 * kMiB) << "anon before " << before << ", after " << after;
}

}  // namespace
}  // namespace weightcache::daemon
