#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <list>
#include <optional>
#include <thread>

#include "common/logging.h"
#include "common/mutex.h"
#include "fleet/arena_transfer_hello.h"
#include "fleet/arena_transfer_internal.h"
#include "fleet/ucx_support.h"
#include "os/syscalls.h"

namespace weightcache::fleet {
namespace ucx_detail {

using Clock = std::chrono::steady_clock;
constexpr auto kCloseTimeout = std::chrono::seconds(2);

// ucp_ep_rkey_unpack takes no length: it parses the packed key as far as the key says. A peer's
// rkey is copied into a buffer with this many zero bytes after it, so that a lying key can only
// make UCX read zeros we own (a zero descriptor ends the parse), never past our allocation.
constexpr size_t kRkeyPadding = size_t{64} << 10;

// When a pass made no progress: sleeps until the worker has an event (a completion, a peer's
// data, a disconnect) or `timeout_ms` passes, instead of spinning on a CPU the sources and the
// rest of the node share.
void WaitForEvents(ucp_worker_h worker, int efd, int timeout_ms) {
  if (ucp_worker_arm(worker) != UCS_OK) return;  // UCS_ERR_BUSY: events are pending already
  pollfd fd{efd, POLLIN, 0};
  (void)os::SysCalls::Default().Poll(&fd, 1, timeout_ms);
}
constexpr int kPollMs = 10;
// Once the first source is ready, how long the reads wait for the others' hellos (so that
// healthy sources are striped across from the start); a later one still joins.
constexpr auto kGatherWindow = std::chrono::milliseconds(100);

double Millis(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// ---- ArenaServer -------------------------------------------------------------------------------

class UcxServer final : public ArenaServer::Impl {
 public:
  // One accepted peer. Lives in a std::list (the error handler's argument is its address).
  struct Peer {
    UcxServer* server = nullptr;
    ucp_ep_h ep = nullptr;
    std::string address;
    ucs_status_ptr_t send = nullptr;  // the hello, until it completes
    std::atomic<bool> failed{false};  // the endpoint's error handler ran
    ucs_status_t error = UCS_OK;
  };

  ArenaServerOptions options;
  std::string endpoint;
  std::vector<uint8_t> hello;  // encoded once, sent to every peer
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<bool> stopping{false};
  Mutex stop_mu;
  bool stopped WEIGHTCACHE_GUARDED_BY(stop_mu) = false;

  // Declared in acquisition order: destroyed in reverse (listener and memory before the worker,
  // the worker before the context).
  ucx::UcpContext context;
  ucx::UcpWorker worker;
  std::vector<ucx::UcpMem> memory;
  ucx::UcpListener listener;
  std::list<Peer> peers;  // touched by the progress thread only (and by Stop after the join)
  std::thread progress;

  static void OnConnRequest(ucp_conn_request_h request, void* arg) {
    static_cast<UcxServer*>(arg)->ConnRequest(request);
  }
  static void OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* peer = static_cast<Peer*>(arg);
    peer->error = status;
    peer->failed = true;
  }

  void ConnRequest(ucp_conn_request_h request) {
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    const ucs_status_t queried = ucp_conn_request_query(request, &attr);
    const sockaddr* client =
        queried == UCS_OK ? reinterpret_cast<const sockaddr*>(&attr.client_address) : nullptr;
    const std::string address = client != nullptr ? FormatSockaddr(client) : "<unknown address>";
    if (stopping || client == nullptr || !options.allow.Allows(client) ||
        peers.size() >= options.max_peers) {
      ++refused;
      if (stopping) {
        LOG_INFO << "fleet: transport " << endpoint << " refused " << address << " (stopping)";
      } else if (peers.size() >= options.max_peers) {
        LOG_WARN << "fleet: transport " << endpoint << " refused " << address << ": "
                 << peers.size() << " peers connected already (the limit)";
      } else {
        LOG_WARN << "fleet: transport " << endpoint << " refused a connection from " << address
                 << ": not on the peer allow-list (" << options.allow.ToString() << ")";
      }
      ucp_listener_reject(listener.get(), request);
      return;
    }
    Peer& peer = peers.emplace_back();
    peer.server = this;
    peer.address = address;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &OnPeerError;
    params.err_handler.arg = &peer;
    const ucs_status_t status = ucp_ep_create(worker.get(), &params, &peer.ep);
    if (status != UCS_OK) {
      LOG_WARN << "fleet: transport " << endpoint << ": accepting " << address << ": "
               << ucs_status_string(status);
      peers.pop_back();
      return;
    }
    ++accepted;
    LOG_INFO << "fleet: transport " << endpoint << " serves " << address;
    const std::vector<uint8_t>& frame =
        options.hello_override_for_test.empty() ? hello : options.hello_override_for_test;
    ucp_request_param_t send{};
    peer.send = ucp_stream_send_nbx(peer.ep, frame.data(), frame.size(), &send);
    if (UCS_PTR_IS_ERR(peer.send)) {
      peer.error = UCS_PTR_STATUS(peer.send);
      peer.send = nullptr;
      peer.failed = true;
    }
  }

  // Frees completed hello sends; closes the endpoints of peers that failed.
  void Reap() {
    for (auto it = peers.begin(); it != peers.end();) {
      Peer& peer = *it;
      if (peer.send != nullptr && ucp_request_check_status(peer.send) != UCS_INPROGRESS) {
        ucp_request_free(peer.send);
        peer.send = nullptr;
      }
      if (peer.failed) {
        LOG_INFO << "fleet: transport " << endpoint << ": peer " << peer.address
                 << " gone: " << ucs_status_string(peer.error);
        if (peer.send != nullptr) {
          ucp_request_cancel(worker.get(), peer.send);
          ucp_request_free(peer.send);  // released when it completes
          peer.send = nullptr;
        }
        ucx::CloseEndpoints(worker.get(), {peer.ep}, kCloseTimeout);
        it = peers.erase(it);
      } else {
        ++it;
      }
    }
  }

  void Run() {
    if (options.on_progress_thread) {
      if (Status ready = options.on_progress_thread(); !ready.ok()) {
        LOG_ERROR << "fleet: transport " << endpoint
                  << ": preparing the progress thread: " << ready.ToString();
      }
    }
    while (!stopping) {
      // A busy peer (reads served in software over TCP) keeps progress non-zero for as long as
      // it reads: `stopping` is checked inside too, so Stop never waits for a transfer.
      while (!stopping && ucp_worker_progress(worker.get()) != 0) {
      }
      Reap();
      if (stopping) break;
      const ucs_status_t armed = ucp_worker_arm(worker.get());
      if (armed == UCS_ERR_BUSY) continue;
      if (armed != UCS_OK) {
        LOG_ERROR << "fleet: transport " << endpoint
                  << ": ucp_worker_arm: " << ucs_status_string(armed);
        break;
      }
      ucp_worker_wait(worker.get());
    }
  }

  const std::string& endpoint_name() const override { return endpoint; }
  uint64_t peers_accepted() const override { return accepted; }
  uint64_t peers_refused() const override { return refused; }
  ~UcxServer() override { Stop(); }

  void Stop() override {
    {
      MutexLock lock(stop_mu);
      if (stopped) return;
      stopped = true;
    }
    stopping = true;
    if (progress.joinable()) {
      ucp_worker_signal(worker.get());
      progress.join();
    }
    std::vector<ucp_ep_h> endpoints;
    for (Peer& peer : peers) {
      if (peer.send != nullptr) {
        ucp_request_cancel(worker.get(), peer.send);
        ucp_request_free(peer.send);
        peer.send = nullptr;
      }
      endpoints.push_back(peer.ep);
    }
    if (worker) ucx::CloseEndpoints(worker.get(), endpoints, kCloseTimeout);
    peers.clear();
    listener.Reset();
    memory.clear();
  }
};

}  // namespace ucx_detail

Result<std::unique_ptr<ArenaServer::Impl>> StartUcxServer(ArenaServerOptions options) {
  using ucx_detail::UcxServer;
  WEIGHTCACHE_ASSIGN_OR_RETURN(ucx::SocketAddress bind, ucx::ResolveEndpoint(options.listen));
  auto impl = std::make_unique<UcxServer>();
  UcxServer& s = *impl;
  s.options = std::move(options);
  WEIGHTCACHE_ASSIGN_OR_RETURN(s.context, ucx::CreateContext());
  WEIGHTCACHE_ASSIGN_OR_RETURN(s.worker,
                               ucx::CreateWorker(s.context.get(), ucx::Threading::kMulti));
  if (std::any_of(s.options.regions.begin(), s.options.regions.end(),
                  [](const ServedRegion& r) { return r.memory == RegionMemory::kCuda; })) {
    WEIGHTCACHE_RETURN_IF_ERROR(
        ucx::CheckMemoryType(s.context.get(), UCS_MEMORY_TYPE_CUDA).Context("arena server"));
  }

  Hello hello;
  hello.protocol = HelloProtocol::kUcx;
  hello.manifest = s.options.manifest;
  for (const ServedRegion& region : s.options.regions) {
    // Registered for remote reads only.
    WEIGHTCACHE_ASSIGN_OR_RETURN(ucx::UcpMem memory,
                                 ucx::MapMemory(s.context.get(), const_cast<void*>(region.data),
                                                region.bytes, region.memory == RegionMemory::kCuda,
                                                ucx::Access::kRemoteReadOnly, "arena server"));
    ucp_mem_h memh = memory.get();
    s.memory.push_back(std::move(memory));
    void* packed = nullptr;
    size_t packed_bytes = 0;
    ucs_status_t status = ucp_rkey_pack(s.context.get(), memh, &packed, &packed_bytes);
    if (status != UCS_OK) return ucx::UcxError("arena server: ucp_rkey_pack", status);
    HelloRegion& out = hello.regions.emplace_back();
    out.remote_address = reinterpret_cast<uintptr_t>(region.data);
    out.bytes = region.bytes;
    out.rkey.assign(static_cast<const uint8_t*>(packed),
                    static_cast<const uint8_t*>(packed) + packed_bytes);
    ucp_rkey_buffer_release(packed);
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(s.hello, EncodeHello(hello));

  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = bind.get();
  params.sockaddr.addrlen = bind.length;
  params.conn_handler.cb = &UcxServer::OnConnRequest;
  params.conn_handler.arg = &s;
  ucp_listener_h listener = nullptr;
  ucs_status_t status = ucp_listener_create(s.worker.get(), &params, &listener);
  if (status != UCS_OK) {
    return ucx::UcxError("arena server: listening on " + s.options.listen, status);
  }
  s.listener.Reset(listener);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  status = ucp_listener_query(listener, &attr);
  if (status != UCS_OK) return ucx::UcxError("arena server: ucp_listener_query", status);
  s.endpoint = FormatSockaddr(reinterpret_cast<const sockaddr*>(&attr.sockaddr));
  s.progress = std::thread([&s] { s.Run(); });
  LOG_INFO << "fleet: transport listening on " << s.endpoint << " (" << s.options.regions.size()
           << " regions, peers " << s.options.allow.ToString() << ")";
  return std::unique_ptr<ArenaServer::Impl>(std::move(impl));
}

namespace ucx_detail {

// ---- FetchArena --------------------------------------------------------------------------------

struct Stripe {
  size_t region = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct InFlight {
  size_t stripe = 0;
  ucs_status_ptr_t request = nullptr;
  Clock::time_point started;
};

enum class Phase { kHeader, kBody, kReady, kDropped };

struct Source {
  std::string endpoint;
  Phase phase = Phase::kHeader;
  ucp_ep_h ep = nullptr;
  bool ep_failed = false;
  ucs_status_t ep_error = UCS_OK;
  Status why;  // set when dropped
  std::vector<uint8_t> header = std::vector<uint8_t>(kHelloHeaderBytes);
  std::vector<uint8_t> body;
  ucs_status_ptr_t receive = nullptr;
  std::vector<ucx::UcpRkey> rkeys;
  std::vector<uint64_t> remote_addresses;
  std::deque<InFlight> in_flight;
  uint64_t bytes = 0;
  bool used = false;
};

void OnSourceError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* source = static_cast<Source*>(arg);
  source->ep_failed = true;
  source->ep_error = status;
}

// The hello a stream receive completed with (or the error). `request` is a recv_nbx result.
// Returns true once the receive is done, with `*status` its outcome.
bool ReceiveDone(ucs_status_ptr_t* request, ucs_status_t* status) {
  if (*request == nullptr) {
    *status = UCS_OK;
    return true;
  }
  if (UCS_PTR_IS_ERR(*request)) {
    *status = UCS_PTR_STATUS(*request);
    *request = nullptr;
    return true;
  }
  size_t length = 0;
  const ucs_status_t state = ucp_stream_recv_request_test(*request, &length);
  if (state == UCS_INPROGRESS) return false;
  ucp_request_free(*request);
  *request = nullptr;
  *status = state;
  return true;
}

ucs_status_ptr_t ReceiveAll(ucp_ep_h ep, std::vector<uint8_t>& buffer) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
  size_t length = 0;
  return ucp_stream_recv_nbx(ep, buffer.data(), buffer.size(), &length, &param);
}

class Fetch {
 public:
  explicit Fetch(const FetchOptions& options) : options_(options) {}

  ~Fetch() {
    // Requests first (a request still running holds the endpoint), then rkeys, then endpoints.
    std::vector<ucp_ep_h> endpoints;
    for (Source& source : sources_) {
      Release(source);
      if (source.ep != nullptr) endpoints.push_back(source.ep);
    }
    if (worker_) ucx::CloseEndpoints(worker_.get(), endpoints, kCloseTimeout);
    sources_.clear();
  }

  Result<FetchResult> Run() {
    const auto start = Clock::now();
    deadline_ = start + options_.deadline;
    PlanStripes();
    WEIGHTCACHE_ASSIGN_OR_RETURN(context_, ucx::CreateContext());
    WEIGHTCACHE_ASSIGN_OR_RETURN(worker_,
                                 ucx::CreateWorker(context_.get(), ucx::Threading::kSingle));
    const ucs_status_t got_fd = ucp_worker_get_efd(worker_.get(), &efd_);
    if (got_fd != UCS_OK) return ucx::UcxError("arena fetch: ucp_worker_get_efd", got_fd);
    const auto ucx_ready = Clock::now();
    WEIGHTCACHE_RETURN_IF_ERROR(RegisterDestination());
    const auto registered = Clock::now();
    sources_.resize(options_.sources.size());
    for (size_t i = 0; i < sources_.size(); ++i) {
      // Resolving a name can block for the resolver's timeout: a stop or the deadline is
      // honoured between sources.
      if (Cancelled()) return Failure(StatusCode::kUnavailable, "cancelled");
      if (Clock::now() >= deadline_) {
        return Failure(StatusCode::kTimeout, "the fetch passed its deadline while connecting");
      }
      Connect(i);
    }
    WEIGHTCACHE_RETURN_IF_ERROR(Handshake());
    const auto reading = Clock::now();
    LOG_INFO << "arena fetch: setup " << Millis(reading - start) << " ms (UCX context and worker "
             << Millis(ucx_ready - start) << " ms, registering the destination "
             << Millis(registered - ucx_ready) << " ms, connecting and the hellos "
             << Millis(reading - registered) << " ms)";
    WEIGHTCACHE_RETURN_IF_ERROR(Transfer());
    const auto end = Clock::now();
    for (Source& source : sources_) {
      if (source.phase != Phase::kHeader && source.phase != Phase::kBody) continue;
      // Still taking its hello when every byte was in: it was not waited for.
      source.why = Status(StatusCode::kUnavailable,
                          "source " + source.endpoint + ": no hello in the " +
                              std::to_string(static_cast<int64_t>(Millis(end - start))) +
                              " ms the fetch took (not used)");
    }

    FetchResult result;
    result.seconds = std::chrono::duration<double>(end - start).count();
    result.setup_seconds = std::chrono::duration<double>(reading - start).count();
    result.transfer_seconds = std::chrono::duration<double>(end - reading).count();
    for (Source& source : sources_) {
      result.sources.push_back({source.endpoint, source.used, source.bytes, source.why});
      result.bytes += source.bytes;
    }
    result.stripes = std::move(records_);
    result.gb_per_s =
        result.seconds > 0 ? static_cast<double>(result.bytes) / result.seconds / 1e9 : 0;
    result.transfer_gb_per_s = result.transfer_seconds > 0 ? static_cast<double>(result.bytes) /
                                                                 result.transfer_seconds / 1e9
                                                           : 0;
    return result;
  }

 private:
  void PlanStripes() {
    for (size_t r = 0; r < options_.destination.size(); ++r) {
      const uint64_t bytes = options_.destination[r].bytes;
      for (uint64_t offset = 0; offset < bytes; offset += options_.stripe_bytes) {
        stripes_.push_back({r, offset, std::min(options_.stripe_bytes, bytes - offset)});
        total_ += stripes_.back().bytes;
      }
    }
    for (size_t i = 0; i < stripes_.size(); ++i) queue_.push_back(i);
    records_.resize(stripes_.size());
  }

  void Drop(Source& source, Status why) {
    if (source.phase == Phase::kDropped) return;
    LOG_WARN << "fleet: dropping source " << source.endpoint << ": " << why.ToString();
    source.phase = Phase::kDropped;
    source.why = std::move(why);
    // Its unfinished stripes go back to the queue, in front (they are the oldest).
    for (auto it = source.in_flight.rbegin(); it != source.in_flight.rend(); ++it) {
      queue_.push_front(it->stripe);
    }
    Release(source);
    if (source.ep != nullptr) {
      ucx::CloseEndpoints(worker_.get(), {source.ep}, kCloseTimeout);
      source.ep = nullptr;
    }
  }

  // Cancels what is outstanding on `source` and frees its rkeys; the endpoint stays.
  void Release(Source& source) {
    for (InFlight& flight : source.in_flight) {
      if (flight.request != nullptr) {
        ucp_request_cancel(worker_.get(), flight.request);
        ucp_request_free(flight.request);
      }
    }
    source.in_flight.clear();
    if (source.receive != nullptr) {
      ucp_request_cancel(worker_.get(), source.receive);
      ucp_request_free(source.receive);
      source.receive = nullptr;
    }
    source.rkeys.clear();
  }

  Status EndpointError(const Source& source) const {
    if (source.ep_error == UCS_ERR_REJECTED) {
      return PermissionDenied("source " + source.endpoint +
                              " rejected the connection (is this node on its peer allow-list?)");
    }
    return ucx::UcxError("source " + source.endpoint + ": connection failed", source.ep_error);
  }

  void Connect(size_t i) {
    Source& source = sources_[i];
    source.endpoint = options_.sources[i];
    auto address = ucx::ResolveEndpoint(source.endpoint);
    if (!address.ok()) {
      Drop(source, address.status());
      return;
    }
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = address->get();
    params.sockaddr.addrlen = address->length;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &OnSourceError;
    params.err_handler.arg = &source;
    const ucs_status_t status = ucp_ep_create(worker_.get(), &params, &source.ep);
    if (status != UCS_OK) {
      source.ep = nullptr;
      Drop(source, ucx::UcxError("source " + source.endpoint + ": connecting", status));
      return;
    }
    source.receive = ReceiveAll(source.ep, source.header);
  }

  // Takes the hellos, concurrently, until every source is ready or dropped, or one is ready
  // and the others had kGatherWindow more: the reads start then, and a source that answers
  // later joins them (Transfer goes on taking hellos), so that a silent source delays nothing.
  Status Handshake() {
    give_up_ = std::min(Clock::now() + options_.connect_timeout, deadline_);
    std::optional<Clock::time_point> first_ready;
    for (;;) {
      if (ucp_worker_progress(worker_.get()) == 0) WaitForEvents(worker_.get(), efd_, kPollMs);
      if (Cancelled()) return Failure(StatusCode::kUnavailable, "cancelled");
      const bool waiting = StepHellos();
      if (!waiting) break;
      const bool ready = std::any_of(sources_.begin(), sources_.end(),
                                     [](const Source& s) { return s.phase == Phase::kReady; });
      if (ready && !first_ready) first_ready = Clock::now();
      if (first_ready && Clock::now() - *first_ready >= kGatherWindow) break;
    }
    return Status::Ok();
  }

  // One pass over the sources still taking their hellos (after the worker progressed); drops
  // those past connect_timeout. Whether any is still taking its hello.
  bool StepHellos() {
    bool waiting = false;
    for (Source& source : sources_) {
      if (source.phase != Phase::kHeader && source.phase != Phase::kBody) continue;
      if (source.ep_failed) {
        Drop(source, EndpointError(source));
        continue;
      }
      ucs_status_t status = UCS_OK;
      if (!ReceiveDone(&source.receive, &status)) {
        waiting = true;
        continue;
      }
      if (status != UCS_OK) {
        Drop(source, ucx::UcxError("source " + source.endpoint + ": receiving the hello", status));
        continue;
      }
      if (source.phase == Phase::kHeader) {
        auto body = DecodeHelloHeader(source.header);
        if (!body.ok()) {
          Drop(source, body.status().Context("source " + source.endpoint));
          continue;
        }
        source.body.resize(*body);
        source.phase = Phase::kBody;
        source.receive = ReceiveAll(source.ep, source.body);
        waiting = true;
        continue;
      }
      Status accepted = AcceptHello(source);
      if (!accepted.ok()) {
        Drop(source, std::move(accepted));
        continue;
      }
      source.phase = Phase::kReady;
      source.used = true;
    }
    if (waiting && Clock::now() >= give_up_) {
      for (Source& source : sources_) {
        if (source.phase == Phase::kHeader || source.phase == Phase::kBody) {
          Drop(source, Status(StatusCode::kTimeout,
                              "source " + source.endpoint + ": no hello within " +
                                  std::to_string(options_.connect_timeout.count()) + " ms"));
        }
      }
      waiting = false;
    }
    return waiting;
  }

  Status AcceptHello(Source& source) {
    const std::string who = "source " + source.endpoint;
    auto hello = DecodeHelloBody(source.body);
    source.body = {};
    if (!hello.ok()) return hello.status().Context(who);
    if (hello->protocol != HelloProtocol::kUcx) {
      return Status(StatusCode::kMismatch,
                    who +
                        " serves its regions over the tcp protocol (host memory: a host-tier "
                        "source), this fill is into device memory");
    }
    if (hello->regions.size() != options_.destination.size()) {
      return Status(StatusCode::kMismatch, who + " serves " +
                                               std::to_string(hello->regions.size()) +
                                               " regions, the destination has " +
                                               std::to_string(options_.destination.size()));
    }
    for (size_t r = 0; r < hello->regions.size(); ++r) {
      if (hello->regions[r].bytes != options_.destination[r].bytes) {
        return Status(StatusCode::kMismatch, who + ": region " + std::to_string(r) + " is " +
                                                 std::to_string(hello->regions[r].bytes) +
                                                 " bytes, the destination's " +
                                                 std::to_string(options_.destination[r].bytes));
      }
    }
    if (options_.accept) {
      Status accepted = options_.accept(source.endpoint, hello->manifest);
      if (!accepted.ok()) return accepted.Context(who + " not accepted");
    }
    for (const HelloRegion& region : hello->regions) {
      std::vector<uint8_t> padded(region.rkey.size() + kRkeyPadding, 0);
      std::memcpy(padded.data(), region.rkey.data(), region.rkey.size());
      ucp_rkey_h rkey = nullptr;
      const ucs_status_t status = ucp_ep_rkey_unpack(source.ep, padded.data(), &rkey);
      if (status != UCS_OK) return ucx::UcxError(who + ": unpacking an rkey", status);
      source.rkeys.emplace_back(rkey);
      source.remote_addresses.push_back(region.remote_address);
    }
    return Status::Ok();
  }

  // Posts stripes on `source` until its window is full or the queue is empty.
  void Fill(Source& source, size_t index) {
    while (source.phase == Phase::kReady && !queue_.empty() &&
           source.in_flight.size() < options_.max_in_flight_per_source) {
      const size_t s = queue_.front();
      queue_.pop_front();
      const Stripe& stripe = stripes_[s];
      ucp_request_param_t param{};
      const DestinationRegion& region = options_.destination[stripe.region];
      if (region.memory == RegionMemory::kCuda) {
        // The device memory's type and registration, so that UCX neither probes the pointer
        // nor registers it per read.
        param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_MEMH;
        param.memory_type = UCS_MEMORY_TYPE_CUDA;
        param.memh = destination_memory_[stripe.region].get();
      }
      auto* into = static_cast<uint8_t*>(region.data) + stripe.offset;
      ucs_status_ptr_t request = ucp_get_nbx(source.ep, into, stripe.bytes,
                                             source.remote_addresses[stripe.region] + stripe.offset,
                                             source.rkeys[stripe.region].get(), &param);
      if (UCS_PTR_IS_ERR(request)) {
        queue_.push_front(s);
        Drop(source,
             ucx::UcxError("source " + source.endpoint + ": ucp_get_nbx", UCS_PTR_STATUS(request)));
        return;
      }
      if (request == nullptr) {
        Complete(source, index, s);
        continue;
      }
      source.in_flight.push_back({s, request, Clock::now()});
    }
  }

  void Complete(Source& source, size_t index, size_t s) {
    const Stripe& stripe = stripes_[s];
    source.bytes += stripe.bytes;
    records_[s] = {stripe.region, stripe.offset, stripe.bytes, index};
    done_ += stripe.bytes;
    ++completed_;
    if (options_.progress) options_.progress(done_, total_);
  }

  Status Transfer() {
    size_t turn = 0;
    while (completed_ < stripes_.size()) {
      // Round-robin: each pass starts filling at the next source.
      for (size_t k = 0; k < sources_.size(); ++k) {
        const size_t i = (turn + k) % sources_.size();
        Fill(sources_[i], i);
      }
      ++turn;
      if (ucp_worker_progress(worker_.get()) == 0) WaitForEvents(worker_.get(), efd_, kPollMs);
      if (Cancelled()) return Failure(StatusCode::kUnavailable, "cancelled");
      StepHellos();
      const auto now = Clock::now();
      for (size_t i = 0; i < sources_.size(); ++i) {
        Source& source = sources_[i];
        if (source.phase != Phase::kReady) continue;
        if (source.ep_failed) {
          Drop(source, EndpointError(source));
          continue;
        }
        while (!source.in_flight.empty()) {
          InFlight& flight = source.in_flight.front();
          const ucs_status_t status = ucp_request_check_status(flight.request);
          if (status == UCS_INPROGRESS) break;
          ucp_request_free(flight.request);
          flight.request = nullptr;
          if (status != UCS_OK) {
            Drop(source, ucx::UcxError("source " + source.endpoint + ": a read", status));
            break;
          }
          const size_t s = flight.stripe;
          source.in_flight.pop_front();
          Complete(source, i, s);
        }
        // Reads complete in order on one endpoint, so the oldest one tells if it stalls.
        if (source.phase == Phase::kReady && !source.in_flight.empty() &&
            now - source.in_flight.front().started > options_.stripe_timeout) {
          Drop(source, Status(StatusCode::kTimeout,
                              "source " + source.endpoint + ": a read made no progress in " +
                                  std::to_string(options_.stripe_timeout.count()) + " ms"));
        }
      }
      const bool any = std::any_of(sources_.begin(), sources_.end(),
                                   [](const Source& s) { return s.phase != Phase::kDropped; });
      if (!any) return Failure(StatusCode::kUnavailable, "every source failed");
      if (now >= deadline_) {
        return Failure(StatusCode::kTimeout, "the fetch passed its deadline of " +
                                                 std::to_string(options_.deadline.count()) + " ms");
      }
    }
    return Status::Ok();
  }

  bool Cancelled() const { return options_.cancel != nullptr && options_.cancel->load(); }

  // CUDA destinations are registered once for the whole fetch (host ones, as before, are
  // left to UCX's registration cache); destination_memory_ is parallel to the destination.
  Status RegisterDestination() {
    const bool cuda =
        std::any_of(options_.destination.begin(), options_.destination.end(),
                    [](const DestinationRegion& r) { return r.memory == RegionMemory::kCuda; });
    if (!cuda) return Status::Ok();
    WEIGHTCACHE_RETURN_IF_ERROR(
        ucx::CheckMemoryType(context_.get(), UCS_MEMORY_TYPE_CUDA).Context("arena fetch"));
    for (const DestinationRegion& region : options_.destination) {
      if (region.memory != RegionMemory::kCuda) {
        destination_memory_.emplace_back(context_.get(), nullptr);
        continue;
      }
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          ucx::UcpMem memory, ucx::MapMemory(context_.get(), region.data, region.bytes,
                                             /*cuda=*/true, ucx::Access::kLocalWrite,
                                             "arena fetch: registering a CUDA destination region"));
      destination_memory_.push_back(std::move(memory));
    }
    return Status::Ok();
  }

  // Before the transfer, when no source survived the handshake, Transfer's check reports it.
  Status Failure(StatusCode code, const std::string& what) const {
    std::string message = "arena fetch: " + what + " (" + std::to_string(done_) + " of " +
                          std::to_string(total_) + " bytes read)";
    for (const Source& source : sources_) {
      if (source.endpoint.empty()) continue;  // not connected yet
      message += "; " + source.endpoint + ": ";
      message += source.phase == Phase::kDropped ? source.why.ToString() : "still serving";
    }
    return Status(code, message);
  }

  const FetchOptions& options_;
  Clock::time_point deadline_;
  Clock::time_point give_up_;  // for the hellos
  std::vector<Stripe> stripes_;
  std::deque<size_t> queue_;
  std::vector<StripeRecord> records_;
  uint64_t total_ = 0;
  uint64_t done_ = 0;
  size_t completed_ = 0;
  // Declared in acquisition order; the destructor closes the endpoints before these go.
  ucx::UcpContext context_;
  ucx::UcpWorker worker_;
  std::vector<ucx::UcpMem> destination_memory_;  // CUDA destinations' registrations
  int efd_ = -1;                                 // the worker's event fd (owned by the worker)
  std::deque<Source> sources_;  // a deque: the error handlers hold each Source's address
};

}  // namespace ucx_detail

Result<FetchResult> FetchOverUcx(const FetchOptions& options) {
  ucx_detail::Fetch fetch(options);
  return fetch.Run();
}

}  // namespace weightcache::fleet
