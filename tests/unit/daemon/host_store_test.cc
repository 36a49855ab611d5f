// The host-tier loader's steps on their own (daemon/host_store.h) and composed by
// LoadHostStore, on real checkpoints written by the `safetensors` library and real memfds:
// the work items cover every byte once, the layout is file order at page granularity, memfds
// are sized to the plan and sealed, a cancelled load stops with kUnavailable, and a finished
// store holds exactly the checkpoint's bytes with the checksums its manifest records.
#include "daemon/host_store.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/content_anchor.h"
#include "common/checksum.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "support/hub_cache.h"
#include "support/test_env.h"
#include "unit/checkpoint/checkpoint_fixture.h"

namespace weightcache::daemon {
namespace {

using ::testing::HasSubstr;

using testing::kMiB;

// Every byte of every tensor, in order, exactly once: the items of MakeHostItems walk the
// sizes without gap or overlap.
void ExpectItemsCoverEveryByte(const std::vector<uint64_t>& sizes,
                               const std::vector<HostItem>& items) {
  size_t tensor = 0;
  uint64_t at = 0;  // within `tensor`
  for (const HostItem& item : items) {
    if (item.count == 1 && sizes[item.first] >= kHostItemBytes) {
      EXPECT_EQ(item.first, tensor);
      EXPECT_EQ(item.from, at);
      EXPECT_LE(item.length, kHostItemBytes);
      at += item.length;
      if (at == sizes[tensor]) {
        ++tensor;
        at = 0;
      }
      continue;
    }
    EXPECT_EQ(at, 0u);
    EXPECT_EQ(item.first, tensor);
    uint64_t bytes = 0;
    for (size_t i = item.first; i < item.first + item.count; ++i) bytes += sizes[i];
    EXPECT_EQ(item.length, bytes);
    EXPECT_LE(item.length, kHostItemBytes);
    tensor += item.count;
  }
  EXPECT_EQ(tensor, sizes.size());
}

TEST(HostItemsTest, SmallTensorsAreGroupedUpToAnItem) {
  const std::vector<uint64_t> sizes = {3 * kMiB, 3 * kMiB, 3 * kMiB, 0, 1, 5 * kMiB};
  const std::vector<HostItem> items = MakeHostItems(sizes);
  ASSERT_EQ(items.size(), 3u);
  EXPECT_EQ(items[0].first, 0u);
  EXPECT_EQ(items[0].count, 2u);  // a third 3 MiB would pass 8 MiB
  EXPECT_EQ(items[1].first, 2u);
  EXPECT_EQ(items[1].count, 3u);  // 3 MiB, the empty tensor and one byte
  EXPECT_EQ(items[1].length, 3 * kMiB + 1);
  EXPECT_EQ(items[2].first, 5u);
  EXPECT_EQ(items[2].count, 1u);
  ExpectItemsCoverEveryByte(sizes, items);
}

TEST(HostItemsTest, ALargeTensorIsSplitIntoItemSizedRanges) {
  const std::vector<uint64_t> sizes = {1 * kMiB, 2 * kHostItemBytes + 12345, 2 * kMiB};
  const std::vector<HostItem> items = MakeHostItems(sizes);
  ASSERT_EQ(items.size(), 5u);
  EXPECT_EQ(items[1].first, 1u);
  EXPECT_EQ(items[1].from, 0u);
  EXPECT_EQ(items[1].length, kHostItemBytes);
  EXPECT_EQ(items[3].from, 2 * kHostItemBytes);
  EXPECT_EQ(items[3].length, 12345u);
  // Every range of a split tensor starts on a checksum chunk boundary, so its pieces hash
  // independently.
  for (const HostItem& item : items) EXPECT_EQ(item.from % kChecksumChunkBytes, 0u);
  ExpectItemsCoverEveryByte(sizes, items);
}

TEST(HostItemsTest, NoTensorsNoItems) { EXPECT_TRUE(MakeHostItems({}).empty()); }

class HostStoreTest : public checkpoint::testing::CheckpointFixture {
 protected:
  checkpoint::Checkpoint Open(const std::string& dir) {
    auto c = checkpoint::Checkpoint::Open(dir);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(c).value();
  }
  static uint64_t PageSize() { return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)); }
};

TEST_F(HostStoreTest, LayoutIsFileOrderAtPageGranularity) {
  const checkpoint::Checkpoint ckpt =
      Open(Make("layout", {"--tensors", "30", "--dtypes", "all", "--shards", "3", "--seed", "5"}));
  const HostLayout layout = PlanHostLayout(ckpt, PageSize());
  const auto& tensors = ckpt.tensors();
  ASSERT_EQ(layout.order.size(), tensors.size());
  ASSERT_EQ(layout.sizes.size(), tensors.size());
  ASSERT_EQ(layout.plan.placements.size(), tensors.size());
  for (size_t i = 0; i < layout.order.size(); ++i) {
    const auto& t = tensors[layout.order[i]];
    EXPECT_EQ(layout.sizes[i], t.nbytes);
    EXPECT_EQ(layout.chunk_begin[i + 1] - layout.chunk_begin[i], ChecksumChunkCount(t.nbytes));
    if (i > 0) {
      const auto& prev = tensors[layout.order[i - 1]];
      EXPECT_TRUE(prev.shard < t.shard || (prev.shard == t.shard && prev.offset <= t.offset))
          << prev.name << " before " << t.name;
    }
  }
  ASSERT_FALSE(layout.plan.allocation_bytes.empty());
  for (uint64_t bytes : layout.plan.allocation_bytes) EXPECT_EQ(bytes % PageSize(), 0u);
}

TEST_F(HostStoreTest, MemfdsAreSizedToThePlanAndSealed) {
  const checkpoint::Checkpoint ckpt = Open(Make("memfds", {"--tensors", "6", "--seed", "2"}));
  const HostLayout layout = PlanHostLayout(ckpt, PageSize());
  auto memfds = CreateHostMemfds("weightcache:test", layout.plan);
  ASSERT_TRUE(memfds.ok()) << memfds.status().ToString();
  ASSERT_EQ(memfds->size(), layout.plan.allocation_bytes.size());
  for (size_t a = 0; a < memfds->size(); ++a) {
    auto size = os::FileSize((*memfds)[a].get());
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, layout.plan.allocation_bytes[a]);
    EXPECT_EQ(os::CheckSealedReadOnly((*memfds)[a].get()).code(), StatusCode::kPermissionDenied);
  }
  ASSERT_TRUE(SealHostMemfds(*memfds).ok());
  for (const UniqueFd& fd : *memfds) {
    EXPECT_TRUE(os::CheckSealedReadOnly(fd.get()).ok());
    const uint8_t byte = 1;
    EXPECT_EQ(::pwrite(fd.get(), &byte, 1, 0), -1);
    EXPECT_EQ(errno, EPERM);
  }
}

TEST_F(HostStoreTest, ACancelledLoadStopsBeforeReading) {
  const checkpoint::Checkpoint ckpt = Open(Make("cancel", {"--tensors", "8", "--seed", "3"}));
  const HostLayout layout = PlanHostLayout(ckpt, PageSize());
  auto memfds = CreateHostMemfds("weightcache:test", layout.plan);
  ASSERT_TRUE(memfds.ok());
  const std::vector<HostItem> items = MakeHostItems(layout.sizes);
  std::vector<uint64_t> chunk_hashes(layout.chunk_begin.back());
  const std::atomic<bool> cancel{true};
  std::vector<uint64_t> progress;
  LoadControl control;
  control.cancel = &cancel;
  control.progress = [&](uint64_t done, uint64_t /*total*/) { progress.push_back(done); };
  const Status status =
      RunHostItems(ckpt, layout, items, *memfds, /*threads=*/2, control, &chunk_hashes);
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(status.message(), "load cancelled");
  EXPECT_EQ(progress, std::vector<uint64_t>{0});
}

TEST_F(HostStoreTest, LoadedStoreHoldsTheCheckpointBytesAndTheirChecksums) {
  // Three f32 tensors larger than a work item (each split into ranges the threads share)
  // among bf16 ones of half that size, in 2 shards.
  const checkpoint::Checkpoint ckpt =
      Open(Make("load", {"--tensors", "5", "--dtypes", "f32,bf16", "--shards", "2", "--seed", "9",
                         "--min-elems", "2200000", "--max-elems", "2500000"}));
  const HostLayout layout = PlanHostLayout(ckpt, PageSize());
  EXPECT_GT(MakeHostItems(layout.sizes).size(), ckpt.tensors().size());
  LoadOptions options;
  options.threads = 3;
  options.cache_name = "weightcache:test";
  std::string memory;
  Result<WeightStore> store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_THAT(memory, HasSubstr("loaded=rss "));
  EXPECT_EQ(store->tier(), Tier::kHost);
  const StoreSummary& summary = store->summary();
  EXPECT_EQ(summary.tensor_count, ckpt.tensors().size());
  EXPECT_EQ(summary.tensor_bytes, ckpt.total_bytes());

  auto region = os::MapReadOnly(summary.manifest.fd.get(), summary.manifest.size);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  auto manifest = protocol::Manifest::DecodeMapped(std::move(region).value());
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_EQ(manifest->tier(), Tier::kHost);
  const std::vector<int> fds = store->fds();
  ASSERT_EQ(fds.size(), manifest->allocation_sizes().size());
  uint64_t resident = 0;
  for (size_t a = 0; a < fds.size(); ++a) {
    EXPECT_TRUE(os::CheckSealedReadOnly(fds[a]).ok());
    resident += manifest->allocation_sizes()[a];
  }
  EXPECT_EQ(summary.resident_bytes, resident);

  ASSERT_EQ(manifest->tensor_count(), ckpt.tensors().size());
  for (size_t i = 0; i < manifest->tensor_count(); ++i) {
    const protocol::TensorEntry entry = manifest->tensor(i);
    const checkpoint::TensorInfo& t = ckpt.tensors()[i];  // both in name order
    ASSERT_EQ(entry.name, t.name);
    std::vector<uint8_t> expected(t.nbytes), held(t.nbytes);
    const checkpoint::ReadRequest request{t.shard, t.offset, t.nbytes, expected.data()};
    ASSERT_TRUE(checkpoint::ReadRanges(ckpt, std::span(&request, 1), {}).ok());
    ASSERT_EQ(
        ::pread(fds[entry.allocation], held.data(), t.nbytes, static_cast<off_t>(entry.offset)),
        static_cast<ssize_t>(t.nbytes));
    EXPECT_EQ(held, expected) << t.name;
    EXPECT_EQ(entry.checksum, TensorChecksum(expected.data(), expected.size())) << t.name;
  }
}

// The fill (FillHostFromPeers): a "source" is a store loaded from a checkpoint, copied into
// the filler's allocations by a fake PeerFill that offers its manifest to accept() first, as
// FetchArena does, then copies its bytes (optionally one byte flipped).
class HostFillTest : public HostStoreTest {
 protected:
  WeightStore LoadSource(const checkpoint::Checkpoint& ckpt) {
    LoadOptions options;
    options.threads = 2;
    options.cache_name = "weightcache:source";
    std::string memory;
    auto store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return std::move(store).value();
  }
  static std::vector<uint8_t> ManifestBytes(const WeightStore& store) {
    std::vector<uint8_t> bytes(store.summary().manifest.size);
    EXPECT_EQ(::pread(store.summary().manifest.fd.get(), bytes.data(), bytes.size(), 0),
              static_cast<ssize_t>(bytes.size()));
    return bytes;
  }
  // Copies `source` into the request's allocations once accept() takes its manifest.
  // With `prove`, the outcome asks the loader to prove the bytes against it (--fill-trust
  // content).
  static PeerFill CopyFrom(const WeightStore& source, bool flip_first_byte = false,
                           std::shared_ptr<const checkpoint::ContentAnchor> prove = nullptr) {
    return
        [&source, flip_first_byte, prove](const PeerFillRequest& request) -> Result<FillOutcome> {
          const std::vector<uint8_t> manifest = ManifestBytes(source);
          WEIGHTCACHE_RETURN_IF_ERROR(request.accept(manifest));
          const std::vector<int> fds = source.fds();
          if (fds.size() != request.allocations.size()) return InternalError("allocation count");
          uint64_t total = 0;
          for (const std::span<uint8_t> to : request.allocations) total += to.size();
          uint64_t done = 0;
          // In 4 KiB pieces, each reported, as the transport reports its stripes.
          for (size_t a = 0; a < fds.size(); ++a) {
            const std::span<uint8_t> to = request.allocations[a];
            for (size_t at = 0; at < to.size(); at += 4096) {
              const size_t n = std::min<size_t>(4096, to.size() - at);
              if (::pread(fds[a], to.data() + at, n, static_cast<off_t>(at)) !=
                  static_cast<ssize_t>(n)) {
                return InternalError("pread");
              }
              done += n;
              request.progress(done, total);
            }
          }
          if (flip_first_byte) request.allocations[0][0] ^= 0xff;
          return FillOutcome{"test", "the test source", prove};
        };
  }
  // Each shard's SHA-256 from its bytes, with `wrong` (a file name) given another.
  static std::shared_ptr<const checkpoint::ContentAnchor> AnchorOf(
      const checkpoint::Checkpoint& ckpt, const std::string& wrong = "") {
    auto anchor = std::make_shared<checkpoint::ContentAnchor>();
    for (const checkpoint::ShardInfo& shard : ckpt.shards()) {
      anchor->shards.push_back({shard.file_name,
                                shard.file_name == wrong
                                    ? std::string(64, '0')
                                    : weightcache::testing::FileSha256(shard.path),
                                checkpoint::AnchorSource::kHubBlob});
    }
    return anchor;
  }
};

// --fill-trust content on the host tier: every shard file's SHA-256, over our header and the
// filled memfds' bytes (one thread per file), must equal the anchor's. An anchor that records
// another digest for one file fails the fill naming it, and the disk load follows.
TEST_F(HostFillTest, AFillIsProvenFileByFileAgainstTheContentAnchor) {
  const checkpoint::Checkpoint ckpt =
      Open(Make("proof", {"--tensors", "7", "--shards", "3", "--seed", "4"}));
  ASSERT_EQ(ckpt.shards().size(), 3u);
  const WeightStore source = LoadSource(ckpt);
  LoadOptions options;
  options.cache_name = "weightcache:filler";
  options.threads = 3;
  options.peer_fill = CopyFrom(source, false, AnchorOf(ckpt));
  std::string memory;
  Result<WeightStore> store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->summary().filled_from, "filled from the test source");

  const std::string wrong = ckpt.shards()[1].file_name;
  options.peer_fill = CopyFrom(source, false, AnchorOf(ckpt, wrong));
  ::testing::internal::CaptureStderr();
  store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->summary().filled_from, "");
  EXPECT_EQ(store->summary().origin, "disk");
  EXPECT_EQ(ManifestBytes(*store), ManifestBytes(source));
  EXPECT_THAT(log, ::testing::HasSubstr("shard " + wrong +
                                        ": the SHA-256 of the filled bytes under our header is " +
                                        weightcache::testing::FileSha256(ckpt.shards()[1].path) +
                                        ", our checkpoint's is " + std::string(64, '0') +
                                        " (hub cache blob name); loading from disk"));
}

TEST_F(HostFillTest, AFillFromAnEqualStoreIsVerifiedAndServedWithItsManifest) {
  // Tensors larger than a work item among smaller ones: the checksums are hashed in ranges
  // on several threads.
  const checkpoint::Checkpoint ckpt =
      Open(Make("fill", {"--tensors", "5", "--dtypes", "f32,bf16", "--shards", "2", "--seed", "9",
                         "--min-elems", "2200000", "--max-elems", "2500000"}));
  const WeightStore source = LoadSource(ckpt);
  LoadOptions options;
  options.cache_name = "weightcache:filler";
  options.threads = 3;
  options.peer_fill = CopyFrom(source);
  std::string memory;
  Result<WeightStore> store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->summary().filled_from, "filled from the test source");
  EXPECT_EQ(store->summary().origin, "test");
  EXPECT_GT(MakeHostItems(PlanHostLayout(ckpt, PageSize()).sizes).size(), ckpt.tensors().size());
  // The same checksums, layout and bytes: the manifest the filler serves is the source's.
  EXPECT_EQ(ManifestBytes(*store), ManifestBytes(source));
  for (const int fd : store->fds()) EXPECT_TRUE(os::CheckSealedReadOnly(fd).ok());
}

// The fill's progress is the load's, in the held tensor bytes a disk load counts; a stop
// (the load's cancel flag) during the fill ends the load, without a disk pass.
TEST_F(HostFillTest, TheFillReportsTheLoadsProgressAndACancelEndsTheLoad) {
  const checkpoint::Checkpoint ckpt =
      Open(Make("progress", {"--tensors", "6", "--shards", "3", "--seed", "5"}));
  const WeightStore source = LoadSource(ckpt);
  const uint64_t held = source.summary().tensor_bytes;
  LoadOptions options;
  options.cache_name = "weightcache:filler";
  options.peer_fill = CopyFrom(source);
  std::vector<std::pair<uint64_t, uint64_t>> reported;
  LoadControl control;
  control.progress = [&reported](uint64_t done, uint64_t total) {
    reported.emplace_back(done, total);
  };
  std::string memory;
  ASSERT_TRUE(LoadHostStore(ckpt, options, control, &memory).ok());
  ASSERT_GE(reported.size(), 2u);
  EXPECT_LT(reported.front().first, held) << "the first piece is not the whole cache";
  for (size_t i = 0; i < reported.size(); ++i) {
    EXPECT_EQ(reported[i].second, held) << i;
    if (i > 0) {
      EXPECT_GE(reported[i].first, reported[i - 1].first) << i;
    }
  }
  EXPECT_EQ(reported.back().first, held);

  // A stop arrives while the fill runs: the fill sees the flag and fails; the load ends.
  std::atomic<bool> cancel{false};
  options.peer_fill = [&cancel](const PeerFillRequest& request) -> Result<FillOutcome> {
    cancel.store(true);
    EXPECT_EQ(request.cancel, &cancel);
    return Status(StatusCode::kUnavailable, "arena fetch: cancelled");
  };
  control.cancel = &cancel;
  reported.clear();
  Result<WeightStore> cancelled = LoadHostStore(ckpt, options, control, &memory);
  ASSERT_FALSE(cancelled.ok());
  EXPECT_EQ(cancelled.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(cancelled.status().message(), HasSubstr("load cancelled (during the fill)"));
  EXPECT_TRUE(reported.empty()) << "no disk pass after a cancelled fill";
}

TEST_F(HostFillTest, ASourceOfAnotherLayoutIsRefusedBeforeItsBytesAreRead) {
  const checkpoint::Checkpoint ours = Open(Make("ours", {"--tensors", "7", "--seed", "11"}));
  const checkpoint::Checkpoint other = Open(Make("other", {"--tensors", "5", "--seed", "12"}));
  const WeightStore source = LoadSource(other);
  const HostLayout layout = PlanHostLayout(ours, PageSize());
  auto memfds = CreateHostMemfds("weightcache:filler", layout.plan);
  ASSERT_TRUE(memfds.ok());
  std::vector<uint64_t> chunk_hashes(layout.chunk_begin.back());
  const Result<FillOutcome> filled = FillHostFromPeers(ours, layout, *memfds, CopyFrom(source),
                                                       /*threads=*/2, LoadControl{}, &chunk_hashes);
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), StatusCode::kMismatch) << filled.status().ToString();

  // Through the loader: logged, then the disk load; the store is the checkpoint's.
  LoadOptions options;
  options.cache_name = "weightcache:filler";
  options.peer_fill = CopyFrom(source);
  std::string memory;
  Result<WeightStore> store = LoadHostStore(ours, options, LoadControl{}, &memory);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->summary().filled_from, "");
  EXPECT_EQ(store->summary().origin, "disk");
  EXPECT_EQ(ManifestBytes(*store), ManifestBytes(LoadSource(ours)));
}

TEST_F(HostFillTest, AWrongByteFailsTheChecksumOverOurMemory) {
  const checkpoint::Checkpoint ckpt = Open(Make("poison", {"--tensors", "7", "--seed", "11"}));
  const WeightStore source = LoadSource(ckpt);
  const HostLayout layout = PlanHostLayout(ckpt, PageSize());
  auto memfds = CreateHostMemfds("weightcache:filler", layout.plan);
  ASSERT_TRUE(memfds.ok());
  std::vector<uint64_t> chunk_hashes(layout.chunk_begin.back());
  const Result<FillOutcome> filled =
      FillHostFromPeers(ckpt, layout, *memfds, CopyFrom(source, /*flip_first_byte=*/true),
                        /*threads=*/2, LoadControl{}, &chunk_hashes);
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), StatusCode::kMismatch);
  EXPECT_THAT(filled.status().message(),
              HasSubstr("the checksum of the filled bytes differs from the source's manifest"));
  EXPECT_THAT(filled.status().message(),
              HasSubstr("tensor " + ckpt.tensors()[layout.order[0]].name + ":"));
}

TEST_F(HostStoreTest, APlanOverTheBudgetAllocatesNothing) {
  const checkpoint::Checkpoint ckpt = Open(Make("budget", {"--tensors", "4", "--seed", "4"}));
  LoadOptions options;
  options.memory_budget = 1;
  std::string memory;
  Result<WeightStore> store = LoadHostStore(ckpt, options, LoadControl{}, &memory);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(store.status().message(), HasSubstr("over the memory budget of 1 bytes"));
  EXPECT_TRUE(memory.empty());
}

}  // namespace
}  // namespace weightcache::daemon
