#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <list>
#include <optional>
#include <thread>

#include "common/logging.h"
#include "common/mutex.h"
#include "common/unique_fd.h"
#include "fleet/arena_transfer_hello.h"
#include "fleet/arena_transfer_internal.h"
#include "fleet/ucx_support.h"
#include "os/syscalls.h"
#include "os/tcp_socket.h"

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

// The UCX side of a CUDA source: the context, the worker (progressed on the server thread, for
// what UCX does there: wire-up from peers' endpoints) and the regions' registrations. The TCP
// side (StartHelloServer) listens, checks the allow-list and sends the hello with the worker's
// address; there is no UCX listener, so nothing of UCX listens on a port.
class UcxWorkerHook final : public ServerThreadHook {
 public:
  int fd() const override { return efd; }
  void Progress() override {
    while (ucp_worker_progress(worker.get()) != 0) {
    }
  }
  bool Arm() override { return ucp_worker_arm(worker.get()) == UCS_OK; }

  // Declared in acquisition order: destroyed in reverse (the memory before the worker, the
  // worker before the context).
  ucx::UcpContext context;
  ucx::UcpWorker worker;
  std::vector<ucx::UcpMem> memory;
  int efd = -1;  // the worker's event fd (owned by the worker)
};

}  // namespace ucx_detail

Result<std::unique_ptr<ArenaServer::Impl>> StartUcxServer(ArenaServerOptions options) {
  WEIGHTCACHE_RETURN_IF_ERROR(ucx::ResolveEndpoint(options.listen).status());
  auto hook = std::make_unique<ucx_detail::UcxWorkerHook>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(hook->context, ucx::CreateContext());
  WEIGHTCACHE_ASSIGN_OR_RETURN(hook->worker,
                               ucx::CreateWorker(hook->context.get(), ucx::Threading::kSingle));
  const bool cuda =
      std::any_of(options.regions.begin(), options.regions.end(),
                  [](const ServedRegion& r) { return r.memory == RegionMemory::kCuda; });
  if (cuda) {
    WEIGHTCACHE_RETURN_IF_ERROR(
        ucx::CheckMemoryType(hook->context.get(), UCS_MEMORY_TYPE_CUDA).Context("arena server"));
  }
  ucs_status_t status = ucp_worker_get_efd(hook->worker.get(), &hook->efd);
  if (status != UCS_OK) return ucx::UcxError("arena server: ucp_worker_get_efd", status);

  Hello hello;
  hello.protocol = HelloProtocol::kUcx;
  hello.manifest = options.manifest;
  for (const ServedRegion& region : options.regions) {
    // Registered for remote reads only.
    WEIGHTCACHE_ASSIGN_OR_RETURN(ucx::UcpMem memory,
                                 ucx::MapMemory(hook->context.get(), const_cast<void*>(region.data),
                                                region.bytes, region.memory == RegionMemory::kCuda,
                                                ucx::Access::kRemoteReadOnly, "arena server"));
    ucp_mem_h memh = memory.get();
    hook->memory.push_back(std::move(memory));
    void* packed = nullptr;
    size_t packed_bytes = 0;
    status = ucp_rkey_pack(hook->context.get(), memh, &packed, &packed_bytes);
    if (status != UCS_OK) return ucx::UcxError("arena server: ucp_rkey_pack", status);
    HelloRegion& out = hello.regions.emplace_back();
    out.remote_address = reinterpret_cast<uintptr_t>(region.data);
    out.bytes = region.bytes;
    out.rkey.assign(static_cast<const uint8_t*>(packed),
                    static_cast<const uint8_t*>(packed) + packed_bytes);
    ucp_rkey_buffer_release(packed);
  }
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  status = ucp_worker_get_address(hook->worker.get(), &address, &address_bytes);
  if (status != UCS_OK) return ucx::UcxError("arena server: ucp_worker_get_address", status);
  hello.worker_address.assign(reinterpret_cast<const uint8_t*>(address),
                              reinterpret_cast<const uint8_t*>(address) + address_bytes);
  ucp_worker_release_address(hook->worker.get(), address);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> encoded, EncodeHello(hello));
  return StartHelloServer(std::move(options), std::move(encoded), AfterHello::kClose,
                          std::move(hook));
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
  Status why;   // set when dropped
  UniqueFd fd;  // the hello's TCP connection, until the hello is in
  bool connected = false;
  Clock::time_point connect_started;
  std::vector<uint8_t> header = std::vector<uint8_t>(kHelloHeaderBytes);
  std::vector<uint8_t> body;
  size_t have = 0;  // bytes of the header, then of the body
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

bool Transient(int error) { return error == EAGAIN || error == EWOULDBLOCK || error == EINTR; }

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
    source.fd.Reset();
    source.rkeys.clear();
  }

  Status EndpointError(const Source& source) const {
    if (source.ep_error == UCS_ERR_REJECTED) {
      return PermissionDenied("source " + source.endpoint +
                              " rejected the connection (is this node on its peer allow-list?)");
    }
    return ucx::UcxError("source " + source.endpoint + ": connection failed", source.ep_error);
  }

  // Starts the hello's TCP connection; the UCX endpoint comes from the hello.
  void Connect(size_t i) {
    Source& source = sources_[i];
    source.endpoint = options_.sources[i];
    source.connect_started = Clock::now();
    auto address = os::ResolveTcp(source.endpoint);
    if (!address.ok()) {
      Drop(source, address.status());
      return;
    }
    auto fd = os::ConnectTcp(*address);
    if (!fd.ok()) {
      Drop(source, fd.status().Context("source " + source.endpoint + ": connecting"));
      return;
    }
    source.fd = std::move(fd).value();
  }

  // Reads what has come of `source`'s hello (non-blocking). Whether it is whole.
  bool ReceiveHello(Source& source) {
    const std::string who = "source " + source.endpoint;
    if (!source.connected) {
      pollfd writable{source.fd.get(), POLLOUT, 0};
      if (os::SysCalls::Default().Poll(&writable, 1, 0) <= 0) return false;
      int error = 0;
      socklen_t length = sizeof(error);
      if (::getsockopt(source.fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) {
        error = errno;
      }
      if (error != 0) {
        Drop(source,
             Status(StatusCode::kUnavailable, who + ": connecting: " + std::strerror(error)));
        return false;
      }
      source.connected = true;
    }
    for (;;) {
      std::vector<uint8_t>& into = source.phase == Phase::kHeader ? source.header : source.body;
      const ssize_t n =
          RecvSome(source.fd.get(), into.data() + source.have, into.size() - source.have);
      if (n < 0 && Transient(errno)) return false;
      if (n <= 0) {
        const int error = n < 0 ? errno : 0;
        if (source.phase == Phase::kHeader && source.have == 0 && (n == 0 || error == ECONNRESET)) {
          Drop(source, PermissionDenied(who + " rejected the connection (closed it before its "
                                              "hello: is this node on its peer allow-list?)"));
        } else {
          Drop(source, Status(StatusCode::kUnavailable,
                              who + ": the connection " +
                                  (n == 0 ? std::string("closed") : std::strerror(error)) +
                                  " inside its hello"));
        }
        return false;
      }
      source.have += static_cast<size_t>(n);
      if (source.have < into.size()) continue;
      source.have = 0;
      if (source.phase == Phase::kBody) return true;
      auto body = DecodeHelloHeader(source.header);
      if (!body.ok()) {
        Drop(source, body.status().Context(who));
        return false;
      }
      source.body.resize(*body);
      source.phase = Phase::kBody;
    }
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
      if (!ReceiveHello(source)) {
        if (source.phase != Phase::kDropped) waiting = true;
        continue;
      }
      Status accepted = AcceptHello(source);
      if (!accepted.ok()) {
        Drop(source, std::move(accepted));
        continue;
      }
      source.fd.Reset();  // its work is done: the reads go over UCX
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
    // ucp_ep_create parses the worker address as far as it says, like an rkey: padded.
    std::vector<uint8_t> address(hello->worker_address.size() + kRkeyPadding, 0);
    std::memcpy(address.data(), hello->worker_address.data(), hello->worker_address.size());
    // Peer error handling where the transports to this source support it (verbs); where
    // they do not (shared memory and cuda_ipc on one host: UCX then finds no lane in that
    // mode), without: a source that dies is then dropped by the stripe timeout.
    ucs_status_t created = UCS_ERR_UNREACHABLE;
    for (const ucp_err_handling_mode_t mode :
         {UCP_ERR_HANDLING_MODE_PEER, UCP_ERR_HANDLING_MODE_NONE}) {
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.address = reinterpret_cast<const ucp_address_t*>(address.data());
      params.err_mode = mode;
      params.err_handler.cb = &OnSourceError;
      params.err_handler.arg = &source;
      created = ucp_ep_create(worker_.get(), &params, &source.ep);
      if (created != UCS_ERR_UNREACHABLE) break;
    }
    if (created != UCS_OK) {
      source.ep = nullptr;
      return ucx::UcxError(who + ": connecting to its UCP worker", created);
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
