// Attachment::Impl — what an Attachment owns, and the mapping of a daemon's AttachReply.
// Internal to src/client; the public contract is weightcache/client.h.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "client/daemon_watcher.h"
#include "client/discovery.h"
#include "client/fallback_loader.h"
#include "client/tensor_table.h"
#include "cuda/driver_api.h"
#include "cuda/imported_arena.h"
#include "identity/env.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "weightcache/client.h"

namespace weightcache {

struct Attachment::Impl {
  Tier tier = Tier::kHost;
  AttachSource source = AttachSource::kFallback;
  std::string source_reason;
  std::string socket_path;
  std::string device_key;
  int cuda_device = -1;  // gpu tier: the resolved device's CUDA ordinal
  // Gpu tier: the driver of the attach's Env and the device it mapped into (verify uses them).
  const cuda::DriverApi* driver = nullptr;
  CUdevice cu_device = 0;
  std::string config_digest;
  int daemon_pid = 0;
  double attach_ms = 0;
  AttachTimings timings;
  uint64_t total_bytes = 0;

  // The attach manifest (daemon attaches): the table's names, shapes and strides point into
  // its mapping. Declared before the table so it is destroyed after it.
  protocol::Manifest manifest;
  // The memory the tensors point into: exactly one of these is populated. Declared before
  // the table so they are destroyed after it (the order does not matter for correctness: the
  // table holds plain addresses).
  std::vector<os::MappedRegion> host_regions;    // daemon, host tier
  std::optional<cuda::ImportedArena> gpu_arena;  // daemon, gpu tier
  std::optional<client::HostFallback> host_fallback;
  std::optional<client::GpuFallback> gpu_fallback;

  // Sorted by name. A fallback load fills it; a daemon attach builds it on first use (Table():
  // tensors(), Find()) from the manifest it checked at attach and the allocations' bases, once,
  // whichever thread asks first: at 10,000 tensors its 1.3 MB of records were half of a fresh
  // process's attach (docs/benchmarks.md, issue 14 part 4), which only needs the mapping.
  client::TensorTable tensors;
  bool table_from_manifest = false;
  std::vector<uint64_t> table_bases;  // allocation i's address, for the table
  std::once_flag table_once;
  const client::TensorTable& Table();

  std::unique_ptr<client::DaemonWatcher> watcher;  // null for fallback
};

namespace client {

struct AttachmentAccess {
  static Attachment Make(std::unique_ptr<Attachment::Impl> impl) {
    return Attachment(std::move(impl));
  }
  static const Attachment::Impl& Of(const Attachment& attachment) { return *attachment.impl_; }
};

// Attachment::Attach with every machine input from `env` (the driver, the socket syscalls,
// the environment variables): the public Attach passes identity::Env::Default(); tests pass a
// fake driver or faulty syscalls and run the whole attach in process.
Result<Attachment> Attach(const AttachOptions& options, const identity::Env& env,
                          AttachDiagnostics* diagnostics = nullptr);

// Both expect a reply whose manifest tier the caller has checked against its own (Attach does,
// and reports a different one as the kMismatch of the field `tier`).
//
// Maps a host-tier AttachReply: every memfd checked sealed read-only and large enough, mapped
// PROT_READ/MAP_SHARED (or, with HostMapping::kCopyOnWrite, writable MAP_PRIVATE), then
// closed; every tensor's dtype and size checked. Fills impl.host_regions, impl.manifest and
// what its table is built from (Impl::Table), the total bytes and the map/table timings
// (table_ms: the records' checks).
Status MapHostReply(protocol::AttachReply& reply, const std::string& who, HostMapping mapping,
                    Attachment::Impl& impl);

// Imports a gpu-tier AttachReply into `device` (ImportedArena): reserves the VA range, then
// maps while the manifest's records are checked — on a second thread when the manifest has
// kConcurrentTableMinTensors or more. Fills impl.gpu_arena, impl.manifest and what its table is
// built from (the reserved addresses), the total bytes and the map/table timings.
inline constexpr size_t kConcurrentTableMinTensors = 2048;
Status MapGpuReply(const cuda::DriverApi* api, CUdevice device, protocol::AttachReply& reply,
                   const std::string& who, Attachment::Impl& impl);

}  // namespace client
}  // namespace weightcache
