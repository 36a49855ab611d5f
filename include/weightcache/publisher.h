// weightcache/publisher.h — store an engine's own (post-processed) weights in a daemon started
// with `weightcache serve --source published:<tag>`, so that the engine's restarts attach to
// them (docs/publish.md). Host tier only for now.
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
//  * The caller fills every tensor's bytes (Data), then calls Commit once. Commit computes
//    each tensor's checksum over the mapping, unmaps the arena (the daemon cannot seal it
//    read-only while a writable mapping exists), then sends the checksums; the daemon seals,
//    recomputes and compares them (a difference refuses the commit naming the first differing
//    tensor) and reports `ready`. After Commit, successful or not, the spans are gone.
//  * Dropping a Publisher before Commit (or the process dying) abandons the publish: the
//    daemon frees the arena and stays as it was (`awaiting`, or `ready` with the old weights).
//  * Not thread-safe: one thread at a time; different tensors' spans may be filled from many
//    threads between Begin and Commit. Move-only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/identity_options.h"
#include "weightcache/status.h"

namespace weightcache {

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

class Publisher {
 public:
  static Result<Publisher> Begin(const PublishOptions& options,
                                 std::span<const PublishTensor> plan);

  Publisher(Publisher&& other) noexcept;
  Publisher& operator=(Publisher&& other) noexcept;
  ~Publisher();

  // The writable bytes of plan tensor `index` (plan order) or `name`; empty after Commit or
  // for an unknown name. Valid until Commit or destruction.
  std::span<uint8_t> Data(size_t index) const;
  std::span<uint8_t> DataByName(std::string_view name) const;
  size_t tensor_count() const;
  int daemon_pid() const;

  // Checksums, unmap, PublishCommit; OK once the daemon is `ready` with these tensors.
  Status Commit();

  struct Impl;

 private:
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightcache
