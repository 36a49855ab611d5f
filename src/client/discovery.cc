#include "client/discovery.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
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

Status ErrorFromDaemon(const protocol::Frame& frame, const std::string& socket) {
  auto err = protocol::DecodeError(frame.payload);
  if (!err.ok()) return err.status().Context("daemon at " + socket);
  return Status(err->code, "daemon at " + socket + ": " + err->message);
}

// The time points of one discovery (DiscoveryPolicy): the wait for a loading daemon ends at
// `wait`, every exchange with a daemon (connect, request, reply) at `answer`, which is `wait`
// unless the min_answer_wait floor lies later.
struct Deadlines {
  explicit Deadlines(const DiscoveryPolicy& policy)
      : wait(policy.start + policy.wait_timeout),
        answer(std::max(wait, policy.start + policy.min_answer_wait)),
        start(policy.start),
        wait_timeout(policy.wait_timeout) {}

  std::chrono::milliseconds AnswerLeft() const {
    return std::max(std::chrono::ceil<std::chrono::milliseconds>(answer - Clock::now()),
                    std::chrono::milliseconds(0));
  }
  os::Deadline Answer() const { return os::Deadline::After(AnswerLeft()); }
  bool AnswerPassed() const { return Clock::now() >= answer; }
  // "within the attach deadline (wait_timeout 1000 ms)"
  std::string Describe() const {
    std::string text =
        "within the attach deadline (wait_timeout " + std::to_string(wait_timeout.count()) + " ms";
    if (answer > wait) {
      text += "; answers awaited " +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::milliseconds>(answer - start).count()) +
              " ms";
    }
    return text + ")";
  }

  Clock::time_point wait;
  Clock::time_point answer;
  Clock::time_point start;
  std::chrono::milliseconds wait_timeout;
};

// The next reply, of `expected` type (an Error frame becomes its Status). *deadline_passed is
// set when no reply arrived by `deadline` (our timeout, as opposed to an Error the daemon sent).
Result<protocol::Frame> ReadReply(int fd, protocol::MessageType expected, os::Deadline deadline,
                                  const std::string& socket, bool* deadline_passed) {
  auto frame = protocol::ReadFrame(fd, protocol::Expect::kReply, deadline);
  if (!frame.ok()) {
    *deadline_passed = frame.status().code() == StatusCode::kTimeout;
    return frame.status().Context("reading the reply of daemon at " + socket);
  }
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
                                 const std::string& socket, bool* deadline_passed) {
  Status sent = protocol::WriteFrame(fd, request, {}, deadline);
  if (!sent.ok()) {
    *deadline_passed = sent.code() == StatusCode::kTimeout;
    return sent.Context("sending to daemon at " + socket);
  }
  return ReadReply(fd, expected, deadline, socket, deadline_passed);
}

// Whether the probe sends Attach right behind Hello, in the same sendmsg (docs/protocol.md
// §1): saves a round trip on the attach path. The daemon answers Hello first, then the Attach
// (an AttachReply only after a matching Hello on a ready cache; otherwise an Error that
// leaves the connection usable), so the client reads the HelloReply, decides, and then reads
// or drops the Attach's reply.
enum class Pipeline { kHelloOnly, kHelloThenAttach };

// kHung: a live daemon (its lock held) that did not answer by the deadline: stopped,
// deadlocked, or its listen backlog full.
enum class SocketState { kAbsent, kStale, kHung, kLive };

struct Probe {
  SocketState state = SocketState::kAbsent;
  std::string why;  // for absent / stale / hung
  UniqueFd connection;
  int64_t pid = 0;
  protocol::HelloReply hello;
  bool attach_pending = false;  // an Attach was sent behind the Hello; its reply is unread
};

constexpr std::string_view kTrustedUidsEnv = "WEIGHTCACHE_TRUSTED_UIDS";

// Our euid, then `configured`, else the uids of WEIGHTCACHE_TRUSTED_UIDS ("1001,1002").
Result<std::vector<uid_t>> TrustedUids(const std::vector<uint32_t>& configured,
                                       const identity::EnvLookup& env) {
  std::vector<uid_t> uids{::geteuid()};
  if (!configured.empty()) {
    uids.insert(uids.end(), configured.begin(), configured.end());
    return uids;
  }
  const std::string list = env(std::string(kTrustedUidsEnv)).value_or("");
  size_t start = 0;
  while (start < list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = list.substr(start, comma - start);
    uint32_t uid = 0;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), uid);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      return InvalidArgument(std::string(kTrustedUidsEnv) + "=\"" + list +
                             "\": expected comma-separated numeric uids");
    }
    uids.push_back(uid);
    start = comma + 1;
  }
  return uids;
}

std::string DescribeUids(const std::vector<uid_t>& uids) {
  std::string out;
  for (uid_t uid : uids) out += (out.empty() ? "" : ", ") + std::to_string(uid);
  return out;
}

// The socket's owner and the daemon's uid must be trusted: a socket of an untrusted user could
// hand us any weights.
Status CheckTrusted(std::string_view what, uid_t uid, const std::vector<uid_t>& trusted) {
  if (std::find(trusted.begin(), trusted.end(), uid) != trusted.end()) return Status::Ok();
  return PermissionDenied(
      std::string(what) + " uid " + std::to_string(uid) +
      ", which this client does not trust (trusted uids: " + DescribeUids(trusted) +
      "; a daemon of a service user needs AttachOptions::trusted_uids, "
      "--trust-uid or " +
      std::string(kTrustedUidsEnv) + ")");
}

Probe Hung(Probe probe, const std::string& who, const Deadlines& deadlines, const Status& status) {
  probe.state = SocketState::kHung;
  probe.why = who + " did not answer " + deadlines.Describe() + ": " + status.message();
  return probe;
}

// lstat → lock → connect → peer credentials → Hello, each step by `deadlines`. Errors are the
// SPEC §4 "error" rows; no answer by the deadline is a kHung probe, not an error.
Result<Probe> ProbeSocket(const std::string& socket, const std::string& lock,
                          const identity::CacheConfig& config, const DiscoveryPolicy& policy,
                          const std::vector<uid_t>& trusted, const Deadlines& deadlines,
                          Pipeline pipeline) {
  Probe probe;
  struct stat st;
  if (::lstat(socket.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      probe.why = "no daemon at " + socket;
      return probe;
    }
    if (errno == EACCES) {
      return PermissionDenied("lstat " + socket +
                              ": permission denied (a daemon of another user serves other uids "
                              "only when started with --allow-uid/--allow-gid, which opens its "
                              "directories to them)");
    }
    return IoError("lstat " + socket, errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return Status(StatusCode::kIo, socket + " exists but is not a socket; refusing to use it");
  }
  WEIGHTCACHE_RETURN_IF_ERROR(
      CheckTrusted("socket " + socket + " is owned by", st.st_uid, trusted));
  if (!os::IsLockHeld(lock)) {
    probe.state = SocketState::kStale;
    probe.why = "stale socket " + socket + " (its lock " + lock + " is not held)";
    return probe;
  }
  auto conn = os::ConnectUnix(socket, deadlines.AnswerLeft());
  if (!conn.ok()) {
    if (conn.status().code() == StatusCode::kTimeout) {
      return Hung(std::move(probe), "daemon at " + socket, deadlines, conn.status());
    }
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
  WEIGHTCACHE_RETURN_IF_ERROR(
      CheckTrusted("daemon at " + socket + " (pid " + std::to_string(cred.pid) + ") runs as",
                   cred.uid, trusted));
  protocol::Hello hello;
  hello.config = config.ToJson();
  hello.client_pid = ::getpid();
  hello.client_name = policy.client_name;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodeHello(hello));
  if (pipeline == Pipeline::kHelloThenAttach) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> attach, protocol::EncodeAttachRequest());
    request.insert(request.end(), attach.begin(), attach.end());
  }
  const std::string who = "daemon at " + socket + " (pid " + std::to_string(cred.pid) + ")";
  // Both frames in one sendmsg (neither carries fds).
  Status sent = os::SendMessage(conn->get(), request, {}, deadlines.Answer());
  if (!sent.ok()) {
    if (sent.code() == StatusCode::kTimeout) return Hung(std::move(probe), who, deadlines, sent);
    // A daemon that refuses a connection (too many connections, a uid it does not allow)
    // sends an Error and closes at once, perhaps before our send: report its Error, not EPIPE.
    auto refusal = protocol::ReadFrame(conn->get(), protocol::Expect::kReply, deadlines.Answer());
    if (refusal.ok() && refusal->type == protocol::MessageType::kError) {
      return ErrorFromDaemon(*refusal, socket);
    }
    return sent.Context("sending to daemon at " + socket);
  }
  bool deadline_passed = false;
  auto frame = ReadReply(conn->get(), protocol::MessageType::kHelloReply, deadlines.Answer(),
                         socket, &deadline_passed);
  if (!frame.ok()) {
    if (deadline_passed) return Hung(std::move(probe), who, deadlines, frame.status());
    return frame.status();
  }
  probe.attach_pending = pipeline == Pipeline::kHelloThenAttach;
  WEIGHTCACHE_ASSIGN_OR_RETURN(probe.hello, protocol::DecodeHelloReply(frame->payload));
  probe.state = SocketState::kLive;
  probe.connection = std::move(conn).value();
  probe.pid = cred.pid;
  return probe;
}

// The fields on which a daemon's config differs from ours, by our own comparison of the
// config its HelloReply carries: the reply's `match` flag and `differences` list are the
// daemon's word and never decide an attach. Only when the daemon itself declares a mismatch
// and its config is unreadable here (another build's) is its own list reported; a config that
// cannot be checked but is claimed to match is refused (kProtocol).
Result<std::vector<identity::FieldDiff>> CompareConfigs(const identity::CacheConfig& ours,
                                                        const protocol::HelloReply& reply,
                                                        const std::string& who) {
  auto theirs = identity::CacheConfig::FromJson(reply.daemon_config);
  if (theirs.ok()) {
    auto diffs = identity::Diff(ours, *theirs);
    // Equal by our reading but refused by the daemon (it refuses the Attach too): its list.
    if (!diffs.empty() || reply.match) return diffs;
  } else if (reply.match) {
    return ProtocolError(who + " says it holds our config, but its config cannot be checked (" +
                         theirs.status().message() + "); refusing to attach");
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

// What the sibling scan found: the closest other config of our model, and the caches it could
// not ask (no answer by the deadline, or the deadline passed before their turn).
struct SiblingScan {
  std::optional<Mismatch> closest;
  std::string unanswered;  // "; "-prefixed notes for the missing reason, "" when none
};

// Looks for another live cache of the same model under our device key (SPEC §4: keep the
// explicit mismatch although different configs have different paths). Bounded by the same
// deadlines as the rest of the discovery: a hung sibling costs what is left of them, no more.
SiblingScan FindClosestSibling(const ResolvedIdentity& id, const DiscoveryPolicy& policy,
                               const Deadlines& deadlines) {
  SiblingScan scan;
  auto sockets = identity::ListCacheSockets(id.paths.device_dir);
  if (!sockets.ok()) {
    LOG_DEBUG << "listing " << id.paths.device_dir << ": " << sockets.status().ToString();
    return scan;
  }
  size_t best_count = SIZE_MAX;
  std::string not_asked;
  for (const std::string& socket : *sockets) {
    if (socket == id.paths.socket) continue;
    if (deadlines.AnswerPassed()) {
      not_asked += (not_asked.empty() ? "" : ", ") + socket;
      continue;
    }
    auto probe = ProbeSocket(socket, identity::LockPathFor(socket), id.config, policy,
                             id.trusted_uids, deadlines, Pipeline::kHelloOnly);
    if (!probe.ok()) {
      LOG_DEBUG << "skipping " << socket << ": " << probe.status().ToString();
      continue;
    }
    if (probe->state == SocketState::kHung) {
      scan.unanswered += "; " + probe->why;
      continue;
    }
    if (probe->state != SocketState::kLive) continue;
    auto model = probe->hello.daemon_config.find("model_id");
    if (model == probe->hello.daemon_config.end() || !model->is_string() ||
        model->get<std::string>() != id.config.model_id) {
      continue;
    }
    const std::string who = "daemon at " + socket + " (pid " + std::to_string(probe->pid) + ")";
    auto diffs = CompareConfigs(id.config, probe->hello, who);
    if (!diffs.ok()) {
      LOG_DEBUG << "skipping " << socket << ": " << diffs.status().ToString();
      continue;
    }
    if (diffs->empty() || diffs->size() >= best_count) continue;
    best_count = diffs->size();
    scan.closest =
        MakeMismatch("no cache of this config at " + id.paths.socket + "; the cache of model \"" +
                         id.config.model_id + "\" on device " + id.device_key + " at " + socket +
                         " (pid " + std::to_string(probe->pid) + ")",
                     *diffs, socket, probe->pid);
  }
  if (!not_asked.empty()) {
    scan.unanswered += "; the attach deadline passed before the caches at " + not_asked +
                       " were asked for their config";
  }
  return scan;
}

Result<Discovery> Missing(std::string why, StatusCode code = StatusCode::kNoDaemon) {
  Discovery d;
  d.missing_reason = std::move(why);
  d.missing_code = code;
  return d;
}

// A daemon whose load failed: absent for the fallback, its own failure code (an error code: the
// decoder checked it) for on_missing=error.
Result<Discovery> Failed(const std::string& who, const std::string& reason, StatusCode code) {
  return Missing(who + " failed: " + reason, code);
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
  c.tier = options.tier;
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
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.trusted_uids, TrustedUids(options.trusted_uids, env));

  std::string spec = options.device;
  if (spec.empty() && options.tier == Tier::kGpu) spec = DefaultGpuSpec();
  if (spec.empty()) {
    id.device_key = std::string(identity::kHostDeviceKey);
  } else {
    identity::InventoryOptions inventory;
    inventory.inventory_file = options.device_inventory;
    inventory.env = env;
    WEIGHTCACHE_ASSIGN_OR_RETURN(identity::DeviceInventory visible,
                                 identity::LoadDeviceInventory(inventory));
    if (options.tier == Tier::kGpu && visible.source != identity::InventorySource::kInventoryFile) {
      // The gpu tier maps device memory through the driver, so without it the answer is the
      // driver's own failure (dlerror, "the gpu tier needs the NVIDIA driver"), not an empty
      // device list. An inventory file still resolves the identity; the load or map that
      // follows then fails with the same message.
      if (auto api = cuda::LoadDriver(); !api.ok()) return api.status();
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(identity::DeviceInfo device,
                                 identity::ResolveDevice(spec, visible.devices));
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
  const Deadlines deadlines(policy);
  const std::string& socket = id.paths.socket;
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Probe probe, ProbeSocket(socket, id.paths.lock, id.config, policy, id.trusted_uids, deadlines,
                               Pipeline::kHelloThenAttach));
  if (probe.state == SocketState::kHung) return Missing(probe.why, StatusCode::kTimeout);
  if (probe.state != SocketState::kLive) {
    if (!id.paths.explicit_socket) {
      SiblingScan scan = FindClosestSibling(id, policy, deadlines);
      if (scan.closest) return Report(*std::move(scan.closest), mismatch);
      return Missing(probe.why + scan.unanswered);
    }
    return Missing(probe.why);
  }
  const std::string who = "daemon at " + socket + " (pid " + std::to_string(probe.pid) + ")";
  if (probe.hello.state == protocol::CacheState::kFailed) {
    return Failed(who, probe.hello.failure_reason, probe.hello.failure_code);
  }
  if (probe.hello.state == protocol::CacheState::kDraining) {
    return Missing(who + " is draining");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<identity::FieldDiff> diffs,
                               CompareConfigs(id.config, probe.hello, who));
  if (!diffs.empty() || !probe.hello.match) {
    return Report(MakeMismatch(who, diffs, socket, probe.pid), mismatch);
  }

  // Ready now, or loading: the pipelined Attach's reply is next on the connection (failed,
  // draining and mismatch returned above, dropping the connection and that reply with it).
  // Every read below ends at the deadline; a daemon silent until then is absent (kTimeout).
  bool deadline_passed = false;
  const auto silent = [&](const Status& status) {
    return Missing(who + " did not answer " + deadlines.Describe() + ": " + status.message(),
                   StatusCode::kTimeout);
  };
  std::optional<protocol::Frame> attach_frame;
  if (probe.hello.state == protocol::CacheState::kLoading) {
    // The daemon answered the Attach after the Hello: usually "cache is loading"
    // (kUnavailable, connection usable), but the load may have finished in between.
    auto pending = ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                             deadlines.Answer(), socket, &deadline_passed);
    if (pending.ok()) {
      attach_frame = std::move(pending).value();
    } else if (deadline_passed) {
      return silent(pending.status());
    } else if (pending.status().code() != StatusCode::kUnavailable) {
      return pending.status();
    }
  }
  if (!attach_frame && probe.hello.state == protocol::CacheState::kLoading) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> status_request,
                                 protocol::EncodeStatusRequest());
    uint64_t done = probe.hello.bytes_done, total = probe.hello.bytes_total;
    for (;;) {
      if (Clock::now() >= deadlines.wait) {
        return Missing(who + " still loading after " + std::to_string(policy.wait_timeout.count()) +
                           " ms (" + std::to_string(done) + " of " + std::to_string(total) +
                           " bytes)",
                       StatusCode::kTimeout);
      }
      std::this_thread::sleep_for(
          std::min<Clock::duration>(kLoadingPollInterval, deadlines.wait - Clock::now()));
      auto frame =
          Exchange(probe.connection.get(), status_request, protocol::MessageType::kStatusReply,
                   deadlines.Answer(), socket, &deadline_passed);
      if (!frame.ok()) return deadline_passed ? silent(frame.status()) : frame.status();
      WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::StatusReply status,
                                   protocol::DecodeStatusReply(frame->payload));
      done = status.bytes_done;
      total = status.bytes_total;
      if (status.state == protocol::CacheState::kReady) break;
      if (status.state == protocol::CacheState::kFailed) {
        return Failed(who, status.failure_reason, status.failure_code);
      }
      if (status.state == protocol::CacheState::kDraining) return Missing(who + " is draining");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> attach_request,
                                 protocol::EncodeAttachRequest());
    auto frame =
        Exchange(probe.connection.get(), attach_request, protocol::MessageType::kAttachReply,
                 deadlines.Answer(), socket, &deadline_passed);
    if (!frame.ok()) return deadline_passed ? silent(frame.status()) : frame.status();
    attach_frame = std::move(frame).value();
  }
  if (!attach_frame) {
    auto frame = ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                           deadlines.Answer(), socket, &deadline_passed);
    if (!frame.ok()) return deadline_passed ? silent(frame.status()) : frame.status();
    attach_frame = std::move(frame).value();
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
