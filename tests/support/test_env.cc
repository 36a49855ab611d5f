#include "support/test_env.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/child_process.h"

namespace weightcache::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/wc-test-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) std::abort();
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

bool ToolsRequired() { return std::getenv("WEIGHTCACHE_REQUIRE_TOOLS") != nullptr; }

std::string SourceDir() { return WEIGHTCACHE_SOURCE_DIR; }
std::string PythonExe() { return WEIGHTCACHE_PYTHON; }
std::string CliPath() { return WEIGHTCACHE_CLI_PATH; }

CommandResult WriteCheckpoint(const std::string& out, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py",
                                   "--out", out};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv);
}

CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env) {
  CommandResult result;
  // stdin stays the test's own, as it always was for one-shot commands.
  Result<TestChild> child = TestChild::Spawn({.argv = argv,
                                              .env_overrides = extra_env,
                                              .in = Stdio::kInherit,
                                              .out = Stdio::kPipe,
                                              .err = Stdio::kPipe});
  if (!child.ok()) {
    result.err = child.status().ToString();
    return result;
  }
  if (Status drained = child->DrainOutput(&result.out, &result.err); !drained.ok()) {
    child->Kill();
    result.err += "\n" + drained.ToString();
    return result;
  }
  result.exit_code = child->WaitExit();
  return result;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  ASSERT_TRUE(f.good()) << "cannot write " << path;
  f.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(f.good()) << "short write " << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

uint64_t ProcessReadChars(pid_t pid) {
  std::ifstream io("/proc/" + std::to_string(pid) + "/io");
  std::string key;
  uint64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  ADD_FAILURE() << "no rchar in /proc/" << pid << "/io";
  return 0;
}

}  // namespace weightcache::testing
