// The daemon's side of its keeper (docs/keeper.md, "The daemon and its keeper"): re-adopt a
// kept cache at start, deposit a cache that reached `ready`, drop the keeper on a deliberate
// stop. The keeper process and its client functions are src/keeper/; this file is the policy.
//
// Rules (each lives here only):
//  * Only a complete load is deposited (DepositWithKeeper is called with a finished store):
//    a crash during loading leaves nothing to adopt.
//  * Adoption re-validates everything before a byte is served: the handoff's fds (kinds,
//    sizes, seals: protocol::DecodeHandoff), the config digest, the checkpoint's fingerprint
//    and files as they are now (headers and stat only, checkpoint::Checkpoint::Open), then the
//    manifest's checksums against the memory (protocol::CheckAdoptable, a sample or every
//    tensor). Any failure is logged with its reason, the keeper is dropped (it holds memory
//    nobody may serve) and the caller loads from the checkpoint.
//  * A cache without a keeper path (sun_path too long) or with keepers disabled (--no-keeper)
//    neither adopts nor deposits; it serves as before.
//
// Thread-safety: plain functions, no shared state; the daemon calls them on its loader thread
// (adopt, deposit) and on its event loop (drop, at the end of a drain).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/driver_api.h"
#include "daemon/weight_store.h"
#include "identity/cache_config.h"
#include "identity/device_inventory.h"
#include "identity/paths.h"
#include "keeper/keeper_client.h"
#include "protocol/handoff.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

struct KeeperLinkOptions {
  // Off unless the process is the weightcache binary (`serve` turns it on; `--no-keeper` keeps
  // it off): the keeper runs `<program> keeper`, and an in-process daemon (tests) is no such
  // program.
  bool enabled = false;
  std::string program;  // the binary the keeper runs; "" = this process's own
  // What adoption checks against the memory (`serve --adopt-verify`). The default is a sample:
  // a host-tier deposit is sealed memfds that nobody, the loader included, can write after
  // the seal, and every fd and the manifest are checked in full anyway; the sample catches a
  // deposit of the wrong memory (a bug, a corrupted keeper) at a cost independent of the
  // cache's size (64 tensors), which is what keeps a restart near-instant. `full` reads
  // every byte once (host: mapped here; gpu: the checksum kernel).
  protocol::ChecksumCheck verify = protocol::ChecksumCheck::kSample;
  uint32_t sample_tensors = 64;
  // `--adopt-verify behind`: a re-adoption from the keeper serves once everything but the
  // memory is checked (the fds, the config digest, the checkpoint as it is now), and checks
  // every tensor's checksum against the memory right after `ready`, on the loader thread; a
  // mismatch drains the daemon (exit non-zero) and drops the keeper. What it buys: no CUDA
  // context before `ready` on the gpu tier (~0.12 s of a restart on an H200). What it gives
  // up: clients that attach in that window get memory not yet re-verified since its load.
  bool verify_behind_ready = false;
  std::vector<uid_t> allow_uids;  // the daemon's --allow-uid: they may query the keeper too
  std::chrono::milliseconds timeout{5'000};  // each keeper call
};

// Gpu tier: what importing a withdrawn VMM fd and checksumming it needs.
struct GpuAdoptContext {
  const cuda::DriverApi* driver = nullptr;
  identity::DeviceInfo device;
};

// A store taken back from the keeper, and what the ready line says about it.
struct AdoptedStore {
  WeightStore store;
  int64_t keeper_pid = 0;
  int64_t depositor_pid = 0;  // the daemon that loaded it
  // What was checked: DescribeVerified's, or "all 291 tensors to be checked behind ready".
  std::string verified;
  // Where the adoption's time went, for the ready line: "checkpoint check 0.3 ms, withdrawal
  // 1.1 ms, context and import 150.2 ms, checksums 14.2 ms" (the last two only on the gpu
  // tier).
  std::string timings;
  // With verify_behind_ready: the withdrawn handoff (its own fds; the store holds duplicates)
  // whose checksums VerifyKeptBehindReady checks after `ready`.
  std::optional<protocol::Handoff> verify_behind;
};

// verify_behind_ready's check, after `ready`: every tensor's checksum against the kept memory
// (gpu tier: VerifyGpuHandoff, `gpu` required). `timings` gets the steps' times.
Status VerifyKeptBehindReady(const protocol::Handoff& handoff, const identity::CacheConfig& config,
                             const GpuAdoptContext* gpu, std::string* timings);

// The kept cache of `paths`, validated (the rules above), or std::nullopt: no keeper, keeper
// disabled or pathless, nothing deposited yet, or a validation failure (logged; the keeper is
// dropped). `gpu` is required for a gpu-tier cache (without it a gpu deposit is not adopted).
std::optional<AdoptedStore> AdoptFromKeeper(const identity::CachePaths& paths,
                                            const identity::CacheConfig& config,
                                            const std::string& model_path,
                                            const KeeperLinkOptions& options,
                                            const GpuAdoptContext* gpu);

// Starts the cache's keeper when its load starts (keeper::StartKeeper: the fork, exec and the
// keeper's start overlap the load; the keeper exits by itself if this process dies or drops
// the StartingKeeper before depositing). std::nullopt when keepers are disabled or the cache
// has no keeper path; an error when the fork fails (the caller starts one at the deposit).
Result<std::optional<keeper::StartingKeeper>> StartCacheKeeper(const identity::CachePaths& paths,
                                                               const KeeperLinkOptions& options);

// A keeper StartCacheKeeper started for a load that did not complete: abandoned (it exits once
// its depositor pipe closes), then waited for, bounded by options.timeout, so that a daemon
// whose load failed or was cancelled leaves no keeper behind when it exits. A keeper that did
// not start (another one holds the cache) is not waited for.
void EndUnusedKeeper(keeper::StartingKeeper started, const identity::CachePaths& paths,
                     const KeeperLinkOptions& options);

// Hands a ready store to the cache's keeper: the one StartCacheKeeper started (`started`), or
// one started now (a live keeper that is still waiting is used as it is). OK without doing
// anything when keepers are disabled or the cache has no keeper path; an error (the caller
// logs it and serves without a keeper) when the keeper cannot be started or refuses.
Status DepositWithKeeper(const identity::CachePaths& paths, const identity::CacheConfig& config,
                         const WeightStore& store, const KeeperLinkOptions& options,
                         std::optional<keeper::StartingKeeper> started = std::nullopt);

// A deliberate stop: tells the keeper the cache is dead (its memory is freed once no client
// maps it) and waits, bounded by options.timeout, until it has exited. kNoDaemon when there
// was no live keeper.
Status DropCacheKeeper(const identity::CachePaths& paths, const KeeperLinkOptions& options);

// Gpu tier: the checks of a withdrawn handoff that need the driver. Imports duplicates of its
// allocation fds on the device and maps them (which checks each is a VMM allocation of the
// manifest's size: kInvalidArgument/kCuda naming the allocation), then runs
// protocol::CheckAdoptable with the checksum kernel over the mappings. Everything it imports is
// released before it returns; the handoff's own fds are untouched.
// `step_done`, when given, is called with "context and import" once the allocations are
// imported (the ready line's timings).
using StepDone = std::function<void(std::string_view step)>;
Status VerifyGpuHandoff(const GpuAdoptContext& gpu, const protocol::Handoff& handoff,
                        const protocol::AdoptOptions& adopt, const StepDone& step_done = nullptr);

// The one validation of kept memory, shared by the keeper's withdrawal, the upgrade's handover
// and the service manager's fd store (fd_store.h), after protocol::DecodeHandoff checked the fds'
// kinds, sizes and seals and the manifest: the handoff's config digest equals `config`'s
// (kMismatch naming both); the checkpoint is unchanged (CheckCheckpointUnchanged; skipped when
// `model_path` is empty: a published cache); the manifest's checksums match the memory, a sample
// or every tensor as `options.verify` says (gpu tier: VerifyGpuHandoff, `gpu` required).
// `timings`, when given, gets the steps' times appended ("checkpoint check 0.3 ms, ...").
Status ValidateKeptHandoff(const protocol::Handoff& handoff, const identity::CacheConfig& config,
                           const std::string& model_path, const KeeperLinkOptions& options,
                           const GpuAdoptContext* gpu, std::string* timings = nullptr);

// What a deposit or an upgrade's handover says about `store` of `config`, sent by this process.
protocol::DepositInfo DescribeStore(const identity::CacheConfig& config, const WeightStore& store);

// The checkpoint as it is now, by its headers and the stat of its files (no tensor byte is
// read): the same fingerprint and files the identity was computed from, or kInvalidCheckpoint
// saying what changed.
Status CheckCheckpointUnchanged(const identity::CacheConfig& config, const std::string& model_path);

// "all 291 tensors verified" / "64 of 291 tensors verified": what `adopt` checked of a manifest
// of `tensors`.
std::string DescribeVerified(const protocol::AdoptOptions& adopt, size_t tensors);

// The WeightStore a validated handoff describes: its manifest memfd and allocation fds, the
// totals from its manifest.
WeightStore StoreFromHandoff(protocol::Handoff handoff);
// The same store, of duplicates of the handoff's fds (the handoff keeps its own).
Result<WeightStore> StoreOfDuplicates(const protocol::Handoff& handoff);

}  // namespace weightcache::daemon
