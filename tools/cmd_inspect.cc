// `weightcache inspect CHECKPOINT [--json]`: validate a safetensors checkpoint (file or
// directory) and print its shards, tensors, metadata and fingerprint. An invalid checkpoint
// exits 5 with the validation error (docs/design.md "Exit codes").
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "cli_common.h"
#include "common/terminal_text.h"

namespace weightcache::cli {
namespace {

namespace ckpt = weightcache::checkpoint;

struct InspectArgs {
  std::string path;
  bool json = false;
};

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 4) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), unit == 0 ? "%.0f %s" : "%.2f %s", v, kUnits[unit]);
  return buf;
}

nlohmann::json ToJson(const ckpt::Checkpoint& c) {
  nlohmann::json out;
  out["path"] = c.path();
  out["fingerprint"] = c.fingerprint();
  // The shards' identity on this host (CacheConfig's checkpoint_files, docs/identity.md): the
  // engine plugins key their published caches on both (docs/engines.md "Identity").
  out["files_digest"] = c.files_digest();
  out["total_bytes"] = c.total_bytes();
  out["tensor_count"] = c.tensors().size();
  out["metadata"] = c.metadata();
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& s : c.shards()) {
    shards.push_back({{"file_name", s.file_name},
                      {"path", s.path},
                      {"file_size", s.file_size},
                      {"header_len", s.header_len},
                      {"data_start", s.data_start},
                      {"metadata", s.metadata}});
  }
  out["shards"] = std::move(shards);
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : c.tensors()) {
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(ckpt::DTypeName(t.dtype))},
                       {"shape", t.shape},
                       {"nbytes", t.nbytes},
                       {"shard", t.shard},
                       {"offset", t.offset}});
  }
  out["tensors"] = std::move(tensors);
  return out;
}

// Names, metadata and paths come from the file: escaped (common/terminal_text.h).
void PrintHuman(const ckpt::Checkpoint& c) {
  std::cout << "checkpoint:  " << EscapeForTerminal(c.path()) << "\n";
  std::cout << "fingerprint: " << c.fingerprint() << "\n";
  std::cout << "files:       " << c.files_digest() << "\n";
  std::cout << "tensors:     " << c.tensors().size() << ", " << c.total_bytes() << " bytes ("
            << HumanBytes(c.total_bytes()) << ")\n";
  std::cout << "shards:      " << c.shards().size() << "\n";
  for (const auto& s : c.shards()) {
    std::cout << "  " << EscapeForTerminal(s.file_name) << "  " << s.file_size << " bytes, header "
              << s.header_len << " bytes\n";
  }
  std::cout << "metadata:" << (c.metadata().empty() ? "    (none)" : "") << "\n";
  for (const auto& [k, v] : c.metadata()) {
    std::cout << "  " << EscapeForTerminal(k) << " = " << EscapeForTerminal(v) << "\n";
  }
  std::vector<std::string> names;
  names.reserve(c.tensors().size());
  size_t name_width = 4;
  for (const auto& t : c.tensors()) {
    names.push_back(EscapeForTerminal(t.name));
    name_width = std::max(name_width, names.back().size());
  }
  std::cout << "\n";
  std::printf("%-*s  %-11s  %-20s  %14s  %s\n", static_cast<int>(name_width), "NAME", "DTYPE",
              "SHAPE", "BYTES", "SHARD");
  std::fflush(stdout);
  for (size_t i = 0; i < c.tensors().size(); ++i) {
    const auto& t = c.tensors()[i];
    std::printf("%-*s  %-11s  %-20s  %14llu  %u\n", static_cast<int>(name_width), names[i].c_str(),
                std::string(ckpt::DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                static_cast<unsigned long long>(t.nbytes), t.shard);
  }
  std::fflush(stdout);
}

int RunInspect(const InspectArgs& args) {
  Result<ckpt::Checkpoint> c = ckpt::Checkpoint::Open(args.path);
  if (!c.ok()) return Fail("inspect", c.status());
  if (args.json) {
    std::cout << ToJson(*c).dump(2) << std::endl;
  } else {
    PrintHuman(*c);
  }
  return kExitOk;
}

}  // namespace

void RegisterInspectCommand(CLI::App& root) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* sub =
      root.add_subcommand("inspect",
                          "Validate a safetensors checkpoint and list its tensors, dtypes, sizes, "
                          "metadata and fingerprint");
  sub->add_option("checkpoint", args->path,
                  "a .safetensors file, or a directory (model.safetensors.index.json or one "
                  ".safetensors file)")
      ->required();
  sub->add_flag("--json", args->json, "print one JSON object instead of a table");
  SetAction(sub, [args] { return RunInspect(*args); });
}

}  // namespace weightcache::cli
