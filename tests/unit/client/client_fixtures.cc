#include "unit/client/client_fixtures.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/hash.h"
#include "support/test_env.h"

namespace weightcache::testing {

bool MakeReferenceCheckpoint(const std::string& dir, int tensors, int shards, int seed,
                             const std::string& dtypes, int max_elems, ReferenceCheckpoint* out,
                             std::string* why) {
  const std::string manifest = dir + ".manifest.json";
  CommandResult r = RunCommand(
      {PythonExe(), SourceDir() + "/tests/tools/make_checkpoint.py", "--out", dir, "--tensors",
       std::to_string(tensors), "--shards", std::to_string(shards), "--seed", std::to_string(seed),
       "--dtypes", dtypes, "--max-elems", std::to_string(max_elems), "--manifest", manifest});
  if (r.exit_code == 77) {
    *why = r.err;
    return false;
  }
  EXPECT_EQ(r.exit_code, 0) << r.err;
  out->dir = dir;
  out->tensors.clear();
  nlohmann::json j = nlohmann::json::parse(ReadFile(manifest));
  // {"tensors": {name: {...}}} or {name: {...}}: accept both spellings of the manifest.
  const nlohmann::json& table =
      j.contains("tensors") && j["tensors"].is_object() ? j["tensors"] : j;
  for (auto it = table.begin(); it != table.end(); ++it) {
    ReferenceTensor t;
    t.dtype = it.value().at("dtype").get<std::string>();
    t.shape = it.value().at("shape").get<std::vector<int64_t>>();
    t.nbytes = it.value().at("nbytes").get<uint64_t>();
    t.sha256 = it.value().at("sha256").get<std::string>();
    out->tensors[it.key()] = std::move(t);
  }
  EXPECT_EQ(out->tensors.size(), static_cast<size_t>(tensors));
  return true;
}

std::string HostTensorSha256(const Tensor& tensor) {
  Sha256 sha;
  sha.Update(tensor.host_ptr(), tensor.nbytes);
  return sha.FinalHex();
}

std::string CompareWithReference(const Attachment& attachment, const ReferenceCheckpoint& ref) {
  if (attachment.tensors().size() != ref.tensors.size()) {
    return "tensor count " + std::to_string(attachment.tensors().size()) + " != reference " +
           std::to_string(ref.tensors.size());
  }
  for (const auto& [name, r] : ref.tensors) {
    const Tensor* t = attachment.Find(name);
    if (t == nullptr) return "missing tensor " + name;
    if (t->dtype != r.dtype) return name + ": dtype " + std::string(t->dtype) + " != " + r.dtype;
    if (!std::ranges::equal(t->shape, r.shape)) return name + ": shape differs";
    if (t->nbytes != r.nbytes) return name + ": nbytes differ";
    if (HostTensorSha256(*t) != r.sha256) return name + ": bytes differ from the file's";
  }
  return "";
}

}  // namespace weightcache::testing
