// The gpu tier's fill from other nodes (LoadGpuStore with LoadOptions::peer_fill, docs/fleet.md
// "Fill") over the fake driver with its VMM memory backed, so that what the fill wrote and what
// the checks read back are real bytes. A "source" is a gpu store loaded from a checkpoint
// written by the safetensors library; a fake PeerFill offers its manifest to accept() first, as
// FetchArena does, then writes its bytes into the filler's device allocations through the
// driver (optionally one byte flipped, or junk in the gaps between tensors). Whole and TP=2
// sharded caches (rank for rank).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/content_anchor.h"
#include "cuda/imported_arena.h"
#include "daemon/weight_store.h"
#include "identity/resolve.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "serve/seed_fill.h"
#include "sharding/planner.h"
#include "support/hub_cache.h"
#include "support/test_env.h"
#include "unit/cuda/fake_driver.h"
#include "unit/sharding/sharding_fixture.h"

namespace weightcache::daemon {
namespace {

using cuda::testing::FakeDriver;
using ::testing::HasSubstr;

constexpr uint64_t kGranularity = 4096;

class GpuFillTest : public sharding::testing::ShardingFixture {
 protected:
  void SetUp() override {
    fake_.emplace(kGranularity);
    fake_->BackVmmMemory();
    env_.load_driver = [this]() -> Result<const cuda::DriverApi*> { return fake_->api(); };
    env_.lookup = identity::MapEnv({});
  }

  // A dense Llama-shaped checkpoint (config.json and the built-in rules beside it).
  std::string MakeModel(const std::string& name) {
    const sharding::testing::DenseModel model;
    return Make(name, model.Tensors(), model.Config(), 2);
  }

  // A copy of `dir` with every tensor byte changed and the headers kept: the same fleet key and
  // layout, other weights (another fine-tune with equal headers).
  std::string OtherWeightsOf(const std::string& dir, const std::string& name) {
    const std::string out = tmp_.Join(name);
    std::filesystem::copy(dir, out, std::filesystem::copy_options::recursive);
    for (const auto& entry : std::filesystem::directory_iterator(out)) {
      if (entry.path().extension() != ".safetensors") continue;
      std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
      uint64_t header = 0;
      f.read(reinterpret_cast<char*>(&header), sizeof(header));
      std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      for (size_t i = header; i < data.size(); ++i) data[i] = static_cast<char>(data[i] ^ 0x55);
      f.seekp(static_cast<std::streamoff>(sizeof(header)));
      f.write(data.data(), static_cast<std::streamsize>(data.size()));
    }
    return out;
  }

  sharding::testing::OpenedModel Open(const std::string& dir) {
    auto opened = sharding::testing::OpenWithBuiltinRules(dir);
    EXPECT_TRUE(opened.ok()) << opened.status().ToString();
    return std::move(opened).value();
  }

  LoadOptions Options(const std::string& dir, const sharding::ShardPlan* plan) {
    IdentityOptions identity;
    identity.model_dir = dir;
    identity.tier = Tier::kGpu;
    identity.device = "1";
    identity.runtime_dir = tmp_.Join("run");
    auto id = identity::ResolveIdentity(identity, env_);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    LoadOptions options;
    options.threads = 2;
    options.device = *id->device;
    options.driver = fake_->api();
    options.cache_name = "weightcache:test";
    options.shard_plan = plan;
    return options;
  }

  WeightStore Load(const checkpoint::Checkpoint& ckpt, const LoadOptions& options,
                   const LoadControl& control = {}) {
    std::string memory;
    auto store = LoadGpuStore(ckpt, options, control, &memory);
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return std::move(store).value();
  }

  static std::vector<uint8_t> ManifestBytes(const WeightStore& store) {
    std::vector<uint8_t> bytes(store.summary().manifest.size);
    EXPECT_EQ(::pread(store.summary().manifest.fd.get(), bytes.data(), bytes.size(), 0),
              static_cast<ssize_t>(bytes.size()));
    return bytes;
  }

  // Every allocation's bytes, read back through its exported fd.
  std::vector<std::string> ArenaBytes(const WeightStore& store) const {
    auto manifest = protocol::Manifest::Decode(ManifestBytes(store));
    EXPECT_TRUE(manifest.ok());
    std::vector<std::string> out;
    const std::vector<int> fds = store.fds();
    for (size_t a = 0; a < fds.size(); ++a) {
      out.push_back(fake_->ExportedBytes(fds[a], 0, manifest->allocation_sizes()[a]));
    }
    return out;
  }

  enum class Poison { kNone, kFlipFirstByte, kJunkInGaps, kJunkInGapsAndAWrongByte };
  // Writes `source`'s allocations into the request's device allocations (through the driver,
  // in 4 KiB pieces, each reported) once accept() takes its manifest.
  PeerFill CopyFrom(const WeightStore& source, Poison poison = Poison::kNone) {
    return [this, &source, poison](const PeerFillRequest& request) -> Result<FillOutcome> {
      EXPECT_EQ(request.memory, FillMemory::kDevice);
      WEIGHTCACHE_RETURN_IF_ERROR(request.accept(ManifestBytes(source)));
      std::vector<std::string> bytes = ArenaBytes(source);
      if (bytes.size() != request.allocations.size()) return InternalError("allocation count");
      // Junk in the gaps: the tensors' bytes in their places, 0xee everywhere else.
      if (poison == Poison::kJunkInGaps || poison == Poison::kJunkInGapsAndAWrongByte) {
        bytes = TensorBytesOnly(source, bytes);
      }
      // The first tensor starts the first allocation: its checksum fails.
      if (poison == Poison::kFlipFirstByte || poison == Poison::kJunkInGapsAndAWrongByte) {
        bytes[0][0] = static_cast<char>(bytes[0][0] ^ 0xff);
      }
      uint64_t total = 0;
      for (const auto& a : request.allocations) total += a.size();
      uint64_t done = 0;
      for (size_t a = 0; a < bytes.size(); ++a) {
        const auto ptr = reinterpret_cast<CUdeviceptr>(request.allocations[a].data());
        for (size_t at = 0; at < bytes[a].size(); at += 4096) {
          const size_t n = std::min<size_t>(4096, bytes[a].size() - at);
          if (fake_->api()->cuMemcpyHtoD(ptr + at, bytes[a].data() + at, n) != CUDA_SUCCESS) {
            return InternalError("cuMemcpyHtoD");
          }
          done += n;
          request.progress(done, total);
        }
      }
      return FillOutcome{"test", "the test source", prove_};
    };
  }

  // The content anchor of `dir`'s shards, computed from their bytes (what a hub cache's blob
  // names record).
  static std::shared_ptr<const checkpoint::ContentAnchor> AnchorOf(const std::string& dir) {
    auto anchor = std::make_shared<checkpoint::ContentAnchor>();
    auto files = checkpoint::CheckpointShardFiles(dir);
    EXPECT_TRUE(files.ok()) << files.status().ToString();
    for (const auto& [path, name] : *files) {
      anchor->shards.push_back(
          {name, weightcache::testing::FileSha256(path), checkpoint::AnchorSource::kPinned});
    }
    return anchor;
  }

  // A copy of `dir` whose last shard's last byte (inside its last tensor) is flipped: the same
  // headers, one byte of other weights.
  std::string OneByteOtherThan(const std::string& dir, const std::string& name,
                               std::string* changed_file) {
    const std::string out = tmp_.Join(name);
    std::filesystem::copy(dir, out, std::filesystem::copy_options::recursive);
    auto files = checkpoint::CheckpointShardFiles(out);
    EXPECT_TRUE(files.ok());
    const std::string& last = files->back().first;
    *changed_file = files->back().second;
    std::fstream f(last, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char byte = 0;
    f.read(&byte, 1);
    f.seekp(-1, std::ios::end);
    byte = static_cast<char>(byte ^ 0x01);
    f.write(&byte, 1);
    EXPECT_TRUE(f.good());
    return out;
  }

  // `bytes` with every byte outside a tensor of `store`'s manifest set to 0xee.
  static std::vector<std::string> TensorBytesOnly(const WeightStore& store,
                                                  std::vector<std::string> bytes) {
    auto manifest = protocol::Manifest::Decode(ManifestBytes(store));
    std::vector<std::string> out;
    for (const std::string& a : bytes) out.emplace_back(a.size(), '\xee');
    for (size_t i = 0; i < manifest->tensor_count(); ++i) {
      const protocol::TensorEntry e = manifest->tensor(i);
      std::memcpy(out[e.allocation].data() + e.offset, bytes[e.allocation].data() + e.offset,
                  e.nbytes);
    }
    return out;
  }
  std::optional<FakeDriver> fake_;
  identity::Env env_ = identity::Env::Default();
  // What CopyFrom's outcome asks the loader to prove (serve --fill-trust content); null: none.
  std::shared_ptr<const checkpoint::ContentAnchor> prove_;
};

TEST_F(GpuFillTest, AFillFromAnEqualStoreIsVerifiedAndServedWithTheSameBytes) {
  const std::string dir = MakeModel("fill");
  const auto model = Open(dir);
  const WeightStore source = Load(model.ckpt, Options(dir, nullptr));

  // The disk upload pins its staging ring first: no pinning, no disk pass.
  const int pinned = fake_->CallCount("cuMemHostRegister");
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source);
  const WeightStore filled = Load(model.ckpt, options);
  EXPECT_EQ(filled.summary().filled_from, "filled from the test source");
  EXPECT_EQ(filled.summary().origin, "test");
  EXPECT_EQ(fake_->CallCount("cuMemHostRegister"), pinned) << "the disk upload ran too";
  // The same checksums and layout (the manifest the filler serves is the source's), and the
  // same bytes on the device.
  EXPECT_EQ(ManifestBytes(filled), ManifestBytes(source));
  EXPECT_EQ(ArenaBytes(filled), ArenaBytes(source));
}

// A cache that serves fills (serve --fill-serve) keeps its allocations' creating handles, so
// that its fill source maps memory UCX can hand to a peer on the same host; nothing else of
// the load stays, and the handles go with the memory they name (a demotion's ExchangeFds).
TEST_F(GpuFillTest, AStoreThatServesFillsKeepsItsCreatingHandlesAndNothingElseOfTheLoad) {
  const std::string dir = MakeModel("handles");
  const auto model = Open(dir);
  const WeightStore plain = Load(model.ckpt, Options(dir, nullptr));
  EXPECT_TRUE(plain.creating_handles().empty());
  EXPECT_EQ(fake_->live_handles(), 0);

  LoadOptions options = Options(dir, nullptr);
  options.keep_creating_handles = true;
  WeightStore store = Load(model.ckpt, options);
  const std::vector<CUmemGenericAllocationHandle> handles = store.creating_handles();
  ASSERT_EQ(handles.size(), store.fds().size());
  EXPECT_EQ(fake_->live_handles(), static_cast<int>(handles.size()));
  EXPECT_EQ(fake_->live_mappings(), 0);
  EXPECT_EQ(fake_->total_context_refs(), 0);

  auto manifest = protocol::Manifest::Decode(ManifestBytes(store));
  ASSERT_TRUE(manifest.ok());
  {
    auto source =
        cuda::ImportedArena::MapCreated(fake_->api(), 1, handles, manifest->allocation_sizes());
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    for (const cuda::ImportedAllocation& a : source->allocations()) {
      EXPECT_TRUE(fake_->MappingExportable(a.ptr));
    }
  }
  // A demotion: the new memory's fds in, the old ones out; the handles go with the old ones.
  std::vector<UniqueFd> old = store.ExchangeFds({});
  EXPECT_TRUE(store.creating_handles().empty());
  EXPECT_EQ(fake_->live_handles(), 0);
  EXPECT_EQ(old.size(), handles.size());
}

// Sharded caches fill rank for rank: each rank's daemon fills from the same rank's cache.
TEST_F(GpuFillTest, ATp2RankFillsFromTheSameRanksCache) {
  const std::string dir = MakeModel("tp2");
  const auto model = Open(dir);
  for (uint32_t rank : {0u, 1u}) {
    SCOPED_TRACE("tp rank " + std::to_string(rank));
    auto plan =
        sharding::PlanShard(model.ckpt, model.rules, model.config, {.tp_size = 2, .tp_rank = rank});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const WeightStore source = Load(model.ckpt, Options(dir, &*plan));
    LoadOptions options = Options(dir, &*plan);
    options.peer_fill = CopyFrom(source);
    std::vector<std::pair<uint64_t, uint64_t>> progress;
    LoadControl control;
    control.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };
    const WeightStore filled = Load(model.ckpt, options, control);
    EXPECT_EQ(filled.summary().filled_from, "filled from the test source");
    EXPECT_EQ(ManifestBytes(filled), ManifestBytes(source));
    EXPECT_EQ(ArenaBytes(filled), ArenaBytes(source));
    // The pull is the load's progress, in the rank's held bytes.
    ASSERT_GE(progress.size(), 2u);
    EXPECT_EQ(progress.back(), std::make_pair(plan->bytes, plan->bytes));
  }
  // Rank 0's cache is no source for rank 1: another layout, refused before a byte is read;
  // rank 1 loads from disk.
  auto plan0 =
      sharding::PlanShard(model.ckpt, model.rules, model.config, {.tp_size = 2, .tp_rank = 0});
  auto plan1 =
      sharding::PlanShard(model.ckpt, model.rules, model.config, {.tp_size = 2, .tp_rank = 1});
  ASSERT_TRUE(plan0.ok() && plan1.ok());
  const WeightStore rank0 = Load(model.ckpt, Options(dir, &*plan0));
  LoadOptions options = Options(dir, &*plan1);
  options.peer_fill = CopyFrom(rank0);
  const WeightStore rank1 = Load(model.ckpt, options);
  EXPECT_EQ(rank1.summary().filled_from, "");
  EXPECT_EQ(ManifestBytes(rank1), ManifestBytes(Load(model.ckpt, Options(dir, &*plan1))));
}

TEST_F(GpuFillTest, AWrongByteFailsTheChecksumAndTheDiskLoadReplacesIt) {
  const std::string dir = MakeModel("poison");
  const auto model = Open(dir);
  const WeightStore source = Load(model.ckpt, Options(dir, nullptr));
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source, Poison::kFlipFirstByte);
  const WeightStore store = Load(model.ckpt, options);
  EXPECT_EQ(store.summary().filled_from, "");
  EXPECT_EQ(store.summary().origin, "disk");
  EXPECT_EQ(ManifestBytes(store), ManifestBytes(source));
  EXPECT_EQ(ArenaBytes(store), ArenaBytes(source)) << "the disk pass rewrote the flipped byte";
}

// A source with other weights under equal headers: its manifest is consistent with its own
// bytes (every checksum passes) and only the sample against our checkpoint catches it.
TEST_F(GpuFillTest, OtherWeightsUnderEqualHeadersAreCaughtByTheSample) {
  const std::string dir = MakeModel("ours");
  const std::string other = OtherWeightsOf(dir, "theirs");
  const auto ours = Open(dir);
  const auto theirs = Open(other);
  const WeightStore source = Load(theirs.ckpt, Options(other, nullptr));
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source);
  const WeightStore store = Load(ours.ckpt, options);
  EXPECT_EQ(store.summary().filled_from, "");
  EXPECT_NE(ManifestBytes(store), ManifestBytes(source));
  EXPECT_EQ(ManifestBytes(store), ManifestBytes(Load(ours.ckpt, Options(dir, nullptr))));
}

// A first fill (the node's peer caches) whose manifest was accepted and whose copy then failed
// does not bind the second (the fleet): the second's sources are held to their own manifest.
// Here the first offers other weights under equal headers (a layout-equal manifest with other
// checksums), so the honest second would be refused as "differs from the first accepted
// source's" if the first's manifest were kept.
TEST_F(GpuFillTest, ASecondFillIsNotHeldToTheManifestOfAFirstThatFailed) {
  const std::string dir = MakeModel("ours");
  const std::string other = OtherWeightsOf(dir, "theirs");
  const auto ours = Open(dir);
  const auto theirs = Open(other);
  const WeightStore wrong = Load(theirs.ckpt, Options(other, nullptr));
  const WeightStore source = Load(ours.ckpt, Options(dir, nullptr));
  ASSERT_NE(ManifestBytes(wrong), ManifestBytes(source));
  bool first_accepted = false;
  PeerFill first = [this, &wrong,
                    &first_accepted](const PeerFillRequest& request) -> Result<FillOutcome> {
    WEIGHTCACHE_RETURN_IF_ERROR(request.accept(ManifestBytes(wrong)));
    first_accepted = true;
    return Status(StatusCode::kUnavailable, "the peer went away mid-copy");
  };
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = serve::FirstFillOf(std::move(first), CopyFrom(source));
  const WeightStore filled = Load(ours.ckpt, options);
  EXPECT_TRUE(first_accepted);
  EXPECT_EQ(filled.summary().filled_from, "filled from the test source");
  EXPECT_EQ(ManifestBytes(filled), ManifestBytes(source));
  EXPECT_EQ(ArenaBytes(filled), ArenaBytes(source));
}

// The bytes between tensors (each allocation's padding) come from the source: zeroed, as a
// disk load leaves them.
TEST_F(GpuFillTest, TheGapsBetweenTensorsAreZeroed) {
  const std::string dir = MakeModel("gaps");
  const auto model = Open(dir);
  const WeightStore source = Load(model.ckpt, Options(dir, nullptr));
  const std::vector<std::string> expected = ArenaBytes(source);
  const std::vector<std::string> tensors_only = TensorBytesOnly(source, expected);
  size_t gap_bytes = 0;
  for (const std::string& a : tensors_only) gap_bytes += std::count(a.begin(), a.end(), '\xee');
  ASSERT_GT(gap_bytes, 0u) << "the test needs padding between or after the tensors";

  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source, Poison::kJunkInGaps);
  const WeightStore store = Load(model.ckpt, options);
  EXPECT_EQ(store.summary().filled_from, "filled from the test source");
  EXPECT_EQ(ArenaBytes(store), expected);
}

// A rejected source's padding does not outlive it: the disk load that follows writes only the
// tensors, and the gaps are zero as after a disk load alone.
TEST_F(GpuFillTest, ARejectedFillLeavesNoneOfItsBytesInTheGaps) {
  const std::string dir = MakeModel("rejected-gaps");
  const auto model = Open(dir);
  const WeightStore source = Load(model.ckpt, Options(dir, nullptr));
  const std::vector<std::string> expected = ArenaBytes(source);

  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source, Poison::kJunkInGapsAndAWrongByte);
  const WeightStore store = Load(model.ckpt, options);
  EXPECT_EQ(store.summary().filled_from, "") << "the wrong byte must fail the fill";
  EXPECT_EQ(store.summary().origin, "disk");
  EXPECT_EQ(ArenaBytes(store), expected);
}

TEST_F(GpuFillTest, AFailedFillIsFollowedByTheDiskAndACancelEndsTheLoad) {
  const std::string dir = MakeModel("fails");
  const auto model = Open(dir);
  const WeightStore reference = Load(model.ckpt, Options(dir, nullptr));
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = [](const PeerFillRequest&) -> Result<FillOutcome> {
    return Status(StatusCode::kUnavailable, "arena fetch: every source failed");
  };
  const WeightStore store = Load(model.ckpt, options);
  EXPECT_EQ(store.summary().filled_from, "");
  EXPECT_EQ(ArenaBytes(store), ArenaBytes(reference));

  std::atomic<bool> cancel{false};
  options.peer_fill = [&cancel](const PeerFillRequest& request) -> Result<FillOutcome> {
    cancel.store(true);
    EXPECT_EQ(request.cancel, &cancel);
    return Status(StatusCode::kUnavailable, "arena fetch: cancelled");
  };
  LoadControl control;
  control.cancel = &cancel;
  std::string memory;
  Result<WeightStore> cancelled = LoadGpuStore(model.ckpt, options, control, &memory);
  ASSERT_FALSE(cancelled.ok());
  EXPECT_EQ(cancelled.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(cancelled.status().message(), HasSubstr("load cancelled (during the fill)"));
}

// serve --fill-trust content: the loader proves each shard file's SHA-256, over our own header
// and the bytes copied back from the device (one thread per file, each in the load's context),
// against our anchor. An honest source passes; the copy-back threads made the context current.
TEST_F(GpuFillTest, AnHonestFillIsProvenAgainstTheContentAnchor) {
  const std::string dir = MakeModel("proven");
  const auto model = Open(dir);
  ASSERT_EQ(model.ckpt.shards().size(), 2u);
  const WeightStore source = Load(model.ckpt, Options(dir, nullptr));
  prove_ = AnchorOf(dir);
  const int set_current = fake_->CallCount("cuCtxSetCurrent");
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source);
  const WeightStore filled = Load(model.ckpt, options);
  EXPECT_EQ(filled.summary().filled_from, "filled from the test source");
  EXPECT_EQ(ArenaBytes(filled), ArenaBytes(source));
  EXPECT_GT(fake_->CallCount("cuCtxSetCurrent"), set_current) << "no proof thread ran";
}

// The class of bug on the gpu tier: a source that lies consistently (its manifest's
// checksums are its own bytes') with one byte of other weights under equal headers. The
// SHA-256 of the filled file differs from our anchor: the fill fails naming the file and both
// digests, and the disk load replaces every byte.
TEST_F(GpuFillTest, AFlippedByteOfAConsistentSourceFailsTheSha256AndTheDiskReplacesIt) {
  const std::string dir = MakeModel("ours");
  std::string file;
  const std::string other = OneByteOtherThan(dir, "theirs", &file);
  const auto ours = Open(dir);
  const auto theirs = Open(other);
  const WeightStore source = Load(theirs.ckpt, Options(other, nullptr));
  const WeightStore reference = Load(ours.ckpt, Options(dir, nullptr));
  ASSERT_NE(ArenaBytes(source), ArenaBytes(reference));
  prove_ = AnchorOf(dir);
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = CopyFrom(source);
  ::testing::internal::CaptureStderr();
  const WeightStore store = Load(ours.ckpt, options);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(store.summary().filled_from, "");
  EXPECT_EQ(store.summary().origin, "disk");
  EXPECT_EQ(ArenaBytes(store), ArenaBytes(reference));
  const std::string filled_sha = weightcache::testing::FileSha256(other + "/" + file);
  EXPECT_THAT(log,
              HasSubstr("shard " + file + ": the SHA-256 of the filled bytes under our header is " +
                        filled_sha + ", our checkpoint's is " + prove_->Find(file)->sha256));
  EXPECT_THAT(log, HasSubstr("; loading from disk"));
}

// A TP rank of the built-in rules holds slices: the loader says so in the request (a fill that
// must prove its bytes refuses at once), and a proof asked of it fails rather than passing.
TEST_F(GpuFillTest, ASlicedRankCannotBeProvenAgainstTheFilesSha256s) {
  const std::string dir = MakeModel("sliced");
  const auto model = Open(dir);
  auto plan =
      sharding::PlanShard(model.ckpt, model.rules, model.config, {.tp_size = 2, .tp_rank = 1});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<bool> whole;
  const auto record = [&whole](const PeerFillRequest& request) -> Result<FillOutcome> {
    whole.push_back(request.holds_whole_files);
    return Status(StatusCode::kUnavailable, "recorded");
  };
  LoadOptions options = Options(dir, nullptr);
  options.peer_fill = record;
  Load(model.ckpt, options);
  LoadOptions sliced = Options(dir, &*plan);
  sliced.peer_fill = record;
  Load(model.ckpt, sliced);
  EXPECT_THAT(whole, ::testing::ElementsAre(true, false));

  const WeightStore source = Load(model.ckpt, Options(dir, &*plan));
  prove_ = AnchorOf(dir);
  sliced.peer_fill = CopyFrom(source);
  ::testing::internal::CaptureStderr();
  const WeightStore store = Load(model.ckpt, sliced);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(store.summary().filled_from, "");
  EXPECT_THAT(log, HasSubstr("the cache holds slices of tensors, which the files' SHA-256s cannot "
                             "prove; loading from disk"));
}

}  // namespace
}  // namespace weightcache::daemon
