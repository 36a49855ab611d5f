#include "integration/daemon_process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "client/discovery.h"
#include "identity/paths.h"
#include "protocol/connection.h"
#include "protocol/frame.h"
#include "protocol/wire.h"
#include "support/test_env.h"

extern char** environ;

namespace weightcache::testing {

using Clock = std::chrono::steady_clock;

std::unique_ptr<ServeProcess> ServeProcess::Start(const std::vector<std::string>& args,
                                                  const std::string& log_path) {
  std::vector<std::string> argv = {CliPath(), "serve"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargs;
  for (auto& s : argv) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  // The tests read the daemon's info lines (ctest runs with WEIGHTCACHE_LOG_LEVEL=warn).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "WEIGHTCACHE_LOG_LEVEL=", 22) != 0) env.emplace_back(*e);
  }
  env.emplace_back("WEIGHTCACHE_LOG_LEVEL=info");
  std::vector<char*> cenv;
  for (auto& s : env) cenv.push_back(s.data());
  cenv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, cargs[0], &actions, nullptr, cargs.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return nullptr;
  return std::unique_ptr<ServeProcess>(new ServeProcess(pid, log_path));
}

ServeProcess::~ServeProcess() {
  if (!exit_code_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

bool ServeProcess::Running() { return !WaitExit(std::chrono::milliseconds(0)).has_value(); }

void ServeProcess::Signal(int signo) const { ::kill(pid_, signo); }

std::optional<int> ServeProcess::WaitExit(std::chrono::milliseconds timeout) {
  if (exit_code_) return exit_code_;
  const auto deadline = Clock::now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string ServeProcess::Log() const { return ReadFile(log_path_); }

std::string MakeCheckpoint(const std::string& dir, int tensors, int shards, int seed,
                           int max_elems) {
  const CommandResult r = RunCommand(
      {PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out", dir, "--tensors",
       std::to_string(tensors), "--shards", std::to_string(shards), "--seed", std::to_string(seed),
       "--dtypes", "f32,bf16,f16,i64,u8,f8_e4m3", "--max-elems", std::to_string(max_elems)});
  if (r.exit_code != 0) {
    ADD_FAILURE() << "make_checkpoint.py failed: " << r.err;
  }
  return dir;
}

identity::CacheConfig ConfigFor(const std::string& model_dir, const std::string& model_id) {
  AttachOptions options;
  options.model_dir = model_dir;
  options.model_id = model_id;
  options.tier = Tier::kHost;
  auto id = client::ResolveIdentity(options);
  if (!id.ok()) {
    ADD_FAILURE() << id.status().ToString();
    return {};
  }
  return id->config;
}

std::vector<std::string> FindSockets(const std::string& runtime_dir,
                                     const std::string& namespace_name) {
  std::vector<std::string> out;
  auto entries = identity::ListAllCacheSockets(runtime_dir);
  if (!entries.ok()) return out;
  for (const auto& e : *entries) {
    if (namespace_name.empty() || e.namespace_name == namespace_name) out.push_back(e.socket);
  }
  return out;
}

Result<protocol::StatusReply> QueryStatus(const std::string& socket) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto conn,
                               protocol::Connection::Connect(socket, std::chrono::seconds(2)));
  return conn.QueryStatus(os::Deadline::After(std::chrono::seconds(5)));
}

Result<std::string> WaitForState(ServeProcess& process, const std::string& runtime_dir,
                                 std::optional<protocol::CacheState> state,
                                 std::chrono::milliseconds timeout,
                                 const std::string& namespace_name) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no socket yet";
  while (Clock::now() < deadline) {
    if (!process.Running()) {
      return InternalError("serve exited with " + std::to_string(*process.WaitExit({})) +
                           " before the state was reached; log:\n" + process.Log());
    }
    auto sockets = FindSockets(runtime_dir, namespace_name);
    if (sockets.size() == 1) {
      auto st = QueryStatus(sockets[0]);
      if (st.ok()) {
        last = std::string(protocol::CacheStateName(st->state));
        const bool reached =
            state ? st->state == *state : st->state != protocol::CacheState::kLoading;
        if (reached) return sockets[0];
      } else {
        last = st.status().ToString();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status(StatusCode::kTimeout,
                "state not reached; last: " + last + "; log:\n" + process.Log());
}

Result<int> ConnectRaw(const std::string& socket) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError("socket", errno);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("connect " + socket, err);
  }
  return fd;
}

std::string ReadUntilEof(int fd, std::chrono::milliseconds timeout, bool* eof) {
  std::string out;
  *eof = false;
  const auto deadline = Clock::now() + timeout;
  char buf[4096];
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return out;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) {
      *eof = true;
      return out;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      *eof = true;  // ECONNRESET: the daemon closed with unread bytes of ours
      return out;
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

std::vector<uint8_t> RawHeader(uint16_t version, uint16_t type, uint32_t flags, uint32_t fds,
                               uint64_t payload_length, const char* magic) {
  std::vector<uint8_t> out(magic, magic + 4);
  protocol::wire::PutU16(out, version);
  protocol::wire::PutU16(out, type);
  protocol::wire::PutU32(out, flags);
  protocol::wire::PutU32(out, fds);
  protocol::wire::PutU64(out, payload_length);
  return out;
}

Result<protocol::ErrorReply> DecodeErrorFrame(const std::string& bytes) {
  std::span<const uint8_t> data(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  if (data.size() < protocol::kFrameHeaderSize) {
    return ProtocolError("only " + std::to_string(data.size()) + " bytes received");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(auto header,
                               protocol::DecodeFrameHeader(data, protocol::Expect::kReply));
  if (header.type != protocol::MessageType::kError) {
    return ProtocolError("expected an Error frame, got " + protocol::MessageTypeName(header.type));
  }
  if (data.size() < protocol::kFrameHeaderSize + header.payload_length) {
    return ProtocolError("truncated Error frame");
  }
  return protocol::DecodeError(data.subspan(protocol::kFrameHeaderSize, header.payload_length));
}

}  // namespace weightcache::testing
