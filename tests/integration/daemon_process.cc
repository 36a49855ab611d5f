#include "integration/daemon_process.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "client/discovery.h"
#include "identity/paths.h"
#include "keeper/keeper_client.h"
#include "protocol/frame.h"
#include "protocol/wire.h"
#include "support/test_env.h"

namespace weightcache::testing {

using Clock = std::chrono::steady_clock;

std::unique_ptr<ServeProcess> ServeProcess::Start(const std::vector<std::string>& args,
                                                  const std::string& log_path) {
  Result<TestChild> child = SpawnServe(args, {}, log_path);
  if (!child.ok()) {
    ADD_FAILURE() << "serve did not start: " << child.status().ToString();
    return nullptr;
  }
  return std::unique_ptr<ServeProcess>(new ServeProcess(std::move(child).value()));
}

void ServeProcess::Signal(int signo) {
  const Status sent = child_.Signal(signo);
  EXPECT_TRUE(sent.ok()) << sent.ToString();
}

std::string FakeGpuUuid(int index) {
  char uuid[64];
  std::snprintf(uuid, sizeof(uuid), "GPU-00000000-0000-0000-0000-%012d", index);
  return uuid;
}

std::string WriteFakeInventory(const std::string& path, int gpus) {
  nlohmann::json inventory = nlohmann::json::array();
  for (int i = 0; i < gpus; ++i) {
    inventory.push_back({{"index", i},
                         {"uuid", FakeGpuUuid(i)},
                         {"name", "Fake H200"},
                         {"memory_bytes", 150'000'000'000ULL}});
  }
  std::ofstream(path) << inventory.dump();
  return path;
}

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
  options.identity.model_dir = model_dir;
  options.identity.model_id = model_id;
  options.identity.tier = Tier::kHost;
  auto id = identity::ResolveIdentity(options.identity);
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

Result<std::string> WaitForState(ServeProcess& process, const std::string& runtime_dir,
                                 std::optional<protocol::CacheState> state,
                                 std::chrono::milliseconds timeout,
                                 const std::string& namespace_name) {
  StatusWait wait;
  wait.sockets = [&] {
    std::vector<std::string> sockets = FindSockets(runtime_dir, namespace_name);
    if (sockets.size() != 1) sockets.clear();  // wait until exactly one socket exists
    return sockets;
  };
  wait.reached = [&](const protocol::StatusReply& st) {
    return state ? st.state == *state : st.state != protocol::CacheState::kLoading;
  };
  wait.what = state ? "state " + std::string(protocol::CacheStateName(*state))
                    : std::string("a state past loading");
  wait.timeout = timeout;
  WEIGHTCACHE_ASSIGN_OR_RETURN(FoundStatus found, WaitForStatus(process.child(), wait));
  return found.socket;
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

std::vector<std::string> HostServeArgs(const std::string& model_dir, const std::string& runtime_dir,
                                       std::vector<std::string> extra) {
  std::vector<std::string> args = {"--model", model_dir,       "--model-id", "tiny",      "--tier",
                                   "host",    "--runtime-dir", runtime_dir,  "--threads", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

void DropAllKeepers(const std::string& runtime_dir, std::chrono::milliseconds timeout) {
  auto keepers = identity::ListAllKeeperSockets(runtime_dir);
  if (!keepers.ok()) return;
  for (const auto& k : *keepers) {
    (void)keeper::DropKeeper({k.socket, identity::LockPathFor(k.socket)}, timeout);
  }
}

}  // namespace weightcache::testing
