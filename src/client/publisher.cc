// weightcache::Publisher (weightcache/publisher.h, docs/publish.md): the client side of
// PublishBegin → PublishArena → fill → PublishCommit, host tier.
#include "weightcache/publisher.h"

#include <unistd.h>

#include <map>
#include <utility>

#include "client/discovery.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "identity/resolve.h"
#include "os/memfd.h"
#include "protocol/frame.h"
#include "protocol/messages.h"

namespace weightcache {

struct Publisher::Impl {
  UniqueFd connection;
  std::string who;  // "daemon at <socket> (pid P)"
  int64_t pid = 0;
  std::chrono::milliseconds timeout{0};
  std::vector<os::MappedRegion> regions;  // writable, one per allocation; gone at Commit
  std::vector<std::span<uint8_t>> spans;  // plan order
  std::map<std::string, size_t, std::less<>> index;
  bool committed = false;
};

namespace {

using protocol::MessageType;

// One request, its one reply of `expected` type (an Error reply becomes its Status).
Result<protocol::Frame> Call(Publisher::Impl& impl, const std::vector<uint8_t>& request,
                             MessageType expected) {
  const os::Deadline deadline = os::Deadline::After(impl.timeout);
  Status sent = protocol::WriteFrame(impl.connection.get(), request, {}, deadline);
  if (!sent.ok()) return sent.Context("sending to " + impl.who);
  auto frame = protocol::ReadFrame(impl.connection.get(), protocol::Expect::kReply, deadline);
  if (!frame.ok()) return frame.status().Context("reading the reply of " + impl.who);
  if (frame->type == MessageType::kError) {
    auto error = protocol::DecodeError(frame->payload);
    if (!error.ok()) return error.status().Context(impl.who);
    return Status(error->code, impl.who + ": " + error->message);
  }
  if (frame->type != expected) {
    return ProtocolError(impl.who + " answered " + protocol::MessageTypeName(frame->type) +
                         " where " + protocol::MessageTypeName(expected) + " was expected");
  }
  return std::move(frame).value();
}

// Maps the arena of a PublishArena and finds every plan tensor in its manifest: the daemon's
// layout is checked against our plan (name, dtype, shape, bytes), never trusted.
Status MapArena(protocol::AttachReply& arena, const protocol::PublishBegin& plan,
                Publisher::Impl& impl) {
  const auto& sizes = arena.manifest.allocation_sizes();
  if (arena.manifest.tier() != Tier::kHost) {
    return ProtocolError(impl.who + ": PublishArena for the " +
                         std::string(TierName(arena.manifest.tier())) + " tier");
  }
  for (size_t a = 0; a < sizes.size(); ++a) {
    const std::string what = impl.who + ": arena allocation " + std::to_string(a);
    auto size = os::FileSize(arena.fds[a].get());
    if (!size.ok()) return size.status().Context(what);
    if (*size < sizes[a]) {
      return ProtocolError(what + " is " + std::to_string(*size) + " bytes, the manifest says " +
                           std::to_string(sizes[a]));
    }
    auto region = os::MapReadWrite(arena.fds[a].get(), sizes[a]);
    if (!region.ok()) return region.status().Context(what);
    impl.regions.push_back(std::move(region).value());
  }
  arena.fds.clear();  // the mappings are what we write through; Commit unmaps them
  if (arena.manifest.tensor_count() != plan.tensors.size()) {
    return ProtocolError(impl.who + ": PublishArena lists " +
                         std::to_string(arena.manifest.tensor_count()) + " tensors for a plan of " +
                         std::to_string(plan.tensors.size()));
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) impl.index.emplace(plan.tensors[i].name, i);
  impl.spans.assign(plan.tensors.size(), {});
  for (size_t r = 0; r < arena.manifest.tensor_count(); ++r) {
    const protocol::TensorRecord rec = arena.manifest.record(r);
    auto it = impl.index.find(rec.name);
    if (it == impl.index.end()) {
      return ProtocolError(impl.who + ": PublishArena lists tensor '" + std::string(rec.name) +
                           "', which is not in the plan");
    }
    const protocol::PlannedTensor& t = plan.tensors[it->second];
    bool same_shape = rec.shape.size() == t.shape.size();
    for (size_t d = 0; same_shape && d < t.shape.size(); ++d) {
      same_shape = static_cast<uint64_t>(rec.shape[d]) == t.shape[d];
    }
    if (rec.dtype != t.dtype || rec.nbytes != t.nbytes || !same_shape) {
      return ProtocolError(impl.who + ": PublishArena's tensor '" + t.name +
                           "' differs from the plan (dtype, shape or bytes)");
    }
    auto* base = static_cast<uint8_t*>(impl.regions[rec.allocation].data());
    impl.spans[it->second] = std::span<uint8_t>(base + rec.offset, rec.nbytes);
  }
  return Status::Ok();
}

}  // namespace

Result<Publisher> Publisher::Begin(const PublishOptions& options,
                                   std::span<const PublishTensor> plan) {
  if (!identity::IsPublishedSource(options.identity.source)) {
    return InvalidArgument("publish needs source \"published:<tag>\" (got \"" +
                           options.identity.source + "\")");
  }
  protocol::PublishBegin begin;
  begin.metadata = options.metadata;
  begin.tensors.reserve(plan.size());
  for (const PublishTensor& t : plan) {
    begin.tensors.push_back({t.name, t.dtype, t.shape, t.nbytes, t.alias_of});
  }
  // The daemon's own rules, checked before anything is sent.
  WEIGHTCACHE_RETURN_IF_ERROR(protocol::ValidatePublishPlan(begin));
  WEIGHTCACHE_ASSIGN_OR_RETURN(identity::ResolvedIdentity id,
                               identity::ResolveIdentity(options.identity));
  client::DiscoveryPolicy policy;
  policy.wait_timeout = options.timeout;
  policy.client_name = "weightcache-publisher";
  WEIGHTCACHE_ASSIGN_OR_RETURN(client::PublisherSession session,
                               client::ConnectPublisher(id, policy));
  auto impl = std::make_unique<Impl>();
  impl->connection = std::move(session.connection);
  impl->pid = session.pid;
  impl->who = "daemon at " + id.paths.socket + " (pid " + std::to_string(session.pid) + ")";
  impl->timeout = options.timeout;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodePublishBegin(begin));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Frame frame,
                               Call(*impl, request, MessageType::kPublishArena));
  auto arena = protocol::DecodePublishArena(std::move(frame));
  if (!arena.ok()) return arena.status().Context(impl->who);
  WEIGHTCACHE_RETURN_IF_ERROR(MapArena(*arena, begin, *impl));
  return Publisher(std::move(impl));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::Publisher(Publisher&& other) noexcept = default;
Publisher& Publisher::operator=(Publisher&& other) noexcept = default;
Publisher::~Publisher() = default;

std::span<uint8_t> Publisher::Data(size_t index) const {
  if (!impl_ || impl_->committed || index >= impl_->spans.size()) return {};
  return impl_->spans[index];
}

std::span<uint8_t> Publisher::DataByName(std::string_view name) const {
  if (!impl_) return {};
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? std::span<uint8_t>() : Data(it->second);
}

size_t Publisher::tensor_count() const { return impl_ ? impl_->spans.size() : 0; }
int Publisher::daemon_pid() const { return impl_ ? static_cast<int>(impl_->pid) : 0; }

Status Publisher::Commit() {
  if (!impl_ || impl_->committed) {
    return InvalidArgument("Publisher::Commit: nothing to commit (already committed or moved)");
  }
  impl_->committed = true;
  protocol::PublishCommit commit;
  commit.checksums.reserve(impl_->spans.size());
  for (const std::span<uint8_t>& s : impl_->spans) {
    commit.checksums.push_back(TensorChecksum(s.data(), s.size()));
  }
  // Unmapped before the commit: the daemon's F_SEAL_WRITE fails while a writable shared
  // mapping of the memfd exists (docs/publish.md, "Order").
  impl_->spans.clear();
  impl_->regions.clear();
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodePublishCommit(commit));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Frame frame,
                               Call(*impl_, request, MessageType::kPublishCommitted));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::PublishCommitted done,
                               protocol::DecodePublishCommitted(frame.payload));
  LOG_DEBUG << "published " << done.tensor_count << " tensors (" << done.bytes << " bytes) to "
            << impl_->who;
  return Status::Ok();
}

}  // namespace weightcache
