// The device's memory budget (docs/budget.md) against real `weightcache serve --tier host`
// daemons sharing one runtime dir: admission registers each cache in the device's ledger, a
// cache that does not fit exits 8 naming the budget, the need and the holders, a clean stop
// and a kill -9 both give the memory back, and budget.conf is read when no flag is given.
#include "daemon/budget.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "daemon/byte_size.h"
#include "identity/paths.h"
#include "integration/daemon_process.h"
#include "os/syscalls.h"
#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using protocol::CacheState;

class BudgetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    runtime_ = dir_.Join("run");
    for (int i = 0; i < 3; ++i) {
      models_.push_back(MakeCheckpoint(dir_.Join("model" + std::to_string(i)), 4, 1, 10 + i, 8192));
      auto ckpt = checkpoint::Checkpoint::Open(models_.back());
      ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
      bytes_.push_back(ckpt->total_bytes());
    }
  }
  std::vector<std::string> Args(int model, std::vector<std::string> extra) const {
    std::vector<std::string> args = {"--model",       models_[model],
                                     "--model-id",    "m" + std::to_string(model),
                                     "--tier",        "host",
                                     "--runtime-dir", runtime_,
                                     "--threads",     "2",
                                     "--no-keeper"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  std::unique_ptr<ServeProcess> Serve(int model, std::vector<std::string> extra) {
    auto p = ServeProcess::Start(Args(model, std::move(extra)),
                                 dir_.Join("serve" + std::to_string(model) + ".log"));
    EXPECT_NE(p, nullptr);
    return p;
  }
  // A serve that is expected to exit at once (refused): its exit code and output.
  CommandResult ServeRefused(int model, std::vector<std::string> extra) {
    std::vector<std::string> argv = {CliPath(), "serve"};
    for (auto& a : Args(model, std::move(extra))) argv.push_back(a);
    return RunCommand(argv);
  }
  std::string DeviceDir(const std::string& socket) const {
    return std::filesystem::path(socket).parent_path().string();
  }
  daemon::Ledger ReadLedger(const std::string& device_dir) {
    auto ledger = daemon::BudgetLedger(device_dir).Read();
    EXPECT_TRUE(ledger.ok()) << ledger.status().ToString();
    return ledger.ok() ? *ledger : daemon::Ledger{};
  }
  // Polls the ledger until the entry of `socket` counts `clients` (a serving daemon writes its
  // count from a thread of its own, after the attach). Generous bound: it fails, not hangs.
  ::testing::AssertionResult WaitLedgerClients(const std::string& socket, uint32_t clients) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    std::string last = "no entry";
    while (std::chrono::steady_clock::now() < deadline) {
      auto ledger = daemon::BudgetLedger(DeviceDir(socket)).ReadOnly();
      if (ledger.ok()) {
        if (const daemon::LedgerEntry* e = ledger->Find(socket)) {
          if (e->clients == clients) return ::testing::AssertionSuccess();
          last = std::to_string(e->clients) + " clients";
        }
      } else {
        last = ledger.status().ToString();
      }
      std::this_thread::sleep_for(20ms);
    }
    return ::testing::AssertionFailure() << "the ledger entry of " << socket << " never counted "
                                         << clients << " clients (last: " << last << ")";
  }
  // Polls the sockets other than `except` until one answers ready.
  Result<std::string> WaitOtherReady(ServeProcess& p, const std::string& except) {
    return WaitOtherReady(p, std::vector<std::string>{except});
  }
  Result<std::string> WaitOtherReady(ServeProcess& p, const std::vector<std::string>& except) {
    StatusWait wait;
    wait.sockets = [&] {
      std::vector<std::string> out;
      for (auto& s : FindSockets(runtime_)) {
        if (std::ranges::find(except, s) == except.end()) out.push_back(s);
      }
      return out;
    };
    wait.reached = [](const protocol::StatusReply& r) { return r.state == CacheState::kReady; };
    wait.what = "state ready";
    WEIGHTCACHE_ASSIGN_OR_RETURN(FoundStatus found, WaitForStatus(p.child(), wait));
    return found.socket;
  }

  TempDir dir_;
  std::string runtime_;
  std::vector<std::string> models_;
  std::vector<uint64_t> bytes_;
};

TEST_F(BudgetTest, AdmittedCacheIsInTheLedgerAndLeavesItAtStop) {
  auto a = Serve(0, {"--host-budget", std::to_string(bytes_[0])});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  daemon::Ledger ledger = ReadLedger(DeviceDir(*socket));
  ASSERT_EQ(ledger.entries.size(), 1u);
  EXPECT_EQ(ledger.entries[0].socket, *socket);
  EXPECT_EQ(ledger.entries[0].pid, a->pid());
  EXPECT_EQ(ledger.entries[0].bytes, bytes_[0]);
  EXPECT_EQ(ledger.entries[0].tier, Tier::kHost);
  EXPECT_FALSE(ledger.entries[0].pinned);
  EXPECT_EQ(ledger.entries[0].clients, 0u);
  a->Signal(SIGTERM);
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(0)) << a->Log();
  EXPECT_TRUE(ReadLedger(DeviceDir(*socket)).entries.empty());
}

TEST_F(BudgetTest, CacheThatDoesNotFitExits8NamingBudgetNeedAndPinnedHolder) {
  const std::string budget = std::to_string(bytes_[0] + bytes_[1] - 1);
  auto a = Serve(0, {"--host-budget", budget, "--pin"});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  CommandResult b = ServeRefused(1, {"--host-budget", budget});
  EXPECT_EQ(b.exit_code, 8) << b.err;
  EXPECT_NE(b.err.find("the host budget is " + daemon::FormatBytes(bytes_[0] + bytes_[1] - 1)),
            std::string::npos)
      << b.err;
  EXPECT_NE(b.err.find("this cache needs " + daemon::FormatBytes(bytes_[1])), std::string::npos)
      << b.err;
  EXPECT_NE(b.err.find(*socket + " " + daemon::FormatBytes(bytes_[0]) + " (pid " +
                       std::to_string(a->pid()) + ", 0 clients, pinned)"),
            std::string::npos)
      << b.err;
  EXPECT_NE(b.err.find("nothing more can be freed"), std::string::npos) << b.err;
  daemon::Ledger ledger = ReadLedger(DeviceDir(*socket));
  ASSERT_EQ(ledger.entries.size(), 1u);  // the refused cache never registered
  EXPECT_EQ(ledger.entries[0].socket, *socket);
  EXPECT_TRUE(ledger.entries[0].pinned);
  EXPECT_TRUE(a->Running());
}

// Three caches under a budget that fits two: the least recently used idle one gives its memory
// back (an Evict: its daemon drains and exits 0), the new one is admitted; the other stays.
TEST_F(BudgetTest, LeastRecentlyUsedIdleCacheIsEvictedToMakeRoom) {
  // a and b fit; b and c fit; all three do not.
  const std::string budget = std::to_string(std::max(bytes_[0] + bytes_[1], bytes_[1] + bytes_[2]));
  auto a = Serve(0, {"--host-budget", budget});
  auto sa = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(sa.ok()) << sa.status().ToString() << a->Log();
  auto b = Serve(1, {"--host-budget", budget});
  auto sb = WaitOtherReady(*b, *sa);
  ASSERT_TRUE(sb.ok()) << sb.status().ToString() << b->Log();
  auto c = Serve(2, {"--host-budget", budget});
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(0)) << a->Log();
  EXPECT_NE(a->Log().find("evicted to make room under the device's budget"), std::string::npos)
      << a->Log();
  auto sc = WaitOtherReady(*c, std::vector<std::string>{*sa, *sb});
  ASSERT_TRUE(sc.ok()) << sc.status().ToString() << c->Log();
  EXPECT_TRUE(b->Running());
  daemon::Ledger ledger = ReadLedger(DeviceDir(*sc));
  ASSERT_EQ(ledger.entries.size(), 2u);
  EXPECT_EQ(ledger.Find(*sa), nullptr);
  ASSERT_NE(ledger.Find(*sb), nullptr);
  ASSERT_NE(ledger.Find(*sc), nullptr);
  EXPECT_EQ(ledger.Find(*sc)->pid, c->pid());
}

// `--demote host` on a host-tier cache: its memory is host RAM already, so an Evict stops it
// as without the flag (docs/budget.md, "Demotion and promotion").
TEST_F(BudgetTest, DemoteHostOnAHostTierCacheIsPlainlyEvicted) {
  const std::string budget = std::to_string(std::max(bytes_[0] + bytes_[1], bytes_[1] + bytes_[2]));
  auto a = Serve(0, {"--host-budget", budget, "--demote", "host"});
  auto sa = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(sa.ok()) << sa.status().ToString() << a->Log();
  auto b = Serve(1, {"--host-budget", budget, "--demote", "host"});
  auto sb = WaitOtherReady(*b, *sa);
  ASSERT_TRUE(sb.ok()) << sb.status().ToString() << b->Log();
  auto c = Serve(2, {"--host-budget", budget, "--demote", "host"});
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(0)) << a->Log();
  EXPECT_NE(a->Log().find("not demoting (a host-tier cache is in host RAM already): stopping "
                          "instead"),
            std::string::npos)
      << a->Log();
  EXPECT_NE(a->Log().find("evicted to make room under the device's budget"), std::string::npos)
      << a->Log();
  auto sc = WaitOtherReady(*c, std::vector<std::string>{*sa, *sb});
  ASSERT_TRUE(sc.ok()) << sc.status().ToString() << c->Log();
  daemon::Ledger ledger = ReadLedger(DeviceDir(*sc));
  EXPECT_EQ(ledger.Find(*sa), nullptr);
  ASSERT_NE(ledger.Find(*sc), nullptr);
  EXPECT_EQ(ledger.Find(*sc)->tier, Tier::kHost);
}

// Any other tier after --demote is a usage error (exit 2) naming the flag.
TEST_F(BudgetTest, DemoteToAnotherTierThanHostIsRefused) {
  CommandResult r = ServeRefused(0, {"--demote", "disk"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(
      r.err.find("--demote disk: the only tier to demote to is host (`host` or `host-pinned`)"),
      std::string::npos)
      << r.err;
}

// A pinned cache is never evicted, even when it is the least recently used: the next one is.
TEST_F(BudgetTest, PinnedCacheIsSkippedTheNextIdleOneIsEvicted) {
  // a and b fit; a and c fit; all three do not.
  const std::string budget = std::to_string(std::max(bytes_[0] + bytes_[1], bytes_[0] + bytes_[2]));
  auto a = Serve(0, {"--host-budget", budget, "--pin"});
  auto sa = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(sa.ok()) << sa.status().ToString() << a->Log();
  auto b = Serve(1, {"--host-budget", budget});
  auto sb = WaitOtherReady(*b, *sa);
  ASSERT_TRUE(sb.ok()) << sb.status().ToString() << b->Log();
  auto c = Serve(2, {"--host-budget", budget});
  ASSERT_EQ(b->WaitExit(30s), std::optional<int>(0)) << b->Log();
  auto sc = WaitOtherReady(*c, std::vector<std::string>{*sa, *sb});
  ASSERT_TRUE(sc.ok()) << sc.status().ToString() << c->Log();
  EXPECT_TRUE(a->Running());
  daemon::Ledger ledger = ReadLedger(DeviceDir(*sc));
  EXPECT_NE(ledger.Find(*sa), nullptr);
  EXPECT_EQ(ledger.Find(*sb), nullptr);
}

TEST_F(BudgetTest, KilledHolderIsReclaimedByTheNextAdmission) {
  const std::string budget = std::to_string(bytes_[0] + bytes_[1] - 1);
  auto a = Serve(0, {"--host-budget", budget, "--pin"});
  auto first = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(first.ok()) << first.status().ToString() << a->Log();
  a->Signal(SIGKILL);
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(128 + SIGKILL));
  auto b = Serve(1, {"--host-budget", budget});
  auto second = WaitOtherReady(*b, *first);
  ASSERT_TRUE(second.ok()) << second.status().ToString() << b->Log();
  daemon::Ledger ledger = ReadLedger(DeviceDir(*second));
  ASSERT_EQ(ledger.entries.size(), 1u);
  EXPECT_EQ(ledger.entries[0].socket, *second);
  EXPECT_EQ(ledger.entries[0].pid, b->pid());
}

TEST_F(BudgetTest, BudgetConfIsReadWhenNoFlagIsGiven) {
  auto a = Serve(0, {});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  // No budget applied: nothing registered.
  EXPECT_TRUE(ReadLedger(DeviceDir(*socket)).entries.empty());
  const std::string conf = identity::BudgetConfigPath(DeviceDir(*socket));
  std::ofstream(conf) << "# the device's budget\nhost_budget = " << (bytes_[1] - 1) << "\n";
  CommandResult b = ServeRefused(1, {});
  EXPECT_EQ(b.exit_code, 8) << b.err;
  EXPECT_NE(b.err.find("this cache needs " + daemon::FormatBytes(bytes_[1])), std::string::npos)
      << b.err;

  std::ofstream(conf) << "host_budget = 1G\nbogus = 1\n";
  CommandResult c = ServeRefused(1, {});
  EXPECT_EQ(c.exit_code, 2) << c.err;
  EXPECT_NE(c.err.find(conf + " line 2: unknown key 'bogus'"), std::string::npos) << c.err;
}

TEST_F(BudgetTest, AttachedClientIsCountedAndProtectsItsCache) {
  const std::string budget = std::to_string(bytes_[0] + bytes_[1] - 1);
  auto a = Serve(0, {"--host-budget", budget});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  const int64_t admitted = ReadLedger(DeviceDir(*socket)).entries.at(0).last_used_ms;
  {
    auto conn = protocol::Connection::Connect(*socket, 2s);
    ASSERT_TRUE(conn.ok()) << conn.status().ToString();
    protocol::Hello hello;
    hello.config = ConfigFor(models_[0], "m0").ToJson();
    auto hr = conn->SendHello(hello, os::Deadline::After(5s));
    ASSERT_TRUE(hr.ok() && hr->match);
    auto reply = conn->Attach(os::Deadline::After(5s));
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    ASSERT_TRUE(WaitLedgerClients(*socket, 1));
    daemon::Ledger ledger = ReadLedger(DeviceDir(*socket));
    ASSERT_EQ(ledger.entries.size(), 1u);
    EXPECT_EQ(ledger.entries[0].clients, 1u);
    EXPECT_GE(ledger.entries[0].last_used_ms, admitted);
    CommandResult b = ServeRefused(1, {"--host-budget", budget});
    EXPECT_EQ(b.exit_code, 8) << b.err;
    EXPECT_NE(b.err.find(*socket + " " + daemon::FormatBytes(bytes_[0]) + " (pid " +
                         std::to_string(a->pid()) + ", 1 client)"),
              std::string::npos)
        << b.err;
    EXPECT_NE(b.err.find("nothing more can be freed"), std::string::npos) << b.err;
  }
  // The client is gone: the daemon counts it out (polled: it sees the hang-up on its loop).
  StatusWait wait;
  wait.sockets = [&] { return std::vector<std::string>{*socket}; };
  wait.reached = [](const protocol::StatusReply& r) { return r.clients == 0; };
  wait.what = "0 clients";
  ASSERT_TRUE(WaitForStatus(a->child(), wait).ok());
  EXPECT_TRUE(WaitLedgerClients(*socket, 0));
}

// A process that holds the ledger's OFD lock (forked: open + fcntl + write + pause only, all
// async-signal-safe) until it is killed; it writes one byte to `ready_fd` once it holds it.
pid_t HoldLockForever(const std::string& lock_path, int ready_fd) {
  const char* path = lock_path.c_str();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  const int fd = ::open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (fd < 0 || ::fcntl(fd, F_OFD_SETLKW, &lock) != 0) ::_exit(1);
  if (::write(ready_fd, "x", 1) != 1) ::_exit(1);
  for (;;) ::pause();
}

// Attach and detach — the client-count changes that are written to the ledger — complete
// while another process holds the ledger's lock (hung, or stuck on a slow disk): the daemon
// writes the count from a thread of its own, logs that it could not, and writes the latest
// count once the lock is free.
TEST_F(BudgetTest, AHungLedgerLockHolderStallsNoAttach) {
  auto a = Serve(0, {"--host-budget", std::to_string(bytes_[0])});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  const pid_t holder =
      HoldLockForever(identity::BudgetLedgerLockPath(DeviceDir(*socket)), ready[1]);
  ASSERT_GT(holder, 0);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);

  auto attach = [&]() -> Result<protocol::Connection> {
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn, protocol::Connection::Connect(*socket, 30s));
    protocol::Hello hello;
    hello.config = ConfigFor(models_[0], "m0").ToJson();
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto hr, conn.SendHello(hello, os::Deadline::After(30s)));
    if (!hr.match) return Status(StatusCode::kInternal, "hello did not match");
    WEIGHTCACHE_RETURN_IF_ERROR(conn.Attach(os::Deadline::After(30s)).status());
    return conn;
  };
  StatusWait one_client;
  one_client.sockets = [&] { return std::vector<std::string>{*socket}; };
  one_client.reached = [](const protocol::StatusReply& r) { return r.clients == 1; };
  one_client.what = "1 client";
  {
    auto first = attach();
    ASSERT_TRUE(first.ok()) << first.status().ToString() << a->Log();
    {
      auto second = attach();
      ASSERT_TRUE(second.ok()) << second.status().ToString() << a->Log();
    }  // the second client detaches
    ASSERT_TRUE(WaitForStatus(a->child(), one_client).ok()) << a->Log();
    {
      auto third = attach();
      ASSERT_TRUE(third.ok()) << third.status().ToString() << a->Log();
    }
    ASSERT_TRUE(WaitForStatus(a->child(), one_client).ok()) << a->Log();

    // The daemon says it could not write (its bounded lock wait ran out).
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (a->Log().find("could not update the budget ledger") == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(50ms);
    }
    EXPECT_NE(a->Log().find("could not update the budget ledger"), std::string::npos) << a->Log();
    EXPECT_NE(a->Log().find(identity::BudgetLedgerLockPath(DeviceDir(*socket))), std::string::npos)
        << a->Log();

    ::kill(holder, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(holder, &status, 0), holder);
    // Once the lock is free, the latest count (the first client, still attached) is written.
    EXPECT_TRUE(WaitLedgerClients(*socket, 1)) << a->Log();
  }
  EXPECT_TRUE(WaitLedgerClients(*socket, 0)) << a->Log();
  a->Signal(SIGTERM);
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(0)) << a->Log();
  EXPECT_TRUE(ReadLedger(DeviceDir(*socket)).entries.empty());
}

// `status` shows the device's budget from its budget.conf and the bytes its ledger holds;
// without a budget.conf, the budget the caches were admitted under (their serve flag).
TEST_F(BudgetTest, StatusShowsTheDevicesBudgetUsedAndFree) {
  auto a = Serve(0, {"--host-budget", "2G"});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  // The one device of `status --json` (null, with the failure recorded, when there is not one).
  auto device = [&] {
    CommandResult st = RunCommand({CliPath(), "status", "--json", "--runtime-dir", runtime_});
    EXPECT_EQ(st.exit_code, 0) << st.err;
    const auto j = nlohmann::json::parse(st.out, nullptr, /*allow_exceptions=*/false);
    const bool one = j.is_object() && j["devices"].size() == 1U;
    EXPECT_TRUE(one) << st.out;
    return one ? j["devices"][0] : nlohmann::json();
  };
  {
    nlohmann::json d = device();  // not const: operator[] of a missing key is then defined
    EXPECT_EQ(d["budget_bytes"], uint64_t{2} << 30) << d;
    EXPECT_EQ(d["budget_source"], "serve flag") << d;
    EXPECT_EQ(d["free_bytes"], (uint64_t{2} << 30) - bytes_[0]) << d;
    CommandResult text = RunCommand({CliPath(), "status", "--runtime-dir", runtime_});
    ASSERT_EQ(text.exit_code, 0) << text.err;
    EXPECT_NE(text.out.find("budget 2.00 GiB (serve flag), used " + daemon::FormatBytes(bytes_[0])),
              std::string::npos)
        << text.out;
  }
  // budget.conf, once written, is the device's budget.
  std::ofstream(identity::BudgetConfigPath(DeviceDir(*socket))) << "host_budget = 1G\n";
  nlohmann::json d = device();
  EXPECT_EQ(d["budget_bytes"], uint64_t{1} << 30) << d;
  EXPECT_EQ(d["budget_source"], "budget.conf") << d;
  EXPECT_EQ(d["used_bytes"], bytes_[0]) << d;
  EXPECT_EQ(d["free_bytes"], (uint64_t{1} << 30) - bytes_[0]) << d;

  // `ls` prints the same budget line per device, after its table.
  const std::string line = "device " + std::string(identity::kHostDeviceKey) +
                           " (namespace default): budget 1.00 GiB, used " +
                           daemon::FormatBytes(bytes_[0]) + ", free " +
                           daemon::FormatBytes((uint64_t{1} << 30) - bytes_[0]);
  CommandResult ls = RunCommand({CliPath(), "ls", "--runtime-dir", runtime_});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_NE(ls.out.find(line), std::string::npos) << ls.out;
  CommandResult text = RunCommand({CliPath(), "status", "--runtime-dir", runtime_});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find(line), std::string::npos) << text.out;
}

// `serve --wait`: a cache that finds no room (every holder pinned) waits, saying so, and gets
// in once a holder stops.
TEST_F(BudgetTest, WaitingCacheGetsInOnceAHolderStops) {
  // a and b fit; b and c fit; all three do not.
  const std::string budget = std::to_string(std::max(bytes_[0] + bytes_[1], bytes_[1] + bytes_[2]));
  auto a = Serve(0, {"--host-budget", budget, "--pin"});
  auto sa = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(sa.ok()) << sa.status().ToString() << a->Log();
  auto b = Serve(1, {"--host-budget", budget, "--pin"});
  auto sb = WaitOtherReady(*b, *sa);
  ASSERT_TRUE(sb.ok()) << sb.status().ToString() << b->Log();
  auto c = Serve(2, {"--host-budget", budget, "--wait=600"});
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (c->Log().find("waiting for room (--wait") == std::string::npos && c->Running() &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_NE(c->Log().find("waiting for room (--wait"), std::string::npos) << c->Log();
  EXPECT_NE(c->Log().find("nothing more can be freed"), std::string::npos) << c->Log();
  a->Signal(SIGTERM);
  ASSERT_EQ(a->WaitExit(30s), std::optional<int>(0)) << a->Log();
  auto sc = WaitOtherReady(*c, std::vector<std::string>{*sa, *sb});
  ASSERT_TRUE(sc.ok()) << sc.status().ToString() << c->Log();
  daemon::Ledger ledger = ReadLedger(DeviceDir(*sc));
  EXPECT_EQ(ledger.entries.size(), 2u);
  EXPECT_EQ(ledger.Find(*sa), nullptr);
  ASSERT_NE(ledger.Find(*sc), nullptr);
  EXPECT_EQ(ledger.Find(*sc)->pid, c->pid());
}

// A --wait that runs out fails as a cache without --wait does: exit 8, the refusal.
TEST_F(BudgetTest, WaitThatRunsOutExits8WithTheRefusal) {
  const std::string budget = std::to_string(bytes_[0] + bytes_[1] - 1);
  auto a = Serve(0, {"--host-budget", budget, "--pin"});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  CommandResult b = ServeRefused(1, {"--host-budget", budget, "--wait=1"});
  EXPECT_EQ(b.exit_code, 8) << b.err;
  EXPECT_NE(b.err.find("nothing more can be freed"), std::string::npos) << b.err;
  EXPECT_NE(b.err.find("(waited 1 s, --wait)"), std::string::npos) << b.err;
}

// `status` is read-only: with a dead cache's entry in the ledger it counts only the live
// ones, and leaves the file as it was, bytes and mtime (the next writer reclaims the entry).
TEST_F(BudgetTest, StatusLeavesTheLedgerUntouchedAndSkipsDeadEntries) {
  auto a = Serve(0, {"--host-budget", "1G"});
  auto socket = WaitForState(*a, runtime_, CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString() << a->Log();
  const std::string dir = DeviceDir(*socket);
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(dead, &status, 0), dead);
  daemon::LedgerEntry ghost;
  ghost.socket = dir + "/gone.sock";
  ghost.pid = dead;
  ghost.pid_start_time = 1;
  ghost.bytes = 12345;
  ghost.tier = Tier::kHost;
  ASSERT_TRUE(daemon::BudgetLedger(dir).Put(ghost).ok());
  const std::string path = identity::BudgetLedgerPath(dir);
  const std::string before = ReadFile(path);
  ASSERT_NE(before.find("gone.sock"), std::string::npos) << before;
  struct stat st_before {};
  ASSERT_EQ(::stat(path.c_str(), &st_before), 0);

  CommandResult st = RunCommand({CliPath(), "status", "--json", "--runtime-dir", runtime_});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  const auto j = nlohmann::json::parse(st.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << st.out;
  ASSERT_EQ(j["devices"].size(), 1U) << st.out;
  EXPECT_EQ(j["devices"][0]["used_bytes"], bytes_[0]) << st.out;  // the dead entry not counted
  CommandResult text = RunCommand({CliPath(), "status", "--runtime-dir", runtime_});
  ASSERT_EQ(text.exit_code, 0) << text.err;

  EXPECT_EQ(ReadFile(path), before);
  struct stat st_after {};
  ASSERT_EQ(::stat(path.c_str(), &st_after), 0);
  EXPECT_EQ(st_after.st_ino, st_before.st_ino);  // not replaced
  EXPECT_EQ(st_after.st_mtim.tv_sec, st_before.st_mtim.tv_sec);
  EXPECT_EQ(st_after.st_mtim.tv_nsec, st_before.st_mtim.tv_nsec);
}

}  // namespace
}  // namespace weightcache::testing
