// Issue 10, checkpoint area: what a hostile or unlucky user did to the checkpoint a daemon or
// an engine reads. Real `weightcache` processes, real files written by the Python safetensors
// library (tests/tools/make_checkpoint.py, or inline where the file is itself the attack).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/test_hooks.h"
#include "common/unique_fd.h"
#include "integration/daemon_process.h"
#include "protocol/messages.h"
#include "support/child_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

// Runs the CLI with a bound on its run time: a command that hangs (the FIFO case before the
// fix) fails the test instead of the whole suite's timeout. Output: stdout and stderr merged.
CommandResult RunBounded(const std::vector<std::string>& args, const std::string& log_path,
                         std::chrono::milliseconds limit = 60s) {
  ChildSpec spec;
  spec.argv = {CliPath()};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.log_path = log_path;
  ::unlink(log_path.c_str());
  auto child = TestChild::Spawn(spec);
  EXPECT_TRUE(child.ok()) << child.status().ToString();
  CommandResult r;
  if (!child.ok()) return r;
  std::optional<int> code = child->WaitExit(limit);
  if (!code) {
    child->Kill();
    ADD_FAILURE() << "weightcache " << args.at(0) << " still running after " << limit.count()
                  << " ms (hung)";
    r.exit_code = -1;
  } else {
    r.exit_code = *code;
  }
  r.err = child->Log();
  return r;
}

// Writes `python_code` to a script and runs it with the configured Python (numpy, safetensors).
void RunPython(const TempDir& dir, const std::string& python_code) {
  const std::string script = dir.Join("write.py");
  WriteFile(script, "import numpy as np\nfrom safetensors.numpy import save_file\n" + python_code);
  const CommandResult r = RunCommand({PythonExe(), script});
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

class CheckpointAdversarialTest : public ::testing::Test {
 protected:
  void SetUp() override {
    runtime_ = dir_.Join("run");
    ASSERT_EQ(::mkdir(runtime_.c_str(), 0700), 0);
  }

  // The three commands that open a checkpoint, each given `model`.
  std::vector<std::pair<std::string, std::vector<std::string>>> Commands(const std::string& model) {
    return {
        {"inspect", {"inspect", model}},
        {"serve",
         {"serve", "--model", model, "--model-id", "m", "--tier", "host", "--runtime-dir",
          runtime_}},
        {"attach",
         {"attach", "--model", model, "--model-id", "m", "--tier", "host", "--runtime-dir",
          runtime_}},
    };
  }

  // Every command exits 5 at once, naming `path` and `type`.
  void ExpectRefused(const std::string& model, const std::string& path, const std::string& type) {
    for (const auto& [name, args] : Commands(model)) {
      SCOPED_TRACE(name + " " + model);
      const CommandResult r = RunBounded(args, dir_.Join(name + ".log"));
      EXPECT_EQ(r.exit_code, 5) << r.err;
      EXPECT_NE(r.err.find(path + " is a " + type + ", not a regular file"), std::string::npos)
          << r.err;
    }
    EXPECT_TRUE(FindSockets(runtime_).empty());
  }

  TempDir dir_;
  std::string runtime_;
};

// ---- item 7: special files ------------------------------------------------------------------

struct SpecialKind {
  const char* name;
  const char* type;  // as the message names it
  // Creates the special file at `path`.
  void (*make)(const std::string& path);
};

void MakeFifo(const std::string& path) { ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path; }
void MakeDir(const std::string& path) { ASSERT_EQ(::mkdir(path.c_str(), 0700), 0) << path; }
void MakeNullLink(const std::string& path) { ASSERT_EQ(::symlink("/dev/null", path.c_str()), 0); }
void MakeZeroLink(const std::string& path) { ASSERT_EQ(::symlink("/dev/zero", path.c_str()), 0); }

const SpecialKind kKinds[] = {
    {"fifo", "FIFO", MakeFifo},
    {"directory", "directory", MakeDir},
    {"char_device", "character device", MakeNullLink},
    {"symlink_to_dev_zero", "character device", MakeZeroLink},
};

TEST_F(CheckpointAdversarialTest, SpecialFileAsTheShardOfAOneFileDirectoryExits5AtOnce) {
  for (const SpecialKind& kind : kKinds) {
    SCOPED_TRACE(kind.name);
    const std::string model = dir_.Join(std::string("shard_") + kind.name);
    MakeDir(model);
    kind.make(model + "/model.safetensors");
    ExpectRefused(model, model + "/model.safetensors", kind.type);
  }
}

TEST_F(CheckpointAdversarialTest, SpecialFileAsAShardNamedByTheIndexExits5AtOnce) {
  for (const SpecialKind& kind : kKinds) {
    SCOPED_TRACE(kind.name);
    const std::string model = dir_.Join(std::string("indexed_") + kind.name);
    MakeCheckpoint(model, 6, 2);
    const std::string shard = model + "/model-00002-of-00002.safetensors";
    ASSERT_EQ(::unlink(shard.c_str()), 0);
    kind.make(shard);
    ExpectRefused(model, shard, kind.type);
  }
}

TEST_F(CheckpointAdversarialTest, SpecialFileAsTheIndexExits5AtOnce) {
  for (const SpecialKind& kind : kKinds) {
    SCOPED_TRACE(kind.name);
    const std::string model = dir_.Join(std::string("index_") + kind.name);
    MakeCheckpoint(model, 6, 2);
    const std::string index = model + "/model.safetensors.index.json";
    ASSERT_EQ(::unlink(index.c_str()), 0);
    kind.make(index);
    ExpectRefused(model, index, kind.type);
  }
}

TEST_F(CheckpointAdversarialTest, SpecialFileAsTheModelPathExits5AtOnce) {
  for (const SpecialKind& kind : kKinds) {
    if (std::string(kind.name) == "directory") continue;  // a directory is a valid --model
    SCOPED_TRACE(kind.name);
    const std::string model = dir_.Join(std::string("model_") + kind.name);
    kind.make(model);
    for (const auto& [name, args] : Commands(model)) {
      SCOPED_TRACE(name);
      const CommandResult r = RunBounded(args, dir_.Join(name + ".log"));
      EXPECT_EQ(r.exit_code, 5) << r.err;
      EXPECT_NE(r.err.find("checkpoint " + model + " is a " + kind.type +
                           ", not a regular file or a directory"),
                std::string::npos)
          << r.err;
    }
  }
}

TEST_F(CheckpointAdversarialTest, SpecialFileAsTheQuantizationConfigIsRefusedAtOnce) {
  const std::string model = MakeCheckpoint(dir_.Join("model"), 4);
  const std::string fifo = dir_.Join("quant.json");
  MakeFifo(fifo);
  const CommandResult r =
      RunBounded({"attach", "--model", model, "--model-id", "m", "--tier", "host", "--runtime-dir",
                  runtime_, "--quantization", "fp8", "--quantization-config", fifo},
                 dir_.Join("attach.log"));
  EXPECT_EQ(r.exit_code, 2) << r.err;  // a bad option: kInvalidArgument
  EXPECT_NE(r.err.find(fifo + " is a FIFO, not a regular file"), std::string::npos) << r.err;
}

// ---- item 8: one set of limits --------------------------------------------------------------

TEST_F(CheckpointAdversarialTest, RankNineIsRefusedWhenTheCheckpointOpensWithExit5) {
  const std::string model = dir_.Join("rank9");
  MakeDir(model);
  RunPython(dir_,
            "save_file({'r9': np.zeros((1,) * 9, np.float32), 'ok': np.zeros((2,), "
            "np.float32)}, '" +
                model + "/model.safetensors')\n");
  for (const auto& [name, args] : Commands(model)) {
    SCOPED_TRACE(name);
    const CommandResult r = RunBounded(args, dir_.Join(name + ".log"));
    EXPECT_EQ(r.exit_code, 5) << r.err;
    EXPECT_NE(r.err.find("tensor 'r9': rank over the limit of 8 dimensions"), std::string::npos)
        << r.err;
  }
  EXPECT_TRUE(FindSockets(runtime_).empty());
}

TEST_F(CheckpointAdversarialTest, TooManyTensorsAreRefusedByInspectStatingTheLimit) {
  const std::string model = dir_.Join("many");
  MakeDir(model);
  RunPython(dir_,
            "z = np.zeros((0,), np.uint8)\nsave_file({f't{i}': z for i in "
            "range(1_000_001)}, '" +
                model + "/model.safetensors')\n");
  const CommandResult r = RunBounded({"inspect", model}, dir_.Join("inspect.log"));
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_NE(r.err.find("over the limit of 1000000 tensors per checkpoint"), std::string::npos)
      << r.err;
}

// ---- items 1-3: the identity covers the files' content ---------------------------------------

// Flips the last byte of `file` in place: same size, same header, different values.
void RewriteLastByteInPlace(const std::string& file) {
  const UniqueFd fd(::open(file.c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(fd) << file;
  struct stat st {};
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  char byte = 0;
  ASSERT_EQ(::pread(fd.get(), &byte, 1, st.st_size - 1), 1);
  byte = static_cast<char>(~byte);
  ASSERT_EQ(::pwrite(fd.get(), &byte, 1, st.st_size - 1), 1);
}

class ContentIdentityTest : public CheckpointAdversarialTest {
 protected:
  void SetUp() override {
    CheckpointAdversarialTest::SetUp();
    for (const char* d : {"a", "b", "c"}) MakeDir(dir_.Join(d));
    a_ = MakeCheckpoint(dir_.Join("a/final"), 6);
    // b/final: a copy of a/final whose values differ and whose header does not.
    b_ = dir_.Join("b/final");
    MakeDir(b_);
    WriteFile(b_ + "/model.safetensors", ReadFile(a_ + "/model.safetensors"));
    RewriteLastByteInPlace(b_ + "/model.safetensors");
    // c/final: a's very files through another path.
    c_ = dir_.Join("c/final");
    ASSERT_EQ(::symlink(a_.c_str(), c_.c_str()), 0);
  }

  std::unique_ptr<ServeProcess> ServeA() {
    auto serve = ServeProcess::Start({"--model", a_, "--tier", "host", "--runtime-dir", runtime_},
                                     dir_.Join("serve.log"));
    if (serve) {
      auto ready = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
      EXPECT_TRUE(ready.ok()) << ready.status().ToString();
    }
    return serve;
  }

  CommandResult Attach(const std::string& model, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"attach", "--model",       model,    "--tier",
                                     "host",   "--runtime-dir", runtime_, "--verify"};
    args.insert(args.end(), extra.begin(), extra.end());
    return RunBounded(args, dir_.Join("attach.log"));
  }

  std::string a_, b_, c_;
};

TEST_F(ContentIdentityTest, EqualHeadersWithDifferentValuesAreAMismatchNamingCheckpointFiles) {
  auto serve = ServeA();
  ASSERT_TRUE(serve);
  const CommandResult r = Attach(b_);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("checkpoint_files: ours="), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the checkpoint files on this host are not the ones the daemon loaded"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("checkpoint_fingerprint"), std::string::npos) << r.err;  // headers equal
  EXPECT_EQ(r.err.find("source:     daemon"), std::string::npos) << r.err;
}

TEST_F(ContentIdentityTest, TheSameFilesThroughAnotherPathStillMatch) {
  auto serve = ServeA();
  ASSERT_TRUE(serve);
  const CommandResult r = Attach(c_);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("source:     daemon"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("verify:     ok"), std::string::npos) << r.err;
}

TEST_F(ContentIdentityTest, AFileRewrittenAfterReadyIsAMismatchOrAFallbackNeverTheOldWeights) {
  auto serve = ServeA();
  ASSERT_TRUE(serve);
  RewriteLastByteInPlace(a_ + "/model.safetensors");

  const CommandResult error = Attach(a_);
  EXPECT_EQ(error.exit_code, 4) << error.err;
  EXPECT_NE(error.err.find("checkpoint_files: ours="), std::string::npos) << error.err;

  const CommandResult fallback = Attach(a_, {"--on-mismatch", "fallback"});
  EXPECT_EQ(fallback.exit_code, 0) << fallback.err;
  EXPECT_NE(fallback.err.find("source:     fallback (mismatch ignored"), std::string::npos)
      << fallback.err;
  EXPECT_NE(fallback.err.find("checkpoint_files"), std::string::npos) << fallback.err;
  EXPECT_NE(fallback.err.find("verify:     ok"), std::string::npos) << fallback.err;
}

TEST_F(ContentIdentityTest, AFileRewrittenWhileTheDaemonLoadsItFailsTheLoadNamingTheShard) {
  if (!TestHooksBuilt()) GTEST_SKIP() << "needs the test hooks (WEIGHTCACHE_TEST_HOOKS=ON)";
  // The daemon's test seam holds its loader on this FIFO after the last byte is read and
  // before the files are re-checked (daemon_loader.cc, PauseAfterLoadForTest).
  const std::string fifo = dir_.Join("loaded.fifo");
  MakeFifo(fifo);
  auto serve = SpawnServe(
      {"--model", a_, "--tier", "host", "--runtime-dir", runtime_, "--failed-linger", "60"},
      {"WEIGHTCACHE_TEST_LOADED_FIFO=" + fifo}, dir_.Join("serve.log"));
  ASSERT_TRUE(serve.ok()) << serve.status().ToString();
  // Our write end opens once the loader holds the read end; until then ENXIO. A daemon that
  // exits or gets ready without pausing (no seam) ends the wait.
  UniqueFd writer;
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  while (!writer) {
    writer = UniqueFd(::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
    if (writer) break;
    ASSERT_EQ(errno, ENXIO);
    ASSERT_FALSE(serve->WaitExit(10ms).has_value()) << serve->Log();
    for (const std::string& socket : FindSockets(runtime_)) {
      auto st = QueryStatus(socket);
      ASSERT_FALSE(st.ok() && st->state == protocol::CacheState::kReady)
          << "ready with the file still to be rewritten: the loader never paused";
    }
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "the loader never paused";
  }
  RewriteLastByteInPlace(a_ + "/model.safetensors");
  writer.Reset();  // the loader reads EOF and re-checks the files

  auto failed = WaitForStatus(*serve, {.sockets = [&] { return FindSockets(runtime_); },
                                       .reached =
                                           [](const protocol::StatusReply& s) {
                                             return s.state != protocol::CacheState::kLoading;
                                           },
                                       .what = "the end of the load"});
  ASSERT_TRUE(failed.ok()) << failed.status().ToString();
  EXPECT_EQ(failed->status.state, protocol::CacheState::kFailed);
  const std::string& reason = failed->status.failure_reason;
  EXPECT_NE(reason.find("shard 'model.safetensors' (" + a_ + "/model.safetensors)"),
            std::string::npos)
      << reason;
  EXPECT_NE(reason.find("was rewritten in place while it was read ("), std::string::npos) << reason;
  EXPECT_NE(reason.find("ctime "), std::string::npos) << reason;
}

// ---- item 11: the index parse -----------------------------------------------------------------

TEST_F(CheckpointAdversarialTest, AnIndexOf90kTensorsOpens) {
  const std::string model = dir_.Join("big");
  MakeDir(model);
  // Two shards of 45k zero-byte tensors each, and the index transformers would write.
  RunPython(dir_,
            "import json\nz = np.zeros((0,), np.uint8)\nwm = {}\n"
            "for s in range(2):\n"
            "    f = f'model-0000{s + 1}-of-00002.safetensors'\n"
            "    names = [f'model.layers.{i // 768}.mlp.experts.{i % 256}.w{s}.{i}' "
            "for i in range(45000)]\n"
            "    save_file({n: z for n in names}, '" +
                model +
                "/' + f)\n"
                "    wm.update({n: f for n in names})\n"
                "json.dump({'metadata': {}, 'weight_map': wm}, open('" +
                model + "/model.safetensors.index.json', 'w'), indent=2)\n");
  const CommandResult r = RunBounded({"inspect", "--json", model}, dir_.Join("inspect.log"));
  ASSERT_EQ(r.exit_code, 0) << r.err.substr(0, 2000);
  const CommandResult again = RunCommand({CliPath(), "inspect", "--json", model});
  EXPECT_EQ(nlohmann::json::parse(again.out)["tensor_count"], 90000);
}

// The quadratic step of the old parse: nlohmann's callback (DOM) parser scans the enclosing
// object for discarded values at the end of every object or array, so 100k small objects in
// one member cost 100k x 100k steps (over 100 s for a 1.4 MB index). The SAX parse is linear.
TEST_F(CheckpointAdversarialTest, AnIndexWithManySmallObjectsOpens) {
  const std::string model = MakeCheckpoint(dir_.Join("objects"), 4, 2);
  const std::string index = model + "/model.safetensors.index.json";
  nlohmann::json doc = nlohmann::json::parse(ReadFile(index));
  for (int i = 0; i < 100'000; ++i) doc["metadata"]["k" + std::to_string(i)] = {{"v", {i}}};
  WriteFile(index, doc.dump());
  const CommandResult r = RunBounded({"inspect", model}, dir_.Join("inspect.log"));
  EXPECT_EQ(r.exit_code, 0) << r.err.substr(0, 2000);
}

TEST_F(CheckpointAdversarialTest, ADeeplyNestedIndexIsRefusedWithExit5) {
  const std::string model = MakeCheckpoint(dir_.Join("nested"), 4, 2);
  const std::string index = model + "/model.safetensors.index.json";
  nlohmann::json doc = nlohmann::json::parse(ReadFile(index));
  const std::string depth(1'000'000, '[');
  WriteFile(index, "{\"metadata\":" + depth + std::string(depth.size(), ']') +
                       ",\"weight_map\":" + doc["weight_map"].dump() + "}");
  const CommandResult r = RunBounded({"inspect", model}, dir_.Join("inspect.log"));
  EXPECT_EQ(r.exit_code, 5) << r.err.substr(0, 2000);
  EXPECT_NE(r.err.find(index + " nests JSON deeper than 64 levels"), std::string::npos)
      << r.err.substr(0, 2000);
}

// ---- item 12: terminal escapes ----------------------------------------------------------------

TEST_F(CheckpointAdversarialTest, InspectPrintsATensorNamesEscapeSequenceEscaped) {
  const std::string model = dir_.Join("evil");
  MakeDir(model);
  RunPython(dir_, "save_file({'\\x1b[31mevil': np.zeros((2,), np.float32)}, '" + model +
                      "/model.safetensors', metadata={'k\\x07': 'v\\x1b]0;title\\x07'})\n");
  const CommandResult r = RunCommand({CliPath(), "inspect", model});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\x07'), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\\x1b[31mevil"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("k\\x07 = v\\x1b]0;title\\x07"), std::string::npos) << r.out;
  // JSON output keeps the real name (JSON-escaped by the encoder).
  const CommandResult json = RunCommand({CliPath(), "inspect", "--json", model});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_EQ(nlohmann::json::parse(json.out)["tensors"][0]["name"], "\x1b[31mevil");
}

}  // namespace
}  // namespace weightcache::testing
