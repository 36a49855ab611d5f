// `weightcache serve --detach` (docs/daemon.md "Detached"): the real binary starts its daemon
// in the background and exits once it serves; a publisher then publishes into it, a client
// attaches, `stop` ends it. Failures keep the exit codes of the one table. The caller is left
// with no child (zombie or not) and no new fd.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "integration/daemon_process.h"
#include "support/test_env.h"
#include "weightcache/client.h"
#include "weightcache/publisher.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

int OpenFdCount() {
  int count = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++count;
  }
  return count - 1;  // the iterator's own
}

// Whether this process has any child, exited or running (waitid's ECHILD: none at all).
bool HasChildren() {
  siginfo_t info{};
  return ::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0;
}

bool Alive(pid_t pid) { return std::filesystem::exists("/proc/" + std::to_string(pid)); }

// The state letter of `pid` (field 3 of /proc/<pid>/stat: R, S, Z, ...), 0 when it is gone.
char StateOf(pid_t pid) {
  std::error_code ec;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  if (!std::filesystem::exists(path, ec)) return 0;
  const std::string stat = ReadFile(path);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() ? 0 : stat[paren + 2];
}

// Waits (up to 30 s) until `pid` has exited: gone, or a zombie of its new parent (the lock
// `stop` waits for is released just before the process ends; who reaps it is init's
// business, not ours).
bool WaitExited(pid_t pid) {
  for (int i = 0; i < 3000; ++i) {
    const char state = StateOf(pid);
    if (state == 0 || state == 'Z') return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// The parent pid of `pid` (field 4 of /proc/<pid>/stat), -1 when it is gone.
pid_t ParentOf(pid_t pid) {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  char state = 0;
  int ppid = -1;
  if (std::sscanf(stat.c_str() + paren + 1, " %c %d", &state, &ppid) != 2) return -1;
  return ppid;
}

class DetachTest : public ::testing::Test {
 protected:
  void SetUp() override { runtime_ = dir_.Join("run"); }
  void TearDown() override {
    // A daemon a failed assertion left running: it is no child of ours, stop it by socket.
    if (!socket_.empty()) {
      (void)RunCommand({CliPath(), "stop", "--socket", socket_, "--timeout", "10"});
    }
  }

  std::vector<std::string> Published() const {
    return {CliPath(),        "serve",  "--source", "published:detach-v1", "--model-id",
            "detached-llama", "--tier", "host",     "--runtime-dir",       runtime_};
  }
  IdentityOptions Identity() const {
    IdentityOptions id;
    id.source = "published:detach-v1";
    id.model_id = "detached-llama";
    id.tier = Tier::kHost;
    id.runtime_dir = runtime_;
    return id;
  }
  CommandResult Detach(std::vector<std::string> args) {
    args.emplace_back("--detach");
    args.emplace_back("--json");
    return RunCommand(args);
  }

  TempDir dir_;
  std::string runtime_;
  std::string socket_;
};

TEST_F(DetachTest, DetachedDaemonTakesAPublisherServesAttachesAndStops) {
  const int fds_before = OpenFdCount();
  const CommandResult r = Detach(Published());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto out = nlohmann::json::parse(r.out);
  ASSERT_EQ(out["status"], "ok") << r.out;
  ASSERT_EQ(out["daemons"].size(), 1u);
  const auto& d = out["daemons"][0];
  socket_ = d["socket"];
  const pid_t pid = d["pid"];
  EXPECT_EQ(d["state"], "ready") << r.out;  // able to take its publisher
  EXPECT_THAT(socket_, HasSubstr(runtime_));

  // The caller: its child (serve --detach) reaped by RunCommand, no other child, no fd left.
  EXPECT_FALSE(HasChildren());
  EXPECT_EQ(OpenFdCount(), fds_before);
  // The daemon: alive, not our child, awaiting, its output in its log (not our pipes: the
  // RunCommand above read them to EOF while the daemon runs).
  ASSERT_TRUE(Alive(pid));
  EXPECT_NE(ParentOf(pid), ::getpid());
  auto status = QueryStatus(socket_);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->state, protocol::CacheState::kAwaiting);
  const std::string log = d["log"];
  EXPECT_EQ(std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/fd/2"), log);

  // Publish, attach, compare.
  std::vector<PublishTensor> plan = {{"qkv_proj.weight", "F32", {64, 32}, 64 * 32 * 4},
                                     {"gate_up_proj.weight", "F32", {3, 5}, 60}};
  PublishOptions po;
  po.identity = Identity();
  po.timeout = 10s;
  auto publisher = Publisher::Begin(po, plan);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  for (size_t i = 0; i < plan.size(); ++i) {
    std::span<uint8_t> dest = publisher->Data(i);
    for (size_t b = 0; b < dest.size(); ++b) dest[b] = static_cast<uint8_t>(b * 7 + i);
  }
  ASSERT_TRUE(publisher->Commit().ok());
  AttachOptions ao;
  ao.identity = Identity();
  ao.on_missing = OnMissing::kError;
  ao.wait_timeout = 10s;
  auto attached = Attachment::Attach(ao);
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  ASSERT_EQ(attached->tensors().size(), 2u);
  const Tensor* qkv = attached->Find("qkv_proj.weight");
  ASSERT_NE(qkv, nullptr);
  ASSERT_EQ(qkv->nbytes, 64u * 32 * 4);
  const auto* bytes = static_cast<const uint8_t*>(qkv->host_ptr());
  for (size_t b = 0; b < qkv->nbytes; ++b) ASSERT_EQ(bytes[b], static_cast<uint8_t>(b * 7)) << b;

  const CommandResult stopped =
      RunCommand({CliPath(), "stop", "--socket", socket_, "--timeout", "30"});
  ASSERT_EQ(stopped.exit_code, 0) << stopped.err;
  EXPECT_TRUE(WaitExited(pid));
  EXPECT_FALSE(std::filesystem::exists(socket_));
  socket_.clear();
  EXPECT_FALSE(HasChildren());
}

TEST_F(DetachTest, ASecondDetachOfAServedIdentityExits7AndStartsNothing) {
  const CommandResult first = Detach(Published());
  ASSERT_EQ(first.exit_code, 0) << first.err;
  socket_ = nlohmann::json::parse(first.out)["daemons"][0]["socket"];

  const CommandResult second = Detach(Published());
  EXPECT_EQ(second.exit_code, 7) << second.out << second.err;
  const auto out = nlohmann::json::parse(second.out);
  EXPECT_EQ(out["status"], "already served");
  EXPECT_EQ(out["exit_code"], 7);
  EXPECT_THAT(second.err, HasSubstr("is already served"));
  EXPECT_FALSE(HasChildren());
}

TEST_F(DetachTest, ADaemonThatFailsToStartReportsItsOwnExitCode) {
  // A disk-source daemon whose plan is over --memory-budget fails its load; it exits 8 (no
  // room under the budget), and so does serve --detach, quoting its error line.
  const std::string model = MakeCheckpoint(dir_.Join("model"), 4, 1, 3, 4096);
  const int fds_before = OpenFdCount();
  const CommandResult r = Detach({CliPath(), "serve", "--model", model, "--model-id", "tiny",
                                  "--tier", "host", "--runtime-dir", runtime_, "--memory-budget",
                                  "1K", "--failed-linger", "0", "--no-keeper"});
  EXPECT_EQ(r.exit_code, 8) << r.out << r.err;
  const auto out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["status"], "out of memory") << r.out;
  EXPECT_EQ(out["exit_code"], 8);
  EXPECT_THAT(r.err, HasSubstr("memory budget"));
  const pid_t pid = out["daemons"][0]["pid"];
  EXPECT_TRUE(WaitExited(pid));
  EXPECT_FALSE(HasChildren());
  EXPECT_EQ(OpenFdCount(), fds_before);
  EXPECT_TRUE(FindSockets(runtime_).empty());
}

TEST_F(DetachTest, DetachOfAnInvalidIdentityFailsBeforeSpawningWithItsUsageCode) {
  // Found by the caller's own resolution (a published source needs --model-id): exit 2.
  const CommandResult r = Detach({CliPath(), "serve", "--source", "published:detach-v1", "--tier",
                                  "host", "--runtime-dir", runtime_});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("no model id"));
  EXPECT_FALSE(HasChildren());
  EXPECT_TRUE(FindSockets(runtime_).empty());
}

}  // namespace
}  // namespace weightcache::testing
