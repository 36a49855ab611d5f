/* Compiled as C (not C++): proves weightcache/c_api.h is plain C and usable from C. */
#include <stdio.h>
#include <string.h>

#include "weightcache/c_api.h"

/* Attaches (host tier, fallback expected) and checks the table through the C ABI only.
 * Returns 0 on success, else a step number, with a message in `msg`. */
int wc_c_smoke_fallback(const char* model, const char* runtime_dir, char* msg, size_t len) {
  wc_attach_options options;
  wc_attachment* a = NULL;
  wc_error err;
  wc_tensor t;
  size_t i, n;
  wc_attach_options_init(&options);
  options.model_dir = model;
  options.model_id = "c-smoke";
  options.runtime_dir = runtime_dir;
  options.tier = WC_TIER_HOST;
  if (wc_attach(&options, &a, &err) != WC_OK) {
    snprintf(msg, len, "wc_attach: %s", err.message);
    return 1;
  }
  if (wc_attachment_source(a) != WC_SOURCE_FALLBACK) {
    snprintf(msg, len, "source is not fallback");
    wc_attachment_free(a);
    return 2;
  }
  n = wc_attachment_tensor_count(a);
  for (i = 0; i < n; ++i) {
    wc_tensor by_name;
    if (wc_attachment_tensor(a, i, &t, &err) != WC_OK ||
        wc_attachment_find(a, t.name, &by_name, &err) != WC_OK || by_name.data != t.data ||
        t.ndim < 0 || (t.ndim > 0 && t.strides[t.ndim - 1] != 1) ||
        /* an unsharded cache: every tensor whole */
        t.slice_dim != -1 || t.slice_offset != 0 || t.slice_length != 0 ||
        t.slice_full_length != 0) {
      snprintf(msg, len, "tensor %zu inconsistent", i);
      wc_attachment_free(a);
      return 3;
    }
  }
  if (wc_attachment_tensor(a, n, &t, &err) != WC_NOT_FOUND) {
    snprintf(msg, len, "out-of-range index accepted");
    wc_attachment_free(a);
    return 4;
  }
  if (wc_attachment_daemon_alive(a) != 0 || wc_attachment_daemon_pid(a) != 0) {
    snprintf(msg, len, "fallback reports a daemon");
    wc_attachment_free(a);
    return 5;
  }
  snprintf(msg, len, "%zu tensors, %llu bytes, device %s", n,
           (unsigned long long)wc_attachment_total_bytes(a), wc_attachment_device_key(a));
  wc_attachment_free(a);
  return 0;
}

/* on_missing=error: returns the wc_status_code, with the message in `msg`. */
int wc_c_on_missing_error(const char* model, const char* runtime_dir, char* msg, size_t len) {
  wc_attach_options options;
  wc_attachment* a = NULL;
  wc_error err;
  wc_status_code rc;
  wc_attach_options_init(&options);
  options.model_dir = model;
  options.runtime_dir = runtime_dir;
  options.tier = WC_TIER_HOST;
  options.on_missing = WC_ON_MISSING_ERROR;
  rc = wc_attach(&options, &a, &err);
  snprintf(msg, len, "%s", err.message);
  if (a != NULL) wc_attachment_free(a);
  return (int)rc;
}
