#include "gpu/gpu_e2e_support.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "cuda/driver_api.h"
#include "cuda/exported_arena.h"
#include "identity/device_inventory.h"
#include "identity/paths.h"
#include "protocol/connection.h"
#include "support/test_env.h"

extern char** environ;

namespace weightcache::testing {
namespace {

using Clock = std::chrono::steady_clock;

GpuSetup Probe() {
  GpuSetup setup;
  Result<const cuda::DriverApi*> api = cuda::LoadDriver();
  if (!api.ok()) {
    setup.skip_reason = "no usable CUDA driver: " + api.status().ToString();
    return setup;
  }
  int count = 0;
  if (CUresult rc = (*api)->cuDeviceGetCount(&count); rc != CUDA_SUCCESS) {
    setup.skip_reason = cuda::DriverError(*api, rc, "cuDeviceGetCount").ToString();
    return setup;
  }
  if (count == 0) {
    setup.skip_reason = "CUDA driver present but no GPU visible";
    return setup;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUuuid raw{};
    if ((*api)->cuDeviceGet(&dev, i) != CUDA_SUCCESS ||
        (*api)->cuDeviceGetUuid(&raw, dev) != CUDA_SUCCESS) {
      setup.skip_reason = "cannot read the UUID of device " + std::to_string(i);
      return setup;
    }
    if (i == 0) {
      // The gpu tier needs VMM with POSIX-fd export; without it every test here would fail
      // for a reason that is not the code's.
      if (Status s = cuda::CheckVmmSupport(*api, dev); !s.ok()) {
        setup.skip_reason = s.ToString();
        return setup;
      }
    }
    setup.uuids.push_back(identity::FormatGpuUuid(raw));
  }
  return setup;
}

std::vector<std::string> MergedEnv(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& kv : overrides) {
    const std::string key = kv.substr(0, kv.find('=') + 1);
    std::erase_if(env, [&](const std::string& s) { return s.rfind(key, 0) == 0; });
    env.push_back(kv);
  }
  return env;
}

}  // namespace

const GpuSetup& ProbeGpus() {
  static const GpuSetup* setup = new GpuSetup(Probe());
  return *setup;
}

std::string ClientHelperPath() { return WEIGHTCACHE_GPU_CLIENT_HELPER; }

Result<TestModel> MakeModel(const std::string& dir, int tensors, int shards, int seed,
                            int max_elems) {
  TestModel model;
  model.dir = dir;
  model.manifest_path = dir + ".manifest.json";
  const CommandResult r =
      RunCommand({PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out", dir,
                  "--tensors", std::to_string(tensors), "--shards", std::to_string(shards),
                  "--seed", std::to_string(seed), "--dtypes", "f32,bf16,f16,i64,u8,f8_e4m3",
                  "--max-elems", std::to_string(max_elems), "--manifest", model.manifest_path});
  if (r.exit_code != 0) {
    return InternalError("make_checkpoint.py exited " + std::to_string(r.exit_code) + ": " + r.err);
  }
  nlohmann::json summary = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  if (summary.is_discarded()) return InternalError("make_checkpoint.py printed " + r.out);
  model.tensor_count = summary["tensors"].get<size_t>();
  model.total_bytes = summary["total_bytes"].get<uint64_t>();
  return model;
}

// ---- Daemon ---------------------------------------------------------------------------------

Result<std::unique_ptr<Daemon>> Daemon::Start(const std::vector<std::string>& serve_args,
                                              const std::vector<std::string>& env_overrides,
                                              const std::string& log) {
  launcher::SpawnOptions o;
  o.argv = {CliPath(), "serve"};
  o.argv.insert(o.argv.end(), serve_args.begin(), serve_args.end());
  // The tests read the daemon's info lines (ctest runs with WEIGHTCACHE_LOG_LEVEL=warn).
  o.env_overrides = env_overrides;
  o.env_overrides.push_back("WEIGHTCACHE_LOG_LEVEL=info");
  o.log_path = log;
  WEIGHTCACHE_ASSIGN_OR_RETURN(launcher::ChildProcess child, launcher::ChildProcess::Spawn(o));
  return std::unique_ptr<Daemon>(new Daemon(std::move(child), log));
}

std::string Daemon::Log() const { return ReadFile(log_); }

Result<std::string> Daemon::WaitReady(const std::string& runtime_dir,
                                      const std::string& namespace_name,
                                      const std::string& device_uuid, protocol::StatusReply* status,
                                      std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no socket under " + runtime_dir + "/" + namespace_name + "/" + device_uuid;
  while (Clock::now() < deadline) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<launcher::ExitInfo> exit, child_.TryReap());
    if (exit.has_value()) {
      return InternalError("serve (pid " + std::to_string(child_.pid()) + ") exited with " +
                           exit->ToString() + " before it was ready; log:\n" + Log());
    }
    for (const std::string& socket : SocketsUnder(runtime_dir, namespace_name, device_uuid)) {
      Result<protocol::StatusReply> st = StatusOf(socket);
      if (!st.ok()) {
        last = socket + ": " + st.status().ToString();
        continue;
      }
      if (st->pid != child_.pid()) continue;  // another test daemon on the same device dir
      last = socket + ": " + std::string(protocol::CacheStateName(st->state));
      if (st->state == protocol::CacheState::kReady) {
        if (status != nullptr) *status = *st;
        return socket;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Status(StatusCode::kTimeout, "daemon pid " + std::to_string(child_.pid()) +
                                          " not ready; last: " + last + "; log:\n" + Log());
}

Status Daemon::Kill9() {
  WEIGHTCACHE_RETURN_IF_ERROR(child_.Signal(SIGKILL));
  WEIGHTCACHE_ASSIGN_OR_RETURN(launcher::ExitInfo exit, child_.Wait());
  if (exit.signal != SIGKILL) return InternalError("daemon ended with " + exit.ToString());
  return Status::Ok();
}

Result<int> Daemon::Terminate(std::chrono::milliseconds timeout) {
  WEIGHTCACHE_RETURN_IF_ERROR(child_.Signal(SIGTERM));
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<launcher::ExitInfo> exit, child_.TryReap());
    if (exit.has_value()) return exit->exited() ? exit->exit_code : 128 + exit->signal;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status(StatusCode::kTimeout, "daemon pid " + std::to_string(child_.pid()) +
                                          " still running after SIGTERM; log:\n" + Log());
}

// ---- PipedChild -----------------------------------------------------------------------------

Result<std::unique_ptr<PipedChild>> PipedChild::Spawn(const std::vector<std::string>& argv,
                                                      const std::vector<std::string>& env_overrides,
                                                      const std::string& stderr_log) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return IoError("pipe2", errno);
  UniqueFd in_read(in[0]), in_write(in[1]);
  if (::pipe2(out, O_CLOEXEC) != 0) return IoError("pipe2", errno);
  UniqueFd out_read(out[0]), out_write(out[1]);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_read.get(), STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_write.get(), STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_log.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0600);
  std::vector<std::string> env = MergedEnv(env_overrides);
  std::vector<std::string> args = argv;
  std::vector<char*> cenv, cargs;
  for (auto& s : env) cenv.push_back(s.data());
  cenv.push_back(nullptr);
  for (auto& s : args) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, cargs[0], &actions, nullptr, cargs.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return IoError("posix_spawn " + argv[0], rc);
  return std::unique_ptr<PipedChild>(
      new PipedChild(pid, std::move(in_write), std::move(out_read), stderr_log));
}

PipedChild::~PipedChild() {
  if (!exit_code_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

Status PipedChild::WriteLine(const std::string& line) {
  if (!stdin_) return InternalError("stdin of pid " + std::to_string(pid_) + " is closed");
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(stdin_.get(), data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("writing to the stdin of pid " + std::to_string(pid_), errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<std::string> PipedChild::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const size_t nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return Status(StatusCode::kTimeout, "no line from pid " + std::to_string(pid_) +
                                              " (partial: \"" + buffered_ + "\"); stderr:\n" +
                                              StderrLog());
    }
    pollfd p{stdout_.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno != EINTR) return IoError("poll", errno);
    if (n <= 0) continue;
    char buf[4096];
    const ssize_t got = ::read(stdout_.get(), buf, sizeof(buf));
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("reading the stdout of pid " + std::to_string(pid_), errno);
    }
    if (got == 0) {
      return Status(StatusCode::kUnavailable, "pid " + std::to_string(pid_) +
                                                  " closed its stdout (partial: \"" + buffered_ +
                                                  "\"); stderr:\n" + StderrLog());
    }
    buffered_.append(buf, static_cast<size_t>(got));
  }
}

Result<nlohmann::json> PipedChild::ReadJson(std::chrono::milliseconds timeout) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string line, ReadLine(timeout));
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return InternalError("pid " + std::to_string(pid_) + " printed a non-JSON line: " + line);
  }
  return j;
}

std::optional<int> PipedChild::Wait(std::chrono::milliseconds timeout) {
  if (exit_code_) return exit_code_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string PipedChild::StderrLog() const { return ReadFile(log_); }

// ---- one-shot commands and sockets ----------------------------------------------------------

JsonRun RunJson(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  CommandResult r = RunCommand(argv, env);
  JsonRun out;
  out.exit_code = r.exit_code;
  out.out = r.out;
  out.err = r.err;
  std::string last;
  size_t start = 0;
  while (start < r.out.size()) {
    size_t end = r.out.find('\n', start);
    if (end == std::string::npos) end = r.out.size();
    if (end > start) last = r.out.substr(start, end - start);
    start = end + 1;
  }
  out.json = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  return out;
}

std::vector<std::string> SocketsUnder(const std::string& runtime_dir,
                                      const std::string& namespace_name,
                                      const std::string& device_uuid) {
  auto sockets = identity::ListCacheSockets(runtime_dir + "/" + namespace_name + "/" + device_uuid);
  return sockets.ok() ? *sockets : std::vector<std::string>{};
}

Result<protocol::StatusReply> StatusOf(const std::string& socket) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn,
                               protocol::Connection::Connect(socket, std::chrono::seconds(2)));
  return conn.QueryStatus(os::Deadline::After(std::chrono::seconds(5)));
}

std::string VisibleDevicesFor(int index) {
  const char* own = std::getenv("CUDA_VISIBLE_DEVICES");
  if (own == nullptr) return std::to_string(index);
  return ProbeGpus().uuids.at(static_cast<size_t>(index));
}

}  // namespace weightcache::testing
