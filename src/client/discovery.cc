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

#include "common/logging.h"
#include "os/fd_passing.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "protocol/frame.h"

namespace weightcache::client {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kLoadingPollInterval{50};

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

// How an exchange with a daemon failed to produce a frame, if it did: the one rule of missing
// vs error for the transport (docs/design.md "Discovery outcomes"; docs/client.md "Discovery,
// row by row", item 7). A daemon
// that did not answer by the deadline is hung, one that went away at any point of the exchange
// (it closed the connection before or inside a frame, EPIPE on our send, ECONNRESET: killed,
// crashed, restarted) is gone; both are a missing daemon, never an error. Anything else (a
// malformed frame, unexpected fds, a failed syscall of ours) stays the error it is, and so does
// an Error the daemon sent, which never reaches this rule.
enum class Lost { kNo, kSilent, kGone };

Lost Classify(const Status& transport) {
  if (transport.code() == StatusCode::kTimeout) return Lost::kSilent;
  // os/fd_passing.h: a peer that went away, however it left, is kUnavailable.
  if (transport.code() == StatusCode::kUnavailable) return Lost::kGone;
  return Lost::kNo;
}

// The next reply, of `expected` type (an Error frame becomes its Status). *lost says whether
// and how the transport failed (Classify), as opposed to an Error the daemon sent.
Result<protocol::Frame> ReadReply(int fd, protocol::MessageType expected, os::Deadline deadline,
                                  const std::string& socket, Lost* lost, os::SysCalls& sys) {
  *lost = Lost::kNo;
  auto frame = protocol::ReadFrame(fd, protocol::Expect::kReply, deadline, sys);
  if (!frame.ok()) {
    *lost = Classify(frame.status());
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
                                 const std::string& socket, Lost* lost, os::SysCalls& sys) {
  Status sent = protocol::WriteFrame(fd, request, {}, deadline, sys);
  if (!sent.ok()) {
    *lost = Classify(sent);
    return sent.Context("sending to daemon at " + socket);
  }
  return ReadReply(fd, expected, deadline, socket, lost, sys);
}

// Whether the probe sends Attach right behind Hello, in the same sendmsg (docs/protocol.md
// §1): saves a round trip on the attach path. The daemon answers Hello first, then the Attach
// (an AttachReply only after a matching Hello on a ready cache; otherwise an Error that
// leaves the connection usable), so the client reads the HelloReply, decides, and then reads
// or drops the Attach's reply.
enum class Pipeline { kHelloOnly, kHelloThenAttach };

// kHung: a live daemon (its lock held) that did not answer by the deadline: stopped,
// deadlocked, or its listen backlog full. kGone: a daemon that went away before its HelloReply
// was read (Lost::kGone).
enum class SocketState { kAbsent, kStale, kHung, kGone, kLive };

struct Probe {
  SocketState state = SocketState::kAbsent;
  std::string why;  // for absent / stale / hung / gone
  UniqueFd connection;
  int64_t pid = 0;
  protocol::HelloReply hello;
  bool attach_pending = false;  // an Attach was sent behind the Hello; its reply is unread
  // Refused although the lock was held: the instant of an upgrade's takeover (worth a retry).
  bool refused_while_locked = false;
};

// An upgrade's takeover (docs/upgrade.md): the successor renames its socket over the old
// daemon's, which keeps accepting for a grace period and then closes its listener. A connect
// that resolved the old socket and reached it only after that close is refused while the lock
// is held throughout. Discover probes again, this often, within the answer deadline.
constexpr int kTakeoverRetries = 50;
constexpr std::chrono::milliseconds kTakeoverRetryInterval{2};

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
      std::string(identity::kTrustedUidsEnv) + ")");
}

Probe Hung(Probe probe, const std::string& who, const Deadlines& deadlines, const Status& status) {
  probe.state = SocketState::kHung;
  probe.why = who + " did not answer " + deadlines.Describe() + ": " + status.message();
  return probe;
}

// "<who> went away during the attach (<step>): <what the transport said>", the reason of every
// Lost::kGone (the Hello's probe and the rest of Discover).
std::string GoneReason(const std::string& who, std::string_view step, const Status& status) {
  return who + " went away during the attach (" + std::string(step) + "): " + status.message();
}

// lstat → lock → connect → peer credentials → Hello, each step by `deadlines`. Errors are the
// error rows of docs/design.md "Discovery outcomes"; no answer by the deadline is a kHung probe,
// not an error.
Result<Probe> ProbeSocket(const std::string& socket, const std::string& lock,
                          const identity::CacheConfig& config, const DiscoveryPolicy& policy,
                          const std::vector<uid_t>& trusted, const Deadlines& deadlines,
                          Pipeline pipeline, os::SysCalls& sys) {
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
      probe.refused_while_locked = true;
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
  const auto gone = [&](const Status& status) {
    probe.state = SocketState::kGone;
    probe.why = GoneReason(who, "Hello", status);
    return std::move(probe);
  };
  // Both frames in one sendmsg (neither carries fds).
  Status sent = os::SendMessage(conn->get(), request, {}, deadlines.Answer(), sys);
  if (!sent.ok()) {
    const Lost lost = Classify(sent);
    if (lost == Lost::kSilent) return Hung(std::move(probe), who, deadlines, sent);
    // A daemon that refuses a connection (too many connections, a uid it does not allow)
    // sends an Error and closes at once, perhaps before our send: report its Error, not EPIPE.
    auto refusal =
        protocol::ReadFrame(conn->get(), protocol::Expect::kReply, deadlines.Answer(), sys);
    if (refusal.ok() && refusal->type == protocol::MessageType::kError) {
      return ErrorFromDaemon(*refusal, socket);
    }
    if (lost == Lost::kGone) return gone(sent);
    return sent.Context("sending to daemon at " + socket);
  }
  Lost lost = Lost::kNo;
  auto frame = ReadReply(conn->get(), protocol::MessageType::kHelloReply, deadlines.Answer(),
                         socket, &lost, sys);
  if (!frame.ok()) {
    if (lost == Lost::kSilent) return Hung(std::move(probe), who, deadlines, frame.status());
    if (lost == Lost::kGone) return gone(frame.status());
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

// Looks for another live cache of the same model under our device key, to keep the explicit
// mismatch although different configs have different paths (docs/design.md "Explicit mismatch").
// Bounded by the same deadlines as the rest of the discovery: a hung sibling costs what is left
// of them, no more.
SiblingScan FindClosestSibling(const ResolvedIdentity& id, const DiscoveryPolicy& policy,
                               const Deadlines& deadlines, os::SysCalls& sys) {
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
                             id.trusted_uids, deadlines, Pipeline::kHelloOnly, sys);
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

Result<Discovery> Discover(const ResolvedIdentity& id, const DiscoveryPolicy& policy,
                           MismatchDetails* mismatch, const identity::Env& env) {
  os::SysCalls& sys = *env.syscalls;
  const Deadlines deadlines(policy);
  const std::string& socket = id.paths.socket;
  auto probe_once = [&] {
    return ProbeSocket(socket, id.paths.lock, id.config, policy, id.trusted_uids, deadlines,
                       Pipeline::kHelloThenAttach, sys);
  };
  const auto at_takeover = [](const Result<Probe>& p) { return p.ok() && p->refused_while_locked; };
  Result<Probe> probed = probe_once();
  for (int retry = 0; retry < kTakeoverRetries && at_takeover(probed) && !deadlines.AnswerPassed();
       ++retry) {
    std::this_thread::sleep_for(kTakeoverRetryInterval);
    probed = probe_once();
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(Probe probe, std::move(probed));
  if (probe.state == SocketState::kHung) return Missing(probe.why, StatusCode::kTimeout);
  if (probe.state == SocketState::kGone) return Missing(probe.why);
  if (probe.state != SocketState::kLive) {
    if (!id.paths.explicit_socket) {
      SiblingScan scan = FindClosestSibling(id, policy, deadlines, sys);
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
  // Every read below ends at the deadline; a daemon silent until then is absent (kTimeout),
  // and one that goes away on the way is absent too (kNoDaemon): Classify's rule.
  Lost lost = Lost::kNo;
  const auto missing_or_error = [&](const Status& status, std::string_view step) {
    switch (lost) {
      case Lost::kSilent:
        return Missing(who + " did not answer " + deadlines.Describe() + ": " + status.message(),
                       StatusCode::kTimeout);
      case Lost::kGone:
        return Missing(GoneReason(who, step, status));
      case Lost::kNo:
        break;
    }
    return Result<Discovery>(status);
  };
  std::optional<protocol::Frame> attach_frame;
  // A published cache awaiting its publisher is waited for like a loading one (docs/design.md
  // "Discovery outcomes"), unless nobody publishes to it and the caller would rather publish
  // itself (wait_for_publisher false). An awaiting daemon's bytes_total is the arena of the
  // publication in progress, 0 while there is none (docs/publish.md "States").
  const auto unpublished = [&](protocol::CacheState state, uint64_t total) {
    return !policy.wait_for_publisher && state == protocol::CacheState::kAwaiting && total == 0;
  };
  const auto none_publishing = [&] {
    return Missing(who + " awaits its publisher, and none is publishing");
  };
  if (unpublished(probe.hello.state, probe.hello.bytes_total)) return none_publishing();
  const bool not_yet = probe.hello.state == protocol::CacheState::kLoading ||
                       probe.hello.state == protocol::CacheState::kAwaiting;
  if (not_yet) {
    // The daemon answered the Attach after the Hello: usually "cache is loading"
    // (kUnavailable, connection usable), but the load may have finished in between.
    auto pending = ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                             deadlines.Answer(), socket, &lost, sys);
    if (pending.ok()) {
      attach_frame = std::move(pending).value();
    } else if (lost != Lost::kNo || pending.status().code() != StatusCode::kUnavailable) {
      return missing_or_error(pending.status(), "Attach");
    }
  }
  if (!attach_frame && not_yet) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> status_request,
                                 protocol::EncodeStatusRequest());
    uint64_t done = probe.hello.bytes_done, total = probe.hello.bytes_total;
    protocol::CacheState state = probe.hello.state;
    Clock::time_point last_answer = Clock::now();
    // The wait ended with the daemon answering: say in which state, never "did not answer".
    const auto still = [&] {
      const std::string after = " after " + std::to_string(policy.wait_timeout.count()) + " ms";
      const std::string answered = "; it answered every poll";
      if (state == protocol::CacheState::kAwaiting) {
        return Missing(who + " still awaiting its publisher" + after + answered,
                       StatusCode::kTimeout);
      }
      return Missing(who + " still loading" + after + " (" + std::to_string(done) + " of " +
                         std::to_string(total) + " bytes)" + answered,
                     StatusCode::kTimeout);
    };
    for (;;) {
      std::this_thread::sleep_for(std::min<Clock::duration>(
          kLoadingPollInterval, std::max<Clock::duration>(deadlines.wait - Clock::now(), {})));
      if (Clock::now() >= deadlines.wait) return still();
      auto frame =
          Exchange(probe.connection.get(), status_request, protocol::MessageType::kStatusReply,
                   deadlines.Answer(), socket, &lost, sys);
      if (!frame.ok()) {
        // A poll sent just before the end of the wait meets the answer deadline (the same
        // instant, unless min_answer_wait lies later) before its reply: the daemon answered
        // the poll before, so it is still what it said then. Silent for longer is "did not
        // answer"; gone is gone.
        if (lost == Lost::kSilent && Clock::now() - last_answer < policy.min_answer_wait) {
          return still();
        }
        return missing_or_error(frame.status(), "Status");
      }
      last_answer = Clock::now();
      WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::StatusReply status,
                                   protocol::DecodeStatusReply(frame->payload));
      done = status.bytes_done;
      total = status.bytes_total;
      state = status.state;
      if (status.state == protocol::CacheState::kReady) break;
      if (unpublished(status.state, status.bytes_total)) return none_publishing();  // it died
      if (status.state == protocol::CacheState::kFailed) {
        return Failed(who, status.failure_reason, status.failure_code);
      }
      if (status.state == protocol::CacheState::kDraining) return Missing(who + " is draining");
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> attach_request,
                                 protocol::EncodeAttachRequest());
    auto frame =
        Exchange(probe.connection.get(), attach_request, protocol::MessageType::kAttachReply,
                 deadlines.Answer(), socket, &lost, sys);
    if (!frame.ok()) return missing_or_error(frame.status(), "Attach");
    attach_frame = std::move(frame).value();
  }
  std::string note;
  if (!attach_frame) {
    // A demoted cache (docs/budget.md) answers the Attach once it is promoted back to the GPU,
    // within the same deadline.
    const auto asked = Clock::now();
    auto frame = ReadReply(probe.connection.get(), protocol::MessageType::kAttachReply,
                           deadlines.Answer(), socket, &lost, sys);
    if (!frame.ok()) return missing_or_error(frame.status(), "Attach");
    attach_frame = std::move(frame).value();
    if (probe.hello.state == protocol::CacheState::kDemoted) {
      note =
          "promoted from host RAM in " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - asked).count()) +
          " ms";
    }
  }
  // The manifest's records are checked by the caller, on the thread that builds the tensor
  // table (attachment.cc), so that on the gpu tier the check overlaps the VMM import.
  auto reply =
      protocol::DecodeAttachReply(std::move(*attach_frame), protocol::RecordCheck::kDeferred);
  if (!reply.ok()) return reply.status().Context(who);
  Discovery d;
  d.session = DaemonSession{std::move(probe.connection), std::move(reply).value(), probe.pid};
  d.note = std::move(note);
  return d;
}

Result<PublisherSession> ConnectPublisher(const ResolvedIdentity& id, const DiscoveryPolicy& policy,
                                          const identity::Env& env) {
  const Deadlines deadlines(policy);
  const std::string& socket = id.paths.socket;
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      Probe probe, ProbeSocket(socket, id.paths.lock, id.config, policy, id.trusted_uids, deadlines,
                               Pipeline::kHelloOnly, *env.syscalls));
  if (probe.state == SocketState::kHung) return Status(StatusCode::kTimeout, probe.why);
  if (probe.state != SocketState::kLive) {
    return Status(
        StatusCode::kNoDaemon,
        probe.why + " (start one with `weightcache serve --source " + id.config.source + "`)");
  }
  const std::string who = "daemon at " + socket + " (pid " + std::to_string(probe.pid) + ")";
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<identity::FieldDiff> diffs,
                               CompareConfigs(id.config, probe.hello, who));
  if (!diffs.empty() || !probe.hello.match) {
    return Report(MakeMismatch(who, diffs, socket, probe.pid), nullptr);
  }
  return PublisherSession{std::move(probe.connection), probe.pid, std::move(probe.hello)};
}

}  // namespace weightcache::client
