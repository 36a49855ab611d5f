// The fleet's registration of a served cache (registration.h), in a build with the fleet.
#include "serve/registration.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "common/hash.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/test_hooks.h"
#include "daemon/served_device_memory.h"
#include "fleet/arena_transfer.h"
#include "fleet/registrar.h"
#include "identity/device_inventory.h"
#include "launcher/serve_daemons.h"
#include "os/file_mapping.h"
#include "os/host_name.h"
#include "os/memfd.h"
#include "os/read_file.h"
#include "protocol/manifest.h"
#include "serve/fleet_registry.h"

namespace weightcache::serve {

static_assert(kDefaultRegistryPrefix == fleet::kDefaultRegistryPrefix,
              "serve/fleet_options.h names the registry's default prefix");

bool FleetBuilt() { return true; }

// Members in acquisition order: the server, destroyed first, stops reading the memory.
// Declared in the order they are acquired; destroyed in reverse: the server (which stops
// reading) first, then the memory it served, then the context that memory is mapped in.
struct FillSource {
  // gpu tier: the allocations, mapped in the primary context current on the server's thread
  std::optional<daemon::ServedDeviceMemory> device;
  std::vector<os::MappedRegion> mappings;  // host tier: the sealed memfds, read-only
  std::vector<uint8_t> poisoned;           // WEIGHTCACHE_TEST_FILL_POISON's copy
  std::unique_ptr<fleet::ArenaServer> server;
};

// What a registration holds and does; Registration forwards to it.
class Registration::Impl {
 public:
  Impl(std::unique_ptr<fleet::Registrar> registrar_in, fleet::RegistryEntry entry_in,
       Tier configured_in, std::optional<identity::DeviceInfo> device_in, FleetOptions options_in,
       fleet::PeerAllowList allow_in, FleetAnchor anchor_in)
      : registrar_(std::move(registrar_in)),
        options_(std::move(options_in)),
        allow_(std::move(allow_in)),
        entry_(std::move(entry_in)),
        configured_(configured_in),
        device_(std::move(device_in)),
        anchor_(std::move(anchor_in)) {}

  daemon::PeerFill Filler() const;
  void Ready(const daemon::StoreSummary& summary, std::span<const int> fds,
             std::span<const CUmemGenericAllocationHandle> creating_handles);
  void Moved(Tier tier, std::span<const int> fds);
  void Draining();
  void HandoverFailed(std::span<const int> fds,
                      std::span<const CUmemGenericAllocationHandle> creating_handles);
  void PublishLocked() WEIGHTCACHE_REQUIRES(mu_);
  // Starts the fill source over `fds` when --fill-serve is given and none runs (a failure is
  // logged: the cache serves on without one).
  void StartFillSourceLocked(std::span<const int> fds,
                             std::span<const CUmemGenericAllocationHandle> creating_handles)
      WEIGHTCACHE_REQUIRES(mu_);
  void StopFillSource();
  bool ServesFill() const { return !options_.fill_serve.empty(); }
  // The destructor's: the registrar stops (its lease revoked), then the fill source.
  void Stop() {
    if (registrar_) registrar_->Stop();
    StopFillSource();
  }

 private:
  std::unique_ptr<fleet::Registrar> registrar_;
  const FleetOptions options_;
  const fleet::PeerAllowList allow_;
  mutable Mutex mu_;
  // The fill source (--fill-serve) once ready.
  std::unique_ptr<FillSource> fill_ WEIGHTCACHE_GUARDED_BY(mu_);
  fleet::RegistryEntry entry_ WEIGHTCACHE_GUARDED_BY(mu_);
  bool ready_ WEIGHTCACHE_GUARDED_BY(mu_) = false;
  // The ready store's encoded manifest (what the fill source sends in its hello), kept for a
  // gpu-tier source started again after a promotion.
  std::vector<uint8_t> manifest_ WEIGHTCACHE_GUARDED_BY(mu_);
  const Tier configured_;
  const std::optional<identity::DeviceInfo> device_;  // the gpu tier's device
  const FleetAnchor anchor_;                          // in the fleet key; a fill proves it
};

Result<fleet::EtcdClient> RegistryClient(const FleetOptions& asked) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::EtcdOptions options, fleet::ParseRegistryUrl(asked.url));
  options.tls.ca_file = asked.ca_file;
  options.tls.cert_file = asked.cert_file;
  options.tls.key_file = asked.key_file;
  const bool tls = asked.url.rfind("etcds://", 0) == 0;
  if (!tls && (!asked.ca_file.empty() || !asked.cert_file.empty() || !asked.key_file.empty())) {
    return InvalidArgument(
        "--registry-ca/--registry-cert/--registry-key need an etcds:// registry");
  }
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(asked.timeout_s * 1000));
  for (const std::string* file : {&asked.ca_file, &asked.cert_file, &asked.key_file}) {
    if (!file->empty() && ::access(file->c_str(), R_OK) != 0) {
      return IoError("registry TLS file " + *file, errno);
    }
  }
  auto client = fleet::EtcdClient::Create(std::move(options));
  if (!client.ok()) return Status(client.status()).Context("--registry");
  return client;
}

namespace {

// The sources --fill-from lists ("HOST:PORT[,HOST:PORT...]"), or kInvalidArgument.
Result<std::vector<std::string>> ListedSources(const std::string& fill_from) {
  std::vector<std::string> sources;
  size_t at = 0;
  while (at <= fill_from.size()) {
    const size_t comma = std::min(fill_from.find(',', at), fill_from.size());
    const std::string source = fill_from.substr(at, comma - at);
    if (!fleet::IsEndpoint(source)) {
      return InvalidArgument("--fill-from: \"" + fill_from +
                             "\" is neither \"registry\" nor HOST:PORT[,HOST:PORT...] (\"" +
                             source + "\" is not HOST:PORT)");
    }
    sources.push_back(source);
    at = comma + 1;
  }
  if (sources.size() > fleet::kMaxFetchSources) {
    return InvalidArgument("--fill-from lists " + std::to_string(sources.size()) +
                           " sources; a fill connects to at most " +
                           std::to_string(fleet::kMaxFetchSources));
  }
  return sources;
}

// The rules between the fleet options, for serve and for launch before it starts a daemon; the
// parsed --fill-allow (empty without it).
Result<fleet::PeerAllowList> CheckFleetFlags(const FleetOptions& options) {
  if (options.fill_from == "registry" && options.url.empty()) {
    return InvalidArgument(
        "--fill-from registry needs --registry (or list the sources: "
        "--fill-from HOST:PORT[,HOST:PORT...])");
  }
  if (!options.fill_from.empty() && options.fill_from != "registry") {
    WEIGHTCACHE_RETURN_IF_ERROR(ListedSources(options.fill_from).status());
  }
  if (options.fill_trust != kFillTrustContent && options.fill_from.empty()) {
    return InvalidArgument(
        "--fill-trust is how --fill-from checks what it pulls: give --fill-from "
        "too");
  }
  if (!options.fill_content_sha256.empty() && options.url.empty() && options.fill_from.empty() &&
      options.fill_serve.empty()) {
    return InvalidArgument(
        "--fill-content-sha256 anchors the fleet key and the fill: give --registry, "
        "--fill-from or --fill-serve too");
  }
  if (!options.fill_allow.empty() && options.fill_serve.empty()) {
    return InvalidArgument("--fill-allow is the peer list of --fill-serve: give --fill-serve too");
  }
  if (!options.fill_serve.empty() && options.fill_allow.empty()) {
    return InvalidArgument("--fill-serve needs --fill-allow (the peers that may fill from it)");
  }
  // The entry names the bound endpoint unless --advertise does: "0.0.0.0:7400" would send every
  // other node to its own host.
  if (!options.url.empty() && options.advertise.empty() &&
      fleet::IsWildcardEndpoint(options.fill_serve)) {
    return InvalidArgument("--fill-serve " + options.fill_serve +
                           " listens on every address, and the registry entry needs one other "
                           "nodes can reach: give --advertise HOST:PORT (this node's address and "
                           "the port it serves at)");
  }
  if (options.fill_allow.empty()) return fleet::PeerAllowList();
  auto parsed = fleet::PeerAllowList::Parse(options.fill_allow);
  if (!parsed.ok()) return Status(parsed.status()).Context("--fill-allow");
  return parsed;
}

}  // namespace

Status CheckFleetOptions(const FleetOptions& options) { return CheckFleetFlags(options).status(); }

Result<FleetOptions> FleetOptionsForRank(const FleetOptions& options, int rank) {
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFleetOptions(options));
  FleetOptions out = options;
  for (std::string* file :
       {&out.ca_file, &out.cert_file, &out.key_file, &out.fill_content_sha256}) {
    if (!file->empty()) *file = std::filesystem::absolute(*file).string();
  }
  if (!options.fill_from.empty() && options.fill_from != "registry") {
    // Rank r of a source node serves at --fill-serve's PORT + r: so does each listed source.
    out.fill_from.clear();
    WEIGHTCACHE_ASSIGN_OR_RETURN(const std::vector<std::string> sources,
                                 ListedSources(options.fill_from));
    for (const std::string& source : sources) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          std::string ranked,
          launcher::AddrForRank("--fill-from", source, rank, launcher::RankedAddr::kHostPort));
      out.fill_from += (out.fill_from.empty() ? "" : ",") + ranked;
    }
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(out.advertise,
                               launcher::AddrForRank("--advertise", options.advertise, rank,
                                                     launcher::RankedAddr::kHostPort));
  WEIGHTCACHE_ASSIGN_OR_RETURN(out.fill_serve,
                               launcher::AddrForRank("--fill-serve", options.fill_serve, rank,
                                                     launcher::RankedAddr::kHostPort));
  return out;
}

Result<FleetAnchor> LookUpFleetAnchor(const FleetOptions& options, const std::string& model_dir,
                                      const identity::CacheConfig& config) {
  FleetAnchor out;
  if (identity::IsPublishedSource(config.source)) {
    if (!options.fill_content_sha256.empty()) {
      return InvalidArgument("--fill-content-sha256: a published cache reads no checkpoint");
    }
    out.why_none = "a published cache reads no checkpoint";
    return out;
  }
  auto anchor = checkpoint::FindContentAnchor(model_dir, options.fill_content_sha256);
  if (anchor.ok()) {
    out.anchor = std::make_shared<const checkpoint::ContentAnchor>(std::move(anchor).value());
  } else if (anchor.status().code() == StatusCode::kNotFound) {
    out.why_none = anchor.status().message();
  } else {
    return anchor.status();
  }
  return out;
}

std::string FleetKey(const identity::CacheConfig& config, const FleetAnchor& anchor) {
  return config.FleetDigest(anchor.anchor ? anchor.anchor->Digest() : std::string());
}

Result<std::unique_ptr<Registration>> Registration::Create(const FleetOptions& options,
                                                           const identity::ResolvedIdentity& id,
                                                           const std::string& model_dir) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::PeerAllowList allow, CheckFleetFlags(options));
  const bool fill = !options.fill_from.empty() || !options.fill_serve.empty();
  if (options.url.empty() && !fill) return std::unique_ptr<Registration>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(FleetAnchor anchor,
                               LookUpFleetAnchor(options, model_dir, id.config));
  if (anchor.anchor) {
    LOG_INFO << "fleet: content anchor " << anchor.anchor->Digest().substr(0, 16) << " ("
             << anchor.anchor->shards.size() << " file(s), " << anchor.anchor->Describe()
             << ") in the fleet key";
  } else {
    LOG_INFO << "fleet: no content anchor (" << anchor.why_none
             << "): the fleet key holds the headers only";
  }
  fleet::RegistryEntry entry;
  entry.fleet_key = FleetKey(id.config, anchor);
  entry.digest = id.config.Digest();
  if (options.node_name.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(entry.node, os::HostName());
  } else {
    entry.node = options.node_name;
  }
  if (Status node = fleet::ValidateNodeName(entry.node); !node.ok()) {
    return Status(node).Context(options.node_name.empty() ? "the hostname (give --node-name)"
                                                          : "--node-name");
  }
  entry.endpoint = options.advertise;
  entry.tier = id.config.tier;
  entry.device = id.device_key;
  entry.pid = ::getpid();
  entry.model_id = id.config.model_id;
  entry.revision = id.config.revision;
  entry.tp_rank = id.config.tp_rank;
  entry.tp_size = id.config.tp_size;
  entry.pp_rank = id.config.pp_rank;
  entry.pp_size = id.config.pp_size;
  entry.ep_rank = id.config.ep_rank;
  entry.ep_size = id.config.ep_size;
  if (Status valid = entry.Validate(); !valid.ok()) {
    return Status(valid).Context(valid.message().find("endpoint") != std::string::npos
                                     ? "--advertise (HOST:PORT)"
                                     : "the registry entry");
  }
  // Without --registry the fill options work alone: listed sources, a source nobody registers.
  std::unique_ptr<fleet::Registrar> registrar;
  if (!options.url.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::EtcdClient client, RegistryClient(options));
    fleet::RegistrarOptions registrar_options;
    registrar_options.prefix = options.prefix;
    registrar_options.ttl = std::chrono::seconds(options.ttl_s);
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        registrar, fleet::Registrar::Create(std::move(client), std::move(registrar_options)));
    LOG_INFO << "registry: " << options.url << ", key " << fleet::EntryKey(options.prefix, entry)
             << " (registered once the cache is ready)";
  }
  return std::unique_ptr<Registration>(new Registration(
      std::make_unique<Impl>(std::move(registrar), std::move(entry), id.config.tier, id.device,
                             options, std::move(allow), std::move(anchor))));
}

Registration::Registration(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Registration::~Registration() { impl_->Stop(); }

void Registration::Impl::PublishLocked() {
  if (!registrar_) return;
  Status published = registrar_->Publish(entry_);
  if (!published.ok()) {
    LOG_WARN << "registry: " << published.ToString();
  }
}

namespace {

// The encoded manifest the daemon serves its clients, copied out of its sealed memfd.
Result<std::vector<uint8_t>> ReadManifest(const daemon::ManifestFile& manifest) {
  if (!manifest.fd.valid() || manifest.size == 0) return InternalError("the store has no manifest");
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::ReadOnlyMapping mapping,
                               os::ReadOnlyMapping::Map(manifest.fd.get(), "the cache manifest"));
  if (mapping.size() < manifest.size) return InternalError("the manifest memfd is short");
  const auto* bytes = reinterpret_cast<const uint8_t*>(mapping.data());
  return std::vector<uint8_t>(bytes, bytes + manifest.size);
}

// Test seams (tests/integration/fleet_fill_test.cc), read from the environment:
//  * WEIGHTCACHE_TEST_FILL_POISON=1 on a source: it serves allocation 0 with its first byte
//    flipped (a poisoned node), from a copy; the memfds are untouched.
//  * WEIGHTCACHE_TEST_FILL_STRIPE_BYTES=N on a filler: stripes of N bytes (a small checkpoint
//    then takes several), one read in flight.
//  * WEIGHTCACHE_TEST_FILL_PAUSE_FIFO=PATH on a filler: after its first stripe, it opens that
//    FIFO and reads it to its end (the stripe is reported as the load's progress first), so a
//    test can see the progress and kill the source mid-transfer, then let go.
// All three are compiled out of release builds (common/test_hooks.h).
bool PoisonFillForTest() { return TestHookValue(TestHook::kFillPoison) == "1"; }

void ApplyFillTestHooks(fleet::FetchOptions* fetch) {
  if (const std::optional<std::string> stripe = TestHookValue(TestHook::kFillStripeBytes)) {
    const uint64_t bytes = std::strtoull(stripe->c_str(), nullptr, 10);
    if (bytes > 0) {
      fetch->stripe_bytes = bytes;
      fetch->max_in_flight_per_source = 1;
    }
  }
  std::optional<std::string> fifo = TestHookValue(TestHook::kFillPauseFifo);
  if (!fifo) return;
  fetch->progress = [path = std::move(*fifo), paused = false, report = std::move(fetch->progress)](
                        uint64_t done, uint64_t total) mutable {
    if (report) report(done, total);
    if (paused) return;
    paused = true;
    os::WaitForFifoEof(path.c_str());
  };
}

// The gpu tier's memory to serve, mapped into the device's primary context, which the server's
// progress thread makes current (UCX's CUDA transports copy from there): what
// daemon::ServedDeviceMemory maps (the store's creating handles, else an import of its fds).
Status MapDeviceMemory(const identity::DeviceInfo& info, std::span<const int> fds,
                       std::span<const CUmemGenericAllocationHandle> creating_handles,
                       const std::vector<uint64_t>& sizes, FillSource* source,
                       fleet::ArenaServerOptions* options) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(daemon::ServedDeviceMemory memory,
                               daemon::ServedDeviceMemory::Map(info, fds, creating_handles, sizes));
  for (const std::span<const uint8_t> region : memory.regions()) {
    options->regions.push_back({region.data(), region.size(), fleet::RegionMemory::kCuda});
  }
  // By value: `source` is moved once the server runs (the context stays retained by it).
  options->on_progress_thread = memory.OnThread();
  source->device.emplace(std::move(memory));
  return Status::Ok();
}

Result<FillSource> StartFillSource(const FleetOptions& asked, const fleet::PeerAllowList& allow,
                                   std::vector<uint8_t> manifest_bytes, std::span<const int> fds,
                                   std::span<const CUmemGenericAllocationHandle> creating_handles,
                                   Tier tier, const std::optional<identity::DeviceInfo>& device) {
  FillSource source;
  fleet::ArenaServerOptions options;
  options.listen = asked.fill_serve;
  options.allow = allow;
  options.manifest = std::move(manifest_bytes);
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Manifest manifest,
                               protocol::Manifest::Decode(options.manifest));
  if (manifest.allocation_sizes().size() != fds.size()) {
    return InternalError("the store has " + std::to_string(fds.size()) +
                         " allocations, its manifest " +
                         std::to_string(manifest.allocation_sizes().size()));
  }
  if (tier == Tier::kGpu) {
    if (!device) return InternalError("a gpu-tier cache without its device");
    WEIGHTCACHE_RETURN_IF_ERROR(MapDeviceMemory(*device, fds, creating_handles,
                                                manifest.allocation_sizes(), &source, &options));
  } else {
    for (size_t a = 0; a < fds.size(); ++a) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion region,
                                   os::MapReadOnly(fds[a], manifest.allocation_sizes()[a]));
      options.regions.push_back({region.data(), region.size()});
      source.mappings.push_back(std::move(region));
    }
    if (PoisonFillForTest() && !options.regions.empty()) {
      const auto* first = static_cast<const uint8_t*>(options.regions[0].data);
      source.poisoned.assign(first, first + options.regions[0].bytes);
      source.poisoned[0] ^= 0xff;
      options.regions[0].data = source.poisoned.data();
      LOG_WARN << "fill source: " << TestHookName(TestHook::kFillPoison)
               << ": serving allocation 0 with its first byte flipped";
    }
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(source.server, fleet::ArenaServer::Start(std::move(options)));
  return source;
}

}  // namespace

void Registration::Impl::StartFillSourceLocked(
    std::span<const int> fds, std::span<const CUmemGenericAllocationHandle> creating_handles) {
  if (options_.fill_serve.empty() || fill_) return;
  auto started =
      StartFillSource(options_, allow_, manifest_, fds, creating_handles, configured_, device_);
  if (!started.ok()) {
    LOG_WARN << "fill source: not serving: " << started.status().ToString();
    return;
  }
  fill_ = std::make_unique<FillSource>(std::move(started).value());
  LOG_INFO << "fill source: serving the arena at " << fill_->server->endpoint() << " to "
           << allow_.ToString() << " (" << TierName(configured_) << " memory)";
  if (options_.advertise.empty()) entry_.endpoint = fill_->server->endpoint();
}

void Registration::Impl::Ready(const daemon::StoreSummary& summary, std::span<const int> fds,
                               std::span<const CUmemGenericAllocationHandle> creating_handles) {
  // The manifest, read once: its digest goes into the entry, its bytes into the fill source's
  // hello.
  auto manifest = ReadManifest(summary.manifest);
  std::string manifest_digest;
  if (manifest.ok()) {
    manifest_digest = Sha256Hex(
        std::string_view(reinterpret_cast<const char*>(manifest->data()), manifest->size()));
  } else {
    LOG_WARN << "registry: no manifest digest: " << manifest.status().ToString();
  }
  MutexLock lock(mu_);
  if (!options_.fill_serve.empty()) {
    if (manifest.ok()) {
      manifest_ = std::move(manifest).value();
      StartFillSourceLocked(fds, creating_handles);
    } else {
      LOG_WARN << "fill source: not serving: " << manifest.status().ToString();
    }
  }
  ready_ = true;
  entry_.bytes = summary.tensor_bytes;
  entry_.tensors = summary.tensor_count;
  entry_.manifest_digest = manifest_digest;
  entry_.state = fleet::EntryState::kReady;
  entry_.tier = configured_;
  PublishLocked();
}

void Registration::Impl::Moved(Tier tier, std::span<const int> fds) {
  if (tier != configured_) StopFillSource();  // its mapping of the GPU memory goes first
  MutexLock lock(mu_);
  if (!ready_) return;
  entry_.tier = tier;
  entry_.state = tier == configured_ ? fleet::EntryState::kReady : fleet::EntryState::kDemoted;
  // A promotion's new allocations were released to their fds (cuda::CopyMemfdsToDevice): the
  // source serves an import of them.
  if (tier == configured_ && !manifest_.empty()) StartFillSourceLocked(fds, {});
  PublishLocked();
}

void Registration::Impl::Draining() {
  {
    MutexLock lock(mu_);
    if (ready_) {
      entry_.state = fleet::EntryState::kDraining;
      PublishLocked();
    }
  }
  if (registrar_) registrar_->Withdraw();
  StopFillSource();
}

void Registration::Impl::HandoverFailed(
    std::span<const int> fds, std::span<const CUmemGenericAllocationHandle> creating_handles) {
  MutexLock lock(mu_);
  // Served again only where it served before: a ready cache in its own tier.
  if (!ready_ || manifest_.empty() || entry_.tier != configured_) return;
  StartFillSourceLocked(fds, creating_handles);
  PublishLocked();  // the endpoint, when the entry names the bound one
}

void Registration::Impl::StopFillSource() {
  MutexLock lock(mu_);
  if (!fill_) return;
  fill_->server->Stop();
  LOG_INFO << "fill source: stopped (" << fill_->server->peers_accepted() << " peer(s) served)";
  fill_.reset();
  // Without --advertise the entry named the server's endpoint, which is gone now.
  if (options_.advertise.empty()) entry_.endpoint.clear();
}

std::vector<fleet::RegistryEntry> ChooseFillSources(std::vector<fleet::RegistryEntry> entries,
                                                    Tier tier, std::string_view node,
                                                    std::mt19937_64& rng) {
  // Ourselves excluded: an entry of this node is never a source of its own fill. A source of
  // another tier has another layout (allocation granularity): not one.
  std::erase_if(entries, [&](const fleet::RegistryEntry& e) {
    return e.state != fleet::EntryState::kReady || e.endpoint.empty() || e.tier != tier ||
           e.node == node;
  });
  if (entries.size() > fleet::kMaxFetchSources) {
    std::shuffle(entries.begin(), entries.end(), rng);
    LOG_INFO << "fill: " << entries.size() << " ready sources; " << fleet::kMaxFetchSources
             << " chosen at random";
    entries.resize(fleet::kMaxFetchSources);
  }
  return entries;
}

daemon::PeerFill Registration::Impl::Filler() const {
  if (options_.fill_from.empty()) return {};
  // --fill-trust content: the loader proves the bytes against this before ready; null under
  // --fill-trust fleet.
  std::shared_ptr<const checkpoint::ContentAnchor> prove;
  if (options_.fill_trust == kFillTrustContent) {
    if (!anchor_.anchor) {
      const std::string why =
          "fill not attempted: --fill-trust content proves the filled bytes against our own "
          "checkpoint's SHA-256s, and it records none (" +
          anchor_.why_none +
          "); give them: serve a Hugging Face hub cache snapshot (blobs named by their SHA-256), "
          "a `huggingface-cli download --local-dir` directory (its .cache/huggingface/download "
          "metadata), or --fill-content-sha256 FILE; or trust the fleet's checksums with "
          "--fill-trust fleet";
      return [why](const daemon::PeerFillRequest&) -> Result<daemon::FillOutcome> {
        return Status(StatusCode::kUnavailable, why);
      };
    }
    prove = anchor_.anchor;
  }
  MutexLock lock(mu_);
  return [flags = options_, fleet_key = entry_.fleet_key, node = entry_.node, tier = configured_,
          prove](const daemon::PeerFillRequest& request) -> Result<daemon::FillOutcome> {
    if (prove && !request.holds_whole_files) {
      return Status(StatusCode::kUnavailable,
                    "fill not attempted: this cache holds slices of tensors (a rank of sharding "
                    "rules), which --fill-trust content cannot prove against the files' SHA-256s; "
                    "--fill-trust fleet trusts the sources' checksums and the disk sample instead");
    }
    fleet::FetchOptions fetch;
    std::vector<std::string> nodes;  // what the log calls each source
    if (flags.fill_from != "registry") {
      WEIGHTCACHE_ASSIGN_OR_RETURN(fetch.sources, ListedSources(flags.fill_from));
      nodes.assign(fetch.sources.size(), "listed");
    } else {
      WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::EtcdClient client, RegistryClient(flags));
      WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<fleet::RegistryEntry> entries,
                                   fleet::LookupSources(client, flags.prefix, fleet_key));
      std::mt19937_64 rng(std::random_device{}());
      const size_t listed = entries.size();
      std::vector<fleet::RegistryEntry> ready =
          ChooseFillSources(std::move(entries), tier, node, rng);
      if (ready.empty()) {
        return Status(StatusCode::kNotFound,
                      "no ready " + std::string(TierName(tier)) +
                          "-tier source with an endpoint among the registry's " +
                          std::to_string(listed) + " entries of fleet key " +
                          fleet_key.substr(0, 16));
      }
      for (fleet::RegistryEntry& e : ready) {
        fetch.sources.push_back(std::move(e.endpoint));
        nodes.push_back(std::move(e.node));
      }
    }
    const fleet::RegionMemory memory = request.memory == daemon::FillMemory::kDevice
                                           ? fleet::RegionMemory::kCuda
                                           : fleet::RegionMemory::kHost;
    for (const std::span<uint8_t> allocation : request.allocations) {
      fetch.destination.push_back({allocation.data(), allocation.size(), memory});
    }
    fetch.accept = [&request](const std::string& /*source*/, std::span<const uint8_t> manifest) {
      return request.accept(manifest);
    };
    fetch.progress = request.progress;  // the load's: `status` and launch show the pull
    fetch.cancel = request.cancel;      // a stop during the pull ends it
    ApplyFillTestHooks(&fetch);
    std::string listed;
    for (size_t i = 0; i < fetch.sources.size(); ++i) {
      listed += (i == 0 ? "" : ", ") + nodes[i] + " " + fetch.sources[i];
    }
    LOG_INFO << "fill: pulling into " << fleet::RegionMemoryName(memory) << " memory from "
             << fetch.sources.size() << " source(s): " << listed;
    WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::FetchResult result, fleet::FetchArena(fetch));
    std::string each;
    size_t used = 0;
    for (size_t i = 0; i < result.sources.size(); ++i) {
      if (!result.sources[i].used || result.sources[i].bytes == 0) continue;
      each += std::string(used++ == 0 ? "" : ", ") + nodes[i] + " " + result.sources[i].endpoint +
              " " + std::to_string(result.sources[i].bytes) + " bytes";
    }
    char rate[160];
    std::snprintf(rate, sizeof(rate),
                  " in %.3f s, %.2f GB/s (setup %.3f s, then %.3f s of reads at %.2f GB/s)",
                  result.seconds, result.gb_per_s, result.setup_seconds, result.transfer_seconds,
                  result.transfer_gb_per_s);
    return daemon::FillOutcome{"fleet", std::to_string(used) + " source(s) (" + each + ")" + rate,
                               prove};
  };
}

daemon::PeerFill Registration::Filler() const { return impl_->Filler(); }
bool Registration::ServesFill() const { return impl_->ServesFill(); }
void Registration::Ready(const daemon::StoreSummary& summary, std::span<const int> fds,
                         std::span<const CUmemGenericAllocationHandle> creating_handles) {
  impl_->Ready(summary, fds, creating_handles);
}
void Registration::Moved(Tier tier, std::span<const int> fds) { impl_->Moved(tier, fds); }
void Registration::Draining() { impl_->Draining(); }
void Registration::HandingOver() { impl_->StopFillSource(); }
void Registration::HandoverFailed(std::span<const int> fds,
                                  std::span<const CUmemGenericAllocationHandle> creating_handles) {
  impl_->HandoverFailed(fds, creating_handles);
}

}  // namespace weightcache::serve
