#include "client/discovery.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "cuda/driver_api.h"
#include "identity/read_file.h"
#include "os/fd_passing.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "protocol/frame.h"

namespace weightcache::client {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxQuantizationConfigBytes = 1 << 20;
constexpr std::chrono::milliseconds kLoadingPollInterval{50};

Result<uint32_t> Rank(std::string_view field, int value) {
  if (value < 0) {
    return InvalidArgument(std::string(field) + " must not be negative (got " +
                           std::to_string(value) + ")");
  }
  return static_cast<uint32_t>(value);
}

std::string BaseName(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The device an unqualified gpu-tier attach means: the calling thread's current CUDA device
// (what torch.cuda.set_device / cudaSetDevice selected), else visible index 0. Never a rank.
std::string DefaultGpuSpec() {
  auto api = cuda::LoadDriver();
  if (!api.ok()) return "0";
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  if ((*api)->cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != nullptr &&
      (*api)->cuCtxGetDevice(&dev) == CUDA_SUCCESS) {
    return std::to_string(dev);
  }
  return "0";
}

// The lock that guards a socket path: <stem>.lock for layout paths, <socket>.lock for an
// explicit socket (identity/paths.h).
std::string SiblingLockPath(const std::string& socket) {
  constexpr std::string_view kSuffix = ".sock";
  if (socket.size() > kSuffix.size() && socket.ends_with(kSuffix)) {
    return socket.substr(0, socket.size() - kSuffix.size()) + ".lock";
  }
  return socket + ".lock";
}

Status ErrorFromDaemon(const protocol::Frame& frame, const std::string& socket) {
  auto err = protocol::DecodeError(frame.payload);
  if (!err.ok()) return err.status().Context("daemon at " + socket);
  return Status(err->code, "daemon at " + socket + ": " + err->message);
}

// The next reply, of `expected` type (an Error frame becomes its Status).
Result<protocol::Frame> ReadReply(int fd, protocol::MessageType expected, os::Deadline deadline,
                                  const std::string& socket) {
  auto frame = protocol::ReadFrame(fd, protocol::Expect::kReply, deadline);
  if (!frame.ok()) return frame.status().Context("reading the reply of daemon at " + socket);
  if (frame->type == protocol::MessageType::kError) return ErrorFromDaemon(*frame, socket);
  if (frame->type != expected) {
    return ProtocolError("daemon at " + socket + " answered " +
                         protocol::MessageTypeName(frame->type) + " where " +
                         protocol::MessageTypeName(expected) + " was expected");
  }
  return std::move(frame).value();
}

// One request, one reply of `expected` type.
Result<protocol::Frame> Exchange(int fd, const std::vector<uint8_t>& request,
                                 protocol::MessageType expected, os::Deadline deadline,
                                 const std::string& socket) {
  Status sent = protocol::WriteFrame(fd, request, {}, deadline);
  if (!sent.ok()) return sent.Context("sending to daemon at " + socket);
  return ReadReply(fd, expected, deadline, socket);
}

// Whether the probe sends Attach right behind Hello, in the same sendmsg (docs/protocol.md
// §1): saves a round trip on the attach path. The daemon answers Hello first, then the Attach
// (an AttachReply only after a matching Hello on a ready cache; otherwise an Error that
// leaves the connection usable), so the client reads the HelloReply, decides, and then reads
// or drops the Attach's reply.
enum class Pipeline { kHelloOnly, kHelloThenAttach };

enum class SocketState { kAbsent, kStale, kLive };

struct Probe {
  SocketState state = SocketState::kAbsent;
  std::string why;  // for absent / stale
  UniqueFd connection;
  int64_t pid = 0;
  protocol::HelloReply hello;
  bool attach_pending = false;  // an Attach was sent behind the Hello; its reply is unread
};

// lstat → lock → connect → peer credentials → Hello. Errors are the SPEC §4 "error" rows.
Result<Probe> ProbeSocket(const std::string& socket, const std::string& lock,
                          const identity::CacheConfig& config, const DiscoveryPolicy& policy,
                          Pipeline pipeline) {
  Probe probe;
  struct stat st;
  if (::lstat(socket.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      probe.why = "no daemon at " + socket;
      return probe;
    }
    return IoError("lstat " + socket, errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return Status(StatusCode::kIo, socket + " exists but is not a socket; refusing to use it");
  }
  if (st.st_uid != ::geteuid()) {
    return PermissionDenied("socket " + socket + " is owned by uid " + std::to_string(st.st_uid) +
                            ", not by us (uid " + std::to_string(::geteuid()) + ")");
  }
  // An explicit socket's own lock is <socket>.lock, but an explicit --socket may also name a
  // layout path, whose daemon holds <stem>.lock: the socket is live if either is held.
  const std::string layout_lock = SiblingLockPath(socket);
  if (!os::IsLockHeld(lock) && (layout_lock == lock || !os::IsLockHeld(layout_lock))) {
    probe.state = SocketState::kStale;
    probe.why = "stale socket " + socket + " (its lock " + lock + " is not held)";
    return probe;
  }
  auto conn = os::ConnectUnix(socket, policy.exchange_timeout);
  if (!conn.ok()) {
    if (conn.status().code() == StatusCode::kNotFound) {
      probe.why = "no daemon at " + socket + " (it went away)";
      return probe;
    }
    if (conn.status().sys_errno() == ECONNREFUSED) {
      probe.state = SocketState::kStale;
      probe.why = "nobody listens at " + socket;
      return probe;
    }
    return conn.status().Context("connecting to " + socket);
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::PeerCred cred, os::PeerCredentials(conn->get()));
  if (cred.uid != ::geteuid()) {
    return PermissionDenied("daemon at " + socket + " (pid " + std::to_string(cred.pid) +
                            ") runs as uid " + std::to_string(cred.uid) + ", not as us (uid " +
                            std::to_string(::geteuid()) + ")");
  }
  protocol::Hello hello;
  hello.config = config.ToJson();
  hello.client_pid = ::getpid();
  hello.client_name = policy.client_name;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodeHello(hello));
  if (pipeline == Pipeline::kHelloThenAttach) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> attach, protocol::EncodeAttachRequest());
    request.insert(request.end(), attach.begin(), attach.end());
  }
  auto deadline = os::Deadline::After(policy.exchange_timeout);
  // Both frames in one sendmsg (neither carries fds).
  Status sent = os::SendMessage(conn->get(), request, {}, deadline);
  if (!sent.ok()) return sent.Context("sending to daemon at " + socket);
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      protocol::Frame frame,
      ReadReply(conn->get(), protocol::MessageType::kHelloReply, deadline, socket));
  probe.attach_pending = pipeline == Pipeline::kHelloThenAttach;
  WEIGHTCACHE_ASSIGN_OR_RETURN(probe.hello, protocol::DecodeHelloReply(frame.payload));
  probe.state = SocketState::kLive;
  probe.connection = std::move(conn).value();
  probe.pid = cred.pid;
  return probe;
}

// Our own diff when the daemon's config parses (we trust our Diff over the peer's list),
// else the peer's list.
std::vector<identity::FieldDiff> Differences(const identity::CacheConfig& ours,
                                             const protocol::HelloReply& reply) {
  auto theirs = identity::CacheConfig::FromJson(reply.daemon_config);
  if (theirs.ok()) {
    auto diffs = identity::Diff(ours, *theirs);
    if (!diffs.empty()) return diffs;
  }
  std::vector<identity::FieldDiff> diffs;
  for (const auto& d : reply.differences) diffs.push_back({d.field, d.client, d.daemon});
  return diffs;
}

// A daemon that holds a different config: who to name in the message, and the details.
struct Mismatch {
  std::string where;
  MismatchDetails details;
};

Mismatch MakeMismatch(std::string where, const std::vector<identity::FieldDiff>& diffs,
                      const std::string& socket, int64_t pid) {
  Mismatch m{std::move(where), {}};
  m.details.fields.reserve(diffs.size());
  for (const auto& d : diffs) m.details.fields.push_back(ToConfigFieldDiff(d));
  m.details.daemon_socket = socket;
  m.details.daemon_pid = static_cast<int>(pid);
  return m;
}

Status Report(Mismatch mismatch, MismatchDetails* out) {
  Status status = MismatchStatus(mismatch.where, mismatch.details);
  if (out != nullptr) *out = std::move(mismatch.details);
  return status;
}

// Looks for another live cache of the same model under our device key (SPEC §4: keep the
// explicit mismatch although different configs have different paths).
std::optional<Mismatch> FindClosestSibling(const ResolvedIdentity& id,
                                           const DiscoveryPolicy& policy) {
  auto sockets = identity::ListCacheSockets(id.paths.device_dir);
  if (!sockets.ok()) {
    LOG_DEBUG << "listing " << id.paths.device_dir << ": " << sockets.status().ToString();
    return std::nullopt;
  }
  DiscoveryPolicy sibling_policy = policy;
  sibling_policy.exchange_timeout =
      std::min(policy.exchange_timeout, std::chrono::milliseconds(2000));
  std::optional<Mismatch> best;
  size_t best_count = SIZE_MAX;
  for (const std::string& socket : *sockets) {
    if (socket == id.paths.socket) continue;
    auto probe = ProbeSocket(socket, SiblingLockPath(socket), id.config, sibling_policy,
                             Pipeline::kHelloOnly);
    if (!probe.ok()) {
      LOG_DEBUG << "skipping " << socket << ": " << probe.status().ToString();
      continue;
    }
    if (probe->state != SocketState::kLive || probe->hello.match) continue;
    auto model = probe->hello.daemon_config.find("model_id");
    if (model == probe->hello.daemon_config.end() || !model->is_string() ||
        model->get<std::string>() != id.config.model_id) {
      continue;
    }
    auto diffs = Differences(id.config, probe->hello);
    if (diffs.empty() || diffs.size() >= best_count) continue;
    best_count = diffs.size();
    best = MakeMismatch("no cache of this config at " + id.paths.socket + "; the cache of " +
                            "model \"" + id.config.model_id + "\" on device " + id.device_key +
                            " at " + socket + " (pid " + std::to_string(probe->pid) + ")",
                        diffs, socket, probe->pid);
  }
  return best;
}

Result<Discovery> Missing(std::string why, bool timed_out = false) {
  Discovery d;
  d.missing_reason = std::move(why);
  d.timed_out = timed_out;
  return d;
}

}  // namespace

ConfigFieldDiff ToConfigFieldDiff(const identity::FieldDiff& diff) {
  const auto decode = [](const std::string& text) {
    if (text.empty() || text.front() != '"') return text;
    auto parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    return parsed.is_string() ? parsed.get<std::string>() : text;
  };
  return ConfigFieldDiff{.field = diff.field,
                         .client_text = diff.ours,
                         .daemon_text = diff.theirs,
                         .client_value = decode(diff.ours),
                         .daemon_value = decode(diff.theirs)};
}

Status MismatchStatus(const std::string& where, const MismatchDetails& details) {
  std::string names;
  std::vector<identity::FieldDiff> diffs;
  diffs.reserve(details.fields.size());
  for (const ConfigFieldDiff& f : details.fields) {
    names += (names.empty() ? "" : ", ") + f.field;
    diffs.push_back({f.field, f.client_text, f.daemon_text});
  }
  return Status(StatusCode::kMismatch, where + " holds a different config (" + names +
                                           "): " + identity::FormatDiffOneLine(diffs));
}

Result<identity::CacheConfig> BuildCacheConfig(const AttachOptions& options,
                                               const std::string& fingerprint,
                                               const std::string& files_digest) {
  identity::CacheConfig c;
  c.model_id = options.model_id.empty() ? BaseName(options.model_dir) : options.model_id;
  if (c.model_id.empty()) {
    return InvalidArgument("no model id: set model_id or model_dir");
  }
  c.revision = options.revision;
  c.checkpoint_fingerprint = fingerprint;
  c.checkpoint_files = files_digest;
  if (!options.dtype.empty()) c.dtype = options.dtype;
  if (!options.quantization.empty()) c.quantization = options.quantization;
  if (!options.quantization_config.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        std::string text,
        identity::ReadSmallFile(options.quantization_config, kMaxQuantizationConfigBytes));
    auto digest = identity::QuantizationConfigDigest(text);
    if (!digest.ok()) return digest.status().Context(options.quantization_config);
    c.quantization_config_sha256 = *digest;
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.tp_size, Rank("tp_size", options.tp_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.tp_rank, Rank("tp_rank", options.tp_rank));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.pp_size, Rank("pp_size", options.pp_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.pp_rank, Rank("pp_rank", options.pp_rank));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.ep_size, Rank("ep_size", options.ep_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.ep_rank, Rank("ep_rank", options.ep_rank));
  WEIGHTCACHE_ASSIGN_OR_RETURN(c.dp_size, Rank("dp_size", options.dp_size));
  if (!options.layout_tag.empty()) c.layout_tag = options.layout_tag;
  if (!options.source.empty()) c.source = options.source;
  c.tier = std::string(TierName(options.tier));
  WEIGHTCACHE_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ResolvedIdentity> ResolveIdentity(const AttachOptions& options,
                                         const identity::EnvLookup& env) {
  if (options.model_dir.empty()) {
    return InvalidArgument(
        "model_dir is required (its files define the checkpoint fingerprint and identity)");
  }
  // The identity covers the files' content through their stat identity (checkpoint_files),
  // never through the path this process sees them by; headers are read only when the
  // fingerprint is not given.
  std::string fingerprint = options.checkpoint_fingerprint;
  std::string files_digest;
  if (fingerprint.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt,
                                 checkpoint::Checkpoint::Open(options.model_dir));
    fingerprint = ckpt.fingerprint();
    files_digest = ckpt.files_digest();
  } else {
    WEIGHTCACHE_ASSIGN_OR_RETURN(files_digest,
                                 checkpoint::CheckpointFilesDigest(options.model_dir));
  }
  ResolvedIdentity id;
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.config, BuildCacheConfig(options, fingerprint, files_digest));

  std::string spec = options.device;
  if (spec.empty() && options.tier == Tier::kGpu) spec = DefaultGpuSpec();
  if (spec.empty()) {
    id.device_key = std::string(identity::kHostDeviceKey);
  } else {
    identity::InventoryOptions inventory;
    inventory.inventory_file = options.device_inventory;
    inventory.env = env;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<identity::DeviceInfo> visible,
                                 identity::VisibleDevices(inventory));
    WEIGHTCACHE_ASSIGN_OR_RETURN(identity::DeviceInfo device,
                                 identity::ResolveDevice(spec, visible));
    id.device_key = device.uuid;
    id.device = std::move(device);
  }

  identity::PathOptions paths;
  paths.runtime_dir_flag = options.runtime_dir;
  if (!options.namespace_name.empty()) paths.namespace_name = options.namespace_name;
  paths.socket_flag = options.socket;
  paths.env = env;
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.paths,
                               identity::ResolveCachePaths(id.config, id.device_key, paths));
  return id;
}

Result<Discovery> Discover(const ResolvedIdentity& id, const DiscoveryPolicy& policy,
                           MismatchDetails* mismatch) {
  const std::string& socket = id.paths.socket;
  WEIGHTCACHE_ASSIGN_OR_RETURN(Probe probe, ProbeSocket(socket, id.paths.lock, id.config, policy,
                                                        Pipeline::kHelloThenAttach));
  if (probe.state != SocketState::kLive) {
    if (!id.paths.explicit_socket) {
      if (auto sibling = FindClosestSibling(id, policy)) {
        return Report(*std::move(sibling), mismatch);
      }
    }
    return Missing(probe.why);
  }
  const std::string who = "daemon at " + socket + " (pid " + std::to_string(probe.pid) + ")";
  if (probe.hello.state == protocol::CacheState::kFailed) {
    return Missing(who + " failed: " + probe.hello.failure_reason);
  }
  if (probe.hello.state == protocol::CacheState::kDraining) {
    return Missing(who + " is draining");
  }
  if (!probe.hello.match) {
    return Report(MakeMismatch(who, Differences(id.config, probe.hello), socket, probe.pid),
                  mismatch);
  }

  // Ready now, or loading: the pipelined Attach's reply is next on the connection (failed,
  // draining and mismatch returned above, dropping the connection and that reply with it).
  std::optional<protocol::Frame> attach_frame;
  if (probe.hello.state == protocol::CacheState::kLoading) {
    // The daemon answered the Attach after the Hello: usually "cache is loading"
    // (kUnavailable, connection usable), but the load may have finished in between.
    auto pending = ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                             os::Deadline::After(policy.exchange_timeout), socket);
    if (pending.ok()) {
      attach_frame = std::move(pending).value();
    } else if (pending.status().code() != StatusCode::kUnavailable) {
      return pending.status();
    }
  }
  if (!attach_frame && probe.hello.state == protocol::CacheState::kLoading) {
    auto wait_deadline = Clock::now() + policy.wait_timeout;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> status_request,
                                 protocol::EncodeStatusRequest());
    uint64_t done = probe.hello.bytes_done, total = probe.hello.bytes_total;
    for (;;) {
      if (Clock::now() >= wait_deadline) {
        return Missing(who + " still loading after " + std::to_string(policy.wait_timeout.count()) +
                           " ms (" + std::to_string(done) + " of " + std::to_string(total) +
                           " bytes)",
                       /*timed_out=*/true);
      }
      std::this_thread::sleep_for(
          std::min<Clock::duration>(kLoadingPollInterval, wait_deadline - Clock::now()));
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          protocol::Frame frame,
          Exchange(probe.connection.get(), status_request, protocol::MessageType::kStatusReply,
                   os::Deadline::After(policy.exchange_timeout), socket));
      WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::StatusReply status,
                                   protocol::DecodeStatusReply(frame.payload));
      done = status.bytes_done;
      total = status.bytes_total;
      if (status.state == protocol::CacheState::kReady) break;
      if (status.state == protocol::CacheState::kFailed) {
        return Missing(who + " failed: " + status.failure_reason);
      }
      if (status.state == protocol::CacheState::kDraining) return Missing(who + " is draining");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> attach_request,
                                 protocol::EncodeAttachRequest());
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        attach_frame,
        Exchange(probe.connection.get(), attach_request, protocol::MessageType::kAttachReply,
                 os::Deadline::After(policy.exchange_timeout), socket));
  }
  if (!attach_frame) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        attach_frame, ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                                os::Deadline::After(policy.exchange_timeout), socket));
  }
  // The manifest's records are checked by the caller, on the thread that builds the tensor
  // table (attachment.cc), so that on the gpu tier the check overlaps the VMM import.
  auto reply =
      protocol::DecodeAttachReply(std::move(*attach_frame), protocol::RecordCheck::kDeferred);
  if (!reply.ok()) return reply.status().Context(who);
  Discovery d;
  d.session = DaemonSession{std::move(probe.connection), std::move(reply).value(), probe.pid};
  return d;
}

}  // namespace weightcache::client
