// The C ABI over weightcache::Attachment (include/weightcache/c_api.h). No exception and no C++
// type crosses it: statuses become codes plus a message copied into the caller's buffer.
#include "weightcache/c_api.h"

#include <chrono>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "weightcache/client.h"
#include "weightcache/publisher.h"

struct wc_attachment {
  weightcache::Attachment attachment;
};

struct wc_publisher {
  weightcache::Publisher publisher;
};

namespace {

using weightcache::Status;
using weightcache::StatusCode;

static_assert(static_cast<int>(StatusCode::kInternal) == WC_INTERNAL,
              "wc_status_code must mirror weightcache::StatusCode");
static_assert(static_cast<int>(StatusCode::kMismatch) == WC_MISMATCH);
static_assert(static_cast<int>(StatusCode::kNoDaemon) == WC_NO_DAEMON);
static_assert(static_cast<int>(StatusCode::kTimeout) == WC_TIMEOUT);

wc_status_code Report(const Status& status, wc_error* err) {
  auto code = static_cast<wc_status_code>(status.code());
  if (err != nullptr) {
    err->code = code;
    std::string text = status.ok() ? "" : status.ToString();
    size_t n = std::min(text.size(), sizeof(err->message) - 1);
    std::memcpy(err->message, text.data(), n);
    err->message[n] = '\0';
  }
  return code;
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

// wc_tier <-> weightcache::Tier: the C ABI's one mapping (a value other than WC_TIER_HOST
// selects the gpu tier, the C default).
weightcache::Tier TierFromC(wc_tier tier) {
  return tier == WC_TIER_HOST ? weightcache::Tier::kHost : weightcache::Tier::kGpu;
}
wc_tier TierToC(weightcache::Tier tier) {
  return tier == weightcache::Tier::kHost ? WC_TIER_HOST : WC_TIER_GPU;
}

// The identity fields of wc_attach_options (attach and publish name a cache alike).
weightcache::IdentityOptions IdentityFromC(const wc_attach_options& options) {
  weightcache::IdentityOptions id;
  id.model_dir = Str(options.model_dir);
  id.model_id = Str(options.model_id);
  id.revision = Str(options.revision);
  id.dtype = Str(options.dtype);
  id.quantization = Str(options.quantization);
  id.quantization_config = Str(options.quantization_config);
  id.tp_size = options.tp_size;
  id.tp_rank = options.tp_rank;
  id.pp_size = options.pp_size;
  id.pp_rank = options.pp_rank;
  id.ep_size = options.ep_size;
  id.ep_rank = options.ep_rank;
  id.dp_size = options.dp_size;
  id.layout_tag = Str(options.layout_tag);
  id.shard_rules = Str(options.shard_rules);
  if (options.source != nullptr) id.source = options.source;
  id.tier = TierFromC(options.tier);
  id.device = Str(options.device);
  id.namespace_name = Str(options.namespace_name);
  id.runtime_dir = Str(options.runtime_dir);
  id.socket = Str(options.socket);
  id.device_inventory = Str(options.device_inventory);
  return id;
}

// Tensor::name and ::dtype are NUL-terminated views (client.h), so they pass as C strings.
void Fill(const weightcache::Tensor& t, wc_tensor* out) {
  out->name = t.name.data();
  out->dtype = t.dtype.data();
  out->ndim = static_cast<int32_t>(t.shape.size());
  out->shape = t.shape.data();
  out->strides = t.strides.data();
  out->data = t.data;
  out->nbytes = t.nbytes;
  out->checksum = t.checksum;
  out->slice_dim = t.slice ? static_cast<int32_t>(t.slice->dim) : -1;
  out->slice_offset = t.slice ? t.slice->offset : 0;
  out->slice_length = t.slice ? t.slice->length : 0;
  out->slice_full_length = t.slice ? t.slice->full_length : 0;
}

}  // namespace

extern "C" {

void wc_attach_options_init(wc_attach_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  weightcache::AttachOptions defaults;
  options->tp_size = defaults.identity.tp_size;
  options->pp_size = defaults.identity.pp_size;
  options->ep_size = defaults.identity.ep_size;
  options->dp_size = defaults.identity.dp_size;
  options->tier = TierToC(defaults.identity.tier);
  options->on_missing = WC_ON_MISSING_FALLBACK;
  options->on_mismatch = WC_ON_MISMATCH_ERROR;
  options->wait_timeout_ms = defaults.wait_timeout.count();
  options->fallback_threads = defaults.fallback_threads;
}

wc_status_code wc_attach(const wc_attach_options* options, wc_attachment** out, wc_error* err) {
  if (options == nullptr || out == nullptr) {
    return Report(weightcache::InvalidArgument("wc_attach: options and out must not be NULL"), err);
  }
  *out = nullptr;
  weightcache::AttachOptions o;
  o.identity = IdentityFromC(*options);
  o.on_missing = options->on_missing == WC_ON_MISSING_ERROR ? weightcache::OnMissing::kError
                                                            : weightcache::OnMissing::kFallback;
  o.on_mismatch = options->on_mismatch == WC_ON_MISMATCH_FALLBACK
                      ? weightcache::OnMismatch::kFallback
                      : weightcache::OnMismatch::kError;
  o.wait_timeout = std::chrono::milliseconds(options->wait_timeout_ms);
  if (options->fallback_threads > 0) o.fallback_threads = options->fallback_threads;

  auto attached = weightcache::Attachment::Attach(o);
  if (!attached.ok()) return Report(attached.status(), err);
  *out = new wc_attachment{std::move(attached).value()};
  return Report(Status::Ok(), err);
}

void wc_attachment_free(wc_attachment* attachment) { delete attachment; }

size_t wc_attachment_tensor_count(const wc_attachment* a) {
  return a == nullptr ? 0 : a->attachment.tensors().size();
}

wc_status_code wc_attachment_tensor(const wc_attachment* a, size_t index, wc_tensor* out,
                                    wc_error* err) {
  if (a == nullptr || out == nullptr) {
    return Report(weightcache::InvalidArgument("wc_attachment_tensor: NULL argument"), err);
  }
  const auto& tensors = a->attachment.tensors();
  if (index >= tensors.size()) {
    return Report(
        weightcache::NotFound("tensor index " + std::to_string(index) + " out of range (" +
                              std::to_string(tensors.size()) + " tensors)"),
        err);
  }
  Fill(tensors[index], out);
  return Report(Status::Ok(), err);
}

wc_status_code wc_attachment_find(const wc_attachment* a, const char* name, wc_tensor* out,
                                  wc_error* err) {
  if (a == nullptr || name == nullptr || out == nullptr) {
    return Report(weightcache::InvalidArgument("wc_attachment_find: NULL argument"), err);
  }
  const weightcache::Tensor* t = a->attachment.Find(name);
  if (t == nullptr) {
    return Report(weightcache::NotFound(std::string("no tensor named \"") + name + "\""), err);
  }
  Fill(*t, out);
  return Report(Status::Ok(), err);
}

wc_source wc_attachment_source(const wc_attachment* a) {
  return a->attachment.source() == weightcache::AttachSource::kDaemon ? WC_SOURCE_DAEMON
                                                                      : WC_SOURCE_FALLBACK;
}
wc_tier wc_attachment_tier(const wc_attachment* a) { return TierToC(a->attachment.tier()); }
uint64_t wc_attachment_total_bytes(const wc_attachment* a) { return a->attachment.total_bytes(); }
const char* wc_attachment_source_reason(const wc_attachment* a) {
  return a->attachment.source_reason().c_str();
}
const char* wc_attachment_socket_path(const wc_attachment* a) {
  return a->attachment.socket_path().c_str();
}
const char* wc_attachment_device_key(const wc_attachment* a) {
  return a->attachment.device_key().c_str();
}
const char* wc_attachment_config_digest(const wc_attachment* a) {
  return a->attachment.config_digest().c_str();
}
int32_t wc_attachment_daemon_pid(const wc_attachment* a) { return a->attachment.daemon_pid(); }
const void* wc_attachment_metadata(const wc_attachment* a, size_t* size) {
  const std::string_view metadata = a->attachment.metadata();
  if (size != nullptr) *size = metadata.size();
  return metadata.empty() ? nullptr : metadata.data();
}
int wc_attachment_daemon_alive(const wc_attachment* a) {
  return a->attachment.daemon_alive() ? 1 : 0;
}

wc_status_code wc_attachment_on_daemon_gone(wc_attachment* a, wc_daemon_gone_fn fn, void* user_data,
                                            wc_error* err) {
  if (a == nullptr || fn == nullptr) {
    return Report(weightcache::InvalidArgument("wc_attachment_on_daemon_gone: NULL argument"), err);
  }
  a->attachment.OnDaemonGone([fn, user_data] { fn(user_data); });
  return Report(Status::Ok(), err);
}

wc_status_code wc_publish_begin(const wc_attach_options* identity, const char* metadata,
                                int64_t timeout_ms, const wc_publish_tensor* tensors, size_t count,
                                wc_publisher** out, wc_error* err) {
  if (identity == nullptr || out == nullptr || (tensors == nullptr && count > 0)) {
    return Report(weightcache::InvalidArgument(
                      "wc_publish_begin: identity, out and tensors must not be NULL"),
                  err);
  }
  *out = nullptr;
  weightcache::PublishOptions o;
  o.identity = IdentityFromC(*identity);
  o.metadata = Str(metadata);
  if (timeout_ms > 0) o.timeout = std::chrono::milliseconds(timeout_ms);
  std::vector<weightcache::PublishTensor> plan;
  plan.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const wc_publish_tensor& t = tensors[i];
    if (t.name == nullptr || t.dtype == nullptr || t.ndim < 0 || t.ndim > 8 ||
        (t.shape == nullptr && t.ndim > 0)) {
      return Report(weightcache::InvalidArgument(
                        "wc_publish_begin: tensor " + std::to_string(i) +
                        " needs a name, a dtype, 0 <= ndim <= 8 and ndim shape entries"),
                    err);
    }
    plan.push_back({t.name, t.dtype, std::vector<uint64_t>(t.shape, t.shape + t.ndim), t.nbytes,
                    Str(t.alias_of)});
  }
  auto publisher = weightcache::Publisher::Begin(o, plan);
  if (!publisher.ok()) return Report(publisher.status(), err);
  *out = new wc_publisher{std::move(publisher).value()};
  return Report(Status::Ok(), err);
}

void* wc_publisher_data(const wc_publisher* p, size_t index, uint64_t* nbytes) {
  const weightcache::Publisher::Destination d =
      p == nullptr ? weightcache::Publisher::Destination{} : p->publisher.DestinationOf(index);
  if (nbytes != nullptr) *nbytes = d.size;
  return d.size == 0 ? nullptr : reinterpret_cast<void*>(d.address);
}

wc_tier wc_publisher_tier(const wc_publisher* p) {
  return p != nullptr && p->publisher.tier() == weightcache::Tier::kGpu ? WC_TIER_GPU
                                                                        : WC_TIER_HOST;
}

wc_status_code wc_publisher_copy_in(wc_publisher* p, size_t index, const void* source,
                                    uint64_t nbytes, wc_error* err) {
  if (p == nullptr) {
    return Report(weightcache::InvalidArgument("wc_publisher_copy_in: NULL publisher"), err);
  }
  return Report(p->publisher.CopyIn(index, source, nbytes), err);
}

wc_status_code wc_publisher_commit(wc_publisher* p, wc_error* err) {
  if (p == nullptr) {
    return Report(weightcache::InvalidArgument("wc_publisher_commit: NULL publisher"), err);
  }
  return Report(p->publisher.Commit(), err);
}

void wc_publisher_free(wc_publisher* p) { delete p; }

const char* wc_status_code_name(wc_status_code code) {
  const int i = static_cast<int>(code);
  if (i < 0 || i >= static_cast<int>(weightcache::kStatusCodeCount)) return "unknown";
  // The table's keys are string literals: NUL-terminated.
  return weightcache::kStatusCodeTable[i].key.data();
}

}  // extern "C"
