// Test fixture: real checkpoints written by tests/tools/make_checkpoint.py (the real
// `safetensors` library) in a fresh temp dir. Skips when Python's safetensors is missing.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/test_env.h"

namespace weightcache::checkpoint::testing {

class CheckpointFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto probe = weightcache::testing::RunCommand(
        {weightcache::testing::PythonExe(), "-c", "import safetensors, numpy"});
    if (probe.exit_code != 0) {
      GTEST_SKIP() << "python safetensors/numpy unavailable (" << probe.err
                   << "): run scripts/setup-deps.sh";
    }
  }

  // Runs make_checkpoint.py --out <tmp>/<name> <args> --manifest <tmp>/<name>.manifest.json;
  // returns the output directory. The manifest is read into manifest_.
  std::string Make(const std::string& name, std::vector<std::string> args) {
    const std::string out = tmp_.Join(name);
    const std::string manifest = tmp_.Join(name + ".manifest.json");
    std::vector<std::string> argv = {
        weightcache::testing::PythonExe(),
        weightcache::testing::SourceDir() + "/tests/tools/make_checkpoint.py",
        "--out",
        out,
        "--manifest",
        manifest};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = weightcache::testing::RunCommand(argv);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    summary_ = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    manifest_ = nlohmann::json::parse(weightcache::testing::ReadFile(manifest), nullptr,
                                      /*allow_exceptions=*/false);
    return out;
  }

  weightcache::testing::TempDir tmp_;
  nlohmann::json summary_;
  nlohmann::json manifest_;
};

}  // namespace weightcache::checkpoint::testing
