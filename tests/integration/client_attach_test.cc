// The client against real `weightcache serve --tier host` daemons: bytes equal the files'
// (hashed by the Python safetensors reader, not by our reader), 32 concurrent attach
// processes, a mismatch in each CacheConfig field (and as AttachDiagnostics data), fallback
// and on_missing=error, kill -9 of the daemon under attached clients, two daemons on two GPUs
// of an inventory, and the daemon-gone notification.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "client/discovery.h"
#include "integration/daemon_process.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "weightcache/client.h"

extern char** environ;

namespace weightcache::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A child process with its stdin and stdout on pipes (the `attach --hold` client).
class PipedChild {
 public:
  static std::unique_ptr<PipedChild> Start(const std::vector<std::string>& argv,
                                           const std::vector<std::string>& extra_env = {}) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return nullptr;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    std::vector<std::string> args = argv;
    std::vector<char*> cargs;
    for (auto& s : args) cargs.push_back(s.data());
    cargs.push_back(nullptr);
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> cenv;
    for (auto& s : env) cenv.push_back(s.data());
    cenv.push_back(nullptr);
    pid_t pid = -1;
    int rc = ::posix_spawn(&pid, cargs[0], &fa, nullptr, cargs.data(), cenv.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    if (rc != 0) return nullptr;
    auto c = std::unique_ptr<PipedChild>(new PipedChild);
    c->pid_ = pid;
    c->stdin_ = in[1];
    c->stdout_ = out[0];
    return c;
  }
  ~PipedChild() {
    if (stdin_ >= 0) ::close(stdin_);
    ::close(stdout_);
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  void WriteLine(const std::string& line) {
    std::string l = line + "\n";
    ASSERT_EQ(::write(stdin_, l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  // The next line of stdout, or "" at EOF / timeout.
  std::string ReadLine(std::chrono::milliseconds timeout = 20s) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      pollfd p{stdout_, POLLIN, 0};
      if (::poll(&p, 1, 50) > 0) {
        char buf[4096];
        ssize_t n = ::read(stdout_, buf, sizeof(buf));
        if (n <= 0) return "";
        buffer_.append(buf, static_cast<size_t>(n));
      }
    }
    return "";
  }

 private:
  PipedChild() = default;
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string buffer_;
};

class ClientAttachTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 24, 2, 11, "f32,bf16,f16,i64,u8,f8_e4m3",
                                 65536, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    runtime_ = dir_.Join("run");
    // The tests here serve and attach ranks of every size: a sharded job needs its rules (the
    // reference checkpoint has no config.json), and one that replicates every tensor keeps
    // each rank's bytes the reference's. Every daemon and client of the fixture uses it.
    rules_ = dir_.Join("replicate-all.json");
    WriteFile(rules_, R"({"format": 1, "rules": [{"match": ".*", "mode": "replicate"}]})");
  }

  std::vector<std::string> IdentityArgs(std::vector<std::string> extra = {}) const {
    std::vector<std::string> args = {"--model",       ref_.dir, "--model-id",    "tiny",
                                     "--tier",        "host",   "--runtime-dir", runtime_,
                                     "--shard-rules", rules_};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  std::unique_ptr<ServeProcess> Serve(std::vector<std::string> extra = {},
                                      const std::string& log = "serve.log") {
    auto args = IdentityArgs(std::move(extra));
    args.push_back("--threads");
    args.push_back("2");
    auto p = ServeProcess::Start(args, dir_.Join(log));
    EXPECT_NE(p, nullptr);
    return p;
  }
  // Polls Status on a known socket until ready.
  void WaitReady(ServeProcess& serve, const std::string& socket) {
    const auto deadline = Clock::now() + 30s;
    while (Clock::now() < deadline) {
      ASSERT_TRUE(serve.Running()) << serve.Log();
      auto st = QueryStatus(socket);
      if (st.ok() && st->state == protocol::CacheState::kReady) return;
      std::this_thread::sleep_for(10ms);
    }
    FAIL() << "daemon at " << socket << " never became ready; log:\n" << serve.Log();
  }
  AttachOptions Options() const {
    AttachOptions o;
    o.identity.model_dir = ref_.dir;
    o.identity.model_id = "tiny";
    o.identity.runtime_dir = runtime_;
    o.identity.tier = Tier::kHost;
    o.identity.shard_rules = rules_;
    o.wait_timeout = 30s;
    return o;
  }
  // `weightcache attach` with the identity flags, then `extra`; a flag given again in `extra`
  // replaces the earlier value (CLI11 refuses repeated single-value options).
  CommandResult Attach(std::vector<std::string> extra,
                       const std::vector<std::string>& env = {}) const {
    static const std::set<std::string> kSwitches = {"--verify", "--json", "--hold"};
    std::vector<std::pair<std::string, std::optional<std::string>>> flags;
    auto add = [&](const std::vector<std::string>& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::optional<std::string> value;
        if (!kSwitches.contains(tokens[i]) && i + 1 < tokens.size()) value = tokens[++i];
        auto it = std::find_if(flags.begin(), flags.end(), [&](const auto& f) {
          return f.first == tokens[i - (value ? 1 : 0)];
        });
        const std::string& name = tokens[i - (value ? 1 : 0)];
        if (it != flags.end()) {
          it->second = value;
        } else {
          flags.emplace_back(name, value);
        }
      }
    };
    add(IdentityArgs());
    add(extra);
    std::vector<std::string> argv = {CliPath(), "attach"};
    for (const auto& [name, value] : flags) {
      argv.push_back(name);
      if (value) argv.push_back(*value);
    }
    return RunCommand(argv, env);
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  std::string runtime_;
  std::string rules_;  // replicate-all shard rules (SetUp)
};

TEST_F(ClientAttachTest, EveryTensorsBytesEqualTheFileBytesThroughTheCppApi) {
  auto serve = Serve();
  auto socket = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();

  auto a = Attachment::Attach(Options());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->source(), AttachSource::kDaemon) << a->source_reason();
  EXPECT_EQ(a->socket_path(), *socket);
  EXPECT_EQ(a->daemon_pid(), serve->pid());
  EXPECT_EQ(a->device_key(), "host");
  EXPECT_TRUE(a->daemon_alive());
  EXPECT_EQ(CompareWithReference(*a, ref_), "");
  // Strides are contiguous, in elements.
  for (const Tensor& t : a->tensors()) {
    ASSERT_EQ(t.strides.size(), t.shape.size());
    if (!t.shape.empty()) {
      EXPECT_EQ(t.strides.back(), 1) << t.name;
    }
  }
}

// The table of a daemon attach is built on first use: threads that ask for it at once all get
// the one table (built once), with every tensor's bytes equal to the files' (TSan tier too).
TEST_F(ClientAttachTest, TheTableBuiltOnFirstUseIsOneTableForThreadsAskingAtOnce) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, protocol::CacheState::kReady).ok());
  auto a = Attachment::Attach(Options());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->source(), AttachSource::kDaemon) << a->source_reason();
  constexpr int kThreads = 8;
  std::vector<const std::vector<Tensor>*> seen(kThreads, nullptr);
  std::vector<const Tensor*> found(kThreads, nullptr);
  const std::string first_name(ref_.tensors.begin()->first);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        // Half ask through Find, half through tensors(): either builds the table.
        if (i % 2 == 0) found[i] = a->Find(first_name);
        seen[i] = &a->tensors();
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(seen[i], seen[0]) << "thread " << i;
    if (i % 2 == 0) {
      ASSERT_NE(found[i], nullptr) << "thread " << i;
      EXPECT_EQ(found[i], a->Find(first_name)) << "thread " << i;
    }
  }
  EXPECT_EQ(seen[0]->size(), ref_.tensors.size());
  EXPECT_EQ(CompareWithReference(*a, ref_), "");
}

TEST_F(ClientAttachTest, AttachCliVerifiesAndVerifyCommandMatchesTheFiles) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, protocol::CacheState::kReady).ok());

  CommandResult r = Attach({"--verify", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["source"], "daemon");
  EXPECT_EQ(j["daemon_pid"], serve->pid());
  EXPECT_EQ(j["tensors"], 24);
  EXPECT_EQ(j["verify"]["ok"], true) << r.out;
  EXPECT_EQ(j["verify"]["tensors"], 24);
  // Where the attach went: a daemon attach maps and builds its table, it loads nothing; 24
  // tensors is far below the concurrent-table threshold.
  const auto& t = j["timings"];
  EXPECT_GT(t["discover_ms"].get<double>(), 0) << r.out;
  EXPECT_GT(t["map_ms"].get<double>(), 0) << r.out;
  EXPECT_GT(t["table_ms"].get<double>(), 0) << r.out;
  EXPECT_EQ(t["table_concurrent"], false);
  EXPECT_EQ(t["fallback_ms"].get<double>(), 0);
  EXPECT_LE(t["discover_ms"].get<double>() + t["map_ms"].get<double>(),
            j["attach_ms"].get<double>());

  std::vector<std::string> argv = {CliPath(), "verify"};
  auto ids = IdentityArgs({"--json"});
  argv.insert(argv.end(), ids.begin(), ids.end());
  CommandResult v = RunCommand(argv);
  ASSERT_EQ(v.exit_code, 0) << v.out << v.err;
  auto vj = nlohmann::json::parse(v.out);
  EXPECT_EQ(vj["ok"], true);
  EXPECT_EQ(vj["tensors"], 24);
  EXPECT_EQ(vj["daemon_pid"], serve->pid());
}

TEST_F(ClientAttachTest, ThirtyTwoConcurrentAttachProcessesAllSucceed) {
  auto serve = Serve();
  ASSERT_TRUE(WaitForState(*serve, runtime_, protocol::CacheState::kReady).ok());

  constexpr int kClients = 32;
  std::vector<pid_t> pids;
  for (int i = 0; i < kClients; ++i) {
    std::vector<std::string> argv = {CliPath(), "attach"};
    auto ids = IdentityArgs({"--verify", "--json", "--on-missing", "error"});
    argv.insert(argv.end(), ids.begin(), ids.end());
    std::vector<char*> cargs;
    for (auto& s : argv) cargs.push_back(s.data());
    cargs.push_back(nullptr);
    const std::string out = dir_.Join("client" + std::to_string(i) + ".out");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT, 0600);
    posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, (out + ".err").c_str(), O_WRONLY | O_CREAT,
                                     0600);
    pid_t pid = -1;
    ASSERT_EQ(::posix_spawn(&pid, cargs[0], &fa, nullptr, cargs.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  for (int i = 0; i < kClients; ++i) {
    int st = 0;
    ASSERT_EQ(::waitpid(pids[i], &st, 0), pids[i]);
    const std::string out = dir_.Join("client" + std::to_string(i) + ".out");
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0)
        << "client " << i << " status " << st << ": " << ReadFile(out + ".err");
    auto j = nlohmann::json::parse(ReadFile(out));
    EXPECT_EQ(j["source"], "daemon") << i;
    EXPECT_EQ(j["verify"]["ok"], true) << i;
    EXPECT_EQ(j["daemon_pid"], serve->pid()) << i;
  }
}

// Each flag that changes one CacheConfig field, and the field the mismatch must name. The
// daemon serves ranks of size 2 so that every rank can differ on its own.
struct FieldCase {
  std::vector<std::string> flags;
  std::string field;
};

TEST_F(ClientAttachTest, AMismatchInEachConfigFieldExits4NamingThatField) {
  WriteFile(dir_.Join("quant-a.json"), R"({"bits": 8, "group_size": 128})");
  WriteFile(dir_.Join("quant-b.json"), R"({"bits": 8, "group_size": 64})");
  const std::vector<std::string> served = {"--tp-size",
                                           "2",
                                           "--pp-size",
                                           "2",
                                           "--ep-size",
                                           "2",
                                           "--dp-size",
                                           "2",
                                           "--revision",
                                           "r1",
                                           "--quantization",
                                           "fp8",
                                           "--quantization-config",
                                           dir_.Join("quant-a.json")};
  auto serve = Serve(served);
  auto socket = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();
  ASSERT_EQ(Attach(served).exit_code, 0);  // the exact config attaches

  const std::vector<FieldCase> cases = {
      {{"--revision", "r2"}, "revision"},
      {{"--dtype", "BF16"}, "dtype"},
      {{"--quantization", "awq"}, "quantization"},
      {{"--quantization-config", dir_.Join("quant-b.json")}, "quantization_config_sha256"},
      {{"--tp-size", "4"}, "tp_size"},
      // Ranks change together: the served ep 2 of tp 2 puts ep rank r on tp rank r.
      {{"--tp-rank", "1", "--ep-rank", "1"}, "tp_rank"},
      {{"--pp-size", "4"}, "pp_size"},
      {{"--pp-rank", "1"}, "pp_rank"},
      {{"--ep-size", "4"}, "ep_size"},
      {{"--tp-rank", "1", "--ep-rank", "1"}, "ep_rank"},
      {{"--dp-size", "4"}, "dp_size"},
      {{"--layout-tag", "fused-qkv"}, "layout_tag"},
  };
  for (const FieldCase& c : cases) {
    // Served flags first; the case's flag replaces the served value.
    std::vector<std::string> flags = served;
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    CommandResult r = Attach(flags);
    EXPECT_EQ(r.exit_code, 4) << c.field << ": " << r.out << r.err;
    EXPECT_NE(r.err.find(c.field + ": ours="), std::string::npos) << c.field << ": " << r.err;
    EXPECT_NE(r.err.find(*socket), std::string::npos) << c.field << ": " << r.err;

    // on_mismatch=fallback loads from disk instead, and says why.
    flags.insert(flags.end(), {"--on-mismatch", "fallback", "--json"});
    CommandResult f = Attach(flags);
    ASSERT_EQ(f.exit_code, 0) << c.field << ": " << f.err;
    auto j = nlohmann::json::parse(f.out);
    EXPECT_EQ(j["source"], "fallback") << c.field;
    EXPECT_NE(j["reason"].get<std::string>().find("mismatch ignored"), std::string::npos);
  }

  // source: a published identity (docs/publish.md) differs from a loaded one in its source and
  // in the fields it fixes itself; it is named all the same. It has no checkpoint, so
  // on_mismatch=fallback has nothing to load: no daemon (exit 3), saying why.
  {
    std::vector<std::string> published = served;
    published.insert(published.end(), {"--source", "published:sglang"});
    CommandResult r = Attach(published);
    EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
    EXPECT_NE(r.err.find("source: ours=\"published:sglang\" theirs=\"disk\""), std::string::npos)
        << r.err;
    published.insert(published.end(), {"--on-mismatch", "fallback"});
    CommandResult f = Attach(published);
    EXPECT_EQ(f.exit_code, 3) << f.out << f.err;
    EXPECT_NE(f.err.find("has no checkpoint to load from disk"), std::string::npos) << f.err;
  }

  // model_id: a different model is never "the closest cache"; through an explicit socket the
  // daemon itself reports the difference.
  std::vector<std::string> flags = served;
  flags.insert(flags.end(), {"--model-id", "other", "--socket", *socket});
  CommandResult r = Attach(flags);
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  EXPECT_NE(r.err.find("model_id: ours=\"other\""), std::string::npos) << r.err;

  // The C++ API reports the same as a kMismatch status.
  AttachOptions o = Options();
  o.identity.tp_size = 2;
  o.identity.pp_size = 2;
  o.identity.ep_size = 2;
  o.identity.dp_size = 2;
  o.identity.revision = "r1";
  o.identity.quantization = "fp8";
  o.identity.quantization_config = dir_.Join("quant-a.json");
  o.identity.tp_rank = 1;
  o.identity.ep_rank = 1;
  auto a = Attachment::Attach(o);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kMismatch);
  EXPECT_NE(a.status().message().find("tp_rank: ours=1 theirs=0"), std::string::npos)
      << a.status().ToString();
}

// The C++ API hands a mismatch over as data (AttachDiagnostics): each differing field with
// both values, the daemon that holds the other config and its pid, the same values the
// message shows — whether the client found the daemon by the sibling scan or at its own
// (explicit) socket, and also when on_mismatch=fallback ignored it.
TEST_F(ClientAttachTest, AMismatchComesAsDataWithTheDaemonsSocketAndPid) {
  const std::string daemon_revision = R"(r1 "beta", a=b; (c))";
  auto serve = Serve({"--tp-size", "2", "--tp-rank", "1", "--revision", daemon_revision});
  auto socket = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();

  AttachOptions o = Options();
  o.identity.tp_size = 2;
  o.identity.tp_rank = 0;
  o.identity.revision = R"(r2, x="y" theirs=z)";
  auto ours = identity::ResolveIdentity(o.identity);
  ASSERT_TRUE(ours.ok()) << ours.status().ToString();
  ASSERT_NE(ours->paths.socket, *socket);
  const std::vector<ConfigFieldDiff> expected = {{.field = "revision",
                                                  .client_text = R"j("r2, x=\"y\" theirs=z")j",
                                                  .daemon_text = R"j("r1 \"beta\", a=b; (c)")j",
                                                  .client_value = o.identity.revision,
                                                  .daemon_value = daemon_revision},
                                                 {.field = "tp_rank",
                                                  .client_text = "0",
                                                  .daemon_text = "1",
                                                  .client_value = "0",
                                                  .daemon_value = "1"}};
  const std::string daemon = *socket + " (pid " + std::to_string(serve->pid()) + ")";
  const std::string diffs =
      "holds a different config (revision, tp_rank): revision: ours=" + expected[0].client_text +
      " theirs=" + expected[0].daemon_text + "; tp_rank: ours=0 theirs=1";

  // Our exact socket is absent: the sibling scan finds the daemon's.
  AttachDiagnostics why;
  auto a = Attachment::Attach(o, &why);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kMismatch);
  EXPECT_EQ(why.code, StatusCode::kMismatch);
  EXPECT_EQ(why.socket_path, ours->paths.socket);
  EXPECT_EQ(why.device_key, "host");
  ASSERT_TRUE(why.mismatch.has_value());
  EXPECT_EQ(why.mismatch->fields, expected);
  EXPECT_EQ(why.mismatch->daemon_socket, *socket);
  EXPECT_EQ(why.mismatch->daemon_pid, serve->pid());
  EXPECT_EQ(a.status().message(), "no cache of this config at " + ours->paths.socket +
                                      "; the cache of model \"tiny\" on device host at " + daemon +
                                      " " + diffs);

  // At the daemon's own socket (explicit: no scan), the daemon itself.
  AttachOptions at = o;
  at.identity.socket = *socket;
  auto b = Attachment::Attach(at, &why);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(why.code, StatusCode::kMismatch);
  EXPECT_EQ(why.socket_path, *socket);
  ASSERT_TRUE(why.mismatch.has_value());
  EXPECT_EQ(why.mismatch->fields, expected);
  EXPECT_EQ(why.mismatch->daemon_socket, *socket);
  EXPECT_EQ(why.mismatch->daemon_pid, serve->pid());
  EXPECT_EQ(b.status().message(), "daemon at " + daemon + " " + diffs);

  // on_mismatch=fallback: loaded from disk, and what was ignored is still there as data.
  o.on_mismatch = OnMismatch::kFallback;
  auto c = Attachment::Attach(o, &why);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->source(), AttachSource::kFallback);
  EXPECT_EQ(CompareWithReference(*c, ref_), "");
  EXPECT_EQ(why.code, StatusCode::kOk);
  ASSERT_TRUE(why.mismatch.has_value());
  EXPECT_EQ(why.mismatch->fields, expected);
  EXPECT_EQ(why.mismatch->daemon_pid, serve->pid());

  // The daemon's own config attaches; the diagnostics say so and hold no stale mismatch.
  o.identity.revision = daemon_revision;
  o.identity.tp_rank = 1;
  auto d = Attachment::Attach(o, &why);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->source(), AttachSource::kDaemon) << d->source_reason();
  EXPECT_EQ(why.code, StatusCode::kOk);
  EXPECT_EQ(why.socket_path, *socket);
  EXPECT_FALSE(why.mismatch.has_value());
}

TEST_F(ClientAttachTest, NoDaemonFallsBackWithCorrectBytesOrExits3) {
  auto a = Attachment::Attach(Options());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->source(), AttachSource::kFallback);
  EXPECT_EQ(CompareWithReference(*a, ref_), "");

  CommandResult r = Attach({"--on-missing", "error"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("no daemon at"), std::string::npos) << r.err;

  CommandResult f = Attach({"--json", "--verify"});
  ASSERT_EQ(f.exit_code, 0) << f.err;
  auto j = nlohmann::json::parse(f.out);
  EXPECT_EQ(j["source"], "fallback");
  EXPECT_EQ(j["verify"]["ok"], true);
  EXPECT_GT(j["timings"]["fallback_ms"].get<double>(), 0) << f.out;
  EXPECT_EQ(j["timings"]["map_ms"].get<double>(), 0);
}

TEST_F(ClientAttachTest, KillNineLeavesAttachedClientsWorkingAndANewDaemonServes) {
  auto serve = Serve();
  auto socket = WaitForState(*serve, runtime_, protocol::CacheState::kReady);
  ASSERT_TRUE(socket.ok()) << socket.status().ToString();

  // Client 1: a process holding an attachment (the CLI with --hold).
  std::vector<std::string> argv = {CliPath(), "attach"};
  auto ids = IdentityArgs({"--json", "--hold", "--on-missing", "error"});
  argv.insert(argv.end(), ids.begin(), ids.end());
  auto held = PipedChild::Start(argv);
  ASSERT_NE(held, nullptr);
  auto summary = nlohmann::json::parse(held->ReadLine());
  ASSERT_EQ(summary["source"], "daemon");

  // Client 2: this process, through the C++ API, with a daemon-gone callback.
  auto a = Attachment::Attach(Options());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_EQ(a->source(), AttachSource::kDaemon);
  std::mutex mu;
  std::condition_variable cv;
  bool gone = false;
  a->OnDaemonGone([&] {
    std::lock_guard<std::mutex> lock(mu);
    gone = true;
    cv.notify_all();
  });

  serve->Signal(SIGKILL);
  ASSERT_EQ(serve->WaitExit(10s), 128 + SIGKILL);

  {
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, 10s, [&] { return gone; })) << "no daemon-gone callback";
  }
  EXPECT_FALSE(a->daemon_alive());
  EXPECT_EQ(CompareWithReference(*a, ref_), "");  // the mappings outlive the daemon

  EXPECT_EQ(held->ReadLine(), "daemon-gone");
  held->WriteLine("reread");
  EXPECT_EQ(held->ReadLine(), "verify ok alive=0");

  // A new client finds the stale socket and falls back.
  auto b = Attachment::Attach(Options());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->source(), AttachSource::kFallback);
  EXPECT_NE(b->source_reason().find("stale socket " + *socket), std::string::npos)
      << b->source_reason();
  EXPECT_EQ(CompareWithReference(*b, ref_), "");

  // A new daemon removes the stale socket and serves; new clients attach to it.
  auto serve2 = Serve({}, "serve2.log");
  WaitReady(*serve2, *socket);
  auto c = Attachment::Attach(Options());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->source(), AttachSource::kDaemon);
  EXPECT_EQ(c->daemon_pid(), serve2->pid());
  EXPECT_EQ(CompareWithReference(*c, ref_), "");
  // The old attachments still read the old (identical) bytes.
  held->WriteLine("reread");
  EXPECT_EQ(held->ReadLine(), "verify ok alive=0");
}

TEST_F(ClientAttachTest, TwoGpusSameRankEachClientReachesOnlyItsOwnGpusDaemon) {
  const std::string inventory = dir_.Join("inventory.json");
  const std::string gpu0 = "GPU-00000000-1111-2222-3333-444444444444";
  const std::string gpu1 = "GPU-55555555-6666-7777-8888-999999999999";
  WriteFile(inventory, R"([{"index":0,"uuid":")" + gpu0 +
                           R"(","name":"Fake H200","memory_bytes":150000000000},)" +
                           R"({"index":1,"uuid":")" + gpu1 +
                           R"(","name":"Fake H200","memory_bytes":150000000000}])");
  const std::vector<std::string> rank = {"--tp-size",          "2",      "--tp-rank", "0",
                                         "--device-inventory", inventory};
  auto with = [&](std::vector<std::string> a, std::vector<std::string> b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  auto serve0 = Serve(with(rank, {"--device", gpu0}), "serve0.log");
  auto serve1 = Serve(with(rank, {"--device", gpu1}), "serve1.log");

  // Each daemon's socket, as discovery resolves it for each GPU.
  auto socket_for = [&](const std::string& uuid) {
    AttachOptions o = Options();
    o.identity.tp_size = 2;
    o.identity.device = uuid;
    o.identity.device_inventory = inventory;
    auto id = identity::ResolveIdentity(o.identity);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    return id->paths.socket;
  };
  const std::string socket0 = socket_for(gpu0), socket1 = socket_for(gpu1);
  ASSERT_NE(socket0, socket1);
  WaitReady(*serve0, socket0);
  WaitReady(*serve1, socket1);

  // Same rank, same flags, local device 0 — different CUDA_VISIBLE_DEVICES.
  struct Case {
    std::string visible;
    std::string uuid;
    std::string socket;
    pid_t pid;
  };
  for (const Case& c :
       {Case{"0", gpu0, socket0, serve0->pid()}, Case{"1", gpu1, socket1, serve1->pid()},
        Case{gpu1.substr(0, 12), gpu1, socket1, serve1->pid()}}) {
    CommandResult r = Attach(with(rank, {"--device", "0", "--json", "--on-missing", "error"}),
                             {"CUDA_VISIBLE_DEVICES=" + c.visible});
    ASSERT_EQ(r.exit_code, 0) << c.visible << ": " << r.err;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["device"], c.uuid) << c.visible;
    EXPECT_EQ(j["socket"], c.socket) << c.visible;
    EXPECT_EQ(j["daemon_pid"], c.pid) << c.visible;
    EXPECT_EQ(j["source"], "daemon") << c.visible;
  }
  // With GPU 1 hidden, device 1 does not exist: an error naming the visible devices, never a
  // silent fall-through to another GPU's daemon.
  CommandResult hidden =
      Attach(with(rank, {"--device", "1", "--on-missing", "error"}), {"CUDA_VISIBLE_DEVICES=0"});
  EXPECT_NE(hidden.exit_code, 0);
  EXPECT_NE(hidden.err.find(gpu0), std::string::npos) << hidden.err;
}

// The tier is part of the identity: a host-tier daemon with a GPU affinity and a gpu-tier
// daemon of the same model and ranks on that GPU are two caches with two sockets (before,
// the second was refused as "already served"), and a gpu-tier client that finds only the
// host-tier cache is told that exactly the tier differs.
TEST_F(ClientAttachTest, HostAndGpuTierCachesOnOneGpuAreDistinctAndAMismatchNamesTheTier) {
  const std::string inventory = dir_.Join("inventory.json");
  const std::string gpu0 = "GPU-0000abcd-1111-2222-3333-444444444444";
  WriteFile(inventory, R"([{"index":0,"uuid":")" + gpu0 +
                           R"(","name":"Fake H200","memory_bytes":150000000000}])");
  const std::vector<std::string> on_gpu0 = {"--device", gpu0, "--device-inventory", inventory};
  auto host = Serve(on_gpu0, "serve-host.log");
  AttachOptions o = Options();
  o.identity.device = gpu0;
  o.identity.device_inventory = inventory;
  auto host_id = identity::ResolveIdentity(o.identity);
  ASSERT_TRUE(host_id.ok()) << host_id.status().ToString();
  WaitReady(*host, host_id->paths.socket);

  CommandResult r = Attach({"--tier", "gpu", "--device", gpu0, "--device-inventory", inventory,
                            "--on-missing", "error"});
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  EXPECT_NE(r.err.find("(tier): tier: ours=\"gpu\" theirs=\"host\""), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(host_id->paths.socket), std::string::npos) << r.err;

  // A gpu-tier daemon of the same config on the same GPU takes its own lock and socket. Here
  // (no such device to load onto) its load then fails; what matters is that it got past the
  // lock instead of exiting 7.
  std::vector<std::string> gpu_args = {"--model",       ref_.dir, "--model-id",      "tiny",
                                       "--runtime-dir", runtime_, "--threads",       "2",
                                       "--tier",        "gpu",    "--failed-linger", "0"};
  gpu_args.insert(gpu_args.end(), on_gpu0.begin(), on_gpu0.end());
  auto gpu = ServeProcess::Start(gpu_args, dir_.Join("serve-gpu.log"));
  ASSERT_NE(gpu, nullptr);
  std::optional<int> code = gpu->WaitExit(30s);
  ASSERT_TRUE(code.has_value()) << gpu->Log();
  EXPECT_NE(*code, 7) << gpu->Log();
  EXPECT_EQ(gpu->Log().find("already served"), std::string::npos) << gpu->Log();
  o.identity.tier = Tier::kGpu;
  o.identity.shard_rules = "";  // the gpu-tier daemon above is unsharded
  auto gpu_id = identity::ResolveIdentity(o.identity);
  ASSERT_TRUE(gpu_id.ok()) << gpu_id.status().ToString();
  EXPECT_NE(gpu_id->paths.socket, host_id->paths.socket);
  EXPECT_NE(gpu->Log().find(", tier gpu, device " + gpu0), std::string::npos) << gpu->Log();
  EXPECT_NE(gpu->Log().find("socket " + gpu_id->paths.socket), std::string::npos) << gpu->Log();
  EXPECT_TRUE(host->Running()) << host->Log();
}

}  // namespace
}  // namespace weightcache::testing
