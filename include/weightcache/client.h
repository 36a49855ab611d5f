// weightcache/client.h — attach to a running weightcache daemon, or load from disk when there
// is none. The engine-side C++ API (the C ABI in c_api.h and the Python package wrap it).
//
// Contract:
//  * Attachment::Attach finds the daemon serving exactly this identity on the physical GPU the
//    caller names (a local index into the VISIBLE devices, or a UUID; never a distributed rank,
//    never an implicit physical GPU 0), checks its CacheConfig and maps its memory zero-copy.
//    The discovery rules are docs/design.md "Failure semantics"; docs/client.md walks through them
//    row by row.
//  * Outcomes: source() == kDaemon (mapped from a daemon), kFallback (loaded from disk into
//    memory this process owns — no daemon, stale socket, daemon still loading past the wait
//    timeout, a daemon that did not answer by the deadline, one that went away (killed,
//    crashed) at any point of the attach, failed daemon, or a mismatch ignored with
//    OnMismatch::kFallback). Errors: kMismatch (each differing field named with both values,
//    by the client's own comparison of the daemon's config — never on the daemon's word),
//    kNoDaemon (OnMissing::kError: also a daemon gone during the attach), kTimeout
//    (OnMissing::kError and the daemon was still loading or did not answer by the deadline), a
//    failed daemon's own failure code (OnMissing::kError), kUnavailable (gpu tier without the
//    NVIDIA driver), kPermissionDenied / kProtocol / kIo (a socket that is not ours, not a socket,
//    or speaks garbage: never a silent fallback), kInvalidArgument (options), kInvalidCheckpoint
//    (the model dir).
//  * Diagnostics as data: Attach(options, &diagnostics) also fills an AttachDiagnostics — the
//    outcome's code, the socket and device key discovery resolved, and for a mismatch every
//    differing field with both values, the socket of the daemon that holds the other config
//    and its pid — so a caller acts on a failure without parsing Status::message(). The
//    message is built from the same values (AttachDiagnostics below says how they are spelt).
//  * Ownership and lifetimes: an Attachment owns every mapping its tensors point into, and the
//    tensor table itself (Tensor's name/dtype/shape/strides are views into it). Tensor
//    addresses and views stay valid until the Attachment is destroyed — including after the
//    daemon dies (host tier: the memfd mapping; gpu tier: the imported VMM mapping keeps the
//    memory alive). Moving an Attachment keeps the addresses and views; a moved-from
//    Attachment is empty.
//    Received fds are closed once mapped; the connection to the daemon stays open so the
//    client learns of the daemon's death by EOF.
//  * GPU tier: device addresses are valid in the device's PRIMARY context (the one the CUDA
//    runtime, torch and cupy use). The library retains that context for the Attachment's
//    lifetime. The library installs no signal handlers and does not link libcudart.
//  * Thread-safety: Attach may run concurrently from many threads. A const Attachment
//    (tensors(), Find(), source(), daemon_alive(), …) may be read from any number of threads.
//    OnDaemonGone may be called from any thread. Callbacks run on the library's watcher thread
//    (one per Attachment that registered a callback, started on the first registration), each
//    at most once; a callback registered after the daemon is known gone runs immediately on
//    the registering thread. A callback must not destroy its Attachment (the destructor joins
//    the watcher thread). Destroying an Attachment while another thread uses it is a bug.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/export.h"
#include "weightcache/identity_options.h"
#include "weightcache/status.h"
#include "weightcache/tier.h"  // Tier, TierName, ParseTier

namespace weightcache {

namespace client {
struct AttachmentAccess;  // the library's internal constructor (src/client)
}  // namespace client

// What to do when no daemon serves this identity (absent, stale, failed, still loading).
enum class OnMissing { kFallback, kError };
// What to do when a daemon on this device holds a different config of the same model.
enum class OnMismatch { kError, kFallback };

// How the host tier's memory is mapped into this process. kReadOnly: PROT_READ, shared with
// the daemon's pages; a write faults (SIGSEGV). kCopyOnWrite: the same pages, mapped
// MAP_PRIVATE and writable; a write copies that page into this process only and never reaches
// the cache or any other client (an engine whose post-processing writes a few tensors in
// place). The gpu tier ignores it (device memory is mapped read-write), and so does a
// fallback (the client's own load, read-only).
enum class HostMapping { kReadOnly, kCopyOnWrite };

enum class AttachSource { kDaemon, kFallback };
WEIGHTCACHE_EXPORT std::string_view AttachSourceName(AttachSource source);  // "daemon" | "fallback"

struct AttachOptions {
  // What names the cache: the CacheConfig fields, the device and where to look
  // (weightcache/identity_options.h).
  IdentityOptions identity;

  // ---- policy ----
  OnMissing on_missing = OnMissing::kFallback;
  OnMismatch on_mismatch = OnMismatch::kError;
  // The attach's one deadline, counted from the start of Attach (docs/client.md "Deadlines"):
  // how long to wait for a daemon that reports `loading`, and the end of every exchange with
  // a daemon (connect, Hello, Status polls, the Attach reply, the sibling scan). A daemon
  // that has not answered by then (hung) is treated as absent, like one still loading:
  // fallback with the reason in source_reason, or kTimeout with OnMissing::kError. Answers
  // are awaited at least 1 s, so 0 means "do not wait for a loading daemon".
  std::chrono::milliseconds wait_timeout{std::chrono::seconds(60)};
  // A published cache `awaiting` its publisher (docs/publish.md) with no publication in
  // progress: true waits for one within wait_timeout, as for a loading cache; false treats it
  // as absent at once ("awaits its publisher, and none is publishing"), for a caller that
  // publishes itself after its own load (the engine plugins, docs/engines.md). A daemon
  // whose publisher is filling its arena is waited for either way.
  bool wait_for_publisher = true;
  // Reader threads of the fallback loader.
  int fallback_threads = 8;
  HostMapping host_mapping = HostMapping::kReadOnly;
};

// One tensor as the caller sees it: a view into its Attachment's tensor table (built with no
// per-tensor allocation, so attaching stays flat in tensor count). Every view — name, dtype,
// shape, strides — lives exactly as long as the Attachment (moves included); copy what must
// outlive it. Layout is always contiguous (row-major).
// The part of the full checkpoint tensor a sharded cache holds (docs/sharding.md): elements
// [offset, offset + length) along `dim`, whose full size is `full_length`; length ==
// shape[dim] of the held tensor.
struct TensorSlice {
  uint32_t dim = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t full_length = 0;

  friend bool operator==(const TensorSlice&, const TensorSlice&) = default;
};

struct Tensor {
  // NUL-terminated in the table (name.data()[name.size()] == '\0'): usable as a C string.
  std::string_view name;
  // The safetensors spelling ("BF16", "F8_E4M3", …), a static C string.
  std::string_view dtype;
  std::span<const int64_t> shape;
  std::span<const int64_t> strides;  // in elements, shape.size() entries
  // Host tier: a host pointer (read-only memory). GPU tier: a CUdeviceptr in the device's
  // primary context.
  uint64_t data = 0;
  uint64_t nbytes = 0;
  // Content checksum (docs/integrity.md): the daemon's record, or computed by the fallback
  // loader from the bytes it read.
  uint64_t checksum = 0;
  // Which slice of the full tensor this is (a sharded cache); nullopt: the whole tensor.
  std::optional<TensorSlice> slice;

  const void* host_ptr() const { return reinterpret_cast<const void*>(data); }
};

// Where Attachment::attach_ms() went, in milliseconds (steady clock). For an engine's logs
// and for benchmarks; the phases are those of docs/client.md.
struct AttachTimings {
  // Resolving the identity: options, visible devices, the checkpoint fingerprint (reads the
  // shard headers unless IdentityOptions::checkpoint_fingerprint is given).
  double resolve_ms = 0;
  // Finding the daemon: connect, Hello + Attach, the reply with its fds, mapping and
  // validating the manifest (or deciding there is no daemon).
  double discover_ms = 0;
  // Mapping the memory: host tier, every memfd; gpu tier, importing, mapping and enabling
  // access to every VMM allocation (the CUDA driver's share). 0 for a fallback load.
  double map_ms = 0;
  // Checking the manifest's tensor records (dtypes, sizes) at attach. With many tensors on the
  // gpu tier this runs on a second thread while the driver maps (table_concurrent), hidden
  // inside map_ms. The table itself (tensors(), Find()) is built from the checked manifest on
  // its first use, once, in the thread that asks first.
  double table_ms = 0;
  bool table_concurrent = false;
  // Loading from disk (fallback only).
  double fallback_ms = 0;
};

// One CacheConfig field on which this client and a daemon differ.
struct ConfigFieldDiff {
  std::string field;  // the CacheConfig field name: "revision", "tp_rank", "tier", …
  // Both values exactly as the kMismatch message spells them ("<field>: ours=<client_text>
  // theirs=<daemon_text>"): a string field JSON-quoted ("\"r1\""), a number in decimal.
  std::string client_text;
  std::string daemon_text;
  // The same values decoded: a string field's contents without the JSON quoting ("r1"), a
  // number as above. Use these to act on a value; the *_text ones to match the message.
  std::string client_value;
  std::string daemon_value;
  bool operator==(const ConfigFieldDiff&) const = default;
};

// A daemon on this device that holds a different config of this model
// (docs/design.md "Explicit mismatch").
struct MismatchDetails {
  // Every differing field, in the CacheConfig's canonical (sorted) field order (empty only if
  // a daemon of another build refused our config without naming a field).
  std::vector<ConfigFieldDiff> fields;
  // The socket of the daemon that holds the other config: the socket discovery resolved, or —
  // when that one is absent and the sibling scan found the closest other cache of the model
  // under our device key — that cache's socket.
  std::string daemon_socket;
  int daemon_pid = 0;  // its pid (the peer's credentials), 0 when unknown
};

// The structured outcome of Attachment::Attach. Every field is reset by each call.
struct AttachDiagnostics {
  StatusCode code = StatusCode::kOk;  // the returned Status's code; kOk when Attach succeeded
  // The socket path and device key (GPU UUID or "host") discovery resolved; "" when the
  // identity did not resolve (bad options, bad checkpoint, unknown device).
  std::string socket_path;
  std::string device_key;
  // Set when a daemon holds a different config: with code == kMismatch, or on success when
  // OnMismatch::kFallback ignored it and the weights were loaded from disk.
  std::optional<MismatchDetails> mismatch;
};

class WEIGHTCACHE_EXPORT Attachment {
 public:
  static Result<Attachment> Attach(const AttachOptions& options);
  // The same, and fills *diagnostics (when not null) with the outcome as data, on success and
  // on failure alike. It is written by this call only: give concurrent calls their own.
  static Result<Attachment> Attach(const AttachOptions& options, AttachDiagnostics* diagnostics);

  Attachment(Attachment&& other) noexcept;
  Attachment& operator=(Attachment&& other) noexcept;
  Attachment(const Attachment&) = delete;
  Attachment& operator=(const Attachment&) = delete;
  ~Attachment();

  // Sorted by name (byte order).
  const std::vector<Tensor>& tensors() const;
  const Tensor* Find(std::string_view name) const;  // null when absent
  uint64_t total_bytes() const;

  Tier tier() const;
  AttachSource source() const;
  // Why this source: "attached to daemon pid 123", "no daemon at <socket>", "mismatch
  // ignored (on_mismatch=fallback): revision: ours=a daemon=b", …
  const std::string& source_reason() const;
  const std::string& socket_path() const;  // the path discovery resolved (also for fallback)
  const std::string& device_key() const;   // the GPU UUID, or "host"
  // Gpu tier: the CUDA ordinal of device_key() in this process (its index among the devices
  // the driver shows, CUDA_VISIBLE_DEVICES applied), e.g. the DLPack device id of the
  // tensors; -1 on the host tier.
  int cuda_device() const;
  const std::string& config_digest() const;
  // The metadata blob the publisher of a published cache sent with its plan (at most 64 KiB,
  // opaque bytes, docs/publish.md); empty for a loaded cache and for fallback. A view of the
  // mapped manifest: valid while this Attachment lives.
  std::string_view metadata() const;
  int daemon_pid() const;  // 0 for fallback
  // Wall time of Attach (discovery, handshake, mapping or fallback load) in milliseconds.
  double attach_ms() const;
  // Its phases.
  const AttachTimings& timings() const;

  // False for fallback attachments, and once the daemon's end of the connection closed.
  // Mappings stay valid either way.
  bool daemon_alive() const;
  // Run `callback` once when the daemon goes away (see the thread-safety contract above).
  // For a fallback attachment it never runs.
  void OnDaemonGone(std::function<void()> callback);

  struct Impl;

 private:
  friend struct client::AttachmentAccess;
  explicit Attachment(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightcache
