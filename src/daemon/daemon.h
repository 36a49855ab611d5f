// Daemon — one cache identity served over one Unix socket (docs/design.md "Identity", "Tiers",
// "Security"; docs/daemon.md).
//
// Lifecycle:
//   Create   ensure the runtime dirs (0700, owner-checked) → take the identity lock (a second
//            daemon gets kAlreadyServed naming the owner's pid) → publish the socket (bound
//            under a temporary name, 0600, renamed into place; a socket already there is
//            stale because we hold the lock, and is replaced). Nothing is loaded yet.
//   Run      a published cache (config.source "published:<tag>", docs/publish.md) loads
//            nothing: it answers `awaiting` until one publisher's PublishBegin/PublishCommit
//            makes it `ready`. Otherwise Run
//            starts the loader thread (state `loading`, with bytes done/total) and serves
//            every client from one epoll loop until it drains. The load ends in `ready`, or
//            in `failed` with the reason, which the daemon keeps answering for
//            `failed_linger` so that the launcher and clients can see why, then it drains.
//            With options.keeper enabled (keeper_link.h) the loader first re-adopts a cache
//            its keeper holds and that validates (then `ready` without reading the
//            checkpoint), and deposits a completed load with the keeper.
//   drain    on SIGTERM/SIGINT (signalfd), a Stop request from the owner's uid, or the end of
//            the failed linger: state `draining`, stop accepting, unlink the socket, cancel
//            the loader, flush pending replies (bounded by drain_timeout), close everyone,
//            drop the keeper (a drain is deliberate: the kept memory goes; a crash keeps it).
//   handover an Upgrade request from the owner (upgrade.h, docs/upgrade.md): a successor is
//            started and sent the store and the lock; once it answers HandoverDone (its socket
//            renamed over ours), we accept our backlog, stop listening without unlinking the
//            path, serve those connections until they attached, and Run returns OK keeping
//            the keeper. A successor that fails is killed, our socket re-published, and we
//            serve on.
//   destroy  releases the lock (after the socket is gone, so a successor never sees our
//            socket with its lock free while we still answer on it).
//
// Contract:
//  * Run returns OK after a clean shutdown (a load cancelled by the shutdown is not a
//    failure), or the load's failure Status, so `serve` exits non-zero after a failed load
//    whatever ended the linger.
//  * Signals: the daemon only reads the signalfd its caller (the process's main) created with
//    the signals already blocked in every thread; the library installs no handlers.
//  * Greedy or idle peers (docs/daemon.md, "Limits"): a connection is not read while its last
//    reply is queued, or while an AttachReply's fds (or more than kMaxUnreadReplyBytes) sit
//    unread in its socket, so each connection has at most one set of fds in flight; a
//    connection backed up for stall_timeout, or one that has not attached and sends no
//    request for handshake_timeout, is closed. When accept fails (no fds: EMFILE/ENFILE, no
//    memory), the listener is paused with a doubling back-off (50 ms .. 1 s) and the failure
//    logged once per 10 s with a count; accepting resumes by itself once fds are free.
//  * Clients: any number at once, non-blocking, per-connection buffers. A connection whose
//    peer is not allowed (SO_PEERCRED uid/gid), or which sends a malformed, oversize,
//    wrong-version or out-of-sequence frame, gets an Error frame (where the socket still
//    takes one) and is closed, logged with its pid; no other connection is affected.
//  * Thread-safety: Create and Run on one thread. The loader thread touches only the
//    checkpoint, the store it builds, and atomics/mutex-guarded handoff state.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/unique_fd.h"
#include "common/unique_handle.h"
#include "cuda/tier_copy.h"
#include "cuda/vmm.h"
#include "daemon/fd_store.h"
#include "daemon/keeper_link.h"
#include "daemon/metrics.h"
#include "daemon/publish_store.h"
#include "daemon/upgrade.h"
#include "daemon/weight_store.h"
#include "identity/cache_config.h"
#include "identity/device_inventory.h"
#include "identity/env.h"
#include "identity/paths.h"
#include "identity/resolve.h"
#include "keeper/keeper_client.h"
#include "os/lock_file.h"
#include "os/unix_socket.h"
#include "protocol/messages.h"
#include "weightcache/status.h"

namespace weightcache::daemon {

// `serve --demote host` (docs/budget.md, "Demotion and promotion"): an idle gpu-tier cache asked
// to give its memory back (Evict) copies its allocations into sealed memfds, frees its GPU
// memory and keeps serving, `demoted`; the next Attach promotes it back first. The hooks are the
// budget ledger's (serve sets them); empty ones do nothing.
struct DemotionOptions {
  bool enabled = false;
  // `--demote host-pinned`: once demoted, the host copy is registered with the driver
  // (cuda::PinnedHostCopy) behind the demotion, so that a promotion is one DMA pass at the
  // pinned-H2D rate; the device's primary context is held while the cache is demoted.
  bool pin_host_copy = false;
  // On the loop thread, before accepting a demotion: Ok when `bytes` more fit the host budget,
  // else why not (then the cache is stopped instead, as without --demote).
  std::function<Status(uint64_t bytes)> host_room;
  // On the loop thread: the cache's memory now lives on `tier` (its ledger entry follows), in
  // `fds` (borrowed for the call, one per allocation: the host copy's memfds when demoted, the
  // new exported VMM allocations when promoted). On a demotion the daemon's own GPU fds are
  // closed already: whatever else maps that memory keeps it allocated until it lets go.
  std::function<void(Tier tier, std::span<const int> fds)> moved;
  // On the mover thread, before a promotion copies anything: room under the gpu budget (it may
  // evict other caches and wait for them). An error refuses the waiting attaches.
  std::function<Status()> readmit;
};

// A published cache that is `ready`: whether a new publish may replace its arena.
enum class ReplacePolicy { kRefuse, kReplace };

struct DaemonOptions {
  identity::CacheConfig config;  // config.tier picks the store the loader fills
  identity::CachePaths paths;
  std::string model_path;  // the checkpoint (file or directory) behind config's fingerprint
  std::string device_key = "host";  // the device UUID, or "host"
  // Gpu tier: the device resolved by identity::ResolveIdentity (its UUID is device_key; its
  // cuda_ordinal is what the load opens). The loader gets it, and the driver, in its
  // LoadOptions.
  std::optional<identity::DeviceInfo> device;
  LoadOptions load;  // threads, memory budget (device and driver are set by the loader)
  // A sharded cache (identity::ResolveIdentity's shard): the loader plans this rank's slices
  // (sharding::PlanShard) and loads only those. Host tier only.
  std::optional<identity::ShardSpec> shard;
  // Every machine input: the CUDA driver (gpu tier load), the socket syscalls of the event
  // loop (accept, recvmsg, sendmsg). Tests run a Daemon in process over a fake driver or
  // faulty syscalls (tests/unit/daemon/in_process_daemon.h).
  identity::Env env = identity::Env::Default();
  // Peers allowed besides our own uid (SO_PEERCRED). Stop is only ever accepted from our uid.
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
  // How long a failed daemon keeps answering `failed` before it exits (0: at once).
  std::chrono::milliseconds failed_linger{30'000};
  // `serve --pin`: an Evict is refused (docs/budget.md).
  bool pinned = false;
  // `serve --demote host`: an Evict demotes a gpu-tier cache to host RAM instead of stopping it.
  DemotionOptions demotion;
  // Upper bound on flushing pending replies while draining.
  std::chrono::milliseconds drain_timeout{2'000};
  // Connections beyond this are answered with an Error and closed (fd exhaustion guard).
  size_t max_connections = 4096;
  // A connection that has not attached is closed when no complete request arrives within
  // this of its accept or of its previous request (a peer that connects and says nothing, or
  // stops mid-frame). Attached connections are never idle-closed: their open socket is how
  // the client's DaemonWatcher learns of our death.
  std::chrono::milliseconds handshake_timeout{10'000};
  // A connection whose replies stay unsent (our queue) or unread (its socket) this long is
  // closed: a peer that pipelines requests and never reads.
  std::chrono::milliseconds stall_timeout{30'000};
  // A published cache (config.source "published:<tag>"; nothing is loaded): whether a publish
  // into it once `ready` is accepted (`serve --replace`). Clients attached to the old arena
  // keep their mappings; new attaches get the new one.
  ReplacePolicy replace = ReplacePolicy::kRefuse;
  // The cache's keeper (docs/keeper.md): a loaded cache is re-adopted from it at start when it
  // holds one that validates, deposited with it at `ready`, and dropped by a deliberate stop
  // (a Stop request, SIGTERM, SIGINT). A published cache has no keeper.
  KeeperLinkOptions keeper;
  // Under systemd (fd_store.h, docs/keeper.md "Under systemd"): the service manager's fd store
  // takes the keeper's place (re-adopt at start, deposit a complete load, remove at a
  // deliberate stop); keeper.verify still says what adoption checks. Null: the keeper.
  std::shared_ptr<FdStore> fd_store;
  // A publisher that has not sent its PublishCommit this long after its PublishBegin loses
  // its arena (a stalled or stopped process would otherwise hold the slot and the memory for
  // as long as it lives): its connection is closed and the state stays as it was
  // (`serve --publish-timeout`, docs/publish.md).
  std::chrono::milliseconds publish_timeout{600'000};
  // Upgrade (docs/upgrade.md): how a successor process is started (`serve` sets it; unset,
  // an Upgrade request is refused: an in-process daemon has no binary to start), the binary an
  // Upgrade without one starts (this daemon's executable as it was at its start), and how long
  // the successor has to validate and take over before it is killed and we serve on.
  StartSuccessor start_successor;
  std::string self_binary;
  std::chrono::milliseconds upgrade_timeout{60'000};
  // The counters `serve --metrics-addr` exposes (metrics.h, docs/metrics.md), shared with the
  // metrics server's thread. Unset, the daemon keeps its own (nothing reads them but tests).
  std::shared_ptr<DaemonMetrics> metrics;
};

// Called on the Run thread (never the loader's), for the CLI's log lines.
struct DaemonEvents {
  // Throttled by the loader (about every 1 % or 250 ms).
  std::function<void(uint64_t done, uint64_t total, double seconds)> on_progress;
  std::function<void(const StoreSummary& summary, double seconds)> on_ready;
  // Right before on_ready when the store was re-adopted from the keeper rather than loaded:
  // "from keeper pid K (loaded by pid D), checksums of N of M tensors verified".
  std::function<void(std::string_view how)> on_adopted;
  std::function<void(const Status& failure)> on_failed;
  std::function<void(std::string_view reason)> on_draining;
  // The number of attached clients changed (an attach, or an attached client's disconnect):
  // the budget ledger's clients and LRU time (docs/budget.md). Runs on the event loop.
  std::function<void(uint32_t clients)> on_clients;
  // An upgrade (docs/upgrade.md): on_handing_over right before the successor is started, to
  // let go of what the successor takes up again with the same flags (serve's --fill-serve
  // port); on_handover_failed when it did not take over and this daemon serves on. Event loop.
  std::function<void()> on_handing_over;
  std::function<void()> on_handover_failed;
  // The successor took over (HandoverDone): what it inherited (serve's metrics listener) is
  // its now. Event loop.
  std::function<void()> on_handed_over;
};

class Daemon {
 public:
  using Clock = std::chrono::steady_clock;

  static Result<std::unique_ptr<Daemon>> Create(DaemonOptions options);
  // A successor's daemon (upgrade.h): it owns the lock and the store it took over, publishes
  // the socket (renaming over the old daemon's: from then on new clients reach it) and Run
  // serves `ready` at once, loading nothing.
  static Result<std::unique_ptr<Daemon>> CreateFromHandover(DaemonOptions options, TakenOver taken);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // `signal_fd`: a signalfd for SIGTERM, SIGINT, SIGHUP and SIGUSR2 (an upgrade; borrowed), or
  // -1 (tests).
  Status Run(int signal_fd, DaemonEvents events = {});

  const DaemonOptions& options() const { return options_; }
  const DaemonMetrics& metrics() const { return *options_.metrics; }
  // The ready store's allocation fds (borrowed: valid while the store is, i.e. until the
  // daemon drains or is destroyed), in manifest order; empty before ready. Run thread only:
  // from a DaemonEvents callback (serve's fill source maps them in on_ready).
  std::vector<int> StoreFds() const { return store_ ? store_->fds() : std::vector<int>{}; }
  // The ready store's creating handles (WeightStore::creating_handles; borrowed likewise), or
  // empty. Run thread only, as StoreFds.
  std::vector<CUmemGenericAllocationHandle> StoreCreatingHandles() const {
    return store_ ? store_->creating_handles() : std::vector<CUmemGenericAllocationHandle>{};
  }
  // Blocks until the loader thread has released what its load held — the gpu tier's pipeline,
  // arena mappings and CUDA context, which it releases after `ready` (docs/daemon.md) — and
  // returns at once when no loader was started. For tests that read the driver's or the
  // process's books right after ready. Any thread.
  void WaitLoaderSettled();

 private:
  // The release rule of the published path, for UniqueHandle: unlink it (we hold the lock, so
  // the path is ours; already gone is fine).
  struct SocketPathTraits {
    using Handle = std::string;
    using Context = NoContext;
    static Handle Null() { return {}; }
    static void Close(NoContext /*unused*/, const std::string& path) noexcept;
  };
  // The published socket: the listening fd and the path it is bound to. Destroying it unlinks
  // the path, then closes the fd (members in that reverse order), so a client never finds the
  // path with nobody listening behind it. Movable, not move-assignable: a member-wise
  // assignment would close the old fd before unlinking the old path.
  class PublishedSocket {
   public:
    PublishedSocket() = default;
    PublishedSocket(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
    PublishedSocket(PublishedSocket&& other) noexcept = default;
    PublishedSocket& operator=(PublishedSocket&& other) = delete;
    int fd() const { return fd_.get(); }
    void Withdraw() {
      path_.Reset();
      fd_.Reset();
    }
    // A successor serves at the path now: stop listening, leave the path to it.
    void Abandon() {
      (void)path_.Release();
      fd_.Reset();
    }
    // Listen on `fd` from now on (the path was re-published over a dead successor's).
    void ReplaceFd(UniqueFd fd) { fd_ = std::move(fd); }

   private:
    UniqueFd fd_;
    UniqueHandle<SocketPathTraits> path_;
  };

  struct Connection;

  Daemon(DaemonOptions options, os::LockFile lock, PublishedSocket socket, UniqueFd epoll,
         UniqueFd wakeup);
  // Create's part after the lock: the socket, epoll and the eventfd. `predecessor` (> 0): the
  // socket at the path is that live daemon's, which handed us the lock (for the log line).
  static Result<std::unique_ptr<Daemon>> Publish(DaemonOptions options, os::LockFile lock,
                                                 int64_t predecessor = 0);

  void LoaderMain();
  // The load proper (checkpoint open, fingerprint check, the tier's loader); `memory` gets the
  // loader's memory at its steps for the log line.
  Result<WeightStore> Load(std::string* memory, LoadLeftovers* leftovers);
  // The keeper's part of the loader thread (keeper_link.h): the kept store, validated, or
  // nullopt (then the caller loads); the keeper started with a load (nullopt with the fd
  // store, without keepers, or when the start failed: then the deposit starts one); and the
  // deposit of a store that was loaded, with the keeper started for it if any.
  std::optional<AdoptedStore> AdoptKept();
  // What checking kept gpu memory needs (the driver and the device); nullopt off the gpu tier
  // or without a driver.
  std::optional<GpuAdoptContext> GpuAdoptContextOf() const;
  std::optional<keeper::StartingKeeper> StartKeeperForLoad();
  // `--adopt-verify behind`: every checksum of the adopted memory, after ready, on the loader
  // thread; a failure is handed to the event loop (behind_failure_), which drains.
  void VerifyAdoptedBehindReady(const protocol::Handoff& handoff);
  void DepositLoaded(const WeightStore& store,
                     std::optional<keeper::StartingKeeper> started = std::nullopt);
  // The end of a deliberate stop: the keeper is told the cache is dead.
  void DropKeeperAtStop();
  void OnLoaderWakeup();
  void OnSignal(int signal_fd);
  void AcceptAll();
  void OnConnectionEvent(int fd, uint32_t events);
  // One complete request: the dispatcher, then one handler per request type.
  void HandleFrame(Connection& conn, const protocol::Frame& frame);
  void HandleHello(Connection& conn, std::span<const uint8_t> payload);
  void HandleStatus(Connection& conn);
  void HandleMetrics(Connection& conn);
  void HandleAttach(Connection& conn);
  // False (the peer has been sent a PermissionDenied naming `request`) unless the peer is the
  // daemon's own uid: the rule of every request that ends the daemon.
  bool RequireOwner(Connection& conn, std::string_view request, std::string_view verb);
  void HandleStop(Connection& conn);
  void HandleEvict(Connection& conn);
  // Upgrade (docs/upgrade.md): start the successor and send it the handover; its answer on
  // the channel ends the upgrade (OnUpgradeChannel), or the upgrade deadline does.
  void HandleUpgrade(Connection& conn, std::span<const uint8_t> payload);
  // Starts the successor and sends it the handover (an Upgrade request, or SIGUSR2 with
  // `requester` 0: no connection to answer). An error refuses before anything started.
  Status StartUpgrade(const std::string& binary, const std::string& requested_by,
                      uint64_t requester);
  void OnUpgradeChannel();
  // Success: answer the requester, accept the backlog, leave the socket path to the
  // successor and end the loop once the connections are served (keeping the keeper). Failure:
  // kill and reap the successor, re-publish our socket (it may have renamed its own over it),
  // answer the requester with the reason, and serve on.
  void FinishUpgrade(const Status& result);
  // The end of the handover's accept grace: the backlog taken, the listener closed, the path
  // left to the successor.
  void StopListeningAfterHandover();
  // Publishing (docs/publish.md): one publisher at a time, host tier.
  void HandlePublishBegin(Connection& conn, std::span<const uint8_t> payload);
  void HandlePublishCommit(Connection& conn, std::span<const uint8_t> payload);
  // Why a PublishBegin cannot start now (state, another publisher), or OK.
  Status CanPublish(const Connection& conn) const;
  // The arena of a plan on this cache's tier (CreatePublication; gpu: its driver and device).
  Result<Publication> CreateArenaFor(protocol::PublishBegin plan);
  // The warmer thread's body: retains the device's primary context into warm_context_.
  void WarmContext();
  // Drops the publication in progress (its memfds close, or its VMM arena is destroyed); the
  // state stays what it was.
  void AbandonPublication(std::string_view why);
  // The committer thread's result (CommitPublication): installs the store or refuses the
  // commit, answers the publisher if its connection is still open.
  void OnCommitDone();
  // Demotion and promotion (docs/budget.md): the copies run on the mover thread, whose result
  // the loop takes in OnMoveDone (woken through the loader's eventfd).
  Status CanDemote() const;
  // The driver and the cache's device (options_.device), for the mover's copies and the
  // publisher's context; and the demoted memfds, borrowed, for a copy of the host copy.
  struct CopyDevice {
    const cuda::DriverApi* api = nullptr;
    CUdevice device = 0;
  };
  Result<CopyDevice> CacheDevice() const;
  std::vector<int> DemotedFds() const;
  void StartDemotion();
  void StartPinning();
  void StartPromotion();
  void OnMoveDone();
  void FinishDemotion(Result<std::vector<UniqueFd>> memfds, const std::string& how);
  void FinishPinning(Result<cuda::PinnedHostCopy> pinned);
  void FinishPromotion(Result<std::vector<UniqueFd>> fds, const std::string& how);
  void ReleaseHostCopyBehind();
  // Serves `store` from now on (a load's, or a publish's commit, which may replace a ready
  // one: the old store is retired until no queued reply borrows its fds).
  Status InstallStore(WeightStore store);
  // Status, Attach and Stop carry no payload: true if `frame`'s is empty, else the connection
  // is closed with the decoder's error.
  bool DecodeEmptyRequest(Connection& conn, const protocol::Frame& frame);
  // Logs `log_line`, queues `status` as the connection's last reply and closes the connection
  // once it is flushed: how every malformed or out-of-sequence request ends.
  void CloseWithError(Connection& conn, const Status& status, std::string_view log_line);
  // The load state every Hello and Status reply carries: state, bytes, the failure.
  template <typename Reply>
  void FillLoadState(Reply& reply) const;
  void QueueFrame(Connection& conn, Result<std::vector<uint8_t>> frame, std::vector<int> fds = {});
  void QueueError(Connection& conn, const Status& status);
  // Flushes what it can, then re-arms epoll (or closes a finished connection).
  void FlushAndRearm(Connection& conn);
  void CloseConnection(int fd);
  // Whether `conn` may be read: nothing queued, and not held by replies its peer has not read.
  bool Readable(Connection& conn);
  // What a connection waits for, read off the daemon's own record of it.
  bool IsPublisher(const Connection& conn) const;      // its arena is out
  bool IsCommitting(const Connection& conn) const;     // its PublishCommit is being verified
  bool IsUpgrading(const Connection& conn) const;      // its Upgrade awaits the successor
  bool AwaitsPromotion(const Connection& conn) const;  // its Attach waits for the promotion
  // The periodic check of idle and backed-up connections (handshake/stall timeouts, held
  // connections whose peer caught up). Returns whether another sweep is needed.
  bool Sweep(Clock::time_point now);
  void ScheduleSweep();
  // Accept failures: pause the listener (back-off) and rate-limit the log.
  void PauseAccepting(const Status& error);
  void ResumeAccepting();
  void BeginDrain(std::string_view reason);
  void Fail(Status failure);
  bool PeerAllowed(const os::PeerCred& peer) const;
  protocol::StatusReply MakeStatusReply() const;
  // Joins the loader (cancelled) and the committer (bounded: one pass over the arena).
  void StopLoader();
  // Copies the loop's state (state, clients, bytes, load progress) into the metrics: once per
  // loop iteration, so the metrics thread never reads the loop's members.
  void SyncMetrics();
  // A Hello or Attach ended in `result` (the duration: from the connection's Hello).
  void RecordAttach(const Connection& conn, AttachResult result);

  // Resources in acquisition order (destroyed in reverse: socket unlinked before the lock
  // is released).
  DaemonOptions options_;
  os::LockFile lock_;
  PublishedSocket socket_;
  UniqueFd epoll_;
  UniqueFd wakeup_;  // eventfd: the loader's progress and completion
  std::map<int, std::unique_ptr<Connection>> connections_;

  DaemonEvents events_;  // set by Run
  protocol::CacheState state_ = protocol::CacheState::kLoading;
  Status failure_;  // the load failure, once state_ is kFailed (kept while draining)
  std::optional<WeightStore> store_;  // once ready
  // Replaced stores (a --replace publish) while a queued AttachReply may still borrow their
  // fds; released once every outbox is empty.
  std::vector<WeightStore> retired_stores_;
  // The publish in progress: its arena and the connection (fd) and pid of its publisher.
  std::optional<Publication> publication_;
  int publisher_fd_ = -1;
  int64_t publisher_pid_ = 0;
  int64_t published_by_ = 0;         // the pid whose commit made the current store
  Clock::time_point publish_begun_;  // the PublishBegin of the publish in progress
  // The commit being verified on the committer thread: its publisher's connection (by id,
  // since an fd number is reused once closed; 0 = no commit running) and when it began.
  uint64_t committing_conn_ = 0;
  Clock::time_point commit_start_;
  uint64_t next_connection_id_ = 1;
  std::vector<uint8_t> attach_frame_;  // encoded once the store is ready
  uint32_t clients_ = 0;               // attached connections still open
  std::chrono::steady_clock::time_point load_start_;
  std::optional<std::chrono::steady_clock::time_point> linger_until_;
  std::optional<std::chrono::steady_clock::time_point> drain_until_;
  std::string stop_requested_by_;  // why a Stop or Evict request ends it; the loop then drains
  std::optional<Clock::time_point> sweep_at_;  // the next Sweep, while a connection needs one
  // Accept back-off: the listener is out of epoll until accept_paused_until_.
  std::optional<Clock::time_point> accept_paused_until_;
  std::chrono::milliseconds accept_backoff_{0};
  uint64_t accept_failures_ = 0;           // since accepting last succeeded
  uint64_t accept_failures_unlogged_ = 0;  // since the last log line
  Clock::time_point accept_log_next_;      // no failure line before this

  // Loader handoff.
  std::atomic<bool> cancel_{false};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint64_t> bytes_total_{0};
  Mutex result_mu_;
  bool load_finished_ WEIGHTCACHE_GUARDED_BY(result_mu_) = false;
  std::optional<Result<WeightStore>> load_result_ WEIGHTCACHE_GUARDED_BY(result_mu_);
  // Set with load_result_ when the store was adopted from the keeper: how (for on_adopted).
  std::string adopted_how_ WEIGHTCACHE_GUARDED_BY(result_mu_);
  // VerifyAdoptedBehindReady's failure, for the event loop.
  std::optional<Status> behind_failure_ WEIGHTCACHE_GUARDED_BY(result_mu_);
  bool loader_started_ WEIGHTCACHE_GUARDED_BY(result_mu_) = false;
  bool loader_settled_ WEIGHTCACHE_GUARDED_BY(result_mu_) = false;  // its teardown is done
  CondVar loader_settled_cv_;
  std::thread loader_;

  // Demotion and promotion: what the mover thread is doing, the store's allocation sizes
  // (from its manifest), the sealed memfds while demoted (and, with --demote host-pinned, their
  // pinned mappings once the mover has registered them behind the demotion: read by the mover
  // during a promotion, otherwise the loop's), and the connections (by id) whose Attach waits
  // for the promotion.
  enum class Move : uint8_t { kNone, kDemoting, kPinning, kPromoting };
  Move move_ = Move::kNone;
  Clock::time_point move_start_;
  std::vector<uint64_t> allocation_sizes_;
  std::vector<UniqueFd> demoted_;
  std::optional<cuda::PinnedHostCopy> pinned_copy_;
  std::vector<uint64_t> promotion_waiters_;
  Mutex move_mu_;
  std::optional<Result<std::vector<UniqueFd>>> move_result_ WEIGHTCACHE_GUARDED_BY(move_mu_);
  std::optional<Result<cuda::PinnedHostCopy>> pin_result_ WEIGHTCACHE_GUARDED_BY(move_mu_);
  std::string move_how_ WEIGHTCACHE_GUARDED_BY(move_mu_);  // bytes, seconds, GB/s
  std::thread mover_;
  // Releases a promoted cache's host copy (ReleaseHostCopyBehind); joined by the next release
  // and by StopLoader.
  std::thread releaser_;

  // Committer handoff: sealing and checksumming a published arena is one pass over all of its
  // bytes, done off the event loop so that other connections are served meanwhile.
  Mutex commit_mu_;
  std::optional<Result<WeightStore>> commit_result_ WEIGHTCACHE_GUARDED_BY(commit_mu_);
  std::thread committer_;

  // A published gpu-tier cache: the device's primary context, retained by the warmer thread as
  // soon as the daemon awaits its publisher, so that a PublishBegin's arena does not wait for
  // the context to be created (~120 ms on an H200, docs/publish.md). Written by warmer_ and
  // read only after joining it; released once a publish is installed (the store's fds need no
  // context).
  std::thread warmer_;
  std::optional<cuda::PrimaryContext> warm_context_;

  // The upgrade in progress (HandleUpgrade .. FinishUpgrade).
  struct PendingUpgrade {
    std::unique_ptr<Successor> successor;
    UniqueFd channel;
    uint64_t requester = 0;  // the Upgrade's connection id (it may close meanwhile)
    Clock::time_point started;
    Clock::time_point deadline;
  };
  std::optional<PendingUpgrade> upgrade_;
  mode_t socket_mode_ = 0600;  // what a re-published socket gets
  // Handed over: the successor serves; the loop ends once our connections are served.
  std::optional<Clock::time_point> handed_over_until_;
  std::optional<Clock::time_point> handover_listen_until_;  // set while the accept grace runs
  // A successor's daemon: the store it took over, installed when Run starts.
  std::optional<TakenOver> taken_over_;
};

}  // namespace weightcache::daemon
