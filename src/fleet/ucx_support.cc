#include "fleet/ucx_support.h"

#include <uct/api/uct.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/logging.h"

namespace weightcache::fleet::ucx {

void MemTraits::Close(ucp_context_h context, Handle h) noexcept {
  const ucs_status_t status = ucp_mem_unmap(context, h);
  if (status != UCS_OK) {
    LOG_WARN << "fleet: ucp_mem_unmap: " << ucs_status_string(status);
  }
}

Status UcxError(const std::string& what, ucs_status_t status) {
  std::string message = what + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_REJECTED:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_BUSY:
      return Status(StatusCode::kUnavailable, std::move(message));
    case UCS_ERR_TIMED_OUT:
      return Status(StatusCode::kTimeout, std::move(message));
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return InvalidArgument(std::move(message));
    default:
      return Status(StatusCode::kIo, std::move(message));
  }
}

namespace {

// Whether this UCX has the transport component `name` (its module loaded: cuda_ipc needs a UCX
// built with CUDA and a driver to load against).
bool HasUctComponent(std::string_view name) {
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (uct_query_components(&components, &count) != UCS_OK) return false;
  bool found = false;
  for (unsigned i = 0; i < count && !found; ++i) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    found = uct_component_query(components[i], &attr) == UCS_OK && attr.name == name;
  }
  uct_release_component_list(components);
  return found;
}

}  // namespace

Status CheckTransports(std::string_view tls) {
  std::vector<std::string> entries;
  const bool negated = !tls.empty() && tls.front() == '^';
  if (negated) tls.remove_prefix(1);
  for (size_t at = 0; at <= tls.size();) {
    size_t comma = tls.find(',', at);
    if (comma == std::string_view::npos) comma = tls.size();
    std::string entry(tls.substr(at, comma - at));
    while (!entry.empty() && entry.back() == ' ') entry.pop_back();
    while (!entry.empty() && entry.front() == ' ') entry.erase(0, 1);
    if (!entry.empty()) entries.push_back(std::move(entry));
    at = comma + 1;
  }
  auto names = [&](std::string_view name) {
    return std::find(entries.begin(), entries.end(), name) != entries.end();
  };
  const std::string why =
      ": UCX's tcp and cma transports serve remote reads and writes of any address without "
      "checking rkeys (and tcp listens on every network device); the fill source and filler "
      "refuse to run with them";
  if (negated) {
    for (const char* forbidden : kForbiddenTransports) {
      if (!names(forbidden)) {
        return PermissionDenied("UCX_TLS=^" + std::string(tls) + " does not exclude " + forbidden +
                                why);
      }
    }
    return Status::Ok();
  }
  if (entries.empty()) return PermissionDenied("UCX_TLS is empty (it means all)" + why);
  for (const char* forbidden : {"tcp", "cma", "all", "sm", "shm"}) {
    if (names(forbidden)) {
      return PermissionDenied("UCX_TLS=" + std::string(tls) + " names " + forbidden + why);
    }
  }
  return Status::Ok();
}

Result<UcpContext> CreateContext() {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return UcxError("ucp_config_read", status);
  // ucp_config_read took UCX_TLS from the environment, so the check is of the same value.
  if (const char* tls = std::getenv("UCX_TLS"); tls != nullptr) {
    if (Status allowed = CheckTransports(tls); !allowed.ok()) {
      ucp_config_release(config);
      return allowed;
    }
  } else if (status = ucp_config_modify(config, "TLS", kDefaultTransports); status != UCS_OK) {
    ucp_config_release(config);
    return UcxError(std::string("ucp_config_modify(TLS, ") + kDefaultTransports + ")", status);
  }
  // UCX turns cuda_ipc's get off where the GPU has no NVLink ("auto"), because a PCIe peer read
  // can be slower than a write. A fill only reads (ucp_get from the source's arena), so without
  // it a same-host pull falls back to UCX's software emulation over tcp or shared memory:
  // 0.5 GB/s on an H200 against ~2,100 GB/s D2D (docs/fleet.md). Any cuda_ipc get beats that,
  // so it is on unless the operator set UCX_CUDA_IPC_ENABLE_GET_ZCOPY. Only where this UCX has
  // cuda_ipc: elsewhere UCX warns on stdout about a key no transport takes.
  if (std::getenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == nullptr && HasUctComponent("cuda_ipc")) {
    const ucs_status_t modified = ucp_config_modify(config, "CUDA_IPC_ENABLE_GET_ZCOPY", "y");
    if (modified != UCS_OK) {
      LOG_WARN << "fleet: ucp_config_modify(CUDA_IPC_ENABLE_GET_ZCOPY): "
               << ucs_status_string(modified);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) return UcxError("ucp_init", status);
  return UcpContext(context);
}

Status CheckMemoryType(ucp_context_h context, ucs_memory_type_t type) {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t status = ucp_context_query(context, &attr);
  if (status != UCS_OK) return UcxError("ucp_context_query", status);
  if ((attr.memory_types & UCS_BIT(type)) != 0) return Status::Ok();
  return Status(StatusCode::kUnavailable,
                std::string("this UCX (") + ucp_get_version_string() + ") has no " +
                    ucs_memory_type_names[type] +
                    " memory support: a gpu-tier fill needs a UCX built with CUDA (its "
                    "cuda_copy/cuda_ipc transports; Debian's libucx has none, PyPI's "
                    "libucx-cu13 has them)");
}

Result<UcpMem> MapMemory(ucp_context_h context, void* address, size_t bytes, bool cuda,
                         Access access, const std::string& what) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_PROT;
  params.address = address;
  params.length = bytes;
  params.prot = access == Access::kRemoteReadOnly
                    ? UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ
                    : UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
  if (cuda) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  const ucs_status_t status = ucp_mem_map(context, &params, &memh);
  if (status != UCS_OK) return UcxError(what + ": ucp_mem_map", status);
  return UcpMem(context, memh);
}

Result<UcpWorker> CreateWorker(ucp_context_h context, Threading threading) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode =
      threading == Threading::kMulti ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  const ucs_status_t status = ucp_worker_create(context, &params, &worker);
  if (status != UCS_OK) return UcxError("ucp_worker_create", status);
  return UcpWorker(worker);
}

ucs_status_t WaitRequest(ucp_worker_h worker, ucs_status_ptr_t request,
                         std::chrono::milliseconds timeout) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  ucs_status_t status = UCS_INPROGRESS;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (ucp_worker_progress(worker) == 0 && std::chrono::steady_clock::now() >= give_up) {
      break;
    }
  }
  ucp_request_free(request);
  return status == UCS_INPROGRESS ? UCS_ERR_TIMED_OUT : status;
}

void CloseEndpoints(ucp_worker_h worker, const std::vector<ucp_ep_h>& endpoints,
                    std::chrono::milliseconds timeout) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  std::vector<ucs_status_ptr_t> pending;
  for (ucp_ep_h ep : endpoints) {
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) pending.push_back(request);
  }
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  for (ucs_status_ptr_t request : pending) {
    while (ucp_request_check_status(request) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < give_up) {
      ucp_worker_progress(worker);
    }
    ucp_request_free(request);
  }
}

}  // namespace weightcache::fleet::ucx
