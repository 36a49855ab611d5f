// Issue 11 §2 "Lock path": one rule for every socket. A daemon started with --socket naming
// another daemon's layout socket used to take a different lock (<socket>.lock instead of the
// layout's <stem>.lock), so both held "their" lock and the second replaced the first's live
// socket. With one rule (identity::LockPathFor) the second loses the lock: exit 7 naming the
// first's pid, and the first keeps its socket.
#include <gtest/gtest.h>

#include <chrono>

#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "os/lock_file.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

TEST(LockPathAdversarialTest, ExplicitSocketOntoALiveLayoutSocketExitsSevenNamingItsOwner) {
  TempDir dir;
  const std::string model = MakeCheckpoint(dir.Join("model"), 8, 1);
  const std::string runtime = dir.Join("run");
  const std::vector<std::string> identity = {"--model",   model,  "--model-id",    "tiny",
                                             "--tier",    "host", "--runtime-dir", runtime,
                                             "--threads", "1"};
  auto first = ServeProcess::Start(identity, dir.Join("first.log"));
  ASSERT_NE(first, nullptr);
  auto socket = WaitForState(*first, runtime, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();

  std::vector<std::string> second_args = identity;
  second_args.insert(second_args.end(), {"--socket", *socket});
  auto second = ServeProcess::Start(second_args, dir.Join("second.log"));
  ASSERT_NE(second, nullptr);
  std::optional<int> exit = second->WaitExit(20s);
  ASSERT_TRUE(exit.has_value()) << "the second daemon is serving the first's socket:\n"
                                << second->Log();
  EXPECT_EQ(*exit, 7) << second->Log();
  EXPECT_NE(second->Log().find("is held by pid " + std::to_string(first->pid())), std::string::npos)
      << second->Log();

  // The first daemon still owns its socket and answers on it.
  EXPECT_TRUE(first->Running());
  EXPECT_EQ(os::ReadLockOwner(identity::LockPathFor(*socket)), first->pid());
  auto status = QueryStatus(*socket);
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->pid, first->pid());
}

}  // namespace
}  // namespace weightcache::testing
