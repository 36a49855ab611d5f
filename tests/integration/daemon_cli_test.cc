// `weightcache ls` and `weightcache stop` against real daemons.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "integration/daemon_process.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 6, 1, 5, 4096);
    runtime_ = dir_.Join("run");
  }
  std::vector<std::string> Identity(const std::string& ns = "default") const {
    return {"--model", model_,          "--model-id", "tiny",        "--tier",
            "host",    "--runtime-dir", runtime_,     "--namespace", ns};
  }
  std::unique_ptr<ServeProcess> Serve(const std::string& ns, std::vector<std::string> extra = {}) {
    auto args = Identity(ns);
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = ServeProcess::Start(args, dir_.Join("serve-" + ns + ".log"));
    EXPECT_NE(p, nullptr);
    return p;
  }
  std::string WaitReady(ServeProcess& p, const std::string& ns) {
    auto s = WaitForState(p, runtime_, CacheState::kReady, 30s, ns);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? *s : "";
  }
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }

  TempDir dir_;
  std::string model_, runtime_;
};

TEST_F(CliTest, LsJsonListsLiveAndStaleCachesWithStateAndPid) {
  auto live = Serve("default");
  const std::string live_socket = WaitReady(*live, "default");
  // A daemon of another namespace, killed -9: its socket is stale. (Without a keeper: a
  // killed daemon's keeper would make it an orphan, keeper_daemon_test's subject.)
  auto dead = Serve("other", {"--no-keeper"});
  const std::string dead_socket = WaitReady(*dead, "other");
  dead->Signal(SIGKILL);
  ASSERT_EQ(dead->WaitExit(10s), 128 + SIGKILL);

  const CommandResult all = Cli({"ls", "--json", "--all-namespaces", "--runtime-dir", runtime_});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  const auto out = nlohmann::json::parse(all.out);
  ASSERT_EQ(out["caches"].size(), 2u) << all.out;
  const auto& ready = out["caches"][0];  // "default" sorts before "other"
  EXPECT_EQ(ready["namespace"], "default");
  EXPECT_EQ(ready["socket"], live_socket);
  EXPECT_EQ(ready["state"], "ready");
  EXPECT_EQ(ready["pid"], live->pid());
  EXPECT_EQ(ready["tier"], "host");
  EXPECT_EQ(ready["device"], "host");
  EXPECT_EQ(ready["model_id"], "tiny");
  EXPECT_EQ(ready["tensors"], 6);
  EXPECT_EQ(ready["clients"], 0);
  EXPECT_EQ(ready["digest"], ConfigFor(model_, "tiny").Digest());
  EXPECT_EQ(ready["config"]["tp_size"], 1);
  EXPECT_EQ(ready["config"]["revision"], "");
  const auto& stale = out["caches"][1];
  EXPECT_EQ(stale["namespace"], "other");
  EXPECT_EQ(stale["socket"], dead_socket);
  EXPECT_EQ(stale["state"], "stale");

  // Default: the "default" namespace only.
  const CommandResult def = Cli({"ls", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(def.exit_code, 0) << def.err;
  EXPECT_EQ(nlohmann::json::parse(def.out)["caches"].size(), 1u) << def.out;

  // Human form names the state and the pid.
  const CommandResult human = Cli({"ls", "--all-namespaces", "--runtime-dir", runtime_});
  ASSERT_EQ(human.exit_code, 0) << human.err;
  EXPECT_NE(human.out.find("ready"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("stale"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find(std::to_string(live->pid())), std::string::npos) << human.out;
}

// Issue 39 §11: `ls` and `status` size their columns to their content; a model id longer than the
// old fixed width (24) ran into RANKS.
TEST_F(CliTest, LsSizesEveryColumnToItsContent) {
  const std::string model_id = "meta-llama/Meta-Llama-3-70B-Instruct";
  auto serve = ServeProcess::Start(
      {"--model", model_, "--model-id", model_id, "--tier", "host", "--runtime-dir", runtime_},
      dir_.Join("serve-long.log"));
  ASSERT_NE(serve, nullptr);
  WaitReady(*serve, "default");
  const CommandResult ls = Cli({"ls", "--runtime-dir", runtime_});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  const size_t eol = ls.out.find('\n');
  ASSERT_NE(eol, std::string::npos) << ls.out;
  const std::string header = ls.out.substr(0, eol);
  const std::string row = ls.out.substr(eol + 1, ls.out.find('\n', eol + 1) - eol - 1);
  const auto cell = [&](const std::string& column) {
    const size_t at = header.find(column);
    EXPECT_NE(at, std::string::npos) << header;
    if (at == std::string::npos || at == 0 || at > row.size()) return std::string();
    EXPECT_EQ(row[at - 1], ' ') << "the cell before " << column << " runs into it:\n" << ls.out;
    return row.substr(at, row.find("  ", at) - at);
  };
  EXPECT_EQ(cell("MODEL"), model_id);
  EXPECT_EQ(cell("RANKS"), "tp0/1 pp0/1 ep0/1 dp1");
  EXPECT_EQ(cell("TIER"), "host");
  EXPECT_EQ(cell("STATE"), "ready");
  EXPECT_EQ(cell("PID"), std::to_string(serve->pid()));

  // `status`, the same: its table under the device's line, indented by two.
  const CommandResult st = Cli({"status", "--runtime-dir", runtime_});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  const size_t head = st.out.find("  MODEL");
  ASSERT_NE(head, std::string::npos) << st.out;
  const size_t head_end = st.out.find('\n', head);
  const std::string st_header = st.out.substr(head, head_end - head);
  const std::string st_row =
      st.out.substr(head_end + 1, st.out.find('\n', head_end + 1) - head_end - 1);
  const auto st_cell = [&](const std::string& column) {
    const size_t at = st_header.find(column);
    EXPECT_NE(at, std::string::npos) << st_header;
    if (at == std::string::npos || at == 0 || at > st_row.size()) return std::string();
    EXPECT_EQ(st_row[at - 1], ' ') << "the cell before " << column << " runs into it:\n" << st.out;
    return st_row.substr(at, st_row.find("  ", at) - at);
  };
  EXPECT_EQ(st_cell("MODEL"), model_id);
  EXPECT_EQ(st_cell("STATE"), "host");
  EXPECT_EQ(st_cell("PID"), std::to_string(serve->pid()));
}

TEST_F(CliTest, StopByIdentityStopsTheDaemonAndWaitsForItsExit) {
  auto serve = Serve("default");
  const std::string socket = WaitReady(*serve, "default");
  auto args = Identity();
  args.insert(args.begin(), "stop");
  const CommandResult stop = Cli(args);
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_NE(stop.err.find("stopped"), std::string::npos) << stop.err;
  // `stop` returned only once the socket was gone and the lock free: already true here.
  struct stat st {};
  EXPECT_NE(::lstat(socket.c_str(), &st), 0);
  EXPECT_FALSE(os::IsLockHeld(socket.substr(0, socket.size() - 5) + ".lock"));
  EXPECT_EQ(serve->WaitExit(10s), 0) << serve->Log();
  EXPECT_NE(serve->Log().find("Stop requested by peer pid"), std::string::npos) << serve->Log();
}

TEST_F(CliTest, StopBySocketPathAndStopAll) {
  auto a = Serve("default");
  const std::string socket_a = WaitReady(*a, "default");
  const CommandResult by_path = Cli({"stop", "--socket", socket_a});
  EXPECT_EQ(by_path.exit_code, 0) << by_path.err;
  EXPECT_EQ(a->WaitExit(10s), 0);

  auto b = Serve("one");
  WaitReady(*b, "one");
  auto c = Serve("two");
  WaitReady(*c, "two");
  const CommandResult all = Cli({"stop", "--all", "--all-namespaces", "--runtime-dir", runtime_});
  EXPECT_EQ(all.exit_code, 0) << all.err;
  EXPECT_EQ(b->WaitExit(10s), 0);
  EXPECT_EQ(c->WaitExit(10s), 0);
}

TEST_F(CliTest, StopWithoutADaemonExits3) {
  auto args = Identity();
  args.insert(args.begin(), "stop");
  const CommandResult stop = Cli(args);
  EXPECT_EQ(stop.exit_code, 3) << stop.err;
  EXPECT_NE(stop.err.find("no live daemon at"), std::string::npos) << stop.err;
}

}  // namespace
}  // namespace weightcache::testing
