// The daemon under systemd (docs/keeper.md, "Under systemd"), without systemd: the test plays
// the service manager for real. It binds the AF_UNIX datagram socket NOTIFY_SOCKET names,
// receives the daemon's real READY / STATUS / FDSTORE / FDSTOREREMOVE / STOPPING datagrams
// and the fds that ride on them, keeps those fds as the fd store would, kill -9s the daemon
// and restarts it as systemd does: the stored fds at 3…, LISTEN_FDS, LISTEN_FDNAMES, and
// LISTEN_PID set to the daemon's pid by a small exec helper (listen_pid_exec.cc).
//
// "Without reading the checkpoint" is proved as in keeper_daemon_test: the restarted daemon's
// /proc/PID/io rchar stays below a quarter of the tensor bytes, while the first daemon's (the
// control) is at least the tensor bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "integration/daemon_process.h"
#include "launcher/child_process.h"
#include "os/fd_passing.h"
#include "os/memfd.h"
#include "protocol/connection.h"
#include "support/test_env.h"

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;

constexpr auto kTimeout = std::chrono::milliseconds(20'000);

// One datagram to NOTIFY_SOCKET: its assignments and the fds it carried.
struct Notification {
  std::map<std::string, std::string> vars;
  std::vector<UniqueFd> fds;
  bool Has(const std::string& key) const { return vars.count(key) != 0; }
  std::string Get(const std::string& key) const {
    auto it = vars.find(key);
    return it == vars.end() ? "" : it->second;
  }
};

// The service manager's side: the notify socket and the fd store it keeps.
class FakeServiceManager {
 public:
  explicit FakeServiceManager(std::string path) : path_(std::move(path)) {
    socket_ = UniqueFd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    EXPECT_GE(socket_.get(), 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    EXPECT_LT(path_.size(), sizeof(addr.sun_path));
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(socket_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
  }
  const std::string& path() const { return path_; }

  // The next datagram, or std::nullopt when none comes by `timeout`.
  std::optional<Notification> Next(std::chrono::milliseconds timeout) {
    if (!os::WaitFor(socket_.get(), POLLIN, os::Deadline::After(timeout)).ok()) {
      return std::nullopt;
    }
    std::vector<uint8_t> buffer(65536);
    auto chunk = os::RecvSome(socket_.get(), buffer, os::kMaxFdsPerMessage);
    EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
    if (!chunk.ok() || chunk->would_block) return std::nullopt;
    Notification n;
    std::istringstream lines(std::string(buffer.begin(), buffer.begin() + chunk->bytes));
    for (std::string line; std::getline(lines, line);) {
      const size_t eq = line.find('=');
      if (eq != std::string::npos) n.vars[line.substr(0, eq)] = line.substr(eq + 1);
    }
    n.fds = std::move(chunk->fds);
    return n;
  }

  // Applies datagrams to the fd store until one has `key` (returned), or fails the test.
  std::optional<Notification> Until(const std::string& key,
                                    std::chrono::milliseconds timeout = kTimeout) {
    while (auto n = Next(timeout)) {
      log_.push_back(Describe(*n));
      Apply(*n);
      if (n->Has(key)) return n;
    }
    ADD_FAILURE() << "no " << key << " notification; got:\n" << Log();
    return std::nullopt;
  }

  // What FDSTORE=1 / FDSTOREREMOVE=1 left, as systemd keeps it: name → fds.
  const std::multimap<std::string, UniqueFd>& store() const { return store_; }
  std::string Log() const {
    std::string all;
    for (const auto& l : log_) all += l + "\n";
    return all;
  }
  size_t Count(const std::string& line) const {
    return static_cast<size_t>(std::count(log_.begin(), log_.end(), line));
  }
  void ClearLog() { log_.clear(); }
  // Applies every datagram already queued.
  void Drain() {
    while (auto n = Next(0ms)) {
      log_.push_back(Describe(*n));
      Apply(*n);
    }
  }

 private:
  static std::string Describe(const Notification& n) {
    std::string text;
    for (const auto& [k, v] : n.vars) {
      if (k == "STATUS" || k == "MAINPID") continue;  // free text / pids: checked apart
      text += (text.empty() ? "" : " ") + k + "=" + v;
    }
    if (!n.fds.empty()) text += " fds=" + std::to_string(n.fds.size());
    return text;
  }
  void Apply(Notification& n) {
    if (n.Has("STATUS")) statuses_.push_back(n.Get("STATUS"));
    if (n.Get("FDSTORE") == "1") {
      for (UniqueFd& fd : n.fds) store_.emplace(n.Get("FDNAME"), std::move(fd));
    }
    if (n.Get("FDSTOREREMOVE") == "1") store_.erase(n.Get("FDNAME"));
  }

  std::string path_;
  UniqueFd socket_;
  std::multimap<std::string, UniqueFd> store_;
  std::vector<std::string> log_;
  std::vector<std::string> statuses_;

 public:
  // Every STATUS= seen, in order.
  const std::vector<std::string>& statuses() const { return statuses_; }
};

class SystemdFdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeCheckpoint(dir_.Join("model"), 12, 2, 7, 262144);
    runtime_ = dir_.Join("run");
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    tensor_bytes_ = ckpt->total_bytes();
    manager_ = std::make_unique<FakeServiceManager>(dir_.Join("notify"));
  }
  void TearDown() override { DropAllKeepers(runtime_, kTimeout); }  // the detached daemon's

  // `serve` as the unit starts it, with the fd store's fds passed (a restart) or none.
  std::optional<launcher::ChildProcess> Serve(const std::string& log, bool pass_store) {
    launcher::SpawnOptions spawn;
    spawn.argv = {LISTEN_PID_EXEC, CliPath(), "serve"};
    for (const auto& a : HostServeArgs(model_, runtime_)) spawn.argv.push_back(a);
    spawn.log_path = dir_.Join(log);
    spawn.env_overrides = {"NOTIFY_SOCKET=" + manager_->path(), "WEIGHTCACHE_LOG_LEVEL=info"};
    std::vector<UniqueFd> high;  // the stored fds above any target number: the spawn's dup2
                                 // to 3… must not overwrite a source it has yet to copy
    if (pass_store) {
      std::string names;
      int target = 3;
      for (const auto& [name, fd] : manager_->store()) {
        high.emplace_back(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 512));
        spawn.pass_fds.emplace_back(high.back().get(), target++);
        names += (names.empty() ? "" : ":") + name;
      }
      spawn.env_overrides.push_back("LISTEN_FDS=" + std::to_string(target - 3));
      spawn.env_overrides.push_back("LISTEN_FDNAMES=" + names);
    }
    auto child = launcher::ChildProcess::Spawn(spawn);
    EXPECT_TRUE(child.ok()) << child.status().ToString();
    if (!child.ok()) return std::nullopt;
    return std::move(child).value();
  }

  // Waits for READY=1 from `child`; checks MAINPID.
  bool WaitReady(launcher::ChildProcess& child, const std::string& log) {
    auto ready = manager_->Until("READY");
    if (!ready) {
      ADD_FAILURE() << ReadFile(dir_.Join(log));
      return false;
    }
    EXPECT_EQ(ready->Get("MAINPID"), std::to_string(child.pid()));
    EXPECT_NE(ready->Get("STATUS").find("ready: 12 tensors"), std::string::npos)
        << ready->Get("STATUS");
    // READY=1 goes out before the ready line reaches the log: wait for the line too.
    const auto deadline = std::chrono::steady_clock::now() + kTimeout;
    while (ReadFile(dir_.Join(log)).find("ready: ") == std::string::npos) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "READY=1 but no ready line in " << log << ": " << ReadFile(dir_.Join(log));
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  void Kill(launcher::ChildProcess& child) {
    ASSERT_TRUE(child.Signal(SIGKILL).ok());
    auto exit = child.WaitFor(kTimeout);
    ASSERT_TRUE(exit.ok() && exit->has_value());
    EXPECT_EQ((*exit)->signal, SIGKILL);
  }

  std::string SocketOf() {
    const std::vector<std::string> sockets = FindSockets(runtime_);
    EXPECT_FALSE(sockets.empty());
    return sockets.empty() ? "" : sockets.back();
  }

  // Attaches to `socket` and compares every tensor with the checkpoint's bytes.
  void ExpectEqualBytes(const std::string& socket) {
    auto conn = protocol::Connection::Connect(socket, 2s);
    ASSERT_TRUE(conn.ok()) << conn.status().ToString();
    protocol::Hello hello;
    hello.config = ConfigFor(model_, "tiny").ToJson();
    hello.client_name = "systemd_fd_store_test";
    auto hr = conn->SendHello(hello, os::Deadline::After(5s));
    ASSERT_TRUE(hr.ok() && hr->match);
    auto reply = conn->Attach(os::Deadline::After(5s));
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    std::vector<os::MappedRegion> maps;
    for (size_t i = 0; i < reply->fds.size(); ++i) {
      auto map = os::MapReadOnly(reply->fds[i].get(), reply->manifest.allocation_sizes()[i]);
      ASSERT_TRUE(map.ok()) << map.status().ToString();
      maps.push_back(std::move(map).value());
    }
    auto ckpt = checkpoint::Checkpoint::Open(model_);
    ASSERT_TRUE(ckpt.ok());
    const protocol::Manifest& m = reply->manifest;
    ASSERT_EQ(m.tensor_count(), ckpt->tensors().size());
    for (size_t i = 0; i < m.tensor_count(); ++i) {
      const protocol::TensorEntry e = m.tensor(i);
      const auto* info = ckpt->Find(e.name);
      ASSERT_NE(info, nullptr) << e.name;
      std::vector<uint8_t> expected(info->nbytes);
      ASSERT_TRUE(checkpoint::ReadTensor(*ckpt, *info, expected.data()).ok());
      const auto* mapped = static_cast<const uint8_t*>(maps[e.allocation].data()) + e.offset;
      EXPECT_EQ(std::memcmp(mapped, expected.data(), expected.size()), 0) << e.name;
    }
  }

  // The deposit of a first daemon: wc-deposit, wc-manifest and one wc-alloc-N per allocation,
  // one fd each, all before READY.
  size_t ExpectDeposited() {
    EXPECT_EQ(manager_->Count("FDNAME=wc-deposit FDSTORE=1 fds=1"), 1u) << manager_->Log();
    EXPECT_EQ(manager_->Count("FDNAME=wc-manifest FDSTORE=1 fds=1"), 1u) << manager_->Log();
    EXPECT_EQ(manager_->Count("FDNAME=wc-alloc-0 FDSTORE=1 fds=1"), 1u) << manager_->Log();
    return manager_->store().size();
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_;
  uint64_t tensor_bytes_ = 0;
  std::unique_ptr<FakeServiceManager> manager_;
};

TEST_F(SystemdFdStoreTest, KilledDaemonIsReadoptedFromTheFdStoreWithoutReadingTheCheckpoint) {
  auto first = Serve("first.log", /*pass_store=*/false);
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(WaitReady(*first, "first.log"));
  // STATUS follows the load (`systemctl status`): the loader's last progress says 100%, then
  // READY=1 says ready.
  const std::vector<std::string>& statuses = manager_->statuses();
  ASSERT_GE(statuses.size(), 3u) << manager_->Log();
  EXPECT_EQ(statuses.front().rfind("loading tiny (digest ", 0), 0u) << statuses.front();
  EXPECT_EQ(statuses[statuses.size() - 2].rfind("loading tiny: 100% (", 0), 0u)
      << statuses[statuses.size() - 2];
  EXPECT_EQ(statuses.back().rfind("ready: 12 tensors", 0), 0u) << statuses.back();
  const size_t stored = ExpectDeposited();
  EXPECT_GE(stored, 3u);
  EXPECT_GE(ProcessReadChars(first->pid()), tensor_bytes_);  // the control: it loaded
  // Under a service manager there is no keeper: the fd store keeps the cache.
  EXPECT_NE(ReadFile(dir_.Join("first.log")).find("kept in its fd store"), std::string::npos);
  const std::string socket = SocketOf();
  Kill(*first);

  manager_->ClearLog();
  auto second = Serve("second.log", /*pass_store=*/true);
  ASSERT_TRUE(second.has_value());
  ASSERT_TRUE(WaitReady(*second, "second.log"));
  const std::string log = ReadFile(dir_.Join("second.log"));
  EXPECT_NE(log.find("ready: adopted"), std::string::npos) << log;
  EXPECT_NE(log.find("from the service manager's fd store (loaded by pid " +
                     std::to_string(first->pid()) + ")"),
            std::string::npos)
      << log;
  EXPECT_LT(ProcessReadChars(second->pid()), tensor_bytes_ / 4) << log;
  // Adopted, not re-deposited: the store holds what it held.
  EXPECT_EQ(manager_->Log().find("FDSTORE=1"), std::string::npos) << manager_->Log();
  EXPECT_EQ(manager_->store().size(), stored);
  EXPECT_EQ(SocketOf(), socket);
  ExpectEqualBytes(socket);

  // A deliberate stop empties the fd store: STOPPING=1, then FDSTOREREMOVE=1 for every name.
  manager_->ClearLog();
  const CommandResult stop = RunCommand({CliPath(), "stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
  auto exit = second->WaitFor(kTimeout);
  ASSERT_TRUE(exit.ok() && exit->has_value());
  EXPECT_EQ((*exit)->exit_code, 0) << (*exit)->ToString();
  manager_->Drain();  // it exited: every datagram it sent is queued
  EXPECT_EQ(manager_->Count("STOPPING=1"), 1u) << manager_->Log();
  EXPECT_EQ(manager_->Count("FDNAME=wc-deposit FDSTOREREMOVE=1"), 1u) << manager_->Log();
  EXPECT_EQ(manager_->Count("FDNAME=wc-manifest FDSTOREREMOVE=1"), 1u) << manager_->Log();
  EXPECT_EQ(manager_->Count("FDNAME=wc-alloc-0 FDSTOREREMOVE=1"), 1u) << manager_->Log();
  EXPECT_TRUE(manager_->store().empty()) << manager_->Log();
}

TEST_F(SystemdFdStoreTest, AChangedCheckpointIsNotAdoptedTheStoreIsEmptiedAndTheCacheLoaded) {
  auto first = Serve("first.log", /*pass_store=*/false);
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(WaitReady(*first, "first.log"));
  ExpectDeposited();
  Kill(*first);
  const std::string old_socket = SocketOf();
  ASSERT_EQ(::unlink(old_socket.c_str()), 0);            // leave the new daemon's socket alone
  MakeCheckpoint(dir_.Join("model"), 12, 2, 8, 262144);  // other bytes, same names
  auto changed = checkpoint::Checkpoint::Open(model_);
  ASSERT_TRUE(changed.ok()) << changed.status().ToString();
  tensor_bytes_ = changed->total_bytes();

  manager_->ClearLog();
  auto second = Serve("second.log", /*pass_store=*/true);
  ASSERT_TRUE(second.has_value());
  ASSERT_TRUE(WaitReady(*second, "second.log"));
  const std::string log = ReadFile(dir_.Join("second.log"));
  // Refused with the reason, removed from the store, then loaded and deposited anew.
  EXPECT_NE(log.find("not adopting the cache from the service manager's fd store"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("this daemon serves " + ConfigFor(model_, "tiny").Digest()), std::string::npos)
      << log;
  EXPECT_EQ(log.find("ready: adopted"), std::string::npos) << log;
  EXPECT_GE(ProcessReadChars(second->pid()), tensor_bytes_) << log;
  EXPECT_EQ(manager_->Count("FDNAME=wc-deposit FDSTOREREMOVE=1"), 1u) << manager_->Log();
  EXPECT_EQ(manager_->Count("FDNAME=wc-manifest FDSTOREREMOVE=1"), 1u) << manager_->Log();
  EXPECT_EQ(manager_->Count("FDNAME=wc-alloc-0 FDSTOREREMOVE=1"), 1u) << manager_->Log();
  ExpectDeposited();
  // The store holds the new deposit only: one fd per name.
  EXPECT_EQ(manager_->store().count("wc-deposit"), 1u);
  EXPECT_EQ(manager_->store().count("wc-manifest"), 1u);
  const std::string socket = SocketOf();
  EXPECT_NE(socket, old_socket);
  ExpectEqualBytes(socket);
}

TEST_F(SystemdFdStoreTest, LauncherChildrenGetAnEmptyNotifySocketAndNeverNotify) {
  // `serve --detach` starts its daemon through the launcher: under a service manager, the
  // daemon must not speak for the unit (no READY=1, no FDSTORE=1): it sees an empty
  // NOTIFY_SOCKET and keeps its cache with a keeper.
  std::vector<std::string> args = {CliPath(), "serve"};
  for (const auto& a : HostServeArgs(model_, runtime_)) args.push_back(a);
  args.emplace_back("--detach");
  args.emplace_back("--json");
  const CommandResult r = RunCommand(args, {"NOTIFY_SOCKET=" + manager_->path()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto out = nlohmann::json::parse(r.out);
  ASSERT_EQ(out["daemons"].size(), 1u) << r.out;
  const pid_t pid = out["daemons"][0]["pid"];
  const std::string socket = out["daemons"][0]["socket"];
  EXPECT_EQ(out["daemons"][0]["state"], "ready") << r.out;

  const std::string environ = ReadFile("/proc/" + std::to_string(pid) + "/environ");
  std::vector<std::string> notify_entries;
  for (size_t at = 0; at < environ.size();) {
    const size_t end = environ.find('\0', at);
    const std::string entry = environ.substr(at, end - at);
    if (entry.rfind("NOTIFY_SOCKET=", 0) == 0) notify_entries.push_back(entry);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  EXPECT_EQ(notify_entries, std::vector<std::string>{"NOTIFY_SOCKET="}) << environ;
  manager_->Drain();  // ready: a deposit or READY=1 would be queued by now
  EXPECT_EQ(manager_->Log().find("FDSTORE"), std::string::npos) << manager_->Log();
  EXPECT_EQ(manager_->Log().find("READY"), std::string::npos) << manager_->Log();

  const CommandResult stop = RunCommand({CliPath(), "stop", "--socket", socket});
  EXPECT_EQ(stop.exit_code, 0) << stop.err;
}

}  // namespace
}  // namespace weightcache::testing
