// gpu_client_helper — an engine-like client process for the gpu tier end-to-end tests
// (gpu_e2e_test, gpu_launch_test). It attaches with the public C++ API exactly as an engine
// would (weightcache::Attachment::Attach), then reads every tensor back to the host with
// cuMemcpyDtoH and compares its SHA-256 with the manifest written by
// tests/tools/make_checkpoint.py from the reference safetensors reader. It is a separate
// executable, spawned (never forked) by the tests, so that its CUDA context is the only one
// in its process and the test process never creates one.
//
//   gpu_client_helper --model DIR [--model-id ID] [--device SPEC] [--runtime-dir DIR]
//                     [--namespace NS] [--tp-size N --tp-rank R] [--revision REV]
//                     [--manifest FILE] [--on-missing fallback|error] [--hold]
//                     [--tier gpu|host]
//
// --tier host (no CUDA at all: bytes are read from the mapped host memory) lets the helper
// itself be exercised on machines without a GPU.
//
// Output, one JSON object per line on stdout:
//   after attaching   {"event":"attached", "source", "reason", "device", "socket",
//                      "daemon_pid", "tensors", "bytes", "attach_ms", "device_ordinal",
//                      "pointer_ordinals_ok", "check": {…}}
//   attach failed     {"event":"error", "code": "<StatusCode name>", "message"} (exit 1)
//   with --hold, per stdin line: {"event":"recheck", "daemon_alive", "check": {…}}; the
//                     process exits 0 when stdin closes.
// "check" (only with --manifest) is {"ok", "tensors_checked", "bytes_checked", "digest",
// "problems": [first few]}; "digest" is the SHA-256 over every tensor's SHA-256 in name
// order, so two clients that read identical bytes print identical digests.
#include <cuda.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "client/attachment_impl.h"
#include "common/hash.h"
#include "cuda/driver_api.h"
#include "cuda/vmm.h"
#include "weightcache/client.h"

namespace weightcache {
namespace {

constexpr size_t kMaxProblemsListed = 5;

void Print(const nlohmann::json& j) {
  std::cout << j.dump() << std::endl;  // endl flushes: the test reads line by line
}

[[noreturn]] void FailWith(const Status& s) {
  Print({{"event", "error"},
         {"code", std::string(StatusCodeName(s.code()))},
         {"message", s.ToString()}});
  std::exit(1);
}

struct Args {
  AttachOptions options;
  std::string manifest;
  bool hold = false;
};

Args Parse(int argc, char** argv) {
  Args a;
  a.options.identity.tier = Tier::kGpu;
  a.options.on_missing = OnMissing::kFallback;
  a.options.wait_timeout = std::chrono::seconds(60);
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--hold") {
      a.hold = true;
      continue;
    }
    if (i + 1 >= argc) FailWith(InvalidArgument("flag " + k + " needs a value"));
    const std::string v = argv[++i];
    if (k == "--model") {
      a.options.identity.model_dir = v;
    } else if (k == "--model-id") {
      a.options.identity.model_id = v;
    } else if (k == "--device") {
      a.options.identity.device = v;
    } else if (k == "--runtime-dir") {
      a.options.identity.runtime_dir = v;
    } else if (k == "--namespace") {
      a.options.identity.namespace_name = v;
    } else if (k == "--tp-size") {
      a.options.identity.tp_size = std::stoi(v);
    } else if (k == "--tp-rank") {
      a.options.identity.tp_rank = std::stoi(v);
    } else if (k == "--revision") {
      a.options.identity.revision = v;
    } else if (k == "--manifest") {
      a.manifest = v;
    } else if (k == "--tier") {
      a.options.identity.tier = v == "host" ? Tier::kHost : Tier::kGpu;
    } else if (k == "--on-missing") {
      a.options.on_missing = v == "error" ? OnMissing::kError : OnMissing::kFallback;
    } else {
      FailWith(InvalidArgument("unknown flag " + k));
    }
  }
  return a;
}

// name -> {sha256, nbytes} from make_checkpoint.py --manifest.
std::map<std::string, std::pair<std::string, uint64_t>> LoadManifest(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("tensors")) {
    FailWith(InvalidArgument("manifest " + path + " is not make_checkpoint.py's JSON"));
  }
  std::map<std::string, std::pair<std::string, uint64_t>> out;
  for (const auto& [name, t] : j["tensors"].items()) {
    out[name] = {t["sha256"].get<std::string>(), t["nbytes"].get<uint64_t>()};
  }
  return out;
}

// Every tensor of `a` read back (gpu tier: cuMemcpyDtoH in the primary context, which the
// caller made current; host tier: from the mapping) and compared with the manifest.
nlohmann::json CheckBytes(const cuda::DriverApi* api, const Attachment& a,
                          const std::map<std::string, std::pair<std::string, uint64_t>>& want) {
  nlohmann::json problems = nlohmann::json::array();
  size_t problem_count = 0;
  auto problem = [&](const std::string& what) {
    if (problems.size() < kMaxProblemsListed) problems.push_back(what);
    ++problem_count;
  };
  Sha256 all;
  uint64_t bytes = 0;
  size_t checked = 0;
  std::vector<unsigned char> host;
  for (const Tensor& t : a.tensors()) {
    const std::string name(t.name);  // Tensor::name is a view into the attachment's table
    auto it = want.find(name);
    if (it == want.end()) {
      problem(name + ": not in the manifest");
      continue;
    }
    host.resize(t.nbytes);
    if (t.nbytes > 0 && a.tier() == Tier::kHost) {
      std::memcpy(host.data(), t.host_ptr(), t.nbytes);
    } else if (t.nbytes > 0) {
      CUresult rc = api->cuMemcpyDtoH(host.data(), t.data, t.nbytes);
      if (rc != CUDA_SUCCESS) {
        problem(cuda::DriverError(api, rc, "cuMemcpyDtoH of " + name).ToString());
        continue;
      }
    }
    const std::string sha =
        Sha256Hex(std::string_view(reinterpret_cast<const char*>(host.data()), host.size()));
    all.Update(sha);
    ++checked;
    bytes += t.nbytes;
    if (t.nbytes != it->second.second) {
      problem(name + ": " + std::to_string(t.nbytes) + " bytes, the manifest says " +
              std::to_string(it->second.second));
    } else if (sha != it->second.first) {
      problem(name + ": sha256 " + sha + " != manifest " + it->second.first);
    }
  }
  for (const auto& [name, unused] : want) {
    if (a.Find(name) == nullptr) problem(name + ": in the manifest but not attached");
  }
  return {{"ok", problem_count == 0}, {"tensors_checked", checked},
          {"bytes_checked", bytes},   {"problem_count", problem_count},
          {"problems", problems},     {"digest", all.FinalHex()}};
}

// Every tensor pointer must belong to the attachment's device: the local ordinal of the UUID.
bool PointersOnDevice(const cuda::DriverApi* api, const Attachment& a, int ordinal) {
  for (const Tensor& t : a.tensors()) {
    if (t.nbytes == 0) continue;
    int got = -1;
    if (api->cuPointerGetAttribute(&got, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, t.data) !=
            CUDA_SUCCESS ||
        got != ordinal) {
      return false;
    }
  }
  return true;
}

int Main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  std::map<std::string, std::pair<std::string, uint64_t>> manifest;
  if (!args.manifest.empty()) manifest = LoadManifest(args.manifest);

  Result<Attachment> attached = Attachment::Attach(args.options);
  if (!attached.ok()) FailWith(attached.status());
  const Attachment& a = *attached;

  const cuda::DriverApi* api = nullptr;
  CUdevice device = -1;
  std::optional<cuda::PrimaryContext> context;
  if (a.tier() == Tier::kGpu) {
    Result<const cuda::DriverApi*> loaded = cuda::LoadDriver();
    if (!loaded.ok()) FailWith(loaded.status());
    api = *loaded;
    // The ordinal the attach resolved (Attachment::cuda_device, the public API).
    if (CUresult rc = api->cuDeviceGet(&device, a.cuda_device()); rc != CUDA_SUCCESS) {
      FailWith(InternalError("cuDeviceGet(" + std::to_string(a.cuda_device()) + ") failed"));
    }
    // The tensors live in the primary context (client.h); hold it current on this thread.
    Result<cuda::PrimaryContext> retained = cuda::PrimaryContext::Retain(api, device);
    if (!retained.ok()) FailWith(retained.status());
    context.emplace(std::move(retained).value());
  }

  nlohmann::json out = {
      {"event", "attached"},           {"source", AttachSourceName(a.source())},
      {"reason", a.source_reason()},   {"device", a.device_key()},
      {"socket", a.socket_path()},     {"daemon_pid", a.daemon_pid()},
      {"tensors", a.tensors().size()}, {"bytes", a.total_bytes()},
      {"attach_ms", a.attach_ms()},    {"device_ordinal", static_cast<int>(device)}};
  if (api != nullptr) out["pointer_ordinals_ok"] = PointersOnDevice(api, a, device);
  if (!args.manifest.empty()) out["check"] = CheckBytes(api, a, manifest);
  Print(out);

  if (args.hold) {
    for (std::string line; std::getline(std::cin, line);) {
      nlohmann::json r = {{"event", "recheck"}, {"daemon_alive", a.daemon_alive()}};
      if (!args.manifest.empty()) r["check"] = CheckBytes(api, a, manifest);
      Print(r);
    }
  }
  return 0;
}

}  // namespace
}  // namespace weightcache

int main(int argc, char** argv) { return weightcache::Main(argc, argv); }
