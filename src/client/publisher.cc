// weightcache::Publisher (weightcache/publisher.h, docs/publish.md): the client side of
// PublishBegin → PublishArena → fill → PublishCommit, on either tier (host: writable memfds;
// gpu: the daemon's VMM arena imported read-write, checksummed by the GPU kernel).
#include "weightcache/publisher.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "client/discovery.h"
#include "client/publisher_internal.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "cuda/checksum_gpu.h"
#include "cuda/driver_api.h"
#include "cuda/imported_arena.h"
#include "cuda/vmm.h"
#include "identity/device_inventory.h"
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
  Tier tier = Tier::kHost;
  std::vector<os::MappedRegion> regions;  // host: writable, one per allocation; gone at Commit
  // gpu: the daemon's arena imported read-write on our device; gone at Commit.
  std::optional<cuda::ImportedArena> gpu_arena;
  // Plan order: host addresses (host) or device pointers (gpu), with each tensor's bytes.
  std::vector<std::span<uint8_t>> spans;
  std::map<std::string, size_t, std::less<>> index;
  std::vector<std::string> names;  // plan order
  bool committed = false;
  // Where a publish's time goes, for the debug line Commit logs (milliseconds since Begin was
  // called): connected to the daemon, arena mapped (Begin returned).
  std::chrono::steady_clock::time_point begun;
  double connected_ms = 0;
  double mapped_ms = 0;
};

namespace {

using protocol::MessageType;

double MillisecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

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
                const cuda::DriverApi* api, CUdevice device, Publisher::Impl& impl) {
  const auto& sizes = arena.manifest.allocation_sizes();
  if (arena.manifest.tier() != impl.tier) {
    return ProtocolError(impl.who + ": PublishArena for the " +
                         std::string(TierName(arena.manifest.tier())) + " tier, ours is " +
                         std::string(TierName(impl.tier)));
  }
  std::vector<uint8_t*> bases;
  if (impl.tier == Tier::kGpu) {
    // The fds are checked, imported, mapped read-write and closed (ImportedArena::Import);
    // the mapping alone keeps the memory.
    auto imported = cuda::ImportedArena::Import(api, device, std::move(arena.fds), sizes);
    if (!imported.ok()) return imported.status().Context(impl.who + ": the published arena");
    impl.gpu_arena.emplace(std::move(imported).value());
    for (const cuda::ImportedAllocation& a : impl.gpu_arena->allocations()) {
      bases.push_back(reinterpret_cast<uint8_t*>(a.ptr));  // a device pointer, never dereferenced
    }
  }
  for (size_t a = 0; impl.tier == Tier::kHost && a < sizes.size(); ++a) {
    const std::string what = impl.who + ": arena allocation " + std::to_string(a);
    auto size = os::FileSize(arena.fds[a].get());
    if (!size.ok()) return size.status().Context(what);
    if (*size < sizes[a]) {
      return ProtocolError(what + " is " + std::to_string(*size) + " bytes, the manifest says " +
                           std::to_string(sizes[a]));
    }
    auto region = os::MapReadWrite(arena.fds[a].get(), sizes[a]);
    if (!region.ok()) return region.status().Context(what);
    bases.push_back(static_cast<uint8_t*>(region->data()));
    impl.regions.push_back(std::move(region).value());
  }
  arena.fds.clear();  // the mappings are what we write through; Commit unmaps them
  if (arena.manifest.tensor_count() != plan.tensors.size()) {
    return ProtocolError(impl.who + ": PublishArena lists " +
                         std::to_string(arena.manifest.tensor_count()) + " tensors for a plan of " +
                         std::to_string(plan.tensors.size()));
  }
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    impl.index.emplace(plan.tensors[i].name, i);
    impl.names.push_back(plan.tensors[i].name);
  }
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
    // Within its allocation: the manifest decoder checked every record against the sizes.
    impl.spans[it->second] = std::span<uint8_t>(bases[rec.allocation] + rec.offset, rec.nbytes);
  }
  return Status::Ok();
}

// Every tensor's checksum by the GPU kernel over our mapping of the arena (plan order).
Result<std::vector<uint64_t>> GpuChecksums(Publisher::Impl& impl) {
  const cuda::ImportedArena& arena = *impl.gpu_arena;
  const cuda::ScopedCurrentContext current(arena.api(), arena.context());
  std::vector<cuda::DeviceRange> ranges;
  ranges.reserve(impl.spans.size());
  for (const std::span<uint8_t>& s : impl.spans) {
    ranges.push_back({reinterpret_cast<CUdeviceptr>(s.data()), s.size()});
  }
  // Every copy before this was synchronous (CopyIn's cuMemcpy); a caller that wrote through
  // Destination() on a stream of its own synchronizes it before Commit.
  auto kernel = cuda::ChecksumKernel::Create(arena.api());
  if (!kernel.ok()) return kernel.status().Context("publish commit: the GPU checksum kernel");
  auto sums = kernel->Checksums(nullptr, ranges);
  if (!sums.ok()) return sums.status().Context("publish commit: checksumming the arena");
  return std::move(sums).value();
}

// The daemon's GPU must be ours: the UUID it reports (Status) against the one our identity
// resolved, so that a device pointer of ours is in the memory the daemon checks and serves.
Status CheckDaemonDevice(Publisher::Impl& impl, const identity::DeviceInfo& ours) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodeStatusRequest());
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Frame frame,
                               Call(impl, request, MessageType::kStatusReply));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::StatusReply status,
                               protocol::DecodeStatusReply(frame.payload));
  if (status.device_uuid != ours.uuid) {
    return Status(StatusCode::kMismatch, impl.who + " serves GPU " + status.device_uuid +
                                             ", but this publisher's device is " + ours.uuid +
                                             ": publish from a process on the daemon's GPU");
  }
  return Status::Ok();
}

}  // namespace

namespace client {

Result<Publisher> PublisherAccess::Begin(const PublishOptions& options,
                                         std::span<const PublishTensor> plan,
                                         const identity::Env& env) {
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
  const Tier tier = options.identity.tier;
  if (tier == Tier::kGpu && !cuda::GpuChecksumKernelBuilt()) {
    return Status(StatusCode::kUnavailable,
                  "publishing to the gpu tier needs the GPU checksum kernel, which this build "
                  "lacks (built with WEIGHTCACHE_BUILD_KERNELS=OFF or without nvcc)");
  }
  const auto begun = std::chrono::steady_clock::now();
  WEIGHTCACHE_ASSIGN_OR_RETURN(identity::ResolvedIdentity id,
                               identity::ResolveIdentity(options.identity, env));
  // Gpu tier: our CUdevice, checked by UUID (CudaDevice), before anything is sent.
  const cuda::DriverApi* api = nullptr;
  CUdevice device = 0;
  if (tier == Tier::kGpu) {
    if (!id.device.has_value()) return InternalError("gpu tier publish without a resolved device");
    WEIGHTCACHE_ASSIGN_OR_RETURN(api, env.load_driver());
    WEIGHTCACHE_ASSIGN_OR_RETURN(device, identity::CudaDevice(api, *id.device));
  }
  DiscoveryPolicy policy;
  policy.wait_timeout = options.timeout;
  policy.client_name = "weightcache-publisher";
  WEIGHTCACHE_ASSIGN_OR_RETURN(PublisherSession session, ConnectPublisher(id, policy, env));
  auto impl = std::make_unique<Publisher::Impl>();
  impl->connection = std::move(session.connection);
  impl->pid = session.pid;
  impl->who = "daemon at " + id.paths.socket + " (pid " + std::to_string(session.pid) + ")";
  impl->timeout = options.timeout;
  impl->tier = tier;
  impl->begun = begun;
  impl->connected_ms = MillisecondsSince(begun);
  if (tier == Tier::kGpu) WEIGHTCACHE_RETURN_IF_ERROR(CheckDaemonDevice(*impl, *id.device));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodePublishBegin(begin));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Frame frame,
                               Call(*impl, request, MessageType::kPublishArena));
  auto arena = protocol::DecodePublishArena(std::move(frame));
  if (!arena.ok()) return arena.status().Context(impl->who);
  WEIGHTCACHE_RETURN_IF_ERROR(MapArena(*arena, begin, api, device, *impl));
  impl->mapped_ms = MillisecondsSince(begun);
  return Publisher(std::move(impl));
}

}  // namespace client

Result<Publisher> Publisher::Begin(const PublishOptions& options,
                                   std::span<const PublishTensor> plan) {
  return client::PublisherAccess::Begin(options, plan, identity::Env::Default());
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::Publisher(Publisher&& other) noexcept = default;
Publisher& Publisher::operator=(Publisher&& other) noexcept = default;
Publisher::~Publisher() = default;

std::span<uint8_t> Publisher::Data(size_t index) const {
  if (!impl_ || impl_->committed || impl_->tier != Tier::kHost || index >= impl_->spans.size()) {
    return {};
  }
  return impl_->spans[index];
}

std::span<uint8_t> Publisher::DataByName(std::string_view name) const {
  if (!impl_) return {};
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? std::span<uint8_t>() : Data(it->second);
}

Publisher::Destination Publisher::DestinationOf(size_t index) const {
  if (!impl_) return {};
  if (impl_->committed || index >= impl_->spans.size()) return {impl_->tier, 0, 0};
  const std::span<uint8_t> s = impl_->spans[index];
  return {impl_->tier, reinterpret_cast<uint64_t>(s.data()), s.size()};
}

Status Publisher::CopyIn(size_t index, const void* source, uint64_t nbytes) {
  if (!impl_ || impl_->committed) {
    return InvalidArgument("Publisher::CopyIn: no arena (already committed or moved)");
  }
  if (index >= impl_->spans.size()) {
    return InvalidArgument("Publisher::CopyIn: tensor index " + std::to_string(index) +
                           " is past the plan's " + std::to_string(impl_->spans.size()));
  }
  const std::span<uint8_t> dst = impl_->spans[index];
  const std::string& name = impl_->names[index];
  if (nbytes != dst.size()) {
    return InvalidArgument("Publisher::CopyIn: tensor '" + name + "' has " +
                           std::to_string(dst.size()) + " bytes, the copy " +
                           std::to_string(nbytes));
  }
  if (nbytes == 0) return Status::Ok();
  if (source == nullptr) {
    return InvalidArgument("Publisher::CopyIn: tensor '" + name + "': null source");
  }
  if (impl_->tier == Tier::kHost) {
    std::memcpy(dst.data(), source, nbytes);
    return Status::Ok();
  }
  const cuda::ImportedArena& arena = *impl_->gpu_arena;
  const cuda::DriverApi* api = arena.api();
  const cuda::ScopedCurrentContext current(api, arena.context());
  // Unified addressing: the driver finds out where `source` is (pageable or pinned host
  // memory, this device's or another's memory) and copies; synchronous for the caller.
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api,
                                 cuMemcpy(reinterpret_cast<CUdeviceptr>(dst.data()),
                                          reinterpret_cast<CUdeviceptr>(source), nbytes),
                                 "cuMemcpy into published tensor '" + name + "'");
  return Status::Ok();
}

Tier Publisher::tier() const { return impl_ ? impl_->tier : Tier::kHost; }

size_t Publisher::tensor_count() const { return impl_ ? impl_->spans.size() : 0; }
int Publisher::daemon_pid() const { return impl_ ? static_cast<int>(impl_->pid) : 0; }

Status Publisher::Commit() {
  if (!impl_ || impl_->committed) {
    return InvalidArgument("Publisher::Commit: nothing to commit (already committed or moved)");
  }
  impl_->committed = true;
  const double commit_ms = MillisecondsSince(impl_->begun);
  protocol::PublishCommit commit;
  commit.checksums.reserve(impl_->spans.size());
  if (impl_->tier == Tier::kGpu) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(commit.checksums, GpuChecksums(*impl_));
  } else {
    for (const std::span<uint8_t>& s : impl_->spans) {
      commit.checksums.push_back(TensorChecksum(s.data(), s.size()));
    }
  }
  // Unmapped before the commit: the daemon's F_SEAL_WRITE fails while a writable shared
  // mapping of the memfd exists (docs/publish.md, "Order"); on the gpu tier our mapping is
  // released so that only the daemon's fds (and its clients') hold the memory.
  const double summed_ms = MillisecondsSince(impl_->begun);
  impl_->spans.clear();
  impl_->regions.clear();
  impl_->gpu_arena.reset();
  const double unmapped_ms = MillisecondsSince(impl_->begun);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> request, protocol::EncodePublishCommit(commit));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Frame frame,
                               Call(*impl_, request, MessageType::kPublishCommitted));
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::PublishCommitted done,
                               protocol::DecodePublishCommitted(frame.payload));
  LOG_DEBUG << "published " << done.tensor_count << " tensors (" << done.bytes << " bytes) to "
            << impl_->who << "; ms since Begin: connected " << impl_->connected_ms
            << ", arena mapped " << impl_->mapped_ms << ", commit called " << commit_ms
            << ", checksummed " << summed_ms << ", unmapped " << unmapped_ms << ", committed "
            << MillisecondsSince(impl_->begun);
  return Status::Ok();
}

}  // namespace weightcache
