// load_memory.h — the daemon's own host memory around a load: what /proc/self/status says it
// holds, and the step that gives back what only the load needed.
//
// Why: docs/design.md "Performance targets" wants a serving daemon under 100 MB of host RSS, and a
// load needs far more for a moment (the gpu tier's pinned staging ring, reader threads, per-tensor
// vectors). The daemon's loader thread calls ReleaseLoadMemory() once everything the load allocated
// is destroyed — the checkpoint included — and logs ReadProcessMemory() at the loader's steps and
// after, so a daemon log says what the load left behind.
//
// Contract: header-only, no state. ReadProcessMemory() reads /proc/self/status (all zeros
// when unreadable: it is for logs and never fails a load). ReleaseLoadMemory() is safe from
// any thread at any time; it only returns free heap pages to the kernel.
#pragma once

#include <malloc.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace weightcache::daemon {

// Bytes, from /proc/self/status. rss = anon + file + shmem (the kernel's own split).
struct ProcessMemory {
  uint64_t rss = 0;    // VmRSS
  uint64_t hwm = 0;    // VmHWM: the peak RSS so far
  uint64_t anon = 0;   // RssAnon: heap, malloc arenas, thread stacks, pinned host memory
  uint64_t file = 0;   // RssFile: mapped code and data of the binary and its libraries
  uint64_t shmem = 0;  // RssShmem: shared memory the process maps (the host tier maps none)
};

inline ProcessMemory ReadProcessMemory() {
  ProcessMemory m;
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    std::istringstream in(line);
    std::string key;
    uint64_t kib = 0;
    in >> key >> kib;
    const uint64_t bytes = kib * 1024;
    if (key == "VmRSS:") m.rss = bytes;
    if (key == "VmHWM:") m.hwm = bytes;
    if (key == "RssAnon:") m.anon = bytes;
    if (key == "RssFile:") m.file = bytes;
    if (key == "RssShmem:") m.shmem = bytes;
  }
  return m;
}

// "rss 12.3 MiB (anon 2.4, file 9.9, shmem 0.0 MiB), hwm 13.0 MiB": the bench parses this
// (bench/gpu_attach_bench.cc, bench/host_attach_bench.cc), keep the shape.
inline std::string DescribeProcessMemory(const ProcessMemory& m) {
  auto mib = [](uint64_t b) {
    std::ostringstream s;
    s.setf(std::ios::fixed);
    s.precision(1);
    s << static_cast<double>(b) / (1 << 20);
    return s.str();
  };
  return "rss " + mib(m.rss) + " MiB (anon " + mib(m.anon) + ", file " + mib(m.file) + ", shmem " +
         mib(m.shmem) + " MiB), hwm " + mib(m.hwm) + " MiB";
}

// Returns the free pages of every malloc arena to the kernel. The load's allocations (the
// per-tensor vectors, the checkpoint header's parse, whatever the CUDA driver allocated on
// the pipeline's threads, each of which gets its own arena) are freed by now, but glibc keeps
// freed memory below an arena's top and in the arenas of exited threads resident for reuse;
// a daemon that allocates almost nothing after its load would never reuse it. malloc_trim(0)
// walks all arenas and madvises every whole free page away, not only the top of the heap.
inline void ReleaseLoadMemory() { ::malloc_trim(0); }

}  // namespace weightcache::daemon
