// The CLI's refusals through the real binary (issue 39 §10, §11): each exits with the code of
// the one table (weightcache::kStatusCodeTable; 2 only for usage) and says what happened.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

class CliMessagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 4, 1, 3, 4096);
    runtime_ = dir_.Join("run");
  }
  CommandResult Cli(std::vector<std::string> args) {
    args.insert(args.begin(), CliPath());
    return RunCommand(args);
  }
  TempDir dir_;
  std::string model_, runtime_;
};

// §10: a file where the socket goes is a runtime condition (exit 1), named with what it is.
TEST_F(CliMessagesTest, AFileAtTheSocketPathExits1NamingIt) {
  const std::string path = dir_.Join("taken.sock");
  WriteFile(path, "precious");
  const CommandResult serve = Cli(
      {"serve", "--model", model_, "--tier", "host", "--runtime-dir", runtime_, "--socket", path});
  EXPECT_EQ(serve.exit_code, 1) << serve.err;
  EXPECT_NE(serve.err.find(path + " exists and is not a socket (a regular file); refusing to "
                                  "replace it: remove it, or choose another socket path"),
            std::string::npos)
      << serve.err;
  EXPECT_EQ(ReadFile(path), "precious");
  // A client refuses it with the same code.
  const CommandResult attach = Cli({"attach", "--model", model_, "--tier", "host", "--socket", path,
                                    "--on-missing", "error", "--wait", "1"});
  EXPECT_EQ(attach.exit_code, 1) << attach.err;
  EXPECT_NE(attach.err.find(path + " exists but is not a socket"), std::string::npos) << attach.err;
}

// §10: a corrupt budget ledger is the device's state gone bad, not a usage error: exit 1.
TEST_F(CliMessagesTest, ACorruptBudgetLedgerExits1NamingTheFile) {
  const std::string device_dir = runtime_ + "/default/host";
  for (const std::string& d : {runtime_, runtime_ + "/default", device_dir}) {
    ASSERT_EQ(::mkdir(d.c_str(), 0700), 0) << d;
  }
  const std::string ledger = identity::BudgetLedgerPath(device_dir);
  WriteFile(ledger, "{\"version\": 1, \"entries\": [");
  const CommandResult serve = Cli({"serve", "--model", model_, "--tier", "host", "--runtime-dir",
                                   runtime_, "--host-budget", "1G"});
  EXPECT_EQ(serve.exit_code, 1) << serve.err;
  EXPECT_NE(serve.err.find("budget ledger " + ledger + " is corrupt (not valid JSON)"),
            std::string::npos)
      << serve.err;
  EXPECT_EQ(ReadFile(ledger), "{\"version\": 1, \"entries\": [");
}

// §10: a rules file named on the command line that does not exist is a usage error (exit 2),
// as shard-plan's help says.
TEST_F(CliMessagesTest, AMissingShardRulesFileExits2AsTheHelpSays) {
  const CommandResult plan =
      Cli({"shard-plan", "--model", model_, "--shard-rules", "/nonexistent.json"});
  EXPECT_EQ(plan.exit_code, 2) << plan.err;
  EXPECT_NE(plan.err.find("--shard-rules /nonexistent.json: not a built-in rule set ("),
            std::string::npos)
      << plan.err;
  EXPECT_NE(plan.err.find(") and not a readable rules file: "), std::string::npos) << plan.err;
  const CommandResult help = Cli({"shard-plan", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Exit 2: a missing, unreadable or bad rules file, or bad ranks"),
            std::string::npos)
      << help.out;
}

// §11: every numeric flag refuses with the flag, the value and a readable bound (never DBL_MAX's
// 309 digits), and NaN and infinities are refused wherever a number is parsed.
TEST_F(CliMessagesTest, NumericFlagsRefuseWithAReadableBoundAndNeverTakeNaN) {
  const struct {
    std::vector<std::string> args;
    std::string message;
  } cases[] = {
      {{"serve", "--tp-size", "0"}, "--tp-size: 0 is not \u2265 1"},
      {{"attach", "--tp-rank", "-1"}, "--tp-rank: -1 is not \u2265 0"},
      {{"attach", "--wait", "-1"}, "--wait: -1 is not \u2265 0"},
      {{"attach", "--wait", "nan"}, "--wait: nan is not a finite number"},
      {{"verify", "--wait", "inf"}, "--wait: inf is not a finite number"},
      {{"attach", "--wait", "soon"}, "--wait: soon is not a number"},
      {{"stop", "--timeout", "0"}, "--timeout: 0 is not > 0"},
      {{"ls", "--timeout", "inf"}, "--timeout: inf is not a finite number"},
      {{"serve", "--failed-linger", "NaN"}, "--failed-linger: NaN is not a finite number"},
      {{"serve", "--handshake-timeout", "0"}, "--handshake-timeout: 0 is not > 0"},
      {{"serve", "--threads", "300"}, "--threads: 300 is not in 1 \u2026 256"},
      {{"serve", "--max-connections", "0"}, "--max-connections: 0 is not in 1 \u2026 1048576"},
      {{"launch", "--nnodes", "0"}, "--nnodes: 0 is not \u2265 1"},
      {{"launch", "--ready-timeout", "nan"}, "--ready-timeout: nan is not a finite number"},
      {{"upgrade", "--timeout", "-5"}, "--timeout: -5 is not > 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args[0] + " " + c.args[1] + " " + c.args[2]);
    const CommandResult r = Cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("1797693"), std::string::npos) << r.err;  // DBL_MAX's digits
  }
}

// §11: an attach that gives up on a daemon awaiting its publisher says so: that daemon answered
// every poll, whatever instant the wait ended at (a poll in flight at the deadline included).
TEST_F(CliMessagesTest, AnAttachTimingOutOnAnAwaitingDaemonSaysItIsStillAwaiting) {
  const std::vector<std::string> identity = {"--source",      "published:eng", "--tier",
                                             "host",          "--model-id",    "pub",
                                             "--runtime-dir", runtime_};
  auto serve = ServeProcess::Start(identity, dir_.Join("serve.log"));
  ASSERT_NE(serve, nullptr);
  auto socket = WaitForState(*serve, runtime_, CacheState::kAwaiting);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  for (const std::string wait : {"0", "0.5", "1", "1.1", "1.2", "1.3", "1.5"}) {
    SCOPED_TRACE("--wait " + wait);
    std::vector<std::string> args = {"attach", "--on-missing", "error", "--wait", wait};
    args.insert(args.end(), identity.begin(), identity.end());
    const CommandResult r = Cli(args);
    EXPECT_EQ(r.exit_code, 6) << r.err;
    EXPECT_NE(r.err.find("still awaiting its publisher after "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("; it answered every poll"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("did not answer"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace weightcache::testing
