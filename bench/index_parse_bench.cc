// Index parse: Checkpoint::Open of a sharded directory whose model.safetensors.index.json is
// ~10 MB with ~90k tensors (DeepSeek-V3's shape: 61 layers x 256 experts x 3 projections, long
// names), of 100k small objects in one member, and of a hostile 80 MB index nested 40M levels
// deep. Each Open runs in a spawned child, which reports its own peak RSS (VmHWM). The shards are
// written here by hand in the safetensors layout (zero-byte tensors: the index, not the data, is
// measured). `index_parse_bench [WORK_DIR]` prints one JSON line per case (docs/benchmarks.md).
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "proc_memory.h"

namespace {

using Clock = std::chrono::steady_clock;

void WriteShard(const std::string& path, const std::vector<std::string>& names) {
  nlohmann::json header = nlohmann::json::object();
  for (const auto& n : names) {
    header[n] = {{"dtype", "U8"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
  }
  const std::string text = header.dump();
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << text;
}

// `index_parse_bench --open DIR`: the measured child, a fresh process (so its peak RSS holds
// nothing of the generator's heap). Prints seconds, then the result.
int OpenOnly(const std::string& dir) {
  const auto t0 = Clock::now();
  auto c = weightcache::checkpoint::Checkpoint::Open(dir);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  // VmHWM: this process's own peak (ru_maxrss would include the spawning parent's image).
  const double hwm_bytes =
      weightcache::bench::ProcKeyValues("/proc/self/status", {"VmHWM"}).value("VmHWM", 0.0);
  std::printf("%f\n%f\n%s", s, hwm_bytes,
              c.ok() ? "ok" : c.status().ToString().substr(0, 160).c_str());
  return 0;
}

// Opens `dir` in a child; prints {case, seconds, result, peak_rss_mib, index_mib, ...}.
void Measure(const char* self, const std::string& name, const std::string& dir,
             uint64_t index_bytes) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], 1);
  std::string open_flag = "--open";
  std::string dir_arg = dir;
  char* child_argv[] = {const_cast<char*>(self), open_flag.data(), dir_arg.data(), nullptr};
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, self, &actions, nullptr, child_argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  if (spawned != 0) return;
  std::string got;
  char buf[512];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof(buf))) > 0) got.append(buf, static_cast<size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const size_t nl = got.find('\n');
  const size_t nl2 = nl == std::string::npos ? nl : got.find('\n', nl + 1);
  if (nl2 == std::string::npos) return;
  const double rss_mib = std::stod(got.substr(nl + 1, nl2 - nl - 1)) / (1 << 20);
  nlohmann::json out = {
      {"case", name},
      {"seconds", std::stod(got.substr(0, nl))},
      {"result", got.substr(nl2 + 1)},
      {"peak_rss_mib", rss_mib},
      {"index_mib", static_cast<double>(index_bytes) / (1 << 20)},
      {"peak_rss_per_index_byte", rss_mib * (1 << 20) / static_cast<double>(index_bytes)}};
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--open") return OpenOnly(argv[2]);
  const std::string work = argc > 1 ? argv[1] : "/tmp/index_parse_bench";
  ::mkdir(work.c_str(), 0700);

  // 61 layers x 256 experts x 3 projections x (weight, weight_scale_inv): ~94k tensors, a
  // ~10 MB index.
  const std::string big = work + "/big";
  ::mkdir(big.c_str(), 0700);
  constexpr int kShards = 163;
  std::vector<std::vector<std::string>> shard_names(kShards);
  nlohmann::json weight_map = nlohmann::json::object();
  int count = 0;
  const char* projs[] = {"gate_proj", "up_proj", "down_proj"};
  for (int l = 0; l < 61; ++l) {
    for (int e = 0; e < 256; ++e) {
      for (int k = 0; k < 6; ++k) {
        const std::string name = "model.layers." + std::to_string(l) + ".mlp.experts." +
                                 std::to_string(e) + "." + projs[k / 2] +
                                 (k % 2 ? ".weight_scale_inv" : ".weight");
        const int shard = count++ % kShards;
        char file[64];
        std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", shard + 1, kShards);
        weight_map[name] = file;
        shard_names[shard].push_back(name);
      }
    }
  }
  for (int s = 0; s < kShards; ++s) {
    char file[64];
    std::snprintf(file, sizeof(file), "/model-%05d-of-%05d.safetensors", s + 1, kShards);
    WriteShard(big + file, shard_names[s]);
  }
  const std::string index_text =
      nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump(2);
  std::ofstream(big + "/model.safetensors.index.json") << index_text;
  std::fprintf(stderr, "big index: %d tensors, %zu bytes\n", count, index_text.size());
  Measure(argv[0], "index_94k_tensors", big, index_text.size());

  // The old parse's quadratic case: 100k small objects in one member (1.4 MB).
  const std::string objects = work + "/objects";
  ::mkdir(objects.c_str(), 0700);
  WriteShard(objects + "/model-00001-of-00001.safetensors", {"t"});
  nlohmann::json many = {{"weight_map", {{"t", "model-00001-of-00001.safetensors"}}}};
  for (int i = 0; i < 100'000; ++i)
    many["metadata"]["k" + std::to_string(i)] = nlohmann::json::object();
  const std::string many_text = many.dump();
  std::ofstream(objects + "/model.safetensors.index.json") << many_text;
  Measure(argv[0], "index_100k_small_objects", objects, many_text.size());

  // Hostile: 80 MB of nesting under "metadata".
  const std::string nested = work + "/nested";
  ::mkdir(nested.c_str(), 0700);
  WriteShard(nested + "/model-00001-of-00001.safetensors", {"t"});
  const size_t depth = 40'000'000;
  std::string hostile = "{\"metadata\":" + std::string(depth, '[') + std::string(depth, ']') +
                        ",\"weight_map\":{\"t\":\"model-00001-of-00001.safetensors\"}}";
  std::ofstream(nested + "/model.safetensors.index.json") << hostile;
  Measure(argv[0], "index_nested_80mb", nested, hostile.size());
  return 0;
}
