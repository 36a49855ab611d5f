/* Compiled as C (not C++): publishing through the C ABI (weightcache/c_api.h), then attaching
 * to what was published, through the C ABI only. */
#include <stdio.h>
#include <string.h>

#include "weightcache/c_api.h"

/* Publishes two tensors with known bytes into the awaiting daemon of (runtime_dir,
 * "published:engine-v1", "fused-llama", host tier), then attaches and compares. Returns 0 on
 * success, else a step number, with a message in `msg`. */
int wc_c_publish_then_attach(const char* runtime_dir, char* msg, size_t len) {
  wc_attach_options options;
  wc_publisher* p = NULL;
  wc_attachment* a = NULL;
  wc_error err;
  wc_tensor t;
  const uint64_t shape_a[2] = {4, 8};
  const uint64_t shape_b[1] = {3};
  wc_publish_tensor plan[3];
  const void* metadata;
  size_t metadata_size = 0;
  uint64_t scale_data = 0; /* wc_tensor.data of c.scale, which c.tied aliases */
  uint64_t nbytes = 0;
  unsigned char* data;
  unsigned char copy[12];
  size_t i;
  wc_attach_options_init(&options);
  options.model_id = "fused-llama";
  options.source = "published:engine-v1";
  options.runtime_dir = runtime_dir;
  options.tier = WC_TIER_HOST;
  options.on_missing = WC_ON_MISSING_ERROR;
  plan[0].name = "c.gate_up_proj";
  plan[0].dtype = "BF16";
  plan[0].ndim = 2;
  plan[0].shape = shape_a;
  plan[0].nbytes = 4 * 8 * 2;
  plan[1].name = "c.scale";
  plan[1].dtype = "F32";
  plan[1].ndim = 1;
  plan[1].shape = shape_b;
  plan[1].nbytes = 3 * 4;
  plan[0].alias_of = NULL;
  plan[1].alias_of = "";
  /* c.tied shares the bytes of c.scale (tied weights). */
  plan[2] = plan[1];
  plan[2].name = "c.tied";
  plan[2].alias_of = "c.scale";
  if (wc_publish_begin(&options, "c smoke", 10000, plan, 3, &p, &err) != WC_OK) {
    snprintf(msg, len, "wc_publish_begin: %s", err.message);
    return 1;
  }
  for (i = 0; i < 2; ++i) {
    data = (unsigned char*)wc_publisher_data(p, i, &nbytes);
    if (data == NULL || nbytes != plan[i].nbytes) {
      snprintf(msg, len, "wc_publisher_data(%zu): %llu bytes", i, (unsigned long long)nbytes);
      wc_publisher_free(p);
      return 2;
    }
    memset(data, (int)(0x40 + i), (size_t)nbytes);
  }
  if (wc_publisher_data(p, 2, &nbytes) != wc_publisher_data(p, 1, NULL) || nbytes != 12) {
    snprintf(msg, len, "the alias c.tied does not share the bytes of c.scale");
    wc_publisher_free(p);
    return 3;
  }
  if (wc_publisher_data(p, 3, &nbytes) != NULL || nbytes != 0) {
    snprintf(msg, len, "an out-of-range index has data");
    wc_publisher_free(p);
    return 3;
  }
  if (wc_publisher_tier(p) != WC_TIER_HOST) {
    snprintf(msg, len, "wc_publisher_tier is not WC_TIER_HOST");
    wc_publisher_free(p);
    return 3;
  }
  /* c.scale again through wc_publisher_copy_in (the same bytes), and a wrong size refused. */
  memset(copy, 0x41, sizeof copy);
  if (wc_publisher_copy_in(p, 1, copy, 12, &err) != WC_OK ||
      wc_publisher_copy_in(p, 1, copy, 11, &err) != WC_INVALID_ARGUMENT) {
    snprintf(msg, len, "wc_publisher_copy_in: %s", err.message);
    wc_publisher_free(p);
    return 3;
  }
  if (wc_publisher_commit(p, &err) != WC_OK) {
    snprintf(msg, len, "wc_publisher_commit: %s", err.message);
    wc_publisher_free(p);
    return 4;
  }
  if (wc_publisher_data(p, 0, &nbytes) != NULL) {
    snprintf(msg, len, "data after the commit");
    wc_publisher_free(p);
    return 5;
  }
  wc_publisher_free(p);
  if (wc_attach(&options, &a, &err) != WC_OK) {
    snprintf(msg, len, "wc_attach: %s", err.message);
    return 6;
  }
  if (wc_attachment_find(a, "c.gate_up_proj", &t, &err) != WC_OK || t.nbytes != 64 ||
      ((const unsigned char*)(uintptr_t)t.data)[63] != 0x40 ||
      wc_attachment_find(a, "c.scale", &t, &err) != WC_OK || t.nbytes != 12 ||
      ((const unsigned char*)(uintptr_t)t.data)[0] != 0x41) {
    snprintf(msg, len, "attached bytes differ from the published ones");
    wc_attachment_free(a);
    return 7;
  }
  scale_data = t.data;
  if (wc_attachment_find(a, "c.tied", &t, &err) != WC_OK || t.data != scale_data) {
    snprintf(msg, len, "the attached c.tied is not the region of c.scale");
    wc_attachment_free(a);
    return 8;
  }
  metadata = wc_attachment_metadata(a, &metadata_size);
  if (metadata == NULL || metadata_size != 7 || memcmp(metadata, "c smoke", 7) != 0) {
    snprintf(msg, len, "the attached metadata is not the published \"c smoke\"");
    wc_attachment_free(a);
    return 9;
  }
  snprintf(msg, len, "published and attached %zu tensors", wc_attachment_tensor_count(a));
  wc_attachment_free(a);
  return 0;
}
