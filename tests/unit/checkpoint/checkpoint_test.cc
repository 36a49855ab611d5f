// Checkpoint::Open, the index rules, the fingerprint and ReadRanges, on real checkpoints
// written by the real safetensors library and on hand-built broken ones.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "common/hash.h"
#include "unit/checkpoint/checkpoint_fixture.h"
#include "unit/checkpoint/header_builder.h"

namespace weightcache::checkpoint {
namespace {

using testing::CheckpointFixture;
using ::testing::HasSubstr;
using testing::SafetensorsBytes;
using weightcache::testing::ReadFile;
using weightcache::testing::WriteFile;

ReadOptions Options(int threads, uint64_t chunk_bytes = 16 << 20) {
  ReadOptions options;
  options.threads = threads;
  options.chunk_bytes = chunk_bytes;
  return options;
}

class CheckpointTest : public CheckpointFixture {
 protected:
  // Every tensor of `c` matches the manifest (dtype, shape, size, file) and its bytes, read
  // with one ReadRanges call over all tensors, hash to what the reference reader reported.
  void ExpectMatchesManifest(const Checkpoint& c, const ReadOptions& options) {
    const auto& expected = manifest_["tensors"];
    ASSERT_EQ(c.tensors().size(), expected.size());
    std::vector<std::vector<uint8_t>> buffers;
    std::vector<ReadRequest> requests;
    for (const TensorInfo& t : c.tensors()) {
      buffers.emplace_back(t.nbytes);
      requests.push_back({t.shard, t.offset, t.nbytes, buffers.back().data()});
    }
    Status s = ReadRanges(c, requests, options);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (size_t i = 0; i < c.tensors().size(); ++i) {
      const TensorInfo& t = c.tensors()[i];
      ASSERT_TRUE(expected.contains(t.name)) << t.name;
      const auto& e = expected[t.name];
      EXPECT_EQ(DTypeName(t.dtype), e["dtype"].get<std::string>()) << t.name;
      EXPECT_EQ(t.shape, e["shape"].get<std::vector<uint64_t>>()) << t.name;
      EXPECT_EQ(t.nbytes, e["nbytes"].get<uint64_t>()) << t.name;
      EXPECT_EQ(c.shards()[t.shard].file_name, e["file"].get<std::string>()) << t.name;
      const std::string_view bytes(reinterpret_cast<const char*>(buffers[i].data()),
                                   buffers[i].size());
      EXPECT_EQ(Sha256Hex(bytes), e["sha256"].get<std::string>()) << t.name;
    }
  }
};

TEST_F(CheckpointTest, SingleFileEveryDTypeReadsTheBytesTheReferenceReads) {
  const std::string dir = Make("single", {"--tensors", "44", "--dtypes", "all", "--seed", "7",
                                          "--metadata", "format=pt", "--metadata", "who=test"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->shards().size(), 1u);
  EXPECT_EQ(c->shards()[0].file_name, "model.safetensors");
  EXPECT_EQ(c->total_bytes(), summary_["total_bytes"].get<uint64_t>());
  std::set<DType> seen;
  for (const auto& t : c->tensors()) seen.insert(t.dtype);
  EXPECT_EQ(seen.size(), std::size(kAllDTypes));
  EXPECT_EQ(c->metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"who", "test"}}));
  ExpectMatchesManifest(*c, ReadOptions{});
}

TEST_F(CheckpointTest, SingleFileWrittenBySerializeFileOnly) {
  // Every dtype the Rust writer itself accepts (the F6 pair is hand-laid by the tool).
  const std::string dir =
      Make("rust", {"--tensors", "20", "--seed", "3", "--dtypes",
                    "bool,u8,i8,i16,u16,i32,u32,i64,u64,f16,bf16,f32,f64,c64,f8_e4m3,"
                    "f8_e4m3fnuz,f8_e5m2,f8_e5m2fnuz,f8_e8m0,f4"});
  EXPECT_EQ(summary_["writer"], nlohmann::json::array({"safetensors.serialize_file"}));
  Result<Checkpoint> c = Checkpoint::Open(dir + "/model.safetensors");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ExpectMatchesManifest(*c, Options(1));
}

TEST_F(CheckpointTest, ShardedEveryDTypeInSmallChunksOnManyThreads) {
  const std::string dir = Make("sharded", {"--tensors", "60", "--dtypes", "all", "--shards", "4",
                                           "--seed", "11", "--max-elems", "5000"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->shards().size(), 4u);
  EXPECT_EQ(c->shards()[0].file_name, "model-00001-of-00004.safetensors");
  EXPECT_EQ(c->shards()[3].file_name, "model-00004-of-00004.safetensors");
  EXPECT_EQ(c->metadata().at("format"), "pt");

  std::mutex mu;
  std::vector<uint64_t> reports;
  ReadOptions options = Options(6, 100);
  options.progress = [&](uint64_t done) {
    std::lock_guard<std::mutex> lock(mu);
    reports.push_back(done);
  };
  ExpectMatchesManifest(*c, options);
  ASSERT_FALSE(reports.empty());
  EXPECT_TRUE(std::is_sorted(reports.begin(), reports.end()));
  EXPECT_EQ(reports.back(), c->total_bytes());
  EXPECT_GT(reports.size(), c->tensors().size());  // requests were split into chunks
}

TEST_F(CheckpointTest, FindAndReadTensor) {
  const std::string dir = Make("find", {"--tensors", "5", "--dtypes", "bf16,f32", "--seed", "2"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const TensorInfo* t = c->Find("model.layers.3.f32.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kF32);
  EXPECT_EQ(c->Find("model.layers.3.f32.weigh"), nullptr);
  EXPECT_EQ(c->Find("nope"), nullptr);
  std::vector<uint8_t> buf(t->nbytes);
  ASSERT_TRUE(ReadTensor(*c, *t, buf.data()).ok());
  EXPECT_EQ(Sha256Hex({reinterpret_cast<const char*>(buf.data()), buf.size()}),
            manifest_["tensors"][t->name]["sha256"].get<std::string>());
}

TEST_F(CheckpointTest, FingerprintIsStableAndCoversHeadersNotData) {
  const std::string dir = Make("fp", {"--tensors", "6", "--dtypes", "bf16,i8", "--seed", "5"});
  Result<Checkpoint> a = Checkpoint::Open(dir);
  Result<Checkpoint> b = Checkpoint::Open(dir);
  Result<Checkpoint> file = Checkpoint::Open(dir + "/model.safetensors");
  ASSERT_TRUE(a.ok() && b.ok() && file.ok());
  EXPECT_EQ(a->fingerprint().size(), 64u);
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  EXPECT_EQ(a->fingerprint(), file->fingerprint());  // same shard name, size and header

  // The canonical definition of docs/checkpoint.md, recomputed here.
  const std::string bytes = ReadFile(dir + "/model.safetensors");
  const uint64_t n = a->shards()[0].header_len;
  auto le64 = [](uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
    return s;
  };
  const std::string name = "model.safetensors";
  EXPECT_EQ(a->fingerprint(),
            Sha256Hex("weightcache-checkpoint-fingerprint-v1" + le64(name.size()) + name +
                      le64(bytes.size()) + le64(n) + bytes.substr(8, n)));

  // A data byte does not change it (headers only, so fingerprinting is O(header)).
  std::string data_changed = bytes;
  data_changed.back() ^= 1;
  WriteFile(dir + "/model.safetensors", data_changed);
  Result<Checkpoint> d = Checkpoint::Open(dir);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->fingerprint(), a->fingerprint());

  // A header byte does: "pt" -> "pu" in the metadata keeps the file valid.
  std::string header_changed = bytes;
  const size_t pos = header_changed.find("\"pt\"");
  ASSERT_NE(pos, std::string::npos);
  header_changed[pos + 2] = 'u';
  WriteFile(dir + "/model.safetensors", header_changed);
  Result<Checkpoint> h = Checkpoint::Open(dir);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->metadata().at("format"), "pu");
  EXPECT_NE(h->fingerprint(), a->fingerprint());

  // So does the shard's name.
  std::filesystem::rename(dir + "/model.safetensors", dir + "/renamed.safetensors");
  Result<Checkpoint> r = Checkpoint::Open(dir);
  ASSERT_TRUE(r.ok());
  EXPECT_NE(r->fingerprint(), h->fingerprint());
}

TEST_F(CheckpointTest, ShardedFingerprintDependsOnEveryShard) {
  const std::string dir = Make("fp2", {"--tensors", "6", "--shards", "3", "--seed", "5"});
  Result<Checkpoint> a = Checkpoint::Open(dir);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  const std::string last = dir + "/model-00003-of-00003.safetensors";
  std::string bytes = ReadFile(last);
  bytes[bytes.find("\"pt\"") + 1] = 'q';
  WriteFile(last, bytes);
  Result<Checkpoint> b = Checkpoint::Open(dir);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE(a->fingerprint(), b->fingerprint());
}

TEST_F(CheckpointTest, FileShrunkAfterOpenIsAnIoErrorNamingFileAndOffset) {
  const std::string dir = Make("shrink", {"--tensors", "3", "--dtypes", "f32", "--seed", "1"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok());
  const auto& shard = c->shards()[0];
  ASSERT_EQ(::truncate(shard.path.c_str(), static_cast<off_t>(shard.file_size - 10)), 0);
  const TensorInfo* last = nullptr;
  for (const auto& t : c->tensors()) {
    if (last == nullptr || t.offset > last->offset) last = &t;
  }
  std::vector<uint8_t> buf(last->nbytes);
  Status s = ReadTensor(*c, *last, buf.data(), Options(2, 8));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIo);
  EXPECT_THAT(s.message(), HasSubstr("reading tensor '" + last->name + "'"));
  EXPECT_THAT(s.message(), HasSubstr("unexpected end of file in " + shard.path + " at offset "));
  EXPECT_THAT(s.message(), HasSubstr("shrank"));
}

TEST_F(CheckpointTest, BadReadRequestsAreRefusedBeforeReading) {
  const std::string dir = Make("bad", {"--tensors", "2", "--seed", "1"});
  Result<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok());
  uint8_t buf[16];
  const uint64_t size = c->shards()[0].file_size;
  auto expect = [&](std::vector<ReadRequest> reqs, ReadOptions opt, const std::string& msg) {
    Status s = ReadRanges(*c, reqs, opt);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_THAT(s.message(), HasSubstr(msg));
  };
  expect({{1, 0, 1, buf}}, {}, "read request 0: shard 1 does not exist (checkpoint has 1)");
  expect({{0, 0, 1, buf}, {0, size - 4, 5, buf}}, {},
         "read request 1: [" + std::to_string(size - 4) + ", +5) is outside model.safetensors");
  expect({{0, ~uint64_t{0}, 2, buf}}, {}, "is outside model.safetensors");
  expect({{0, 0, 1, nullptr}}, {}, "read request 0: null destination");
  expect({{0, 0, 1, buf}}, Options(0), "threads must be in [1, 256], got 0");
  expect({{0, 0, 1, buf}}, Options(8, 0), "chunk_bytes must be > 0");
  EXPECT_TRUE(ReadRanges(*c, {}, {}).ok());
}

// ---- directory and index rules -------------------------------------------------------------

class IndexTest : public CheckpointFixture {
 protected:
  // A sharded checkpoint and its parsed index, for tests to break.
  void SetUp() override {
    CheckpointFixture::SetUp();
    if (IsSkipped()) return;
    dir_ = Make("idx", {"--tensors", "6", "--shards", "3", "--seed", "9"});
    index_path_ = dir_ + "/model.safetensors.index.json";
    index_ = nlohmann::json::parse(ReadFile(index_path_));
  }
  void SaveIndex() { WriteFile(index_path_, index_.dump()); }
  void ExpectOpenFails(StatusCode code, const std::string& message) {
    Result<Checkpoint> c = Checkpoint::Open(dir_);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), code) << c.status().ToString();
    EXPECT_THAT(c.status().message(), HasSubstr(message));
  }
  std::string dir_, index_path_;
  nlohmann::json index_;
};

TEST_F(IndexTest, ValidIndexOpens) {
  Result<Checkpoint> c = Checkpoint::Open(dir_);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->tensors().size(), 6u);
  for (const auto& t : c->tensors()) {
    EXPECT_EQ(c->shards()[t.shard].file_name, index_["weight_map"][t.name].get<std::string>());
  }
}

TEST_F(IndexTest, IndexNamingAMissingFile) {
  std::filesystem::remove(dir_ + "/model-00002-of-00003.safetensors");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint,
                  "shard 'model-00002-of-00003.safetensors' named by "
                  "model.safetensors.index.json in " +
                      dir_ + " does not exist");
}

TEST_F(IndexTest, IndexedTensorMissingFromItsShard) {
  index_["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors";
  SaveIndex();
  ExpectOpenFails(StatusCode::kInvalidCheckpoint,
                  "maps tensor 'ghost.weight' to shard 'model-00001-of-00003.safetensors', which "
                  "does not contain it");
}

TEST_F(IndexTest, ShardTensorAbsentFromTheIndex) {
  index_["weight_map"].erase("model.layers.0.bf16.weight");
  SaveIndex();
  ExpectOpenFails(StatusCode::kInvalidCheckpoint,
                  "tensor 'model.layers.0.bf16.weight' of shard "
                  "'model-00001-of-00003.safetensors' is not listed in "
                  "model.safetensors.index.json");
}

TEST_F(IndexTest, IndexPointingAtTheWrongShard) {
  index_["weight_map"]["model.layers.0.bf16.weight"] = "model-00002-of-00003.safetensors";
  SaveIndex();
  ExpectOpenFails(StatusCode::kInvalidCheckpoint,
                  "tensor 'model.layers.0.bf16.weight' is in shard "
                  "'model-00001-of-00003.safetensors' but model.safetensors.index.json maps it "
                  "to 'model-00002-of-00003.safetensors'");
}

TEST_F(IndexTest, PathTraversalIsRefused) {
  for (const std::string bad :
       {"../model-00001-of-00003.safetensors", "/etc/passwd", "sub/x.safetensors", "..", "."}) {
    index_["weight_map"]["model.layers.0.bf16.weight"] = bad;
    SaveIndex();
    ExpectOpenFails(StatusCode::kInvalidCheckpoint,
                    "to '" + bad + "': a shard must be a plain file name");
  }
}

TEST_F(IndexTest, DuplicateIndexEntry) {
  WriteFile(index_path_,
            "{\"weight_map\":{\"a\":\"model-00001-of-00003.safetensors\","
            "\"a\":\"model-00002-of-00003.safetensors\"}}");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, "weight_map lists tensor 'a' twice");
}

TEST_F(IndexTest, MalformedIndex) {
  WriteFile(index_path_, "{\"weight_map\":");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, "model.safetensors.index.json is not valid JSON");
  WriteFile(index_path_, "{\"metadata\":{}}");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, "has no \"weight_map\" object");
  WriteFile(index_path_, "{\"weight_map\":{}}");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, "weight_map is empty");
  WriteFile(index_path_, "{\"weight_map\":{\"a\":3}}");
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, "weight_map entry for 'a' is not a string");
}

TEST_F(IndexTest, CorruptShardNamesItsPath) {
  const std::string shard = dir_ + "/model-00003-of-00003.safetensors";
  WriteFile(shard, SafetensorsBytes("{\"t\":1}"));
  ExpectOpenFails(StatusCode::kInvalidCheckpoint, shard + ": tensor 't': entry is not an object");
}

// Hand-built shards for the cases the real writer cannot produce.
TEST(CheckpointDirTest, TensorInTwoShards) {
  weightcache::testing::TempDir tmp;
  const std::string t = "\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}";
  WriteFile(tmp.Join("a.safetensors"), SafetensorsBytes("{" + t + "}", 1));
  WriteFile(tmp.Join("b.safetensors"), SafetensorsBytes("{" + t + "}", 1));
  WriteFile(tmp.Join("model.safetensors.index.json"),
            "{\"weight_map\":{\"t\":\"a.safetensors\",\"u\":\"b.safetensors\"}}");
  Result<Checkpoint> c = Checkpoint::Open(tmp.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(c.status().message(),
              HasSubstr("tensor 't' is in both shard 'a.safetensors' and shard 'b.safetensors'"));
}

TEST(CheckpointDirTest, SeveralFilesWithoutIndexAreAmbiguous) {
  weightcache::testing::TempDir tmp;
  WriteFile(tmp.Join("a.safetensors"), SafetensorsBytes("{}"));
  WriteFile(tmp.Join("b.safetensors"), SafetensorsBytes("{}"));
  Result<Checkpoint> c = Checkpoint::Open(tmp.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(c.status().message(),
              HasSubstr("holds 2 .safetensors files (a.safetensors, b.safetensors) but no "
                        "model.safetensors.index.json"));
}

TEST(CheckpointDirTest, EmptyDirectoryAndMissingPath) {
  weightcache::testing::TempDir tmp;
  Result<Checkpoint> c = Checkpoint::Open(tmp.path());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("no .safetensors file in " + tmp.path()));
  Result<Checkpoint> m = Checkpoint::Open(tmp.Join("nope"));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("open checkpoint " + tmp.Join("nope")));
}

TEST(CheckpointDirTest, GarbageFileIsInvalidAndNamed) {
  weightcache::testing::TempDir tmp;
  WriteFile(tmp.Join("x.safetensors"), "garbage!garbage!");
  Result<Checkpoint> c = Checkpoint::Open(tmp.Join("x.safetensors"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidCheckpoint);
  EXPECT_THAT(c.status().message(), HasSubstr(tmp.Join("x.safetensors") + ": header length"));
}

TEST(CheckpointDirTest, FilesAreOpenedCloseOnExec) {
  weightcache::testing::TempDir tmp;
  WriteFile(tmp.Join("x.safetensors"), SafetensorsBytes("{}"));
  Result<Checkpoint> c = Checkpoint::Open(tmp.Join("x.safetensors"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const int flags = ::fcntl(c->shard_fd(0), F_GETFD);
  EXPECT_NE(flags & FD_CLOEXEC, 0);
  EXPECT_EQ(::fcntl(c->shard_fd(0), F_GETFL) & O_ACCMODE, O_RDONLY);
}

}  // namespace
}  // namespace weightcache::checkpoint
