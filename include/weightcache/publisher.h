// weightcache/publisher.h — store an engine's own (post-processed) weights in a daemon started
// with `weightcache serve --source published:<tag>`, so that the engine's restarts attach to
// them (docs/publish.md). Both tiers: sealed memfds (host) or VMM memory on the daemon's GPU
// (gpu).
//
// Contract:
//  * Publisher::Begin finds the daemon of options.identity exactly as Attachment::Attach does
//    (same identity resolution, socket, trusted uids, our own config comparison), sends the
//    plan (every tensor's name, dtype, shape and bytes, plus an optional metadata blob) and
//    maps the arena the daemon made for it: one writable span per tensor, laid out as the
//    daemon's loaded caches are. A publisher never falls back: no daemon is kNoDaemon, a
//    different config kMismatch, a plan the daemon refuses its error (kInvalidArgument naming
//    the tensor and the rule, kOutOfMemory over --memory-budget, kUnavailable while another
//    publisher is at work, naming its pid; kAlreadyServed for a ready cache without
//    --replace). The plan is checked here first by the same rules the daemon applies.
//  * Gpu tier: the daemon's arena is imported read-write into this process, on the CUDA device
//    of options.identity.device, which must be the daemon's physical GPU (its UUID is compared
//    with the one the daemon reports: kMismatch naming both otherwise). Its primary context is
//    retained (the one the CUDA runtime and torch use). A build without the GPU checksum kernel
//    cannot publish to the gpu tier (kUnavailable).
//  * The caller fills every tensor's bytes — host tier: through Data (writable host memory) or
//    CopyIn; gpu tier: CopyIn from any pointer (host or device memory, unified addressing), or
//    writes of its own to Destination(i).address, a device pointer valid in the primary context
//    of the daemon's GPU — then calls Commit once. Commit computes each tensor's checksum over
//    the mapping (the GPU checksum kernel on the gpu tier), unmaps the arena (the daemon cannot
//    seal a memfd read-only while a writable mapping exists), then sends the checksums; the
//    daemon seals (host), recomputes (over the sealed memfds, or with the GPU kernel over its
//    own mapping) and compares them (a difference refuses the commit naming the first
//    differing tensor) and reports `ready`. After Commit, successful or not, the destinations
//    are gone.
//  * Dropping a Publisher before Commit (or the process dying) abandons the publish: the
//    daemon frees the arena and stays as it was (`awaiting`, or `ready` with the old weights).
//  * Not thread-safe: one thread at a time; different tensors may be filled from many threads
//    between Begin and Commit (CopyIn makes the arena's context current on its thread for the
//    copy and restores the caller's). Move-only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/export.h"
#include "weightcache/identity_options.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"

namespace weightcache {

namespace client {
struct PublisherAccess;  // the library's internal constructor (src/client)
}  // namespace client

// One tensor of a plan: the safetensors dtype spelling ("BF16", "F8_E4M3"), its shape in
// elements, and its bytes (elements × dtype size; refused otherwise).
struct PublishTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
  // Empty, or the name of another plan tensor (not itself an alias, same dtype, shape and
  // nbytes) whose bytes this one shares: tied weights, published once. Data() of an alias is
  // its target's span; attaching clients get both names on the one region.
  std::string alias_of = {};
};

struct PublishOptions {
  // identity.source must be "published:<tag>"; identity.model_dir is not needed.
  IdentityOptions identity;
  // Free-form, at most 64 KiB (the engine's version, layout notes); served to every attaching
  // client (Attachment::metadata()).
  std::string metadata;
  // One deadline for Begin (connect, Hello, the plan's reply) and one for Commit (the daemon
  // reads every byte to check the checksums: allow for the arena's size).
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

class WEIGHTCACHE_EXPORT Publisher {
 public:
  static Result<Publisher> Begin(const PublishOptions& options,
                                 std::span<const PublishTensor> plan);

  Publisher(Publisher&& other) noexcept;
  Publisher& operator=(Publisher&& other) noexcept;
  ~Publisher();

  // Host tier: the writable bytes of plan tensor `index` (plan order) or `name`; empty after
  // Commit, for an unknown name, and on the gpu tier (device memory: Destination, CopyIn).
  // Valid until Commit or destruction.
  std::span<uint8_t> Data(size_t index) const;
  std::span<uint8_t> DataByName(std::string_view name) const;

  // Where plan tensor `index`'s bytes go, on either tier: a host address (kHost) or a CUDA
  // device pointer of the daemon's GPU, mapped in its primary context (kGpu). {tier, 0, 0}
  // after Commit or for an index past the plan.
  struct Destination {
    Tier tier = Tier::kHost;
    uint64_t address = 0;
    uint64_t size = 0;
  };
  Destination DestinationOf(size_t index) const;

  // Copies `nbytes` (the tensor's size exactly, else kInvalidArgument naming it) from `source`
  // into plan tensor `index`: memcpy on the host tier (host memory only); cuMemcpy on the gpu
  // tier, synchronous, from host or device memory of any device (unified addressing). A driver
  // error names the tensor.
  Status CopyIn(size_t index, const void* source, uint64_t nbytes);

  Tier tier() const;
  size_t tensor_count() const;
  int daemon_pid() const;

  // Checksums, unmap, PublishCommit; OK once the daemon is `ready` with these tensors.
  Status Commit();

  struct Impl;

 private:
  friend struct client::PublisherAccess;
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightcache
