// The UCX seam of the fleet transport: one RAII owner per UCP object (UniqueHandle traits),
// the UCP context and worker as this module configures them, and UCX status codes turned into
// Status. Nothing outside src/fleet includes <ucp/api/ucp.h>.
//
// Contract:
//  * Owners release in the order their members are declared in reverse; the users declare the
//    context first, then the worker, then what lives on the worker (listener, memory handles,
//    rkeys), so a half-built object unwinds itself.
//  * An endpoint is not a UniqueHandle: closing one is asynchronous (ucp_ep_close_nbx returns a
//    request that completes while the worker progresses); CloseEndpoints does that, bounded.
//  * Thread-safety: UCP's own (a worker is driven by one thread; ucp_worker_signal from any).
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_handle.h"
#include "os/tcp_socket.h"
#include "weightcache/status.h"

namespace weightcache::fleet::ucx {

struct ContextTraits {
  using Handle = ucp_context_h;
  using Context = NoContext;
  static constexpr Handle Null() { return nullptr; }
  static void Close(NoContext /*unused*/, Handle h) noexcept { ucp_cleanup(h); }
};
struct WorkerTraits {
  using Handle = ucp_worker_h;
  using Context = NoContext;
  static constexpr Handle Null() { return nullptr; }
  static void Close(NoContext /*unused*/, Handle h) noexcept { ucp_worker_destroy(h); }
};
struct ListenerTraits {
  using Handle = ucp_listener_h;
  using Context = NoContext;
  static constexpr Handle Null() { return nullptr; }
  static void Close(NoContext /*unused*/, Handle h) noexcept { ucp_listener_destroy(h); }
};
struct MemTraits {
  using Handle = ucp_mem_h;
  using Context = ucp_context_h;
  static constexpr Handle Null() { return nullptr; }
  static void Close(ucp_context_h context, Handle h) noexcept;
};
struct RkeyTraits {
  using Handle = ucp_rkey_h;
  using Context = NoContext;
  static constexpr Handle Null() { return nullptr; }
  static void Close(NoContext /*unused*/, Handle h) noexcept { ucp_rkey_destroy(h); }
};
using UcpContext = UniqueHandle<ContextTraits>;
using UcpWorker = UniqueHandle<WorkerTraits>;
using UcpListener = UniqueHandle<ListenerTraits>;
using UcpMem = UniqueHandle<MemTraits>;
using UcpRkey = UniqueHandle<RkeyTraits>;

// A Status for a failed UCX call: "<what>: <ucs_status_string>". Rejections and unreachable
// peers are kUnavailable, timeouts kTimeout, invalid parameters kInvalidArgument, the rest kIo.
Status UcxError(const std::string& what, ucs_status_t status);

// A context with the features the transport uses (RMA, stream, wakeup), configured from the
// UCX_* environment, with cuda_ipc's get on unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY says otherwise
// (UCX leaves it off without NVLink, and a fill reads), and without the transports that serve
// remote reads and writes in software, checking no rkey or bound (docs/fleet.md "Security"):
// tcp (which also opens a listening port per network device) and cma. UCX_TLS unset: the
// context uses "^tcp,cma". UCX_TLS set: kPermissionDenied unless CheckTransports accepts it.
Result<UcpContext> CreateContext();

// The transports UCX must never use here.
inline constexpr const char* kForbiddenTransports[] = {"tcp", "cma"};
// The TLS value CreateContext uses when the operator set none.
inline constexpr const char* kDefaultTransports = "^tcp,cma";
// Whether an operator's UCX_TLS keeps tcp and cma out: a "^" list must name both; a list of
// transports must name neither, nor an alias that takes them in ("all", "sm", "shm").
// kPermissionDenied naming the offending entry.
Status CheckTransports(std::string_view tls);
// Ok when `context` can register and move memory of `type` (ucp_context_query's memory types);
// kUnavailable naming the type and this UCX's version otherwise (Debian's UCX has no CUDA).
Status CheckMemoryType(ucp_context_h context, ucs_memory_type_t type);
// Registers `bytes` at `address` with `context` (ucp_mem_map), as CUDA device memory when
// `cuda` (UCS_MEMORY_TYPE_CUDA; the caller checked CheckMemoryType first). kRemoteReadOnly: a
// served region, registered for local and remote reads only (no remote write). `what` names
// the region in the error.
enum class Access { kRemoteReadOnly, kLocalWrite };
Result<UcpMem> MapMemory(ucp_context_h context, void* address, size_t bytes, bool cuda,
                         Access access, const std::string& what);
enum class Threading { kSingle, kMulti };
Result<UcpWorker> CreateWorker(ucp_context_h context, Threading threading);

// Resolves "host:port" ([v6]:port) into a socket address: os::ResolveTcp.
using SocketAddress = os::SocketAddress;
inline Result<SocketAddress> ResolveEndpoint(const std::string& endpoint) {
  return os::ResolveTcp(endpoint);
}

// Waits for a request returned by a UCP non-blocking call: progresses `worker` until it
// completes or `timeout` passes. Frees the request. UCS_OK / the request's error /
// UCS_ERR_TIMED_OUT (the request is then released to complete on its own).
ucs_status_t WaitRequest(ucp_worker_h worker, ucs_status_ptr_t request,
                         std::chrono::milliseconds timeout);

// Closes every endpoint (UCP_EP_CLOSE_FLAG_FORCE: no round trip to a peer that may be dead),
// progressing `worker` until the closes complete or `timeout` passes.
void CloseEndpoints(ucp_worker_h worker, const std::vector<ucp_ep_h>& endpoints,
                    std::chrono::milliseconds timeout);

}  // namespace weightcache::fleet::ucx
