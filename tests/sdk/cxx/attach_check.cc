// An out-of-tree C++ consumer of the installed SDK, built with find_package(weightcache)
// (CMakeLists.txt here; scripts/sdk-check.sh builds it against an install prefix).
//
//   attach_check MODEL_DIR RUNTIME_DIR
//
// Attaches with weightcache::Attachment to the host-tier daemon serving MODEL_DIR (the
// checkpoint of tests/sdk/make_sdk_checkpoint.py), insisting on the daemon (OnMissing::kError),
// and checks every element of every tensor against the formula it was written with. Exit 0
// when all match; 1 with a message naming the first difference.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/client.h"

namespace {

bool Fail(const std::string& what) {
  std::fprintf(stderr, "attach_check (C++): %s\n", what.c_str());
  return false;
}

// The elements of tensor `name` if it has this dtype and shape, else empty after saying why.
template <typename T>
std::span<const T> Elements(const weightcache::Attachment& attachment, const char* name,
                            std::string_view dtype, const std::vector<int64_t>& shape) {
  const weightcache::Tensor* tensor = attachment.Find(name);
  if (tensor == nullptr) {
    Fail(std::string(name) + ": not found");
    return {};
  }
  uint64_t count = 1;
  for (int64_t d : shape) count *= static_cast<uint64_t>(d);
  if (tensor->dtype != dtype ||
      !std::equal(shape.begin(), shape.end(), tensor->shape.begin(), tensor->shape.end()) ||
      tensor->nbytes != count * sizeof(T)) {
    Fail(std::string(name) + ": dtype " + std::string(tensor->dtype) + ", " +
         std::to_string(tensor->shape.size()) + " dims, " + std::to_string(tensor->nbytes) +
         " bytes");
    return {};
  }
  return {static_cast<const T*>(tensor->host_ptr()), count};
}

// True when every element i of `elements` (non-empty) equals expected(i).
template <typename T, typename F>
bool AllMatch(std::span<const T> elements, const char* name, F expected) {
  if (elements.empty()) return false;
  for (size_t i = 0; i < elements.size(); ++i) {
    if (elements[i] != expected(static_cast<int>(i))) {
      return Fail(std::string(name) + ": element " + std::to_string(i) + " differs");
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    Fail("usage: attach_check MODEL_DIR RUNTIME_DIR");
    return 1;
  }
  weightcache::AttachOptions options;
  options.identity.model_dir = argv[1];
  options.identity.runtime_dir = argv[2];
  options.identity.tier = weightcache::Tier::kHost;
  options.on_missing = weightcache::OnMissing::kError;
  weightcache::Result<weightcache::Attachment> attached = weightcache::Attachment::Attach(options);
  if (!attached.ok()) {
    Fail("Attach: " + attached.status().ToString());
    return 1;
  }
  const weightcache::Attachment& attachment = *attached;

  bool ok = true;
  if (attachment.source() != weightcache::AttachSource::kDaemon) {
    ok = Fail("source is " + std::string(weightcache::AttachSourceName(attachment.source())));
  }
  if (attachment.tier() != weightcache::Tier::kHost) ok = Fail("not the host tier");
  if (attachment.tensors().size() != 4) ok = Fail("not 4 tensors");
  ok &= AllMatch(Elements<float>(attachment, "embed.weight", "F32", {4, 8}), "embed.weight",
                 [](int i) { return static_cast<float>(i) * 0.25f - 3.0f; });
  ok &= AllMatch(Elements<int32_t>(attachment, "layers.0.mlp.bias", "I32", {10}),
                 "layers.0.mlp.bias", [](int i) { return 1000 * i - 7; });
  ok &= AllMatch(Elements<int16_t>(attachment, "layers.0.norm.idx", "I16", {3, 5}),
                 "layers.0.norm.idx", [](int i) { return static_cast<int16_t>(-3 * i); });
  ok &= AllMatch(Elements<uint8_t>(attachment, "lm_head.lut", "U8", {256}), "lm_head.lut",
                 [](int i) { return static_cast<uint8_t>(255 - i); });
  if (!ok) return 1;
  std::printf("attach_check (C++): 4 tensors match, attached to daemon pid %d (%s)\n",
              attachment.daemon_pid(), attachment.source_reason().c_str());
  return 0;
}
