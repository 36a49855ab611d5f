#include "bench_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cuda/vmm.h"
#include "identity/device_inventory.h"
#include "protocol/connection.h"

extern char** environ;

namespace weightcache::bench {
namespace {

std::vector<char*> CArgs(std::vector<std::string>& args) {
  std::vector<char*> c;
  c.reserve(args.size() + 1);
  for (auto& s : args) c.push_back(s.data());
  c.push_back(nullptr);
  return c;
}

}  // namespace

int Capture(std::vector<std::string> argv, std::string* out,
            const std::vector<std::string>& extra_env) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipe_fds[1], STDOUT_FILENO);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> cenv = CArgs(env);
  std::vector<char*> cargs = CArgs(argv);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, cargs[0], &fa, nullptr, cargs.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipe_fds[1]);
  if (rc != 0) {
    ::close(pipe_fds[0]);
    return -1;
  }
  char buf[65536];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof(buf))) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    out->append(buf, static_cast<size_t>(n));
  }
  ::close(pipe_fds[0]);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

nlohmann::json CaptureJson(const std::vector<std::string>& argv, int* code) {
  std::string out;
  *code = Capture(argv, &out);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const size_t nl = out.rfind('\n');
  return nlohmann::json::parse(nl == std::string::npos ? out : out.substr(nl + 1), nullptr,
                               /*allow_exceptions=*/false);
}

void EmitRecord(const char* bench, nlohmann::json j) {
  j["bench"] = bench;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

void NoteLine(const char* program, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", program, what.c_str());
  std::fflush(stderr);
}

pid_t SpawnLogged(std::vector<std::string> argv, const std::string& log,
                  const std::vector<std::string>& extra_env) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("WEIGHTCACHE_LOG_LEVEL=", 0) != 0) env.emplace_back(*e);
  }
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> cenv = CArgs(env);
  std::vector<char*> cargs = CArgs(argv);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, cargs[0], &fa, nullptr, cargs.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  return rc == 0 ? pid : -1;
}

void Stop(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 2000; ++i) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

bool WaitThreadGone(pid_t pid, const std::string& name, Clock::duration timeout) {
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    bool running = false;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
      std::string comm = ReadText((task.path() / "comm").string());
      while (!comm.empty() && comm.back() == '\n') comm.pop_back();
      running = running || comm == name;
    }
    if (!running) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::optional<double> LastMatch(const std::string& text, const std::regex& re, int group) {
  std::smatch m;
  std::optional<double> last;
  for (auto it = text.cbegin(); std::regex_search(it, text.cend(), m, re); it = m.suffix().first) {
    last = std::stod(m[group].str());
  }
  return last;
}

ReadyLine ParseReadyLine(const std::string& log_text) {
  ReadyLine r;
  r.gb_per_s =
      LastMatch(log_text, std::regex(R"(ready: .* in ([0-9.eE+-]+) s, ([0-9.eE+-]+) GB/s)"), 2);
  r.seconds = LastMatch(log_text, std::regex(R"(ready: .* in ([0-9.eE+-]+) s, )"), 1);
  return r;
}

Status WaitReady(std::vector<WatchedDaemon>& daemons, std::chrono::milliseconds timeout,
                 std::chrono::milliseconds poll, size_t* failed_index) {
  auto fail = [&](size_t i) {
    if (failed_index != nullptr) *failed_index = i;
    return Status(StatusCode::kUnavailable, daemons[i].last);
  };
  Clock::time_point first = Clock::time_point::max();
  for (const WatchedDaemon& d : daemons) {
    if (!d.ready) first = std::min(first, d.spawned);
  }
  for (;;) {
    size_t waiting = 0;
    for (size_t i = 0; i < daemons.size(); ++i) {
      WatchedDaemon& d = daemons[i];
      if (d.ready) continue;
      int st = 0;
      if (d.pid > 0 && ::waitpid(d.pid, &st, WNOHANG) == d.pid) {
        d.last = "serve exited; log:\n" + ReadText(d.log);
        d.pid = -1;
      }
      if (d.pid <= 0) return fail(i);
      auto conn = protocol::Connection::Connect(d.socket, std::chrono::seconds(1));
      if (conn.ok()) {
        auto s = conn->QueryStatus(os::Deadline::After(std::chrono::seconds(5)));
        if (s.ok() && s->state == protocol::CacheState::kReady) {
          d.ready = *s;
          d.ready_at = Clock::now();
          continue;
        }
        d.last = s.ok() ? std::string(protocol::CacheStateName(s->state)) : s.status().ToString();
        if (s.ok() && s->state == protocol::CacheState::kFailed) return fail(i);
      }
      ++waiting;
    }
    if (waiting == 0) return Status::Ok();
    if (Clock::now() - first >= timeout) {
      for (size_t i = 0; i < daemons.size(); ++i) {
        if (!daemons[i].ready) return fail(i);
      }
    }
    std::this_thread::sleep_for(poll);
  }
}

Result<CUdevice> DeviceOf(const cuda::DriverApi* api, const std::string& uuid) {
  identity::DeviceInfo device;
  device.uuid = uuid;
  WEIGHTCACHE_ASSIGN_OR_RETURN(device.cuda_ordinal, identity::FindCudaOrdinal(api, uuid));
  return identity::CudaDevice(api, device);
}

int ProbeMemMain(const std::string& uuid) {
  auto api = cuda::LoadDriver();
  if (!api.ok()) return 1;
  auto dev = DeviceOf(*api, uuid);
  if (!dev.ok()) return 1;
  auto ctx = cuda::PrimaryContext::Retain(*api, *dev);
  if (!ctx.ok()) return 1;
  size_t free_bytes = 0, total = 0;
  if ((*api)->cuMemGetInfo(&free_bytes, &total) != CUDA_SUCCESS) return 1;
  std::printf("%s\n", nlohmann::json{{"free", free_bytes}, {"total", total}}.dump().c_str());
  return 0;
}

std::optional<DeviceMemory> ProbeDeviceMemory(const std::string& self, const std::string& uuid) {
  int code = 0;
  const nlohmann::json j = CaptureJson({self, "--probe-mem", uuid}, &code);
  if (code != 0 || !j.is_object() || !j.contains("free") || !j.contains("total")) {
    return std::nullopt;
  }
  return DeviceMemory{j["free"].get<uint64_t>(), j["total"].get<uint64_t>()};
}

Result<DeviceMemory> WaitMemoryReturned(const std::string& self, const std::string& uuid,
                                        uint64_t baseline_free, uint64_t slack,
                                        std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  std::optional<DeviceMemory> last;
  do {
    last = ProbeDeviceMemory(self, uuid);
    if (last && last->free + slack >= baseline_free) return *last;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (Clock::now() - start < timeout);
  if (!last) return Status(StatusCode::kTimeout, "the device-memory probe of " + uuid + " failed");
  return Status(StatusCode::kTimeout, "device " + uuid + ": free memory still " +
                                          std::to_string((baseline_free - last->free) >> 20) +
                                          " MiB below the " + std::to_string(baseline_free >> 20) +
                                          " MiB free before, after " +
                                          std::to_string(timeout.count() / 1000) + " s");
}

}  // namespace weightcache::bench
