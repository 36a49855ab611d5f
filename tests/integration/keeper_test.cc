// The keeper (docs/keeper.md) as a real process: the real `weightcache keeper` binary started
// by keeper::SpawnKeeper, real sealed memfds deposited over its real socket, depositors that
// are real processes killed with SIGKILL, peers of another uid.
#include <dirent.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "identity/paths.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "support/sealed_cache.h"
#include "support/test_env.h"

namespace weightcache::keeper {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::CliPath;
using weightcache::testing::MakeSealedCache;
using weightcache::testing::ReadWhole;
using weightcache::testing::SealedCache;
using weightcache::testing::TempDir;
using weightcache::testing::TestDigest;

constexpr std::chrono::milliseconds kTimeout{10'000};

void ExpectError(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_THAT(s.message(), HasSubstr(needle));
}

// A keeper the test started: watched through a pidfd (it is nobody's child but init's), and
// killed at the end of the test if it still runs.
class KeeperProcess {
 public:
  KeeperProcess() = default;
  explicit KeeperProcess(pid_t pid)
      : pid_(pid), pidfd_(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0))) {}
  KeeperProcess(KeeperProcess&&) noexcept = default;
  KeeperProcess& operator=(KeeperProcess&&) noexcept = default;
  ~KeeperProcess() {
    if (pidfd_.valid() && !Exited(std::chrono::milliseconds(0))) Signal(SIGKILL);
  }
  pid_t pid() const { return pid_; }
  bool watched() const { return pidfd_.valid(); }
  bool Signal(int sig) const {
    return ::syscall(SYS_pidfd_send_signal, pidfd_.get(), sig, nullptr, 0) == 0;
  }
  // Whether it has exited within `timeout` (poll on the pidfd: returns as soon as it does).
  bool Exited(std::chrono::milliseconds timeout) const {
    pollfd p{pidfd_.get(), POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(timeout.count())) == 1;
  }

 private:
  pid_t pid_ = 0;
  UniqueFd pidfd_;
};

// The memfds a process holds, by the names the cache gave them ("/memfd:<name> (deleted)").
std::vector<std::string> MemfdsOf(pid_t pid, const std::string& name) {
  std::vector<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    char target[512];
    ssize_t n = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string link(target, static_cast<size_t>(n));
    if (link.starts_with("/memfd:" + name + "-")) out.push_back(link);
  }
  ::closedir(d);
  return out;
}

class KeeperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    paths_.socket = identity::KeeperSocketFor(dir_.Join("0123456789abcdef.sock"));
    paths_.lock = identity::LockPathFor(paths_.socket);
  }

  SpawnOptions Spawn(std::chrono::milliseconds deposit_timeout = kTimeout) const {
    SpawnOptions o;
    o.program = CliPath();
    o.socket = paths_.socket;
    o.deposit_timeout = deposit_timeout;
    return o;
  }
  KeeperProcess Start(const SpawnOptions& options) {
    auto pid = SpawnKeeper(options);
    EXPECT_TRUE(pid.ok()) << pid.status().ToString();
    return pid.ok() ? KeeperProcess(*pid) : KeeperProcess();
  }
  Status Deposit(const SealedCache& cache, const std::string& digest = TestDigest()) {
    return DepositToKeeper(paths_.socket, cache.Info(digest), cache.manifest_fd.get(),
                           cache.allocation_fds(), kTimeout);
  }
  Result<std::optional<protocol::Handoff>> Withdraw(const std::string& digest = TestDigest()) {
    protocol::AdoptOptions adopt;
    adopt.expected_digest = digest;
    return TryWithdraw(paths_, adopt, kTimeout);
  }
  // Checks that the keeper hands back exactly what `seed` wrote, and says so in Query.
  void ExpectHolds(const std::vector<uint64_t>& sizes, uint8_t seed) {
    auto withdrawn = Withdraw();
    ASSERT_TRUE(withdrawn.ok()) << withdrawn.status().ToString();
    ASSERT_TRUE(withdrawn->has_value());
    auto expected = MakeSealedCache(sizes, seed);
    ASSERT_TRUE(expected.ok());
    ASSERT_EQ((*withdrawn)->allocations.size(), sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(ReadWhole((*withdrawn)->allocations[i].get()), expected->contents[i])
          << "allocation " << i;
    }
  }
  // One raw frame to the keeper; its answer (an Error's Status, or OK for any other frame).
  Status SendRaw(const std::vector<uint8_t>& bytes, std::span<const int> fds = {}) {
    auto conn = os::ConnectUnix(paths_.socket, kTimeout);
    if (!conn.ok()) return conn.status();
    const os::Deadline deadline = os::Deadline::After(kTimeout);
    WEIGHTCACHE_RETURN_IF_ERROR(os::SendMessage(conn->get(), bytes, fds, deadline));
    auto reply = protocol::ReadFrame(conn->get(), protocol::Expect::kKeeperReply, deadline);
    if (!reply.ok()) return reply.status();
    if (reply->type != protocol::MessageType::kError) return Status::Ok();
    auto error = protocol::DecodeError(reply->payload);
    if (!error.ok()) return error.status();
    return Status(error->code, error->message);
  }

  TempDir dir_;
  KeeperPaths paths_;
};

TEST_F(KeeperTest, DepositThenWithdrawGivesTheSameMemfdsAndBytes) {
  KeeperProcess keeper = Start(Spawn());
  auto cache = MakeSealedCache({8192, 4096 * 5}, 7);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  ASSERT_TRUE(Deposit(*cache).ok());
  auto query = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(query.ok()) << query.status().ToString();
  ASSERT_TRUE(query->has_value());
  EXPECT_EQ((*query)->state, protocol::KeeperState::kHolding);
  EXPECT_EQ((*query)->keeper_pid, keeper.pid());
  EXPECT_EQ((*query)->depositor_pid, ::getpid());
  EXPECT_EQ((*query)->fd_count, 2u);
  EXPECT_EQ((*query)->bytes, 8192u + 4096 * 5);
  EXPECT_EQ((*query)->config_digest, TestDigest());
  auto withdrawn = Withdraw();
  ASSERT_TRUE(withdrawn.ok()) << withdrawn.status().ToString();
  ASSERT_TRUE(withdrawn->has_value());
  for (size_t i = 0; i < 2; ++i) {
    struct stat mine {
    }, back{};
    ASSERT_EQ(::fstat(cache->allocations[i].get(), &mine), 0);
    ASSERT_EQ(::fstat((*withdrawn)->allocations[i].get(), &back), 0);
    EXPECT_EQ(mine.st_ino, back.st_ino) << "allocation " << i;
    EXPECT_EQ(ReadWhole((*withdrawn)->allocations[i].get()), cache->contents[i]);
  }
  // Withdraw hands out duplicates: the keeper still holds the cache for the next restart.
  ExpectHolds({8192, 4096 * 5}, 7);
}

// The depositor is a real process (a fork of this test) that starts the keeper, deposits and
// is then SIGKILLed: the keeper, not its child, keeps the memory readable.
TEST_F(KeeperTest, KeeperOutlivesItsDepositorKilledWithSigkill) {
  const std::vector<uint64_t> sizes = {4096 * 4, 4096 * 2};
  int report[2];
  ASSERT_EQ(::pipe2(report, O_CLOEXEC), 0);
  UniqueFd report_read(report[0]), report_write(report[1]);
  const SpawnOptions spawn = Spawn();
  pid_t depositor = ::fork();
  ASSERT_GE(depositor, 0);
  if (depositor == 0) {
    auto pid = SpawnKeeper(spawn);
    auto cache = MakeSealedCache(sizes, 9);
    if (!pid.ok() || !cache.ok() || !Deposit(*cache).ok()) ::_exit(1);
    const std::string line = std::to_string(*pid) + "\n";
    (void)!::write(report_write.get(), line.data(), line.size());
    while (true) ::pause();  // holds its own fds until it is killed
  }
  report_write.Reset();
  char buf[32] = {};
  ssize_t n = ::read(report_read.get(), buf, sizeof(buf) - 1);
  ASSERT_GT(n, 0) << "the depositor died before it deposited";
  KeeperProcess keeper(static_cast<pid_t>(std::stol(buf)));
  ASSERT_EQ(::kill(depositor, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(depositor, &wstatus, 0), depositor);
  ASSERT_TRUE(WIFSIGNALED(wstatus));

  EXPECT_FALSE(keeper.Exited(std::chrono::milliseconds(0)));
  auto query = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(query.ok()) << query.status().ToString();
  ASSERT_TRUE(query->has_value());
  EXPECT_EQ((*query)->depositor_pid, depositor);
  EXPECT_EQ((*query)->state, protocol::KeeperState::kHolding);
  ExpectHolds(sizes, 9);
}

TEST_F(KeeperTest, WithdrawOfAnotherCacheIsRefusedNamingBothDigests) {
  KeeperProcess keeper = Start(Spawn());
  auto cache = MakeSealedCache({8192});
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(Deposit(*cache).ok());
  auto other = Withdraw(TestDigest('b'));
  ExpectError(other.status(), StatusCode::kMismatch,
              "keeper: keeper holds cache " + TestDigest('a') + ", not " + TestDigest('b'));
  ExpectHolds({8192}, 1);
}

TEST_F(KeeperTest, ASecondDepositIsRefusedAndTheFirstKept) {
  KeeperProcess keeper = Start(Spawn());
  auto first = MakeSealedCache({8192}, 1);
  auto second = MakeSealedCache({8192}, 2);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE(Deposit(*first).ok());
  ExpectError(Deposit(*second, TestDigest('a')), StatusCode::kAlreadyServed,
              "keeper: keeper pid " + std::to_string(keeper.pid()) + " already holds cache " +
                  TestDigest('a') + " (deposited by pid " + std::to_string(::getpid()) + ")");
  ExpectHolds({8192}, 1);
}

TEST_F(KeeperTest, ASecondKeeperForTheSameCacheIsRefusedNamingTheFirst) {
  KeeperProcess keeper = Start(Spawn());
  auto again = SpawnKeeper(Spawn());
  ExpectError(again.status(), StatusCode::kAlreadyServed,
              "another keeper (pid " + std::to_string(keeper.pid()) +
                  ") already holds this cache's lock " + paths_.lock);
}

// Malformed frames close their connection only; the keeper keeps waiting for (or holding) its
// deposit. Hostile deposits are refused by their own checks and nothing of them is held.
TEST_F(KeeperTest, HostileFramesAreRefusedAndTheKeeperKeepsServing) {
  KeeperProcess keeper = Start(Spawn());
  auto cache = MakeSealedCache({8192, 8192}, 4);
  ASSERT_TRUE(cache.ok());
  std::vector<int> fds = {cache->manifest_fd.get()};
  for (int fd : cache->allocation_fds()) fds.push_back(fd);
  const std::vector<uint8_t> deposit = *protocol::EncodeDeposit(cache->Info());

  std::vector<uint8_t> wrong_version = deposit;
  wrong_version[4] = 2;
  ExpectError(SendRaw(wrong_version, fds), StatusCode::kProtocol,
              "unsupported handoff version 2 in Deposit (this build speaks handoff version 1)");
  std::vector<uint8_t> oversize = *protocol::EncodeEmptyHandoff(protocol::MessageType::kQuery);
  protocol::wire::SetU64(oversize, 16, uint64_t{1} << 20);
  ExpectError(SendRaw(oversize), StatusCode::kProtocol,
              "Query frame payload of 1048576 bytes exceeds the 65536-byte limit");
  ExpectError(SendRaw(*protocol::EncodeStatusRequest()), StatusCode::kProtocol,
              "unexpected Status frame: expected a keeper request");
  std::vector<uint8_t> short_count = deposit;
  short_count[12] = 2;
  ExpectError(SendRaw(short_count, std::span<const int>(fds).first(2)), StatusCode::kProtocol,
              "Deposit carries 2 fds for 2 allocations");
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd pipe_read(p[0]), pipe_write(p[1]);
  std::vector<int> with_pipe = fds;
  with_pipe[1] = pipe_read.get();
  ExpectError(SendRaw(deposit, with_pipe), StatusCode::kProtocol,
              "Deposit: allocation 0: the fd is a pipe, not a sealed memfd");
  auto unsealed = os::CreateMemfd("unsealed", 8192);
  ASSERT_TRUE(unsealed.ok());
  std::vector<int> with_unsealed = fds;
  with_unsealed[2] = unsealed->get();
  ExpectError(SendRaw(deposit, with_unsealed), StatusCode::kPermissionDenied,
              "is not sealed read-only");
  auto small = os::CreateMemfd("small", 4096);
  ASSERT_TRUE(small.ok());
  ASSERT_TRUE(os::SealReadOnly(small->get()).ok());
  std::vector<int> with_small = fds;
  with_small[2] = small->get();
  ExpectError(SendRaw(deposit, with_small), StatusCode::kProtocol,
              "Deposit: allocation 1: memfd of 4096 bytes is smaller than the allocation's 8192 "
              "bytes");

  auto waiting = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(waiting.ok() && waiting->has_value()) << waiting.status().ToString();
  EXPECT_EQ((*waiting)->state, protocol::KeeperState::kWaiting);
  ASSERT_TRUE(Deposit(*cache).ok());
  // Holding now: the same hostile frames leave the deposit alone.
  ExpectError(SendRaw(wrong_version, fds), StatusCode::kProtocol, "unsupported handoff version 2");
  ExpectError(SendRaw(oversize), StatusCode::kProtocol, "exceeds the 65536-byte limit");
  std::vector<uint8_t> bad_withdraw = *protocol::EncodeWithdraw(TestDigest());
  bad_withdraw[protocol::kFrameHeaderSize] = 'Z';
  ExpectError(SendRaw(bad_withdraw), StatusCode::kProtocol,
              "Withdraw: config digest that is not 64 lowercase hex characters");
  EXPECT_FALSE(keeper.Exited(std::chrono::milliseconds(0)));
  ExpectHolds({8192, 8192}, 4);
}

TEST_F(KeeperTest, DropClosesTheFdsAndTheKeeperExits) {
  KeeperProcess keeper = Start(Spawn());
  ASSERT_TRUE(keeper.watched());
  {
    auto cache = MakeSealedCache({8192, 8192, 8192}, 5, -1, "dropme");
    ASSERT_TRUE(cache.ok());
    ASSERT_TRUE(Deposit(*cache).ok());
  }  // our copies are closed: the keeper's are the last
  EXPECT_EQ(MemfdsOf(keeper.pid(), "dropme").size(), 4u) << "3 allocations + the manifest";
  ASSERT_TRUE(DropKeeper(paths_, kTimeout).ok());
  ASSERT_TRUE(keeper.Exited(kTimeout));
  EXPECT_TRUE(MemfdsOf(keeper.pid(), "dropme").empty());
  struct stat st {};
  EXPECT_NE(::lstat(paths_.socket.c_str(), &st), 0) << "the keeper removes its socket";
  EXPECT_FALSE(os::IsLockHeld(paths_.lock));
  ExpectError(DropKeeper(paths_, kTimeout), StatusCode::kNoDaemon,
              "no live keeper at " + paths_.socket);
}

TEST_F(KeeperTest, SigtermReleasesTheDepositAndRemovesTheSocket) {
  KeeperProcess keeper = Start(Spawn());
  ASSERT_TRUE(keeper.watched());
  {
    auto cache = MakeSealedCache({8192}, 6, -1, "termed");
    ASSERT_TRUE(cache.ok());
    ASSERT_TRUE(Deposit(*cache).ok());
  }
  EXPECT_EQ(MemfdsOf(keeper.pid(), "termed").size(), 2u);
  ASSERT_TRUE(keeper.Signal(SIGTERM));
  ASSERT_TRUE(keeper.Exited(kTimeout));
  EXPECT_TRUE(MemfdsOf(keeper.pid(), "termed").empty());
  struct stat st {};
  EXPECT_NE(::lstat(paths_.socket.c_str(), &st), 0);
  EXPECT_FALSE(os::IsLockHeld(paths_.lock));
}

TEST_F(KeeperTest, AKeeperWithoutADepositExitsAfterItsTimeout) {
  KeeperProcess keeper = Start(Spawn(std::chrono::milliseconds(200)));
  ASSERT_TRUE(keeper.watched());
  ASSERT_TRUE(keeper.Exited(kTimeout));
  EXPECT_FALSE(os::IsLockHeld(paths_.lock));
  auto query = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(query.ok()) << query.status().ToString();
  EXPECT_FALSE(query->has_value());
}

// StartKeeper's keeper (a daemon starts it with its load) watches its depositor instead of a
// timeout: it waits as long as the depositor holds its pipe, and exits once the pipe closes
// with nothing deposited.
TEST_F(KeeperTest, AKeeperStartedForALoadExitsWhenItsDepositorGivesUpFirst) {
  auto starting = StartKeeper(Spawn(std::chrono::milliseconds(200)));
  ASSERT_TRUE(starting.ok()) << starting.status().ToString();
  auto pid = starting->WaitReady();
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  KeeperProcess keeper(*pid);
  ASSERT_TRUE(keeper.watched());
  // Past its 200 ms deposit timeout, still waiting: the pipe is open.
  EXPECT_FALSE(keeper.Exited(std::chrono::milliseconds(600)));
  auto query = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(query.ok()) << query.status().ToString();
  ASSERT_TRUE(query->has_value());
  EXPECT_EQ((*query)->state, protocol::KeeperState::kWaiting);
  EXPECT_EQ((*query)->keeper_pid, *pid);

  { StartingKeeper gone = std::move(starting).value(); }  // the depositor gives up
  ASSERT_TRUE(keeper.Exited(kTimeout));
  EXPECT_FALSE(os::IsLockHeld(paths_.lock));
  struct stat st {};
  EXPECT_NE(::lstat(paths_.socket.c_str(), &st), 0);
}

TEST_F(KeeperTest, AKeeperStartedForALoadHoldsTheDepositOnceItsDepositorIsGone) {
  const std::vector<uint64_t> sizes = {8192, 4096 * 3};
  auto starting = StartKeeper(Spawn(std::chrono::milliseconds(200)));
  ASSERT_TRUE(starting.ok()) << starting.status().ToString();
  auto pid = starting->WaitReady();
  ASSERT_TRUE(pid.ok()) << pid.status().ToString();
  KeeperProcess keeper(*pid);
  auto cache = MakeSealedCache(sizes, 5);
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  ASSERT_TRUE(Deposit(*cache).ok());
  { StartingKeeper gone = std::move(starting).value(); }  // the pipe closes after the deposit
  EXPECT_FALSE(keeper.Exited(std::chrono::milliseconds(300)));
  ExpectHolds(sizes, 5);
  // Its start is read once; a second read says so instead of blocking.
  StartingKeeper again = std::move(StartKeeper(Spawn()).value());
  auto second = again.WaitReady();
  ExpectError(second.status(), StatusCode::kAlreadyServed,
              "another keeper (pid " + std::to_string(*pid) + ") already holds this cache's lock " +
                  paths_.lock);
  ExpectError(again.WaitReady().status(), StatusCode::kInternal,
              "keeper " + paths_.socket + ": its start was already read");
}

// A keeper given something other than a pipe as its depositor refuses to start, and says so
// on its ready pipe.
TEST_F(KeeperTest, ADepositorFdThatIsNotAPipeIsRefusedAtStart) {
  int ready[2];
  ASSERT_EQ(::pipe2(ready, 0), 0);
  UniqueFd ready_read(ready[0]), ready_write(ready[1]);
  const std::string file = dir_.Join("not-a-pipe");
  UniqueFd regular(::open(file.c_str(), O_RDWR | O_CREAT, 0600));
  ASSERT_TRUE(regular.valid());
  ::fcntl(regular.get(), F_SETFD, 0);
  const std::string cmd = CliPath() + " keeper --socket " + paths_.socket + " --ready-fd " +
                          std::to_string(ready_write.get()) + " --depositor-fd " +
                          std::to_string(regular.get()) + " 2>/dev/null";
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  ready_write.Reset();
  std::string said;
  char buf[256];
  for (ssize_t n; (n = ::read(ready_read.get(), buf, sizeof(buf))) > 0;) said.append(buf, n);
  EXPECT_EQ(said, std::to_string(static_cast<uint32_t>(StatusCode::kInvalidArgument)) +
                      " --depositor-fd " + std::to_string(regular.get()) +
                      " is not an open pipe\n");
  EXPECT_FALSE(os::IsLockHeld(paths_.lock));
}
// A keeper socket whose lock is free is a dead keeper's leftover: absent for every reader,
// never connected to, and replaced by the next keeper.
TEST_F(KeeperTest, AStaleKeeperSocketIsTreatedAsAbsent) {
  {
    auto listener = os::ListenUnix(paths_.socket, 0600, os::Blocking::kNonBlocking);
    ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  }  // closed, the socket file stays: what a SIGKILLed keeper leaves
  struct stat st {};
  ASSERT_EQ(::lstat(paths_.socket.c_str(), &st), 0);
  auto withdrawn = Withdraw();
  ASSERT_TRUE(withdrawn.ok()) << withdrawn.status().ToString();
  EXPECT_FALSE(withdrawn->has_value());
  auto query = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(query.ok()) << query.status().ToString();
  EXPECT_FALSE(query->has_value());
  ExpectError(DropKeeper(paths_, kTimeout), StatusCode::kNoDaemon, "no live keeper");
  KeeperProcess keeper = Start(Spawn());
  auto fresh = QueryKeeper(paths_, kTimeout);
  ASSERT_TRUE(fresh.ok() && fresh->has_value()) << fresh.status().ToString();
  EXPECT_EQ((*fresh)->keeper_pid, keeper.pid());
}

TEST_F(KeeperTest, WithdrawFromAWaitingKeeperIsNotFound) {
  KeeperProcess keeper = Start(Spawn());
  ExpectError(Withdraw().status(), StatusCode::kNotFound, "holds no deposit yet");
}

// SO_PEERCRED: a peer of another uid is refused at accept unless allowed; an allowed one may
// Query but not Drop. Needs root, to run the peer as nobody.
TEST_F(KeeperTest, PeersOfAnotherUidAreRefusedUnlessAllowed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a peer as another uid (nobody)";
  constexpr uid_t kNobody = 65534;
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);  // nobody must reach the socket
  // Runs `check` as nobody in a forked child; its exit code.
  auto as_nobody = [](const std::function<bool()>& check) {
    pid_t child = ::fork();
    if (child == 0) {
      if (::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) ::_exit(2);
      ::_exit(check() ? 0 : 1);
    }
    int wstatus = 0;
    ::waitpid(child, &wstatus, 0);
    return WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  };
  SpawnOptions spawn = Spawn();
  spawn.allow_uids = {kNobody - 1};  // someone else: the socket is 0666, SO_PEERCRED decides
  {
    KeeperProcess keeper = Start(spawn);
    const KeeperPaths paths = paths_;
    EXPECT_EQ(as_nobody([&] {
                // Refused with the keeper's Error, never a reset of the connection: the
                // keeper shuts its side down and drains ours before it closes.
                auto q = QueryKeeper(paths, kTimeout);
                return !q.ok() && q.status().code() == StatusCode::kPermissionDenied &&
                       q.status().message().find("uid 65534 is not allowed by keeper pid") !=
                           std::string::npos;
              }),
              0);
    ASSERT_TRUE(DropKeeper(paths_, kTimeout).ok());
    ASSERT_TRUE(keeper.Exited(kTimeout));
  }
  spawn.allow_uids = {kNobody};
  KeeperProcess keeper = Start(spawn);
  const KeeperPaths paths = paths_;
  EXPECT_EQ(as_nobody([&] {
              auto q = QueryKeeper(paths, kTimeout);
              return q.ok() && q->has_value() && (*q)->state == protocol::KeeperState::kWaiting;
            }),
            0);
  EXPECT_EQ(as_nobody([&] {
              Status drop = DropKeeper(paths, kTimeout);
              return drop.code() == StatusCode::kPermissionDenied &&
                     drop.message().find("Drop is accepted from uid 0 only") != std::string::npos;
            }),
            0);
  EXPECT_FALSE(keeper.Exited(std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace weightcache::keeper
