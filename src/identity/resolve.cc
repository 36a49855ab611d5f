#include "identity/resolve.h"

#include <unistd.h>

#include <charconv>
#include <nlohmann/json.hpp>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "common/hash.h"
#include "identity/fingerprint_cache.h"
#include "os/read_file.h"

namespace weightcache::identity {
namespace {

constexpr size_t kMaxQuantizationConfigBytes = 1 << 20;

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
std::string DefaultGpuSpec(const Env& env) {
  auto api = env.load_driver();
  if (!api.ok()) return "0";
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  if ((*api)->cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != nullptr &&
      (*api)->cuCtxGetDevice(&dev) == CUDA_SUCCESS) {
    return std::to_string(dev);
  }
  return "0";
}

// The CacheConfig fields of `options` but the shard digest, validated (CacheConfig::Validate
// names a bad rank by its field before the sharding rules are looked at).
Result<CacheConfig> BuildConfig(const IdentityOptions& options, const std::string& fingerprint,
                                const std::string& files_digest);

}  // namespace

bool IsSharded(const IdentityOptions& options) {
  return options.tp_size > 1 || options.pp_size > 1 || options.ep_size > 1 ||
         !options.shard_rules.empty();
}

Result<std::optional<ShardSpec>> ResolveShardSpec(const IdentityOptions& options) {
  if (!IsSharded(options)) return std::optional<ShardSpec>();
  ShardSpec spec;
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.tp_size, Rank("tp_size", options.tp_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.tp_rank, Rank("tp_rank", options.tp_rank));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.pp_size, Rank("pp_size", options.pp_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.pp_rank, Rank("pp_rank", options.pp_rank));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.ep_size, Rank("ep_size", options.ep_size));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.ranks.ep_rank, Rank("ep_rank", options.ep_rank));
  WEIGHTCACHE_RETURN_IF_ERROR(sharding::ValidateRanks(spec.ranks));
  WEIGHTCACHE_ASSIGN_OR_RETURN(spec.model_config, sharding::ReadModelConfig(options.model_dir));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      spec.rules, sharding::SelectRuleSet(options.shard_rules, spec.model_config.model_type));
  nlohmann::json model_config = {{"integers", nlohmann::json::object()},
                                 {"model_type", spec.model_config.model_type},
                                 {"tie_word_embeddings", spec.model_config.tie_word_embeddings}};
  for (const auto& [key, value] : spec.model_config.integers) {
    model_config["integers"][key] = value;
  }
  // nlohmann::json keeps object keys sorted (byte order = Python's code point order).
  const nlohmann::json doc = {{"model_config", std::move(model_config)},
                              {"rules", nlohmann::json::parse(spec.rules.canonical_json)}};
  spec.digest = Sha256Hex(doc.dump(-1, ' ', /*ensure_ascii=*/true));
  return std::optional<ShardSpec>(std::move(spec));
}

Result<std::vector<uid_t>> TrustedUids(const std::vector<uint32_t>& configured,
                                       const EnvLookup& env) {
  std::vector<uid_t> uids{::geteuid()};
  if (!configured.empty()) {
    uids.insert(uids.end(), configured.begin(), configured.end());
    return uids;
  }
  const std::string list = env(kTrustedUidsEnv).value_or("");
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

Result<CacheConfig> BuildCacheConfig(const IdentityOptions& options, const std::string& fingerprint,
                                     const std::string& files_digest) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(CacheConfig c, BuildConfig(options, fingerprint, files_digest));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::optional<ShardSpec> shard, ResolveShardSpec(options));
  if (shard) c.shard_rules_digest = shard->digest;
  return c;
}

namespace {

Result<CacheConfig> BuildConfig(const IdentityOptions& options, const std::string& fingerprint,
                                const std::string& files_digest) {
  CacheConfig c;
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
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, os::ReadSmallFile(options.quantization_config,
                                                                     kMaxQuantizationConfigBytes));
    auto digest = QuantizationConfigDigest(text);
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

}  // namespace

bool IsPublishedSource(std::string_view source) { return source.starts_with("published:"); }

std::string PublishedSourceDigest(std::string_view source) {
  return Sha256Hex("weightcache published source\n" + std::string(source));
}

Result<ResolvedIdentity> ResolveIdentity(const IdentityOptions& options, const Env& env) {
  const bool published = IsPublishedSource(options.source);
  if (options.model_dir.empty() && !published) {
    return InvalidArgument(
        "model_dir is required (its files define the checkpoint fingerprint and identity)");
  }
  // The identity covers the files' content through their stat identity (checkpoint_files),
  // never through the path this process sees them by; headers are read only when the
  // fingerprint is not given.
  std::string fingerprint = options.checkpoint_fingerprint;
  std::string files_digest;
  if (published) {
    // No checkpoint stands behind published weights: both fields are the published-source
    // digest, and model_dir (ignored here) is never read (docs/publish.md).
    fingerprint = PublishedSourceDigest(options.source);
    files_digest = fingerprint;
  } else {
    // The verified per-user cache (fingerprint_cache.h) in the runtime dir; an unusable
    // runtime dir only disables it (ResolveCachePaths below reports a bad one).
    FingerprintCacheOptions cache;
    if (Result<RuntimeDir> runtime = ResolveRuntimeDir(options.runtime_dir, env.lookup);
        runtime.ok()) {
      cache.runtime_dir = runtime->path;
    }
    if (fingerprint.empty()) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(CheckpointIdentity ckpt,
                                   CheckpointIdentityOf(options.model_dir, cache));
      fingerprint = std::move(ckpt.fingerprint);
      files_digest = std::move(ckpt.files_digest);
    } else {
      WEIGHTCACHE_ASSIGN_OR_RETURN(files_digest, CheckpointFilesDigestOf(options.model_dir, cache));
    }
  }
  ResolvedIdentity id;
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.config, BuildConfig(options, fingerprint, files_digest));
  // A publisher publishes its own rank's tensors: no rules shard a published cache (the ranks
  // are in the config all the same).
  if (!published) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(id.shard, ResolveShardSpec(options));
    if (id.shard) id.config.shard_rules_digest = id.shard->digest;
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.trusted_uids, TrustedUids(options.trusted_uids, env.lookup));

  std::string spec = options.device;
  if (spec.empty() && options.tier == Tier::kGpu) spec = DefaultGpuSpec(env);
  if (spec.empty()) {
    id.device_key = std::string(kHostDeviceKey);
  } else {
    InventoryOptions inventory;
    inventory.inventory_file = options.device_inventory;
    inventory.env = env.lookup;
    inventory.load_driver = env.load_driver;
    WEIGHTCACHE_ASSIGN_OR_RETURN(DeviceInventory visible, LoadDeviceInventory(inventory));
    // The gpu tier maps device memory through the driver, so without it the answer is the
    // driver's own failure (dlerror, "the gpu tier needs the NVIDIA driver"), not an empty
    // device list. An inventory file still resolves the identity; the load or map that
    // follows then fails with the same message.
    std::optional<Result<const cuda::DriverApi*>> driver;
    if (options.tier == Tier::kGpu && visible.source != InventorySource::kCudaDriver) {
      driver.emplace(env.load_driver());
      if (!driver->ok() && visible.source != InventorySource::kInventoryFile) {
        return driver->status();
      }
    }
    WEIGHTCACHE_ASSIGN_OR_RETURN(DeviceInfo device, ResolveDevice(spec, visible.devices));
    // The one UUID → CUDA ordinal lookup, for a device an inventory file names (the driver's
    // own enumeration carries it). A UUID the driver does not show keeps -1: the load or the
    // mapping that needs the device then says so (CudaDevice).
    if (driver.has_value() && driver->ok()) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(device.cuda_ordinal, FindCudaOrdinal(**driver, device.uuid));
    }
    id.device_key = device.uuid;
    id.device = std::move(device);
  }

  PathOptions paths;
  paths.runtime_dir_flag = options.runtime_dir;
  if (!options.namespace_name.empty()) paths.namespace_name = options.namespace_name;
  paths.socket_flag = options.socket;
  paths.env = env.lookup;
  WEIGHTCACHE_ASSIGN_OR_RETURN(id.paths, ResolveCachePaths(id.config, id.device_key, paths));
  return id;
}

}  // namespace weightcache::identity
