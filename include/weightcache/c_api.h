/* weightcache/c_api.h — the C ABI of the weightcache client, for languages that cannot call
 * C++ (Rust, Go, Zig, ctypes). Plain C99: no C++ type crosses it.
 *
 * Contract:
 *  - Same semantics as weightcache/client.h (Attachment::Attach); see docs/client.md. The
 *    wc_publish_* functions wrap weightcache/publisher.h (docs/publish.md).
 *  - Options: call wc_attach_options_init() first, then set the fields you need. String fields
 *    are borrowed for the duration of wc_attach() only; NULL means "unset".
 *  - Errors: every fallible function returns a wc_status_code (WC_OK = 0) and, when `err` is
 *    not NULL, fills it with the code and a NUL-terminated message (truncated to fit).
 *  - Ownership: wc_attach() hands out one wc_attachment, released by wc_attachment_free().
 *    Tensor fields returned by wc_attachment_tensor()/wc_attachment_find() (strings, shape and
 *    stride arrays, data addresses) are owned by the attachment and valid until it is freed.
 *    The data stay valid after the daemon dies.
 *  - Thread-safety: wc_attach may be called from many threads. Read-only accessors may run
 *    concurrently on one attachment; wc_attachment_free must not race with anything else on
 *    the same attachment. Daemon-gone callbacks run on a library thread (see client.h).
 */
#ifndef WEIGHTCACHE_C_API_H_
#define WEIGHTCACHE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include "weightcache/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Mirrors weightcache::StatusCode (the numeric values are part of the ABI). */
typedef enum wc_status_code {
  WC_OK = 0,
  WC_INVALID_ARGUMENT = 1,
  WC_NOT_FOUND = 2,
  WC_PERMISSION_DENIED = 3,
  WC_INVALID_CHECKPOINT = 4,
  WC_NO_DAEMON = 5,
  WC_MISMATCH = 6,
  WC_TIMEOUT = 7,
  WC_ALREADY_SERVED = 8,
  WC_PROTOCOL = 9,
  WC_IO = 10,
  WC_CUDA = 11,
  WC_UNAVAILABLE = 12,
  WC_OUT_OF_MEMORY = 13,
  WC_INTERNAL = 14
} wc_status_code;

typedef enum wc_tier { WC_TIER_GPU = 0, WC_TIER_HOST = 1 } wc_tier;
typedef enum wc_on_missing { WC_ON_MISSING_FALLBACK = 0, WC_ON_MISSING_ERROR = 1 } wc_on_missing;
typedef enum wc_on_mismatch {
  WC_ON_MISMATCH_ERROR = 0,
  WC_ON_MISMATCH_FALLBACK = 1
} wc_on_mismatch;
typedef enum wc_source { WC_SOURCE_DAEMON = 0, WC_SOURCE_FALLBACK = 1 } wc_source;

#define WC_ERROR_MESSAGE_BYTES 1024

typedef struct wc_error {
  wc_status_code code;
  char message[WC_ERROR_MESSAGE_BYTES];
} wc_error;

typedef struct wc_attach_options {
  const char* model_dir;
  const char* model_id;
  const char* revision;
  const char* dtype;
  const char* quantization;
  const char* quantization_config; /* path of the JSON config */
  int32_t tp_size, tp_rank;
  int32_t pp_size, pp_rank;
  int32_t ep_size, ep_rank;
  int32_t dp_size;
  const char* layout_tag;
  const char* source; /* NULL = "disk" */
  wc_tier tier;
  const char* device; /* local index or UUID; NULL = default (see client.h) */
  const char* namespace_name;
  const char* runtime_dir;
  const char* socket;
  const char* device_inventory;
  wc_on_missing on_missing;
  wc_on_mismatch on_mismatch;
  int64_t wait_timeout_ms;
  int32_t fallback_threads;
  /* Added with the sharded caches (the struct grew at its end; wc_attach_options_init sets
   * it): the sharding rules, a built-in set's name or a rules file; NULL = config.json's
   * model_type (used when any size is > 1). */
  const char* shard_rules;
} wc_attach_options;

typedef struct wc_tensor {
  const char* name;
  const char* dtype; /* "BF16", "F32", … */
  int32_t ndim;
  const int64_t* shape;   /* ndim entries */
  const int64_t* strides; /* ndim entries, in elements */
  uint64_t data;          /* host pointer (host tier) or CUdeviceptr (gpu tier) */
  uint64_t nbytes;
  uint64_t checksum;
  /* Added with the sharded caches (the struct grew at its end): which slice of the full
   * checkpoint tensor this is. slice_dim -1: the whole tensor (the other three 0); else
   * elements [slice_offset, slice_offset + slice_length) along dim slice_dim, whose full size
   * is slice_full_length (slice_length == shape[slice_dim]). */
  int32_t slice_dim;
  uint64_t slice_offset;
  uint64_t slice_length;
  uint64_t slice_full_length;
} wc_tensor;

typedef struct wc_attachment wc_attachment;
typedef void (*wc_daemon_gone_fn)(void* user_data);

/* Defaults: ranks 0 of size 1, tier gpu, on_missing fallback, on_mismatch error, 60 s wait. */
WEIGHTCACHE_EXPORT void wc_attach_options_init(wc_attach_options* options);

WEIGHTCACHE_EXPORT wc_status_code wc_attach(const wc_attach_options* options, wc_attachment** out,
                                            wc_error* err);
WEIGHTCACHE_EXPORT void wc_attachment_free(wc_attachment* attachment); /* NULL is a no-op */

WEIGHTCACHE_EXPORT size_t wc_attachment_tensor_count(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT wc_status_code wc_attachment_tensor(const wc_attachment* attachment,
                                                       size_t index, wc_tensor* out, wc_error* err);
WEIGHTCACHE_EXPORT wc_status_code wc_attachment_find(const wc_attachment* attachment,
                                                     const char* name, wc_tensor* out,
                                                     wc_error* err);

WEIGHTCACHE_EXPORT wc_source wc_attachment_source(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT wc_tier wc_attachment_tier(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT uint64_t wc_attachment_total_bytes(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT const char* wc_attachment_source_reason(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT const char* wc_attachment_socket_path(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT const char* wc_attachment_device_key(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT const char* wc_attachment_config_digest(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT int32_t wc_attachment_daemon_pid(const wc_attachment* attachment);
/* The metadata blob of a published cache's publisher (opaque bytes, not NUL-terminated, at
 * most 64 KiB; docs/publish.md) and its size in *size; NULL and 0 when there is none. Valid
 * while the attachment lives. */
WEIGHTCACHE_EXPORT const void* wc_attachment_metadata(const wc_attachment* attachment,
                                                      size_t* size);
/* 1 while the daemon's connection is open, 0 after it closed or for a fallback. */
WEIGHTCACHE_EXPORT int wc_attachment_daemon_alive(const wc_attachment* attachment);
WEIGHTCACHE_EXPORT wc_status_code wc_attachment_on_daemon_gone(wc_attachment* attachment,
                                                               wc_daemon_gone_fn fn,
                                                               void* user_data, wc_error* err);

/* ---- publishing (weightcache/publisher.h, docs/publish.md; host and gpu tiers) ----
 * A publisher names its daemon with the identity fields of wc_attach_options (source must be
 * "published:<tag>"; model_dir is not needed; on_missing, on_mismatch, wait_timeout_ms and
 * fallback_threads are not used). wc_publish_begin borrows every string and array for its
 * own duration; the returned wc_publisher owns the arena's writable mapping, whose tensor
 * bytes wc_publisher_data hands out (valid until wc_publisher_commit or wc_publisher_free):
 * host memory on the host tier, a CUDA device pointer of the daemon's GPU on the gpu tier
 * (wc_publisher_tier says which; wc_publisher_copy_in copies into either).
 * Freeing a publisher before its commit abandons the publish (the daemon frees the arena). */
typedef struct wc_publish_tensor {
  const char* name;
  const char* dtype;     /* the safetensors spelling: "BF16", "F8_E4M3", … */
  int32_t ndim;          /* 0 … 8 */
  const uint64_t* shape; /* ndim entries (may be NULL when ndim is 0) */
  uint64_t nbytes;       /* elements × dtype size */
  /* NULL or "": bytes of its own. Else the name of another plan tensor (no alias itself,
   * same dtype, shape and nbytes) whose bytes this one shares: tied weights, published once;
   * wc_publisher_data of an alias is its target's. */
  const char* alias_of;
} wc_publish_tensor;

typedef struct wc_publisher wc_publisher;

/* timeout_ms: the deadline of each exchange with the daemon (0 = 60 s); metadata may be NULL. */
WEIGHTCACHE_EXPORT wc_status_code wc_publish_begin(const wc_attach_options* identity,
                                                   const char* metadata, int64_t timeout_ms,
                                                   const wc_publish_tensor* tensors, size_t count,
                                                   wc_publisher** out, wc_error* err);
/* Where plan tensor `index` (plan order) goes and its size: a host address (WC_TIER_HOST) or a
 * CUDA device pointer (WC_TIER_GPU, never to be dereferenced on the host); NULL (and *nbytes
 * 0) for an index out of range, after the commit, or for a tensor of 0 bytes. */
WEIGHTCACHE_EXPORT void* wc_publisher_data(const wc_publisher* publisher, size_t index,
                                           uint64_t* nbytes);
WEIGHTCACHE_EXPORT wc_tier wc_publisher_tier(const wc_publisher* publisher);
/* Copies nbytes (the tensor's size exactly) from `source` into plan tensor `index`: memcpy on
 * the host tier; cuMemcpy on the gpu tier, synchronous, from host or device memory. */
WEIGHTCACHE_EXPORT wc_status_code wc_publisher_copy_in(wc_publisher* publisher, size_t index,
                                                       const void* source, uint64_t nbytes,
                                                       wc_error* err);
/* Checksums, unmaps the arena, commits; WC_OK once the daemon is ready with the tensors. */
WEIGHTCACHE_EXPORT wc_status_code wc_publisher_commit(wc_publisher* publisher, wc_error* err);
WEIGHTCACHE_EXPORT void wc_publisher_free(wc_publisher* publisher); /* NULL is a no-op */

WEIGHTCACHE_EXPORT const char* wc_status_code_name(wc_status_code code);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* WEIGHTCACHE_C_API_H_ */
