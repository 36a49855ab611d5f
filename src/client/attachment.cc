#include <unistd.h>

#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "checkpoint/dtype.h"
#include "client/attachment_impl.h"
#include "client/tensor_table.h"
#include "common/logging.h"
#include "identity/device_inventory.h"
#include "identity/resolve.h"
#include "os/file_mapping.h"
#include "sharding/planner.h"

namespace weightcache {

std::string_view AttachSourceName(AttachSource source) {
  return source == AttachSource::kDaemon ? "daemon" : "fallback";
}

namespace client {
namespace {

// The manifest's tier must be ours. The tier is a CacheConfig field, so a matching Hello
// already implies it (defence in depth); a daemon that serves the other tier anyway is
// reported as the mismatch of that field, like any other.
Status CheckTier(const protocol::AttachReply& reply, Tier want, const std::string& who,
                 const std::string& socket, int64_t pid, MismatchDetails* mismatch) {
  const Tier theirs = reply.manifest.tier();
  if (theirs == want) {
    return Status::Ok();
  }
  // Spelt as CacheConfig::FieldText spells the tier field (a JSON string).
  const auto quoted = [](std::string_view name) { return "\"" + std::string(name) + "\""; };
  MismatchDetails details;
  details.fields.push_back(ToConfigFieldDiff(
      identity::FieldDiff{"tier", quoted(TierName(want)), quoted(TierName(theirs))}));
  details.daemon_socket = socket;
  details.daemon_pid = static_cast<int>(pid);
  Status status = MismatchStatus(who, details);
  if (mismatch != nullptr) *mismatch = std::move(details);
  return status;
}

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The last dtype seen: the manifest interns dtype names, so consecutive records usually point
// at the same bytes, and one checkpoint has a handful of dtypes, usually one.
struct DTypeCache {
  std::string_view bytes;  // the manifest's spelling it was parsed from
  checkpoint::DType dtype{};
  uint64_t bits = 0;
  std::string_view name;  // the static spelling (checkpoint::DTypeName)
};

// The manifest's slice as the client's (its length is the held shape's, checked by the
// decoder against the full length).
std::optional<TensorSlice> SliceOf(const protocol::TensorRecord& r) {
  if (!r.slice) return std::nullopt;
  return TensorSlice{r.slice->dim, r.slice->offset, static_cast<uint64_t>(r.shape[r.slice->dim]),
                     r.slice->full_length};
}

// What the manifest decoder leaves to its consumer, checked at attach: the records (discovery
// deferred them: on the gpu tier this runs on its own thread while the driver maps), each dtype
// known and each nbytes the element count times its size. Returns the tensors' total bytes.
// The table itself is built from the checked manifest on first use (BuildViews).
Result<uint64_t> CheckRecords(protocol::Manifest& manifest, const std::string& who) {
  if (Status s = manifest.ValidateRecords(); !s.ok()) return s.Context(who);
  const size_t count = manifest.tensor_count();
  DTypeCache cache;
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    const protocol::TensorRecord r = manifest.record(i);
    if (r.dtype.data() != cache.bytes.data() || r.dtype.size() != cache.bytes.size()) {
      auto dtype = checkpoint::ParseDType(r.dtype);
      if (!dtype.ok()) {
        return ProtocolError(who + ": tensor " + std::string(r.name) + " has unknown dtype \"" +
                             std::string(r.dtype) + "\"");
      }
      cache = {r.dtype, *dtype, checkpoint::DTypeBits(*dtype), checkpoint::DTypeName(*dtype)};
    }
    // The decoder checked that the element count does not overflow.
    uint64_t elements = 1;
    for (int64_t d : r.shape) elements *= static_cast<uint64_t>(d);
    uint64_t bits = 0;
    if (__builtin_mul_overflow(elements, cache.bits, &bits) || bits % 8 != 0 ||
        bits / 8 != r.nbytes) {
      return ProtocolError(who + ": tensor " + std::string(r.name) + " claims " +
                           std::to_string(r.nbytes) + " bytes for " + std::to_string(elements) +
                           " elements of " + std::string(r.dtype));
    }
    total += r.nbytes;  // bounded by the allocations' sizes, which the decoder checked
  }
  return total;
}

// The public table from a manifest CheckRecords passed, in one pass and with no per-tensor
// allocation: each Tensor's name, shape and strides point into the manifest (names are NUL-
// terminated there), its address is the allocation's base plus the offset. Records are in
// name order (checked by the decoder): no sort.
std::vector<Tensor> BuildViews(const protocol::Manifest& manifest,
                               std::span<const uint64_t> allocation_base) {
  const size_t count = manifest.tensor_count();
  std::vector<Tensor> views;
  views.reserve(count);
  // 1.3 MB at 10,000 tensors: in a fresh process, new memory faulted in a page at a time.
  os::PrefaultWritable(views.data(), count * sizeof(Tensor));
  DTypeCache cache;
  for (size_t i = 0; i < count; ++i) {
    const protocol::TensorRecord r = manifest.record(i);
    if (r.dtype.data() != cache.bytes.data() || r.dtype.size() != cache.bytes.size()) {
      // Known: CheckRecords parsed every record's dtype.
      const checkpoint::DType dtype = checkpoint::ParseDType(r.dtype).value();
      cache = {r.dtype, dtype, checkpoint::DTypeBits(dtype), checkpoint::DTypeName(dtype)};
    }
    views.push_back(Tensor{.name = r.name,
                           .dtype = cache.name,
                           .shape = r.shape,
                           .strides = r.strides,
                           .data = allocation_base[r.allocation] + r.offset,
                           .nbytes = r.nbytes,
                           .checksum = r.checksum,
                           .slice = SliceOf(r)});
  }
  return views;
}

// Keeps the checked manifest and what its table will be built from on first use.
void KeepManifest(protocol::Manifest manifest, std::vector<uint64_t> allocation_base,
                  uint64_t total_bytes, Attachment::Impl& impl) {
  impl.manifest = std::move(manifest);
  impl.table_bases = std::move(allocation_base);
  impl.table_from_manifest = true;
  impl.total_bytes = total_bytes;
}

}  // namespace

Status MapHostReply(protocol::AttachReply& reply, const std::string& who, HostMapping mapping,
                    Attachment::Impl& impl) {
  const auto& sizes = reply.manifest.allocation_sizes();
  if (reply.fds.size() != sizes.size()) {
    return ProtocolError(who + ": " + std::to_string(sizes.size()) + " allocations but " +
                         std::to_string(reply.fds.size()) + " fds");
  }
  const auto map_start = Clock::now();
  std::vector<os::MappedRegion> regions;
  std::vector<uint64_t> base;
  regions.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string what = who + ": allocation " + std::to_string(i);
    int fd = reply.fds[i].get();
    // Sealed means the file can never shrink under our mapping (no SIGBUS) nor change.
    Status sealed = os::CheckSealedReadOnly(fd);
    if (!sealed.ok()) return sealed.Context(what);
    auto size = os::FileSize(fd);
    if (!size.ok()) return size.status().Context(what);
    if (*size < sizes[i]) {
      return ProtocolError(what + " is " + std::to_string(*size) + " bytes, the manifest says " +
                           std::to_string(sizes[i]));
    }
    auto region = mapping == HostMapping::kCopyOnWrite ? os::MapCopyOnWrite(fd, sizes[i])
                                                       : os::MapReadOnly(fd, sizes[i]);
    if (!region.ok()) return region.status().Context(what);
    base.push_back(reinterpret_cast<uint64_t>(region->data()));
    regions.push_back(std::move(region).value());
  }
  reply.fds.clear();  // the mappings keep the memory; the fds would only pin it longer
  impl.timings.map_ms = MsSince(map_start);
  const auto table_start = Clock::now();
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t total, CheckRecords(reply.manifest, who));
  impl.timings.table_ms = MsSince(table_start);
  KeepManifest(std::move(reply.manifest), std::move(base), total, impl);
  impl.host_regions = std::move(regions);
  return Status::Ok();
}

Status MapGpuReply(const cuda::DriverApi* api, CUdevice device, protocol::AttachReply& reply,
                   const std::string& who, Attachment::Impl& impl) {
  const auto map_start = Clock::now();
  // Reserving fixes every allocation's address, so the table can be built while the driver
  // imports and maps (the driver's share is most of an attach, and flat in tensor count).
  auto arena = cuda::ImportedArena::Reserve(api, device, reply.manifest.allocation_sizes());
  if (!arena.ok()) return arena.status().Context(who);
  std::vector<uint64_t> base;
  for (const auto& a : arena->allocations()) base.push_back(a.ptr);

  std::optional<Result<uint64_t>> checked;
  Status mapped;
  const auto build = [&] {
    const auto table_start = Clock::now();
    checked.emplace(CheckRecords(reply.manifest, who));
    impl.timings.table_ms = MsSince(table_start);
  };
  impl.timings.table_concurrent = reply.manifest.tensor_count() >= kConcurrentTableMinTensors;
  if (impl.timings.table_concurrent) {
    std::jthread builder(build);  // joined at the end of this scope, also on errors
    mapped = arena->Map(std::move(reply.fds));
  } else {
    mapped = arena->Map(std::move(reply.fds));
    build();
  }
  impl.timings.map_ms = MsSince(map_start);
  // A bad entry unwinds the imported arena with everything else.
  if (!mapped.ok()) return mapped.Context(who);
  if (!checked->ok()) return checked->status();
  KeepManifest(std::move(reply.manifest), std::move(base), **checked, impl);
  impl.gpu_arena.emplace(std::move(arena).value());
  return Status::Ok();
}

namespace {

// The driver and the CUdevice of a gpu-tier attach, from the Env and the resolved device; kept
// in `impl` (verify uses them, never a second lookup).
Status OpenGpuDevice(const identity::Env& env, const ResolvedIdentity& id, Attachment::Impl& impl) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(impl.driver, env.load_driver());
  if (!id.device.has_value()) return InternalError("gpu tier attach without a resolved device");
  WEIGHTCACHE_ASSIGN_OR_RETURN(impl.cu_device, identity::CudaDevice(impl.driver, *id.device));
  impl.cuda_device = id.device->cuda_ordinal;
  return Status::Ok();
}

Status LoadFallback(const AttachOptions& options, const ResolvedIdentity& id,
                    const identity::Env& env, Attachment::Impl& impl) {
  const IdentityOptions& identity = options.identity;
  if (identity::IsPublishedSource(identity.source)) {
    return Status(StatusCode::kNoDaemon, "source " + identity.source +
                                             " has no checkpoint to load from disk (" +
                                             impl.source_reason + ")");
  }
  if (identity.model_dir.empty()) {
    return InvalidArgument("fallback load needs model_dir (" + impl.source_reason + ")");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint ckpt,
                               checkpoint::Checkpoint::Open(identity.model_dir));
  if (ckpt.fingerprint() != id.config.checkpoint_fingerprint) {
    return InvalidArgument("checkpoint_fingerprint " + id.config.checkpoint_fingerprint +
                           " does not match " + identity.model_dir + " (" + ckpt.fingerprint() +
                           ")");
  }
  // A sharded identity loads this rank's slices by the same plan a daemon would use.
  std::optional<sharding::ShardPlan> plan;
  if (id.shard.has_value()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        plan, sharding::PlanShard(ckpt, id.shard->rules, id.shard->model_config, id.shard->ranks));
  }
  if (identity.tier == Tier::kHost) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        HostFallback loaded,
        LoadHostFallback(ckpt, options.fallback_threads, plan ? &*plan : nullptr));
    impl.tensors = std::move(loaded.tensors);
    impl.host_fallback.emplace(std::move(loaded));
    return Status::Ok();
  }
  WEIGHTCACHE_RETURN_IF_ERROR(OpenGpuDevice(env, id, impl));
  WEIGHTCACHE_ASSIGN_OR_RETURN(GpuFallback loaded,
                               LoadGpuFallback(impl.driver, impl.cu_device, ckpt,
                                               options.fallback_threads, plan ? &*plan : nullptr));
  impl.tensors = std::move(loaded.tensors);
  impl.gpu_fallback.emplace(std::move(loaded));
  return Status::Ok();
}

// Attachment::Attach; `diagnostics` is filled as the attach goes (its code by the caller).
Result<Attachment> AttachAndDiagnose(const AttachOptions& options, const identity::Env& env,
                                     AttachDiagnostics& diagnostics) {
  const auto start = Clock::now();
  const Tier tier = options.identity.tier;
  WEIGHTCACHE_ASSIGN_OR_RETURN(ResolvedIdentity id,
                               identity::ResolveIdentity(options.identity, env));
  diagnostics.socket_path = id.paths.socket;
  diagnostics.device_key = id.device_key;
  auto impl = std::make_unique<Attachment::Impl>();
  impl->timings.resolve_ms = MsSince(start);
  impl->tier = tier;
  impl->socket_path = id.paths.socket;
  impl->device_key = id.device_key;
  impl->config_digest = id.config.Digest();

  // One deadline for the whole attach (docs/client.md "Deadlines"), counted from its start.
  DiscoveryPolicy policy;
  policy.start = start;
  policy.wait_timeout = options.wait_timeout;
  policy.wait_for_publisher = options.wait_for_publisher;
  const auto discover_start = Clock::now();
  // Discover fills it on every kMismatch it builds; one relayed from a daemon's Error frame
  // names no field, and then this says at least which daemon refused.
  MismatchDetails mismatch;
  mismatch.daemon_socket = id.paths.socket;
  auto found = Discover(id, policy, &mismatch, env);
  impl->timings.discover_ms = MsSince(discover_start);
  if (!found.ok()) {
    if (found.status().code() == StatusCode::kMismatch) {
      diagnostics.mismatch = std::move(mismatch);
    }
    if (found.status().code() != StatusCode::kMismatch ||
        options.on_mismatch != OnMismatch::kFallback) {
      return found.status();
    }
    impl->source_reason = "mismatch ignored (on_mismatch=fallback): " + found.status().message();
    LOG_WARN << impl->source_reason << "; loading from disk";
  } else if (found->session.has_value()) {
    DaemonSession& session = *found->session;
    const std::string who =
        "daemon at " + id.paths.socket + " (pid " + std::to_string(session.pid) + ")";
    if (Status tier = CheckTier(session.reply, options.identity.tier, who, id.paths.socket,
                                session.pid, &mismatch);
        !tier.ok()) {
      diagnostics.mismatch = std::move(mismatch);
      return tier;
    }
    if (tier == Tier::kHost) {
      WEIGHTCACHE_RETURN_IF_ERROR(MapHostReply(session.reply, who, options.host_mapping, *impl));
    } else {
      WEIGHTCACHE_RETURN_IF_ERROR(OpenGpuDevice(env, id, *impl));
      WEIGHTCACHE_RETURN_IF_ERROR(
          MapGpuReply(impl->driver, impl->cu_device, session.reply, who, *impl));
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(impl->watcher,
                                 DaemonWatcher::Create(std::move(session.connection)));
    impl->source = AttachSource::kDaemon;
    impl->daemon_pid = static_cast<int>(session.pid);
    impl->source_reason =
        "attached to " + who + (found->note.empty() ? "" : " (" + found->note + ")");
  } else {
    if (options.on_missing == OnMissing::kError) {
      return Status(found->missing_code, found->missing_reason + " (on_missing=error)");
    }
    impl->source_reason = found->missing_reason;
    LOG_INFO << found->missing_reason << "; loading " << options.identity.model_dir << " from disk";
  }
  if (impl->source == AttachSource::kFallback) {
    const auto fallback_start = Clock::now();
    WEIGHTCACHE_RETURN_IF_ERROR(LoadFallback(options, id, env, *impl));
    impl->timings.fallback_ms = MsSince(fallback_start);
    for (const Tensor& t : impl->tensors.tensors()) impl->total_bytes += t.nbytes;
  }
  impl->attach_ms = MsSince(start);
  return AttachmentAccess::Make(std::move(impl));
}

}  // namespace

Result<Attachment> Attach(const AttachOptions& options, const identity::Env& env,
                          AttachDiagnostics* diagnostics) {
  AttachDiagnostics unused;
  AttachDiagnostics& d = diagnostics != nullptr ? *diagnostics : unused;
  d = AttachDiagnostics{};
  Result<Attachment> result = AttachAndDiagnose(options, env, d);
  d.code = result.ok() ? StatusCode::kOk : result.status().code();
  return result;
}

}  // namespace client

Result<Attachment> Attachment::Attach(const AttachOptions& options) {
  return Attach(options, nullptr);
}

Result<Attachment> Attachment::Attach(const AttachOptions& options,
                                      AttachDiagnostics* diagnostics) {
  return client::Attach(options, identity::Env::Default(), diagnostics);
}

Attachment::Attachment(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Attachment::Attachment(Attachment&& other) noexcept = default;
Attachment& Attachment::operator=(Attachment&& other) noexcept = default;
Attachment::~Attachment() = default;

const client::TensorTable& Attachment::Impl::Table() {
  if (table_from_manifest) {
    std::call_once(table_once, [this] {
      tensors = client::TensorTable::FromViews(client::BuildViews(manifest, table_bases));
    });
  }
  return tensors;
}

const std::vector<Tensor>& Attachment::tensors() const { return impl_->Table().tensors(); }
const Tensor* Attachment::Find(std::string_view name) const { return impl_->Table().Find(name); }
uint64_t Attachment::total_bytes() const { return impl_->total_bytes; }
Tier Attachment::tier() const { return impl_->tier; }
AttachSource Attachment::source() const { return impl_->source; }
std::string_view Attachment::metadata() const { return impl_->manifest.metadata(); }
const std::string& Attachment::source_reason() const { return impl_->source_reason; }
const std::string& Attachment::socket_path() const { return impl_->socket_path; }
const std::string& Attachment::device_key() const { return impl_->device_key; }
int Attachment::cuda_device() const { return impl_->cuda_device; }
const std::string& Attachment::config_digest() const { return impl_->config_digest; }
int Attachment::daemon_pid() const { return impl_->daemon_pid; }
double Attachment::attach_ms() const { return impl_->attach_ms; }
const AttachTimings& Attachment::timings() const { return impl_->timings; }
bool Attachment::daemon_alive() const { return impl_->watcher && impl_->watcher->alive(); }
void Attachment::OnDaemonGone(std::function<void()> callback) {
  if (impl_->watcher) impl_->watcher->OnGone(std::move(callback));
}

}  // namespace weightcache
