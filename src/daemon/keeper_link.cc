#include "daemon/keeper_link.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/logging.h"
#include "cuda/checksum_gpu.h"
#include "cuda/imported_arena.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"

namespace weightcache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

std::string FormatMillis(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f ms",
                std::chrono::duration<double, std::milli>(d).count());
  return text;
}

keeper::KeeperPaths PathsOf(const identity::CachePaths& paths) {
  return {paths.keeper_socket, paths.keeper_lock};
}

Result<UniqueFd> Duplicate(const UniqueFd& fd) {
  UniqueFd dup(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!dup) return IoError("dup of a kept fd", errno);
  return dup;
}

// Gpu tier: each withdrawn fd imported and mapped here (which checks it is a VMM allocation
// of this device of the manifest's size), and the checksum kernel over it.
struct GpuVerifier {
  std::optional<cuda::ImportedArena> arena;
  std::optional<cuda::ChecksumKernel> kernel;

  Status Open(const GpuAdoptContext& gpu, const protocol::Handoff& handoff) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(CUdevice device, identity::CudaDevice(gpu.driver, gpu.device));
    std::vector<UniqueFd> fds;
    for (const UniqueFd& fd : handoff.allocations) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd dup, Duplicate(fd));
      fds.push_back(std::move(dup));
    }
    auto imported = cuda::ImportedArena::Import(gpu.driver, device, std::move(fds),
                                                handoff.manifest.allocation_sizes());
    if (!imported.ok()) {
      Status status = imported.status();
      return status.Context("importing the kept allocations");
    }
    arena.emplace(std::move(imported).value());
    auto k = cuda::ChecksumKernel::Create(gpu.driver);
    if (!k.ok()) {
      Status status = k.status();
      return status.Context("the checksum kernel");
    }
    kernel.emplace(std::move(k).value());
    return Status::Ok();
  }

  // Every range in one kernel launch: one synchronization for all the tensors checked.
  Result<std::vector<uint64_t>> Checksums(std::span<const protocol::ChecksumRange> ranges) const {
    const auto allocations = arena->allocations();
    std::vector<cuda::DeviceRange> device_ranges;
    device_ranges.reserve(ranges.size());
    for (const protocol::ChecksumRange& r : ranges) {
      if (r.allocation >= allocations.size() || r.offset > allocations[r.allocation].size ||
          r.nbytes > allocations[r.allocation].size - r.offset) {
        return ProtocolError("tensor range outside allocation " + std::to_string(r.allocation));
      }
      device_ranges.push_back({allocations[r.allocation].ptr + r.offset, r.nbytes});
    }
    return kernel->Checksums(/*stream=*/nullptr, device_ranges);
  }
};

}  // namespace

Status CheckCheckpointUnchanged(const identity::CacheConfig& config,
                                const std::string& model_path) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(checkpoint::Checkpoint now,
                               checkpoint::Checkpoint::Open(model_path));
  if (now.fingerprint() != config.checkpoint_fingerprint) {
    return InvalidCheckpoint("checkpoint " + model_path + " has fingerprint " + now.fingerprint() +
                             ", the kept cache was loaded from " + config.checkpoint_fingerprint);
  }
  if (now.files_digest() != config.checkpoint_files) {
    return InvalidCheckpoint("checkpoint " + model_path + " files changed (checkpoint_files " +
                             now.files_digest() + ", the kept cache's " + config.checkpoint_files +
                             ")");
  }
  return Status::Ok();
}

std::string DescribeVerified(const protocol::AdoptOptions& adopt, size_t tensors) {
  if (adopt.checksums == protocol::ChecksumCheck::kFull || tensors <= adopt.sample_tensors) {
    return "all " + std::to_string(tensors) + " tensors verified";
  }
  return std::to_string(adopt.sample_tensors) + " of " + std::to_string(tensors) +
         " tensors verified";
}

Status VerifyGpuHandoff(const GpuAdoptContext& gpu, const protocol::Handoff& handoff,
                        const protocol::AdoptOptions& adopt, const StepDone& step_done) {
  if (gpu.driver == nullptr) {
    return InternalError("gpu tier: no CUDA driver to check the kept allocations");
  }
  GpuVerifier verifier;
  WEIGHTCACHE_RETURN_IF_ERROR(verifier.Open(gpu, handoff));
  if (step_done) step_done("context and import");
  protocol::AdoptOptions checked = adopt;
  checked.gpu_checksum = [&verifier](std::span<const protocol::ChecksumRange> ranges) {
    return verifier.Checksums(ranges);
  };
  return protocol::CheckAdoptable(handoff, checked);
}

namespace {

// Appends "<step> X ms" to `timings` (when given): the time since the previous step.
class StepTimes {
 public:
  explicit StepTimes(std::string* timings) : timings_(timings), start_(Clock::now()) {}
  void operator()(std::string_view step) {
    const auto now = Clock::now();
    if (timings_ != nullptr) {
      *timings_ += std::string(timings_->empty() ? "" : ", ") + std::string(step) + " " +
                   FormatMillis(now - start_);
    }
    start_ = now;
  }

 private:
  std::string* timings_;
  Clock::time_point start_;
};

// What kept memory is checked against: `config`'s digest, a sample or every tensor.
protocol::AdoptOptions AdoptOptionsFor(const identity::CacheConfig& config,
                                       protocol::ChecksumCheck checksums, uint32_t sample) {
  protocol::AdoptOptions adopt;
  adopt.expected_digest = config.Digest();
  adopt.checksums = checksums;
  adopt.sample_tensors = sample;
  return adopt;
}

// Everything but the memory: the config digest, the checkpoint as it is now.
Status CheckKeptIdentity(const protocol::Handoff& handoff, const identity::CacheConfig& config,
                         const std::string& model_path, StepTimes& step_done) {
  if (handoff.info.config_digest != config.Digest()) {
    return Status(StatusCode::kMismatch, "the kept memory is cache " + handoff.info.config_digest +
                                             ", this daemon serves " + config.Digest());
  }
  if (!model_path.empty()) {
    WEIGHTCACHE_RETURN_IF_ERROR(CheckCheckpointUnchanged(config, model_path));
    step_done("checkpoint check");
  }
  return Status::Ok();
}

// The manifest's checksums against the memory, as `adopt` says (gpu tier: VerifyGpuHandoff).
Status CheckKeptMemory(const protocol::Handoff& handoff, const protocol::AdoptOptions& adopt,
                       const GpuAdoptContext* gpu, StepTimes& step_done) {
  if (handoff.tier() == Tier::kGpu) {
    if (gpu == nullptr) {
      return InternalError("gpu tier: no CUDA driver to check the kept allocations");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(VerifyGpuHandoff(
        *gpu, handoff, adopt, [&step_done](std::string_view step) { step_done(step); }));
  } else {
    WEIGHTCACHE_RETURN_IF_ERROR(protocol::CheckAdoptable(handoff, adopt));
  }
  step_done("checksums");
  return Status::Ok();
}

}  // namespace

Status ValidateKeptHandoff(const protocol::Handoff& handoff, const identity::CacheConfig& config,
                           const std::string& model_path, const KeeperLinkOptions& options,
                           const GpuAdoptContext* gpu, std::string* timings) {
  StepTimes step_done(timings);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckKeptIdentity(handoff, config, model_path, step_done));
  return CheckKeptMemory(handoff, AdoptOptionsFor(config, options.verify, options.sample_tensors),
                         gpu, step_done);
}

namespace {

// A handoff's totals, around its manifest memfd.
StoreSummary SummaryOf(const protocol::Handoff& handoff, UniqueFd manifest_fd) {
  StoreSummary summary;
  // A keeper's deposit or an upgrade's handover: where the bytes first came from is not handed
  // over with them.
  summary.origin = "adopted";
  summary.manifest.size = handoff.info.manifest_size;
  summary.manifest.fd = std::move(manifest_fd);
  summary.tensor_count = handoff.manifest.tensor_count();
  for (size_t i = 0; i < handoff.manifest.tensor_count(); ++i) {
    summary.tensor_bytes += handoff.manifest.record(i).nbytes;
  }
  summary.resident_bytes = handoff.bytes();
  return summary;
}

}  // namespace

WeightStore StoreFromHandoff(protocol::Handoff handoff) {
  StoreSummary summary = SummaryOf(handoff, std::move(handoff.manifest_fd));
  const Tier tier = handoff.tier();
  return WeightStore(tier, std::move(handoff.allocations), std::move(summary));
}

Result<WeightStore> StoreOfDuplicates(const protocol::Handoff& handoff) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd manifest, Duplicate(handoff.manifest_fd));
  std::vector<UniqueFd> allocations;
  for (const UniqueFd& fd : handoff.allocations) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd dup, Duplicate(fd));
    allocations.push_back(std::move(dup));
  }
  return WeightStore(handoff.tier(), std::move(allocations),
                     SummaryOf(handoff, std::move(manifest)));
}

Status VerifyKeptBehindReady(const protocol::Handoff& handoff, const identity::CacheConfig& config,
                             const GpuAdoptContext* gpu, std::string* timings) {
  // The identity and the checkpoint were checked before ready; the memory is what is left.
  StepTimes step_done(timings);
  return CheckKeptMemory(handoff, AdoptOptionsFor(config, protocol::ChecksumCheck::kFull, 0), gpu,
                         step_done);
}

std::optional<AdoptedStore> AdoptFromKeeper(const identity::CachePaths& paths,
                                            const identity::CacheConfig& config,
                                            const std::string& model_path,
                                            const KeeperLinkOptions& options,
                                            const GpuAdoptContext* gpu) {
  if (!options.enabled || paths.keeper_socket.empty()) return std::nullopt;
  const keeper::KeeperPaths kp = PathsOf(paths);
  auto query = keeper::QueryKeeper(kp, options.timeout);
  if (query.ok() && !query->has_value()) return std::nullopt;  // no live keeper
  if (query.ok() && (*query)->state != protocol::KeeperState::kHolding) {
    // A keeper whose daemon died before depositing: nothing to adopt; the deposit at ready
    // goes to it.
    LOG_INFO << "keeper pid " << (*query)->keeper_pid << " holds nothing yet; loading";
    return std::nullopt;
  }
  // Any failure from here on: the keeper holds memory this daemon may not serve.
  auto reject = [&](const Status& why) -> std::optional<AdoptedStore> {
    LOG_WARN << "not adopting the kept cache: " << why.ToString()
             << "; dropping the keeper and loading from the checkpoint";
    Status dropped = DropCacheKeeper(paths, options);
    if (!dropped.ok() && dropped.code() != StatusCode::kNoDaemon) {
      LOG_WARN << "dropping the keeper failed: " << dropped.ToString();
    }
    return std::nullopt;
  };
  if (!query.ok()) return reject(query.status());
  if ((*query)->config_digest != config.Digest()) {
    return reject(Status(StatusCode::kMismatch, "keeper holds cache " + (*query)->config_digest +
                                                    ", this daemon serves " + config.Digest()));
  }
  // The withdrawal decodes the fds (kinds, sizes, seals, manifest) and runs no checksum (a
  // sample of 0): ValidateKeptHandoff below is the one check of what was kept.
  protocol::AdoptOptions adopt;
  adopt.expected_digest = config.Digest();
  adopt.checksums = options.verify;
  adopt.sample_tensors = options.sample_tensors;
  protocol::AdoptOptions withdraw_adopt = adopt;
  withdraw_adopt.checksums = protocol::ChecksumCheck::kSample;
  withdraw_adopt.sample_tensors = 0;
  protocol::FdCheck gpu_fd_check;
  if (config.tier == Tier::kGpu) {
    if (gpu == nullptr || gpu->driver == nullptr) {
      return reject(InternalError("gpu tier: no CUDA driver to check the kept allocations"));
    }
    // A VMM fd says nothing about itself without the driver: VerifyGpuHandoff imports it.
    gpu_fd_check = [](int fd, uint64_t /*size*/, uint32_t index) -> Status {
      if (::fcntl(fd, F_GETFD) < 0) {
        return ProtocolError("kept allocation " + std::to_string(index) + " is not an open fd");
      }
      return Status::Ok();
    };
    withdraw_adopt.gpu_checksum =
        [](std::span<const protocol::ChecksumRange>) -> Result<std::vector<uint64_t>> {
      return InternalError("no checksum at withdrawal");
    };
  }
  const auto withdraw_start = Clock::now();
  auto withdrawn = keeper::TryWithdraw(kp, withdraw_adopt, options.timeout, gpu_fd_check);
  if (!withdrawn.ok()) return reject(withdrawn.status());
  if (!withdrawn->has_value()) return std::nullopt;  // the keeper went away meanwhile
  protocol::Handoff handoff = std::move(**withdrawn);
  std::string timings = "withdrawal " + FormatMillis(Clock::now() - withdraw_start);
  if (options.verify_behind_ready) {
    // Everything but the memory now; VerifyKeptBehindReady checks the memory after `ready`.
    StepTimes step_done(&timings);
    Status valid = CheckKeptIdentity(handoff, config, model_path, step_done);
    if (!valid.ok()) return reject(valid);
    auto store = StoreOfDuplicates(handoff);
    if (!store.ok()) return reject(store.status());
    const std::string behind = "all " + std::to_string(handoff.manifest.tensor_count()) +
                               " tensors to be checked behind ready";
    AdoptedStore adopted{std::move(store).value(), (*query)->keeper_pid,
                         (*query)->depositor_pid,  behind,
                         std::move(timings),       std::nullopt};
    adopted.verify_behind.emplace(std::move(handoff));
    return adopted;
  }
  Status valid = ValidateKeptHandoff(handoff, config, model_path, options, gpu, &timings);
  if (!valid.ok()) return reject(valid);
  const std::string verified = DescribeVerified(adopt, handoff.manifest.tensor_count());
  AdoptedStore adopted{StoreFromHandoff(std::move(handoff)),
                       (*query)->keeper_pid,
                       (*query)->depositor_pid,
                       verified,
                       std::move(timings),
                       std::nullopt};
  return adopted;
}

protocol::DepositInfo DescribeStore(const identity::CacheConfig& config, const WeightStore& store) {
  protocol::DepositInfo info;
  info.config_digest = config.Digest();
  info.config_json = config.ToJson().dump();
  info.depositor_pid = ::getpid();
  info.manifest_size = store.summary().manifest.size;
  info.allocation_count = static_cast<uint32_t>(store.fds().size());
  return info;
}

namespace {

keeper::SpawnOptions SpawnOptionsFor(const identity::CachePaths& paths,
                                     const KeeperLinkOptions& options) {
  keeper::SpawnOptions spawn;
  spawn.program = options.program;
  spawn.socket = paths.keeper_socket;
  spawn.allow_uids = options.allow_uids;
  return spawn;
}

}  // namespace

Result<std::optional<keeper::StartingKeeper>> StartCacheKeeper(const identity::CachePaths& paths,
                                                               const KeeperLinkOptions& options) {
  if (!options.enabled || paths.keeper_socket.empty()) {
    return std::optional<keeper::StartingKeeper>();
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(keeper::StartingKeeper starting,
                               keeper::StartKeeper(SpawnOptionsFor(paths, options)));
  return std::optional<keeper::StartingKeeper>(std::move(starting));
}

void EndUnusedKeeper(keeper::StartingKeeper started, const identity::CachePaths& paths,
                     const KeeperLinkOptions& options) {
  started.Abandon();
  auto pid = started.WaitReady();
  if (!pid.ok()) return;  // it did not start: nothing of ours to wait for
  const auto deadline = Clock::now() + options.timeout;
  while (os::IsLockHeld(paths.keeper_lock) && os::ReadLockOwner(paths.keeper_lock) == *pid) {
    if (Clock::now() >= deadline) {
      LOG_WARN << "the keeper (pid " << *pid << ") started for the load still runs "
               << options.timeout.count() << " ms after the load ended without a deposit";
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Status DepositWithKeeper(const identity::CachePaths& paths, const identity::CacheConfig& config,
                         const WeightStore& store, const KeeperLinkOptions& options,
                         std::optional<keeper::StartingKeeper> started) {
  if (!options.enabled || paths.keeper_socket.empty()) return Status::Ok();
  if (!started) {
    auto starting = keeper::StartKeeper(SpawnOptionsFor(paths, options));
    if (!starting.ok()) return starting.status().Context("starting the keeper");
    started.emplace(std::move(starting).value());
  }
  auto pid = started->WaitReady();
  // kAlreadyServed: a keeper is live already (its daemon died before depositing): use it.
  if (!pid.ok() && pid.status().code() != StatusCode::kAlreadyServed) {
    Status status = pid.status();
    return status.Context("starting the keeper");
  }
  const protocol::DepositInfo info = DescribeStore(config, store);
  const std::vector<int> fds = store.fds();
  Status deposited = keeper::DepositToKeeper(
      paths.keeper_socket, info, store.summary().manifest.fd.get(), fds, options.timeout);
  if (!deposited.ok()) return deposited.Context("depositing with the keeper");
  // `started` goes here, after the reply: the keeper holds the deposit and no longer watches us.
  return Status::Ok();
}

Status DropCacheKeeper(const identity::CachePaths& paths, const KeeperLinkOptions& options) {
  if (paths.keeper_socket.empty()) return Status(StatusCode::kNoDaemon, "no keeper path");
  WEIGHTCACHE_RETURN_IF_ERROR(keeper::DropKeeper(PathsOf(paths), options.timeout));
  // The keeper replies, then closes its fds and exits: wait for its lock, so that whoever
  // comes next (a reload's deposit, `stop`'s caller) finds no keeper.
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  while (os::IsLockHeld(paths.keeper_lock)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status(StatusCode::kTimeout,
                    "keeper " + paths.keeper_socket + " still running after its Drop");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return Status::Ok();
}

}  // namespace weightcache::daemon
