/* An out-of-tree C consumer of the installed SDK, built with pkg-config (Makefile here;
 * scripts/sdk-check.sh copies this directory out of the tree and runs `make`).
 *
 *   attach_check MODEL_DIR RUNTIME_DIR
 *
 * Attaches through the C ABI alone to the host-tier daemon serving MODEL_DIR (the checkpoint
 * of tests/sdk/make_sdk_checkpoint.py), insisting on the daemon (on_missing error), and checks
 * every element of every tensor against the formula it was written with. Exit 0 when all
 * match; 1 with a message naming the first difference. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <weightcache/c_api.h>

static int fail(const char* what) {
  fprintf(stderr, "attach_check (C): %s\n", what);
  return 1;
}

/* The tensor `name` with this dtype and shape, or NULL after printing why not. */
static const void* find_tensor(const wc_attachment* attachment, const char* name, const char* dtype,
                               int32_t ndim, const int64_t* shape, uint64_t nbytes) {
  wc_tensor tensor;
  wc_error err;
  if (wc_attachment_find(attachment, name, &tensor, &err) != WC_OK) {
    fprintf(stderr, "attach_check (C): %s: %s: %s\n", name, wc_status_code_name(err.code),
            err.message);
    return NULL;
  }
  if (strcmp(tensor.dtype, dtype) != 0 || tensor.ndim != ndim || tensor.nbytes != nbytes) {
    fprintf(stderr, "attach_check (C): %s: dtype %s ndim %d nbytes %" PRIu64 "\n", name,
            tensor.dtype, tensor.ndim, tensor.nbytes);
    return NULL;
  }
  for (int32_t d = 0; d < ndim; ++d) {
    if (tensor.shape[d] != shape[d]) {
      fprintf(stderr, "attach_check (C): %s: dim %d is %" PRId64 "\n", name, d, tensor.shape[d]);
      return NULL;
    }
  }
  return (const void*)(uintptr_t)tensor.data;
}

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: attach_check MODEL_DIR RUNTIME_DIR");
  wc_attach_options options;
  wc_attach_options_init(&options);
  options.model_dir = argv[1];
  options.runtime_dir = argv[2];
  options.tier = WC_TIER_HOST;
  options.on_missing = WC_ON_MISSING_ERROR;
  options.wait_timeout_ms = 60000;

  wc_attachment* attachment = NULL;
  wc_error err;
  if (wc_attach(&options, &attachment, &err) != WC_OK) {
    fprintf(stderr, "attach_check (C): wc_attach: %s: %s\n", wc_status_code_name(err.code),
            err.message);
    return 1;
  }
  int rc = 0;
  if (wc_attachment_source(attachment) != WC_SOURCE_DAEMON) rc = fail("not attached to a daemon");
  if (wc_attachment_tier(attachment) != WC_TIER_HOST) rc = fail("not the host tier");
  if (wc_attachment_tensor_count(attachment) != 4) rc = fail("not 4 tensors");

  const int64_t embed_shape[] = {4, 8};
  const float* embed = find_tensor(attachment, "embed.weight", "F32", 2, embed_shape, 128);
  if (embed == NULL) rc = 1;
  for (int i = 0; embed != NULL && i < 32; ++i) {
    if (embed[i] != (float)i * 0.25f - 3.0f) rc = fail("embed.weight differs");
  }
  const int64_t bias_shape[] = {10};
  const int32_t* bias = find_tensor(attachment, "layers.0.mlp.bias", "I32", 1, bias_shape, 40);
  if (bias == NULL) rc = 1;
  for (int i = 0; bias != NULL && i < 10; ++i) {
    if (bias[i] != 1000 * i - 7) rc = fail("layers.0.mlp.bias differs");
  }
  const int64_t idx_shape[] = {3, 5};
  const int16_t* idx = find_tensor(attachment, "layers.0.norm.idx", "I16", 2, idx_shape, 30);
  if (idx == NULL) rc = 1;
  for (int i = 0; idx != NULL && i < 15; ++i) {
    if (idx[i] != -3 * i) rc = fail("layers.0.norm.idx differs");
  }
  const int64_t lut_shape[] = {256};
  const uint8_t* lut = find_tensor(attachment, "lm_head.lut", "U8", 1, lut_shape, 256);
  if (lut == NULL) rc = 1;
  for (int i = 0; lut != NULL && i < 256; ++i) {
    if (lut[i] != 255 - i) rc = fail("lm_head.lut differs");
  }

  if (rc == 0) {
    printf("attach_check (C): 4 tensors match, attached to daemon pid %d (%s)\n",
           (int)wc_attachment_daemon_pid(attachment), wc_attachment_source_reason(attachment));
  }
  wc_attachment_free(attachment);
  return rc;
}
