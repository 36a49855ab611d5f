// shmem_probe — how fast this host's kernel gives and reads back memfd (shmem) pages, the bound
// of the host tier's demotion (fresh pages written) and promotion (pages read). No CUDA.
//
//   g++ -O2 -std=c++20 -pthread bench/probes/shmem_probe.cc -o shmem_probe
//   ./shmem_probe [GiB=16]
//
// Prints one JSON line per measurement: {"probe": ..., "threads": N, "gb_per_s": ...}.
// Populate modes: one memfd with every thread on interleaved 32 MiB ranges (what tier_copy
// does), or one memfd per thread; each by MADV_POPULATE_WRITE, fallocate, or writing the pages
// (memset). Read modes: pread into a private buffer, or memcpy from a populated mapping.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

namespace {

constexpr size_t kPiece = size_t{32} << 20;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int NewMemfd(size_t bytes) {
  int fd = ::memfd_create("probe", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::perror("memfd");
    std::exit(1);
  }
  return fd;
}

void* Map(int fd, size_t bytes, int prot) {
  void* p = ::mmap(nullptr, bytes, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  return p;
}

void OnThreads(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n; ++t) threads.emplace_back(fn, t);
  for (auto& t : threads) t.join();
}

enum class Fill { kPopulateWrite, kFallocate, kMemset, kPwrite, kFallocateMemset };
const char* Name(Fill f) {
  switch (f) {
    case Fill::kPopulateWrite:
      return "populate_write";
    case Fill::kFallocate:
      return "fallocate";
    case Fill::kMemset:
      return "memset";
    case Fill::kPwrite:
      return "pwrite";
    case Fill::kFallocateMemset:
      return "fallocate_then_memset";
  }
  return "?";
}

// A private 32 MiB source for kPwrite, per thread.
thread_local std::vector<char> source;

void FillRange(Fill how, int fd, char* map, size_t off, size_t bytes) {
  if (how == Fill::kPopulateWrite) {
    if (::madvise(map + off, bytes, MADV_POPULATE_WRITE) != 0) std::perror("madvise");
  } else if (how == Fill::kFallocate) {
    if (::fallocate(fd, 0, static_cast<off_t>(off), static_cast<off_t>(bytes)) != 0) {
      std::perror("fallocate");
    }
  } else if (how == Fill::kPwrite) {
    if (source.size() < bytes) source.assign(bytes, 1);
    size_t done = 0;
    while (done < bytes) {
      ssize_t n = ::pwrite(fd, source.data() + done, bytes - done, static_cast<off_t>(off + done));
      if (n <= 0) {
        std::perror("pwrite");
        std::exit(1);
      }
      done += static_cast<size_t>(n);
    }
  } else if (how == Fill::kFallocateMemset) {
    if (::fallocate(fd, 0, static_cast<off_t>(off), static_cast<off_t>(bytes)) != 0) {
      std::perror("fallocate");
    }
    std::memset(map + off, 1, bytes);
  } else {
    std::memset(map + off, 1, bytes);
  }
}

// One memfd of `total`, `threads` workers on interleaved kPiece ranges.
void PopulateShared(Fill how, size_t total, size_t threads) {
  int fd = NewMemfd(total);
  char* map = static_cast<char*>(Map(fd, total, PROT_READ | PROT_WRITE));
  const double t0 = Now();
  OnThreads(threads, [&](size_t w) {
    for (size_t off = w * kPiece; off < total; off += threads * kPiece) {
      FillRange(how, fd, map, off, std::min(kPiece, total - off));
    }
  });
  const double s = Now() - t0;
  std::printf(
      "{\"probe\": \"populate_one_memfd\", \"how\": \"%s\", \"threads\": %zu, \"gb_per_s\": "
      "%.2f}\n",
      Name(how), threads, static_cast<double>(total) / 1e9 / s);
  std::fflush(stdout);
  ::munmap(map, total);
  ::close(fd);
}

// One memfd per worker, total/threads each, each worker filling its own whole.
void PopulateOwn(Fill how, size_t total, size_t threads) {
  const size_t each = total / threads / kPiece * kPiece;
  std::vector<int> fds(threads);
  std::vector<char*> maps(threads);
  for (size_t t = 0; t < threads; ++t) {
    fds[t] = NewMemfd(each);
    maps[t] = static_cast<char*>(Map(fds[t], each, PROT_READ | PROT_WRITE));
  }
  const double t0 = Now();
  OnThreads(threads, [&](size_t w) {
    for (size_t off = 0; off < each; off += kPiece) FillRange(how, fds[w], maps[w], off, kPiece);
  });
  const double s = Now() - t0;
  std::printf(
      "{\"probe\": \"populate_own_memfd\", \"how\": \"%s\", \"threads\": %zu, \"gb_per_s\": "
      "%.2f}\n",
      Name(how), threads, static_cast<double>(each * threads) / 1e9 / s);
  std::fflush(stdout);
  for (size_t t = 0; t < threads; ++t) {
    ::munmap(maps[t], each);
    ::close(fds[t]);
  }
}

// A populated memfd read back by `threads` workers into their own 32 MiB buffers.
void Read(int fd, size_t total, size_t threads, bool by_mmap) {
  char* map = by_mmap ? static_cast<char*>(Map(fd, total, PROT_READ)) : nullptr;
  std::vector<std::vector<char>> bufs(threads, std::vector<char>(kPiece, 1));
  const double t0 = Now();
  OnThreads(threads, [&](size_t w) {
    for (size_t off = w * kPiece; off < total; off += threads * kPiece) {
      const size_t n = std::min(kPiece, total - off);
      if (by_mmap) {
        std::memcpy(bufs[w].data(), map + off, n);
      } else {
        size_t done = 0;
        while (done < n) {
          ssize_t r = ::pread(fd, bufs[w].data() + done, n - done, static_cast<off_t>(off + done));
          if (r <= 0) {
            std::perror("pread");
            std::exit(1);
          }
          done += static_cast<size_t>(r);
        }
      }
    }
  });
  const double s = Now() - t0;
  std::printf("{\"probe\": \"read\", \"how\": \"%s\", \"threads\": %zu, \"gb_per_s\": %.2f}\n",
              by_mmap ? "mmap_memcpy" : "pread", threads, static_cast<double>(total) / 1e9 / s);
  std::fflush(stdout);
  if (map != nullptr) ::munmap(map, total);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t gib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 16;
  const size_t total = gib << 30;
  const size_t cores = std::thread::hardware_concurrency();
  std::printf("{\"probe\": \"host\", \"cores\": %zu, \"gib\": %zu}\n", cores, gib);
  for (size_t threads : {size_t{1}, size_t{8}, size_t{16}}) {
    for (Fill how : {Fill::kPopulateWrite, Fill::kFallocate, Fill::kMemset, Fill::kPwrite,
                     Fill::kFallocateMemset}) {
      PopulateShared(how, threads == 1 ? total / 4 : total, threads);
      if (threads > 1) PopulateOwn(how, total, threads);
    }
  }
  // Read back: one populated memfd.
  int fd = NewMemfd(total);
  char* map = static_cast<char*>(Map(fd, total, PROT_READ | PROT_WRITE));
  OnThreads(16, [&](size_t w) {
    for (size_t off = w * kPiece; off < total; off += 16 * kPiece)
      std::memset(map + off, 2, kPiece);
  });
  ::munmap(map, total);
  for (size_t threads : {size_t{8}, size_t{16}}) {
    Read(fd, total, threads, false);
    Read(fd, total, threads, true);
    Read(fd, total, threads, true);  // the mapping's page tables are new each time
  }
  ::close(fd);
  return 0;
}
