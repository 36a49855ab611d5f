// Test support shared by every tier: temp dirs, the real CLI binary, the real Python.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weightcache::testing {

inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;

// A fresh directory under $TMPDIR (or /tmp), mode 0700, removed recursively on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Whether the tools some tests need beyond the build (etcd, openssl, prometheus) must be there:
// with WEIGHTCACHE_REQUIRE_TOOLS set (.ci/run sets it: CI installs them, scripts/setup-deps.sh),
// a test that would skip for want of one fails instead, so CI never passes by skipping them.
bool ToolsRequired();

std::string SourceDir();  // repository root
std::string PythonExe();  // the Python 3 found at configure time
std::string CliPath();    // the built `weightcache` binary

struct CommandResult {
  int exit_code = -1;  // exit status, or 128+signal
  std::string out;     // stdout
  std::string err;     // stderr
};

// Run argv[0] with argv (no shell), with extra "K=V" environment entries, and capture output.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::vector<std::string>& extra_env = {});

// tests/tools/make_checkpoint.py --out `out` `args...`: a checkpoint written by the real
// safetensors library. Exit 77 when Python or safetensors is missing (the caller skips).
CommandResult WriteCheckpoint(const std::string& out, const std::vector<std::string>& args = {});

// /proc/PID/io's rchar: the bytes every read-like call of process `pid` returned, whatever
// the file (a test failure and 0 when it cannot be read). How the keeper and upgrade tests
// prove that a daemon served without reading its checkpoint.
uint64_t ProcessReadChars(pid_t pid);

// Write a file (test fixtures); aborts the test on failure.
void WriteFile(const std::string& path, const std::string& contents);
std::string ReadFile(const std::string& path);

}  // namespace weightcache::testing
