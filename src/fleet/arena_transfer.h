// Arena transfer between nodes (docs/fleet.md "Transport"): a node that holds a cache serves
// its arena regions (ArenaServer); a node that fills its cache pulls them from one or several
// such sources at once (FetchArena). Host memory moves over weightcache's own TCP protocol
// (read requests, arena_transfer_hello.h); CUDA memory over UCX (one-sided ucp_get_nbx, with
// cuda_ipc on one host or GPUDirect RDMA across nodes). Which one is decided by the regions:
// any CUDA region makes the server, or the fetch, UCX's; otherwise it is the TCP protocol's.
//
// Contract:
//  * ArenaServer::Start listens on `listen` (host:port; port 0 picks a free one, endpoint()
//    says which), with one TCP socket, and on nothing else (with UCX too: there is no UCX
//    listener). A connection from an address not on `allow` is closed at accept before any
//    byte is read or sent, and logged with the address. An accepted peer receives the hello
//    (arena_transfer_hello.h): the caller's manifest blob and the regions' sizes (with UCX:
//    their addresses, packed rkeys and the source's UCP worker address, after which the
//    connection is closed and the peer reads over UCX).
//  * Over TCP a peer can only read, only within the served regions: a request out of bounds,
//    an unknown opcode or a malformed frame drops that peer (logged with its address); a peer
//    idle for `idle_timeout` or stalled for `send_timeout` is dropped and its slot freed; past
//    `max_peers` a peer is told the source is full. Over UCX the regions are registered for
//    remote reads only, and the context never uses UCX's tcp or cma transports (which serve
//    any address unchecked): ucx_support.h.
//  * The caller keeps the regions' memory mapped and unchanged until Stop() returns (or the
//    server is destroyed). The server never writes to it.
//  * The server runs its own thread. A peer that dies or stops responding never blocks it;
//    Stop() closes every connection and joins the thread; it is prompt, idempotent, and the
//    destructor calls it. endpoint() is thread-safe.
//  * FetchArena runs in the calling thread and returns when every byte of `destination` has
//    been read, or with an error: every source dropped (each named with why: refused, full,
//    unreachable, a malformed hello, refused by `accept`, regions that do not match, a failed
//    or stalled read, a disconnect), or the overall deadline passed. Over TCP it connects to
//    every source at once and reads from those that answered while the others still connect:
//    a source with no hello by the end is reported unused, never waited for. On an error the
//    destination holds partial data: the caller must not use it (the daemon falls back to
//    disk). A host destination opens no listening socket.
//  * The bytes read are whatever the sources serve: nothing here checks content. The result
//    says which source served each stripe, so that a checksum failure can be blamed on one.
//  * UCX (CUDA regions only) reads UCX_* environment variables as usual, except that a UCX_TLS
//    enabling tcp or cma is refused (kPermissionDenied) and, unset, becomes "^tcp,cma".
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fleet/arena_transfer_allow_list.h"
#include "weightcache/status.h"

namespace weightcache::fleet {

// What memory a region is: host memory, or CUDA device memory mapped in this process (a gpu-tier
// cache's VMM allocations, in a context of the process). UCX moves CUDA memory with its CUDA
// transports (cuda_copy, cuda_ipc, GPUDirect RDMA where present); a UCX built without them
// refuses it up front (kUnavailable, "… has no CUDA memory support …").
enum class RegionMemory { kHost, kCuda };
std::string_view RegionMemoryName(RegionMemory memory);

// One contiguous piece of an arena the server exposes, in this process's memory.
struct ServedRegion {
  const void* data = nullptr;
  uint64_t bytes = 0;
  RegionMemory memory = RegionMemory::kHost;
};

struct ArenaServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; [v6]:port
  PeerAllowList allow;                 // who may connect (empty: nobody)
  std::vector<uint8_t> manifest;       // opaque to the transport, sent in the hello
  std::vector<ServedRegion> regions;   // at least one, none empty
  size_t max_peers = 64;               // connections held at once; more are refused ("full")
  // Host memory (the TCP protocol): a peer with no request outstanding and nothing owed that
  // sends nothing for this long is dropped and its slot freed; a peer owed bytes that takes
  // none for `send_timeout` (a stalled or stopped reader) likewise.
  std::chrono::milliseconds idle_timeout = std::chrono::seconds(10);
  std::chrono::milliseconds send_timeout = std::chrono::seconds(30);
  // Test hook: sent instead of the real hello (a hostile source). Empty: the real hello.
  std::vector<uint8_t> hello_override_for_test;
  // Test hook: serve host regions over UCX, as CUDA ones are (CI's UCX moves no CUDA memory,
  // so this is how its UCX path runs there). Never set outside the transport's tests.
  bool ucx_for_host_for_test = false;
  // Run first on the server's progress thread (e.g. to make a CUDA context current there for
  // CUDA regions); an error stops nothing but is logged. Null: nothing.
  std::function<Status()> on_progress_thread;
};

class ArenaServer {
 public:
  // kInvalidArgument for bad options (no region, an empty one, an unparsable address);
  // kUnavailable/kIo when UCX cannot start or listen (the UCX status named).
  static Result<std::unique_ptr<ArenaServer>> Start(ArenaServerOptions options);
  ~ArenaServer();
  ArenaServer(const ArenaServer&) = delete;
  ArenaServer& operator=(const ArenaServer&) = delete;

  // "host:port" as bound ("127.0.0.1:41234").
  const std::string& endpoint() const;
  // Counters, for tests and the log.
  uint64_t peers_accepted() const;
  uint64_t peers_refused() const;
  void Stop();

  class Impl;

 private:
  explicit ArenaServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Where one region of the arena lands on the fetching node: writable host memory (e.g. a
// MapReadWrite of the memfd before it is sealed), or CUDA device memory mapped in the calling
// thread's current context (registered with UCX for the fetch).
struct DestinationRegion {
  void* data = nullptr;
  uint64_t bytes = 0;
  RegionMemory memory = RegionMemory::kHost;
};

// The most sources one fetch connects to. Each holds a hello of up to kMaxHelloBodyBytes in
// memory while it is checked, and each name may take a resolver's timeout: a registry writer
// must not be able to make a filler connect to thousands. Striping gains nothing past a few
// sources (the filler's own link is the limit, docs/fleet.md "Fill time"); the registry path
// picks this many at random among the ready ones.
inline constexpr size_t kMaxFetchSources = 8;

struct FetchOptions {
  std::vector<std::string> sources;  // host:port of each ArenaServer, 1..kMaxFetchSources
  std::vector<DestinationRegion> destination;
  // Called once per source with its manifest blob, before any byte is read from it: an error
  // keeps the source out of the fetch (the daemon compares the source's plan with its own).
  std::function<Status(const std::string& source, std::span<const uint8_t> manifest)> accept;
  uint64_t stripe_bytes = uint64_t{64} << 20;  // over TCP at most kMaxReadBytes (64 MiB)
  size_t max_in_flight_per_source = 4;  // over TCP: read requests pipelined on the connection
  // Connecting plus the hello, per source. Over TCP the fetch does not wait for it to read
  // from the sources that answered.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(10);
  // A read that has not completed in this long drops its source.
  std::chrono::milliseconds stripe_timeout = std::chrono::seconds(30);
  // The whole fetch.
  std::chrono::milliseconds deadline = std::chrono::minutes(10);
  // Called from the fetching thread after each completed stripe.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // Polled (every few ms) while connecting and transferring: once true the fetch ends with
  // kUnavailable "cancelled" (a daemon's stop during its fill). Null: never.
  const std::atomic<bool>* cancel = nullptr;
  // Test hook: fetch host destinations over UCX (ArenaServerOptions::ucx_for_host_for_test).
  bool ucx_for_host_for_test = false;
};

struct SourceReport {
  std::string endpoint;
  bool used = false;   // it passed the hello and accept(), and was read from (or could be)
  uint64_t bytes = 0;  // bytes it served (completed stripes only)
  Status status;       // why it was dropped or never used; OK if it served to the end
};

struct StripeRecord {
  size_t region = 0;
  uint64_t offset = 0;  // within the region
  uint64_t bytes = 0;
  size_t source = 0;  // index into FetchOptions::sources
};

struct FetchResult {
  std::vector<SourceReport> sources;  // in the order of FetchOptions::sources
  std::vector<StripeRecord> stripes;  // in the order of the arena
  uint64_t bytes = 0;
  double seconds = 0;
  double gb_per_s = 0;  // 1e9 bytes per second
  // `seconds` in two: until the reads start, then the reads alone, which the transfer rate is
  // of. Over TCP the setup is connecting and the first hellos (accept() included; reading
  // starts once every source answered, or 100 ms after the first did); with UCX it is the
  // context and worker, registering the destination, connecting and taking every source's
  // hello (with UCX's unpacking of its rkeys, which on cuda_ipc opens and maps the source's
  // memory).
  double setup_seconds = 0;
  double transfer_seconds = 0;
  double transfer_gb_per_s = 0;
};

// kInvalidArgument for bad options (no source, no destination, a zero stripe size);
// kUnavailable for a CUDA destination when this UCX has no CUDA memory support; otherwise
// OK with every byte read, or kUnavailable (every source dropped) / kTimeout (the deadline),
// the message naming each source and why.
Result<FetchResult> FetchArena(const FetchOptions& options);

}  // namespace weightcache::fleet
