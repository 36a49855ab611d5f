// proc_memory.h — what a process's host memory is made of, for the benches' JSON (docs/design.md
// "Performance targets": a serving daemon under 100 MB of host RSS). Header-only; shared by
// gpu_attach_bench and host_attach_bench.
//
//   ProcMemory(pid)      /proc/<pid>/status (VmRSS, VmHWM, RssAnon, RssFile, RssShmem, VmSwap,
//                        Threads), /proc/<pid>/smaps_rollup (Rss, Pss and its anon/file/shmem
//                        split, dirty/clean), and from /proc/<pid>/smaps the mappings with the
//                        most Rss, grouped by name ("[heap]", "[stack]", a library's path, or
//                        "[anon]" for unnamed ones), plus the largest unnamed mappings one by
//                        one (a glibc malloc arena of a thread reserves 64 MiB; driver and
//                        thread-stack mappings have other sizes). Sizes in bytes.
//   ParseLoadMemory(log) the daemon's "load memory:" log line (src/daemon/load_memory.h):
//                        {"<point>": {"rss","anon","file","shmem","hwm"}} in bytes.
//
// Every reader returns what it could read: a missing file gives an empty object, never an
// error (a pid namespace or an exited process must not fail a bench).
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace weightcache::bench {

// "Key:   123 kB" lines of a /proc file, as {"Key": bytes}; `keep` empty keeps every key.
inline nlohmann::json ProcKeyValues(const std::string& path, const std::vector<std::string>& keep) {
  nlohmann::json out = nlohmann::json::object();
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, colon);
    if (!keep.empty() && std::find(keep.begin(), keep.end(), key) == keep.end()) continue;
    std::istringstream in(line.substr(colon + 1));
    uint64_t value = 0;
    std::string unit;
    if (!(in >> value)) continue;
    in >> unit;
    out[key] = unit == "kB" ? value * 1024 : value;
  }
  return out;
}

inline nlohmann::json ProcMemory(pid_t pid, size_t top = 10) {
  const std::string dir = "/proc/" + std::to_string(pid);
  nlohmann::json out;
  out["status"] = ProcKeyValues(
      dir + "/status", {"VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSwap", "Threads"});
  out["smaps_rollup"] = ProcKeyValues(
      dir + "/smaps_rollup", {"Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean",
                              "Shared_Dirty", "Private_Clean", "Private_Dirty", "Anonymous"});

  struct Group {
    uint64_t rss = 0;
    uint64_t size = 0;
    size_t mappings = 0;
  };
  std::map<std::string, Group> groups;
  std::vector<std::pair<uint64_t, uint64_t>> anon;  // (rss, size) of each unnamed mapping
  std::ifstream f(dir + "/smaps");
  std::string name;
  uint64_t size = 0;
  for (std::string line; std::getline(f, line);) {
    // A mapping's header: "start-end perms offset dev inode [name]"; its fields follow as
    // "Key: value kB" lines, whose first word ends in ':' (a header's never does).
    std::istringstream in(line);
    std::string first;
    in >> first;
    if (first.empty()) continue;
    if (first.back() != ':') {
      std::string perms, offset, dev, inode;
      in >> perms >> offset >> dev >> inode;
      std::getline(in, name);
      name.erase(0, name.find_first_not_of(' '));
      if (name.empty()) name = "[anon]";
      const size_t dash = first.find('-');
      size = dash == std::string::npos ? 0
                                       : std::stoull(first.substr(dash + 1), nullptr, 16) -
                                             std::stoull(first.substr(0, dash), nullptr, 16);
      groups[name].size += size;
      ++groups[name].mappings;
    } else if (first == "Rss:") {
      uint64_t kib = 0;
      in >> kib;
      groups[name].rss += kib * 1024;
      if (name == "[anon]") anon.emplace_back(kib * 1024, size);
    }
  }
  std::vector<std::pair<std::string, Group>> sorted(groups.begin(), groups.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.rss > b.second.rss; });
  nlohmann::json by_name = nlohmann::json::array();
  for (size_t i = 0; i < std::min(top, sorted.size()); ++i) {
    by_name.push_back({{"name", sorted[i].first},
                       {"rss", sorted[i].second.rss},
                       {"size", sorted[i].second.size},
                       {"mappings", sorted[i].second.mappings}});
  }
  out["top_mappings"] = by_name;
  std::sort(anon.begin(), anon.end(), std::greater<>());
  nlohmann::json largest_anon = nlohmann::json::array();
  for (size_t i = 0; i < std::min(top, anon.size()); ++i) {
    largest_anon.push_back({{"rss", anon[i].first}, {"size", anon[i].second}});
  }
  out["top_anon_mappings"] = largest_anon;
  return out;
}

// The last "load memory:" line of a daemon log: "<tier> tier: load memory: point=rss R MiB
// (anon A, file F, shmem S MiB), hwm H MiB; point=...".
inline nlohmann::json ParseLoadMemory(const std::string& log) {
  nlohmann::json out = nlohmann::json::object();
  std::string line;
  for (size_t at = log.find("load memory: "); at != std::string::npos;
       at = log.find("load memory: ", at + 1)) {
    line = log.substr(at, log.find('\n', at) - at);
  }
  static const std::regex re(
      R"((\w+)=rss ([0-9.]+) MiB \(anon ([0-9.]+), file ([0-9.]+), shmem ([0-9.]+) MiB\), hwm ([0-9.]+) MiB)");
  auto bytes = [](const std::string& mib) {
    return static_cast<uint64_t>(std::stod(mib) * (1 << 20));
  };
  std::smatch m;
  for (auto it = line.cbegin(); std::regex_search(it, line.cend(), m, re); it = m.suffix().first) {
    out[m[1].str()] = {{"rss", bytes(m[2])},
                       {"anon", bytes(m[3])},
                       {"file", bytes(m[4])},
                       {"shmem", bytes(m[5])},
                       {"hwm", bytes(m[6])}};
  }
  return out;
}

}  // namespace weightcache::bench
