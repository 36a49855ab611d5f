// The content anchor (checkpoint/content_anchor.h): each shard's SHA-256 as the checkpoint
// records it — hub cache blob names, `huggingface-cli download --local-dir` metadata, a pinned
// sha256sum file — over real symlink trees and metadata files in a temp dir, hostile ones
// included (a blob name that is no SHA-256, a symlink loop, a link out of the repository,
// junk and stale metadata).
#include "checkpoint/content_anchor.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "common/hash.h"
#include "support/hub_cache.h"
#include "support/test_env.h"

namespace weightcache::checkpoint {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kShaA(64, 'a');
const std::string kShaB = Sha256Hex("b");

void Write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// Sets `path`'s mtime to `seconds` since the epoch.
void SetMtime(const fs::path& path, double seconds) {
  timespec times[2];
  times[0].tv_sec = static_cast<time_t>(seconds);
  times[0].tv_nsec = 0;
  times[1] = times[0];
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
}

class ContentAnchorTest : public ::testing::Test {
 protected:
  // <tmp>/hub/models--m/{blobs,snapshots/rev}: the snapshot dir.
  fs::path Snapshot() {
    const fs::path snapshot = fs::path(tmp_.path()) / "hub/models--m/snapshots/rev";
    fs::create_directories(snapshot);
    fs::create_directories(fs::path(tmp_.path()) / "hub/models--m/blobs");
    return snapshot;
  }
  fs::path Blobs() { return fs::path(tmp_.path()) / "hub/models--m/blobs"; }

  Result<ShardDigest> Recorded(const fs::path& path) {
    return RecordedDigest({path.filename().string(), path.string()});
  }

  weightcache::testing::TempDir tmp_;
};

// A real checkpoint (2 shards and the index, written by safetensors) laid out as the hub cache
// does: each shard's digest is its blob's name, the SHA-256 of its bytes.
class HubCheckpointTest : public testing::CheckpointFixture {};

TEST_F(HubCheckpointTest, AHubSnapshotsBlobNamesAreItsShardsSha256s) {
  const std::string dir = Make("ckpt", {"--tensors", "6", "--shards", "2"});
  std::vector<std::string> expected;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".safetensors") {
      expected.push_back(weightcache::testing::FileSha256(entry.path().string()) + "  " +
                         entry.path().filename().string() + "\n");
    }
  }
  std::sort(expected.begin(), expected.end(),
            [](const std::string& a, const std::string& b) { return a.substr(66) < b.substr(66); });
  ASSERT_EQ(expected.size(), 2u);
  const std::string snapshot =
      weightcache::testing::LayOutAsHubCache(dir, tmp_.Join("hub"), "org--tiny");
  auto anchor = FindContentAnchor(snapshot, "");
  ASSERT_TRUE(anchor.ok()) << anchor.status().ToString();
  ASSERT_EQ(anchor->shards.size(), 2u);
  EXPECT_EQ(anchor->Text(), expected[0] + expected[1]);
  EXPECT_EQ(anchor->Digest(), Sha256Hex(anchor->Text()));
  EXPECT_EQ(anchor->shards[0].source, AnchorSource::kHubBlob);
  EXPECT_EQ(anchor->Describe(), "hub cache blob name");
  EXPECT_EQ(anchor->Find("model-00001-of-00002.safetensors")->sha256, expected[0].substr(0, 64));
  EXPECT_EQ(anchor->Find("other.safetensors"), nullptr);

  // The plain directory records nothing.
  const std::string plain = Make("plain", {"--tensors", "2"});
  auto none = FindContentAnchor(plain, "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(),
              HasSubstr("'model.safetensors': no SHA-256 recorded (hub cache: not a symlink"));
  EXPECT_THAT(none.status().message(), HasSubstr("local dir: no download metadata"));
}

TEST_F(ContentAnchorTest, AHubBlobThatIsNotNamedBySha256GivesNoDigest) {
  const fs::path snapshot = Snapshot();
  Write(Blobs() / "3f786850e387550fdab836ed7e6dc881de23001b", "git blob");  // a sha1: not LFS
  fs::create_symlink("../../blobs/3f786850e387550fdab836ed7e6dc881de23001b",
                     snapshot / "a.safetensors");
  auto a = Recorded(snapshot / "a.safetensors");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(a.status().message(), HasSubstr("is not named by a SHA-256"));

  const std::string upper(64, 'A');  // 64 hex, not lowercase: not as the hub names blobs
  Write(Blobs() / upper, "x");
  fs::create_symlink("../../blobs/" + upper, snapshot / "b.safetensors");
  EXPECT_THAT(Recorded(snapshot / "b.safetensors").status().message(),
              HasSubstr("is not named by a SHA-256"));

  fs::create_directories(Blobs() / kShaA);  // named right, but a directory
  fs::create_symlink("../../blobs/" + kShaA, snapshot / "c.safetensors");
  EXPECT_THAT(Recorded(snapshot / "c.safetensors").status().message(),
              HasSubstr("is not a regular file"));

  Write(Blobs() / kShaB, "b");
  fs::create_symlink("../../blobs/" + kShaB, snapshot / "d.safetensors");
  auto d = Recorded(snapshot / "d.safetensors");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->sha256, kShaB);
  EXPECT_EQ(d->source, AnchorSource::kHubBlob);
}

TEST_F(ContentAnchorTest, ASymlinkLoopGivesNoDigest) {
  const fs::path snapshot = Snapshot();
  fs::create_symlink("b.safetensors", snapshot / "a.safetensors");
  fs::create_symlink("a.safetensors", snapshot / "b.safetensors");
  auto a = Recorded(snapshot / "a.safetensors");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(a.status().message(), HasSubstr("a symlink loop"));
}

// The blob must be in the snapshot's own repository: a link to another repository's blobs (or
// any file named by 64 hex anywhere) is not the hub's record of this file.
TEST_F(ContentAnchorTest, ALinkOutOfTheRepositoryGivesNoDigest) {
  const fs::path snapshot = Snapshot();
  const fs::path elsewhere = fs::path(tmp_.path()) / "hub/models--other/blobs" / kShaB;
  Write(elsewhere, "b");
  fs::create_symlink(elsewhere, snapshot / "abs.safetensors");
  fs::create_symlink("../../../models--other/blobs/" + kShaB, snapshot / "rel.safetensors");
  for (const char* name : {"abs.safetensors", "rel.safetensors"}) {
    auto r = Recorded(snapshot / name);
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_THAT(r.status().message(), HasSubstr("is outside the repository of")) << name;
  }
  // Not under blobs/ at all.
  Write(fs::path(tmp_.path()) / "loose" / kShaB, "b");
  fs::create_symlink(fs::path(tmp_.path()) / "loose" / kShaB, snapshot / "loose.safetensors");
  EXPECT_THAT(Recorded(snapshot / "loose.safetensors").status().message(),
              HasSubstr("is not in a hub cache's blobs/"));
}

TEST_F(ContentAnchorTest, LocalDirMetadataGivesTheEtagWhileTheFileIsNotNewer) {
  const fs::path dir = fs::path(tmp_.path()) / "local";
  Write(dir / "model.safetensors", "weights");
  SetMtime(dir / "model.safetensors", 1700000000);
  const fs::path metadata = dir / ".cache/huggingface/download/model.safetensors.metadata";
  Write(metadata, "0123456789abcdef0123456789abcdef01234567\n" + kShaB + "\n1700000000.5\n");
  auto r = Recorded(dir / "model.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->sha256, kShaB);
  EXPECT_EQ(r->source, AnchorSource::kLocalDirMetadata);

  // Within huggingface_hub's one second of slack: still believed.
  SetMtime(dir / "model.safetensors", 1700000001);
  EXPECT_TRUE(Recorded(dir / "model.safetensors").ok());
  // Modified after the download: the metadata is stale.
  SetMtime(dir / "model.safetensors", 1700000010);
  auto stale = Recorded(dir / "model.safetensors");
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(stale.status().message(), HasSubstr("older than the file (modified since download)"));
}

TEST_F(ContentAnchorTest, JunkMetadataGivesNoDigest) {
  const fs::path dir = fs::path(tmp_.path()) / "local";
  Write(dir / "model.safetensors", "weights");
  SetMtime(dir / "model.safetensors", 1700000000);
  const fs::path metadata = dir / ".cache/huggingface/download/model.safetensors.metadata";
  const struct {
    std::string text;
    std::string error;
  } cases[] = {
      {"commit\n" + kShaB + "\n", "is not \"commit\\netag\\ntimestamp\""},
      {"\n" + kShaB + "\n1700000000\n", "is not \"commit\\netag\\ntimestamp\""},
      {"commit\n3f786850e387550fdab836ed7e6dc881de23001b\n1700000000\n",
       "etag '3f786850e387550fdab836ed7e6dc881de23001b' is not a SHA-256"},
      {"commit\n\"" + kShaB + "\"\n1700000000\n", "is not a SHA-256"},
      {"commit\n" + kShaB + "\nsoon\n", "timestamp 'soon' is not a number"},
      {"commit\n" + kShaB + "\ninf\n", "timestamp 'inf' is not a number"},
      {"commit\n" + kShaB + "\n1700000000\n" + std::string(5000, 'x'), "larger than the 4096"},
      {std::string("\x00\xff\x01", 3), "is not \"commit\\netag\\ntimestamp\""},
  };
  for (const auto& c : cases) {
    Write(metadata, c.text);
    auto r = Recorded(dir / "model.safetensors");
    ASSERT_FALSE(r.ok()) << c.error;
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_THAT(r.status().message(), HasSubstr(c.error));
  }
  // A FIFO or a directory in its place is refused without blocking.
  fs::remove(metadata);
  fs::create_directories(metadata);
  auto r = Recorded(dir / "model.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("its download metadata: "));
  fs::remove(metadata);
  ASSERT_EQ(::mkfifo(metadata.c_str(), 0600), 0);
  EXPECT_FALSE(Recorded(dir / "model.safetensors").ok());
}

TEST_F(ContentAnchorTest, APinnedSumsFileAnchorsEveryShardAndOverridesTheLayout) {
  const fs::path snapshot = Snapshot();
  Write(Blobs() / kShaB, "b");
  fs::create_symlink("../../blobs/" + kShaB, snapshot / "model-1.safetensors");
  Write(snapshot / "model-2.safetensors", "two");
  const std::vector<AnchorFile> files = {
      {"model-1.safetensors", (snapshot / "model-1.safetensors").string()},
      {"model-2.safetensors", (snapshot / "model-2.safetensors").string()}};
  // model-2 records nothing: no anchor without the pinned file.
  auto none = FindContentAnchor(files, "");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("'model-2.safetensors': no SHA-256 recorded"));

  const std::string upper = std::string(63, 'C') + "D";
  const fs::path sums = fs::path(tmp_.path()) / "sums.txt";
  Write(sums, "# sha256sum output\n\n" + kShaA + "  shards/model-1.safetensors\n" + upper +
                  " *model-2.safetensors\r\n" + kShaA + "  model-1.safetensors\n");
  auto pinned = FindContentAnchor(files, sums.string());
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  ASSERT_EQ(pinned->shards.size(), 2u);
  EXPECT_EQ(pinned->shards[0].sha256, kShaA) << "the pinned digest, not the blob name";
  EXPECT_EQ(pinned->shards[1].sha256, std::string(63, 'c') + "d");
  EXPECT_EQ(pinned->Describe(), "--fill-content-sha256");

  const struct {
    std::string text;
    std::string error;
  } bad[] = {
      {kShaA + "  model-1.safetensors\n", "has no line for shard 'model-2.safetensors'"},
      {kShaA + "  model-1.safetensors\nnot a line\n", "line 2 ('not a line'): not a sha256sum"},
      {std::string(64, 'g') + "  model-1.safetensors\n", "the digest is not 64 hex characters"},
      {kShaA + "  model-1.safetensors\n" + kShaB + "  model-1.safetensors\n",
       "'model-1.safetensors' is listed with two digests"},
      {kShaA + "\tmodel-1.safetensors\n", "not a sha256sum line"},
  };
  for (const auto& c : bad) {
    Write(sums, c.text);
    auto r = FindContentAnchor(files, sums.string());
    ASSERT_FALSE(r.ok()) << c.error;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("--fill-content-sha256 " + sums.string()));
    EXPECT_THAT(r.status().message(), HasSubstr(c.error));
  }
  auto missing = FindContentAnchor(files, tmp_.Join("absent.txt"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightcache::checkpoint
