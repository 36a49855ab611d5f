// The fingerprint cache (identity/fingerprint_cache.h) over real checkpoints written by the
// safetensors library: a hit only while every file stats the same, a miss (and the true
// fingerprint) after each kind of change, and entries that are corrupt, foreign or
// group-writable ignored and rewritten.
#include "identity/fingerprint_cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "checkpoint/checkpoint.h"
#include "common/hash.h"
#include "support/test_env.h"
#include "unit/checkpoint/checkpoint_fixture.h"

namespace weightcache::identity {
namespace {

using weightcache::testing::ReadFile;
using weightcache::testing::WriteFile;

int64_t NowNs() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

class FingerprintCacheTest : public checkpoint::testing::CheckpointFixture {
 protected:
  void SetUp() override {
    CheckpointFixture::SetUp();
    if (IsSkipped()) return;
    model_ = Make("model", {"--tensors", "12", "--dtypes", "bf16,f32", "--shards", "3"});
    options_.runtime_dir = tmp_.Join("runtime");
    ASSERT_EQ(::mkdir(options_.runtime_dir.c_str(), 0700), 0);
    // The files were just written: model them as aged past the racy window.
    options_.now_ns = NowNs() + 2 * kRacyWindowNs;
  }

  // What Checkpoint::Open says now: the ground truth.
  std::pair<std::string, std::string> Truth() {
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    return {ckpt->fingerprint(), ckpt->files_digest()};
  }

  CheckpointIdentity Identity() {
    auto id = CheckpointIdentityOf(model_, options_);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    return id.ok() ? *id : CheckpointIdentity{};
  }

  // The one entry file of the cache dir.
  std::string EntryPath() {
    std::string found;
    for (const auto& e :
         std::filesystem::directory_iterator(FingerprintCacheDir(options_.runtime_dir))) {
      found = e.path().string();
    }
    return found;
  }

  // Replaces the entry's fingerprint with another valid one and re-signs it: an entry that
  // would be trusted if read, so that a test can see whether it was.
  void PoisonEntry(mode_t mode) {
    const std::string path = EntryPath();
    std::string body = ReadFile(path).substr(65);
    const std::string key = "\"fingerprint\":\"";
    const size_t at = body.find(key);
    ASSERT_NE(at, std::string::npos) << body;
    body.replace(at + key.size(), 64, std::string(64, 'a'));
    ::unlink(path.c_str());
    WriteFile(path, Sha256Hex(body) + "\n" + body);
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
  }

  std::string model_;
  FingerprintCacheOptions options_;
};

TEST_F(FingerprintCacheTest, AMissComputesAndStoresThenAHitReturnsTheSameWithoutReading) {
  const auto [fingerprint, files] = Truth();
  const CheckpointIdentity first = Identity();
  EXPECT_EQ(first.source, FingerprintSource::kComputed);
  EXPECT_EQ(first.fingerprint, fingerprint);
  EXPECT_EQ(first.files_digest, files);
  struct stat dir {};
  ASSERT_EQ(::lstat(FingerprintCacheDir(options_.runtime_dir).c_str(), &dir), 0);
  EXPECT_EQ(dir.st_mode & 07777, 0700u);
  struct stat entry {};
  ASSERT_EQ(::stat(EntryPath().c_str(), &entry), 0);
  EXPECT_EQ(entry.st_mode & 07777, 0600u);

  const CheckpointIdentity second = Identity();
  EXPECT_EQ(second.source, FingerprintSource::kCache);
  EXPECT_EQ(second.fingerprint, fingerprint);
  EXPECT_EQ(second.files_digest, files);
}

TEST_F(FingerprintCacheTest, TheFilesDigestAloneComesFromAVerifiedEntryOrIsComputed) {
  const auto [fingerprint, files] = Truth();
  auto computed = CheckpointFilesDigestOf(model_, options_);  // no entry yet
  ASSERT_TRUE(computed.ok()) << computed.status().ToString();
  EXPECT_EQ(*computed, files);
  EXPECT_EQ(EntryPath(), "") << "nothing is stored without a fingerprint";
  Identity();
  PoisonEntry(0600);  // the entry's shard list is what is used, not its fingerprint
  auto cached = CheckpointFilesDigestOf(model_, options_);
  ASSERT_TRUE(cached.ok());
  EXPECT_EQ(*cached, files);
}

TEST_F(FingerprintCacheTest, AHitTrustsTheEntrySoAPoisonedOneShowsWhetherItWasRead) {
  Identity();
  PoisonEntry(0600);
  const CheckpointIdentity poisoned = Identity();
  EXPECT_EQ(poisoned.source, FingerprintSource::kCache);
  EXPECT_EQ(poisoned.fingerprint, std::string(64, 'a'));
}

TEST_F(FingerprintCacheTest, AFreshlyWrittenCheckpointIsNotStoredUntilItHasAged) {
  options_.now_ns = NowNs();  // the files are younger than the racy window
  EXPECT_EQ(Identity().source, FingerprintSource::kComputed);
  EXPECT_EQ(EntryPath(), "");
  EXPECT_EQ(Identity().source, FingerprintSource::kComputed);
}

TEST_F(FingerprintCacheTest, ContentRewrittenWithItsMtimeRestoredIsAMissByCtime) {
  Identity();
  PoisonEntry(0600);
  const std::string shard = model_ + "/" + summary_["files"][0].get<std::string>();
  struct stat before {};
  ASSERT_EQ(::stat(shard.c_str(), &before), 0);
  std::string bytes = ReadFile(shard);
  bytes[bytes.size() - 1] ^= 0x5a;  // tensor data, same size
  WriteFile(shard, bytes);
  // touch -d: the old mtime back; ctime moves anyway.
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  const auto [fingerprint, files] = Truth();
  const CheckpointIdentity after = Identity();
  EXPECT_EQ(after.source, FingerprintSource::kComputed);
  EXPECT_EQ(after.fingerprint, fingerprint);
  EXPECT_EQ(after.files_digest, files);
}

TEST_F(FingerprintCacheTest, AShardReplacedByRenameIsAMiss) {
  Identity();
  PoisonEntry(0600);
  const std::string shard = model_ + "/" + summary_["files"][1].get<std::string>();
  const std::string copy = shard + ".new";
  WriteFile(copy, ReadFile(shard));
  ASSERT_EQ(::rename(copy.c_str(), shard.c_str()), 0);
  const CheckpointIdentity after = Identity();
  EXPECT_EQ(after.source, FingerprintSource::kComputed);
  EXPECT_EQ(after.fingerprint, Truth().first);
}

TEST_F(FingerprintCacheTest, AFileRenamedAwayOrAddedToTheListingIsAMiss) {
  Identity();
  PoisonEntry(0600);
  // A stray *.safetensors beside an indexed checkpoint changes the listing, not the files.
  WriteFile(model_ + "/extra.safetensors", "x");
  EXPECT_EQ(Identity().source, FingerprintSource::kComputed);
  ASSERT_EQ(::unlink((model_ + "/extra.safetensors").c_str()), 0);
  // The index renamed away: the directory no longer opens as that checkpoint.
  const std::string index = model_ + "/" + std::string(checkpoint::kIndexFileName);
  ASSERT_EQ(::rename(index.c_str(), (index + ".bak").c_str()), 0);
  auto id = CheckpointIdentityOf(model_, options_);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), StatusCode::kInvalidCheckpoint) << id.status().ToString();
}

TEST_F(FingerprintCacheTest, CorruptTruncatedAndForeignFormatEntriesAreIgnoredAndRewritten) {
  const std::string truth = Truth().first;
  Identity();
  const std::string path = EntryPath();
  const std::string good = ReadFile(path);
  for (const std::string& bad : {good.substr(0, good.size() / 2), std::string("garbage"),
                                 std::string(), good.substr(0, 70) + "X" + good.substr(71)}) {
    ::unlink(path.c_str());
    WriteFile(path, bad);
    ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
    const CheckpointIdentity id = Identity();
    EXPECT_EQ(id.source, FingerprintSource::kComputed);
    EXPECT_EQ(id.fingerprint, truth);
    EXPECT_EQ(ReadFile(path), good) << "rewritten";
  }
}

TEST_F(FingerprintCacheTest, AGroupWritableOrForeignOwnedOrSymlinkedEntryIsIgnored) {
  const std::string truth = Truth().first;
  Identity();
  PoisonEntry(0620);
  EXPECT_EQ(Identity().fingerprint, truth);
  PoisonEntry(0600);
  const std::string path = EntryPath();
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
    EXPECT_EQ(Identity().fingerprint, truth);
  }
  // Owned by another uid from the cache's point of view.
  PoisonEntry(0600);
  options_.uid = ::geteuid() + 1;
  // (the cache dir itself is then foreign too: the cache is off, the identity computed)
  EXPECT_EQ(Identity().fingerprint, truth);
  options_.uid = ::geteuid();
  PoisonEntry(0600);
  const std::string target = path + ".target";
  ASSERT_EQ(::rename(path.c_str(), target.c_str()), 0);
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  EXPECT_EQ(Identity().fingerprint, truth);
}

TEST_F(FingerprintCacheTest, AnUnusableCacheDirStillGivesTheIdentity) {
  const auto [fingerprint, files] = Truth();
  // The cache dir's place is taken by a file: nothing can be stored, nothing read.
  WriteFile(FingerprintCacheDir(options_.runtime_dir), "not a directory");
  for (int i = 0; i < 2; ++i) {
    const CheckpointIdentity id = Identity();
    EXPECT_EQ(id.source, FingerprintSource::kComputed);
    EXPECT_EQ(id.fingerprint, fingerprint);
    EXPECT_EQ(id.files_digest, files);
  }
  options_.runtime_dir = "";  // disabled
  EXPECT_EQ(Identity().fingerprint, fingerprint);
}

TEST_F(FingerprintCacheTest, AMissingRuntimeDirIsNotCreated) {
  options_.runtime_dir = tmp_.Join("no-such-runtime");
  EXPECT_EQ(Identity().fingerprint, Truth().first);
  EXPECT_FALSE(std::filesystem::exists(options_.runtime_dir));
}

TEST_F(FingerprintCacheTest, EntriesAreBoundedInNumber) {
  // kMaxEntries + 8 stray entries of other checkpoints: storing one more trims to the bound.
  Identity();
  const std::string dir = FingerprintCacheDir(options_.runtime_dir);
  ASSERT_EQ(::unlink(EntryPath().c_str()), 0);
  for (size_t i = 0; i < kMaxEntries + 8; ++i) {
    WriteFile(dir + "/stale-" + std::to_string(i) + ".json", "x");
  }
  EXPECT_EQ(Identity().source, FingerprintSource::kComputed);
  size_t count = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++count;
  EXPECT_EQ(count, kMaxEntries);
  EXPECT_EQ(Identity().source, FingerprintSource::kCache);
}

}  // namespace
}  // namespace weightcache::identity
