// load_bench — the cold-load path, measured against its own limits in one run (docs/design.md
// "Performance targets": cold load disk → gpu ≥ 90 % of min(file read GB/s, pinned H2D GB/s)
// measured alike).
//
//   load_bench [DATA_DIR] [--gib N] [--files F] [--threads T] [--buffer-mib M] [--buffers K]
//              [--direct | --mapped | --auto] [--streams S] [--chunk-mib M] [--depth D]
//              [--checksum-threads H] [--warm-only] [--reps R]
//              [--device-checksum | --no-checksum] [--hybrid F [--mapped-threads M]]
//              [--io-uring [--uring-depth D] [--uring-piece-mib P] [--uring-inline]]
// (--io-uring: each reader reads its staging fills as P MiB pieces (default 4), D in flight
// (default 8) on its own io_uring, handed to the kernel's io-wq workers, or with
// --uring-inline tried in the reader's own thread first; --mapped: the copy engine reads the
// page cache through registered mappings, checksums by the GPU kernel; --auto: mapped when the
// files are in the page cache, as the daemon loads;
// --hybrid F: the last fraction F of each file's items go through a second, mapped pipeline of
// M threads (default 2) at the same time as the rest go through the staged one: the two paths
// have different limits, CPU copies against the driver's page registration.)
//
// DATA_DIR holds the files to load (every regular file, in name order). If it is missing,
// empty or not given, N GiB (default 4) of files are written there as F files (default 4), or
// in a temp dir, removed afterwards; a tmpfs such as /dev/shm measures "tmpfs → GPU". For each
// cache state (cold: posix_fadvise(DONTNEED) on every file first, with the resident fraction
// checked by mincore; warm: right after a full read) it measures:
//   (a) file read GB/s: the pipeline's reader threads and read size, into pinned memory;
//   (b) pinned H2D GB/s: one 1 GiB cuMemcpyHtoDAsync (best of 3);
//   (c) the pipeline (checksums on, as the daemon runs it) into one cuMemAlloc region, R times
//       warm (--reps, default 1);
// and reports pipeline / min(a, b). Warm, it also measures (a) and (b) at once (the readers
// while a copy stream moves another pinned buffer to the device in a loop): what the host's
// memory gives the two halves of the staged path when they share it. Then it times the GPU
// checksum kernel over the loaded region and checks its checksums against the pipeline's.
// One JSON object per line.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "cuda/checksum_gpu.h"
#include "cuda/driver_api.h"
#include "cuda/upload_pipeline.h"
#include "cuda/upload_resources.h"
#include "os/uring_read.h"

namespace wc = weightcache;
namespace cu = weightcache::cuda;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kItemBytes = 16 * kMiB;  // tensor-sized items, as a real checkpoint has

void Emit(nlohmann::json j) {
  j["bench"] = "load_bench";
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

[[noreturn]] void Die(const std::string& what) {
  Emit({{"kind", "error"}, {"error", what}});
  std::exit(1);
}

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct File {
  std::string path;
  uint64_t size;
  wc::UniqueFd fd;
};

// Write `total` bytes as `count` files of pseudo-random data, synced.
void WriteDataset(const std::string& dir, uint64_t total, int count) {
  std::vector<uint64_t> block(64 * kMiB / 8);
  std::mt19937_64 rng(7);
  for (auto& w : block) w = rng();
  const uint64_t per_file = total / count;
  for (int f = 0; f < count; ++f) {
    const std::string path = dir + "/shard-" + std::to_string(f) + ".bin";
    wc::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd.valid()) Die("create " + path + ": " + std::strerror(errno));
    for (uint64_t off = 0; off < per_file;) {
      block[0] ^= off + f;  // no two blocks alike
      const uint64_t n = std::min<uint64_t>(block.size() * 8, per_file - off);
      if (::pwrite(fd.get(), block.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) {
        Die("write " + path + ": " + std::strerror(errno));
      }
      off += n;
    }
    ::fdatasync(fd.get());
  }
}

std::vector<File> OpenDataset(const std::string& dir) {
  std::vector<File> files;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file() && e.file_size() > 0) names.push_back(e.path().string());
  }
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    wc::UniqueFd fd(::open(n.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) Die("open " + n + ": " + std::strerror(errno));
    struct stat st;
    ::fstat(fd.get(), &st);
    files.push_back({n, static_cast<uint64_t>(st.st_size), std::move(fd)});
  }
  return files;
}

// Drop the files from the page cache (needs nothing but an fd; the kernel may keep pages that
// are mapped or dirty) and return the fraction still resident, by mincore.
double DropCache(const std::vector<File>& files) {
  for (const File& f : files) ::posix_fadvise(f.fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  uint64_t resident = 0, pages = 0;
  const long page = ::sysconf(_SC_PAGESIZE);
  for (const File& f : files) {
    void* m = ::mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd.get(), 0);
    if (m == MAP_FAILED) continue;
    std::vector<unsigned char> vec((f.size + page - 1) / page);
    if (::mincore(m, f.size, vec.data()) == 0) {
      for (unsigned char v : vec) resident += v & 1;
      pages += vec.size();
    }
    ::munmap(m, f.size);
  }
  return pages == 0 ? 0 : static_cast<double>(resident) / pages;
}

// (a) The pipeline's read pattern without the GPU: `threads` threads, each pread'ing
// `piece`-sized runs into its own pinned buffer.
double MeasureRead(const cu::DriverApi* api, const std::vector<File>& files, int threads,
                   uint64_t piece, bool direct) {
  struct Piece {
    int fd;
    uint64_t off, len;
  };
  std::vector<wc::UniqueFd> direct_fds;
  std::vector<Piece> pieces;
  for (const File& f : files) {
    int fd = f.fd.get();
    if (direct) {
      direct_fds.emplace_back(::open(f.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC));
      if (direct_fds.back().valid()) fd = direct_fds.back().get();
    }
    for (uint64_t off = 0; off < f.size; off += piece) {
      pieces.push_back({fd, off, std::min(piece, f.size - off)});
    }
  }
  std::vector<cu::PinnedHostBuffer> buffers;
  for (int t = 0; t < threads; ++t) {
    auto b = cu::PinnedHostBuffer::Create(api, piece + 4096);
    if (!b.ok()) Die(b.status().ToString());
    buffers.push_back(std::move(*b));
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i; (i = next++) < pieces.size();) {
        const Piece& p = pieces[i];
        // O_DIRECT needs a block-multiple length: the file's last piece is read rounded up.
        const uint64_t len = direct ? (p.len + 4095) / 4096 * 4096 : p.len;
        if (::pread(p.fd, buffers[t].data(), len, static_cast<off_t>(p.off)) <
            static_cast<ssize_t>(p.len)) {
          failed = true;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = Seconds(t0);
  if (failed) Die("file read pass failed (short read or error)");
  uint64_t total = 0;
  for (const File& f : files) total += f.size;
  return total / s / 1e9;
}

struct Concurrent {
  double read_gb_per_s;
  double h2d_gb_per_s;
};

// (a) and (b) at once: the file read pass while one stream copies a pinned buffer to the device
// in a loop, both rates over the read pass's wall time.
Concurrent MeasureReadUnderH2D(const cu::DriverApi* api, CUcontext ctx,
                               const std::vector<File>& files, int threads, uint64_t piece,
                               CUdeviceptr dst, uint64_t bytes) {
  auto host = cu::PinnedHostBuffer::Create(api, bytes);
  if (!host.ok()) Die(host.status().ToString());
  std::memset(host->data(), 0x5A, bytes);
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> copied{0};
  std::thread copier([&] {
    std::optional<cu::CudaStream> stream;
    if (api->cuCtxSetCurrent(ctx) == CUDA_SUCCESS) {
      if (auto s = cu::CudaStream::Create(api); s.ok()) stream.emplace(std::move(*s));
    }
    while (stream && !stop.load()) {
      if (api->cuMemcpyHtoDAsync(dst, host->data(), bytes, stream->get()) != CUDA_SUCCESS ||
          api->cuStreamSynchronize(stream->get()) != CUDA_SUCCESS) {
        break;
      }
      copied += bytes;
    }
    failed = !stop.load();
  });
  // The copier's first copy starts the loop; the read pass then runs beside it.
  while (copied.load() == 0 && !failed.load()) std::this_thread::yield();
  const uint64_t copied_before = copied.load();
  const auto t0 = Clock::now();
  const double read = MeasureRead(api, files, threads, piece, /*direct=*/false);
  const double s = Seconds(t0);
  const uint64_t during = copied.load() - copied_before;
  stop = true;
  copier.join();
  if (failed) Die("the H2D copy loop beside the read pass failed");
  return {read, during / s / 1e9};
}

// (b) One big pinned H2D copy, best of 3.
double MeasureH2D(const cu::DriverApi* api, CUdeviceptr dst, uint64_t bytes) {
  auto host = cu::PinnedHostBuffer::Create(api, bytes);
  if (!host.ok()) Die(host.status().ToString());
  std::memset(host->data(), 0x3C, bytes);  // touch: first-touch faults are not copy time
  auto stream = cu::CudaStream::Create(api);
  if (!stream.ok()) Die(stream.status().ToString());
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    CUresult rc = api->cuMemcpyHtoDAsync(dst, host->data(), bytes, stream->get());
    if (rc == CUDA_SUCCESS) rc = api->cuStreamSynchronize(stream->get());
    if (rc != CUDA_SUCCESS) Die(cu::DriverError(api, rc, "pinned H2D").ToString());
    best = std::max(best, bytes / Seconds(t0) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  uint64_t gib = 4;
  int file_count = 4;
  int reps = 1;
  double hybrid = 0;
  int mapped_threads = 2;
  cu::UploadOptions options;
  options.checksums = cu::ChecksumMode::kCompute;
  bool warm_only = false;
  bool io_uring = false;
  wc::os::UringOptions uring;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--hybrid") {
      hybrid = std::clamp(std::atof(next().c_str()), 0.0, 1.0);
    } else if (a == "--mapped-threads") {
      mapped_threads = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--files") {
      file_count = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--gib") {
      gib = std::strtoull(next().c_str(), nullptr, 10);
    } else if (a == "--threads") {
      options.reader_threads = std::atoi(next().c_str());
    } else if (a == "--buffer-mib") {
      options.staging_buffer_bytes = std::strtoull(next().c_str(), nullptr, 10) * kMiB;
    } else if (a == "--buffers") {
      options.staging_buffers = std::atoi(next().c_str());
    } else if (a == "--direct") {
      options.read_mode = cu::ReadMode::kDirect;
    } else if (a == "--mapped") {
      options.read_mode = cu::ReadMode::kMapped;
    } else if (a == "--auto") {
      options.read_mode = cu::ReadMode::kAuto;
    } else if (a == "--io-uring") {
      io_uring = true;
    } else if (a == "--uring-depth") {
      uring.depth = static_cast<unsigned>(std::max(1, std::atoi(next().c_str())));
    } else if (a == "--uring-piece-mib") {
      uring.piece_bytes = std::strtoull(next().c_str(), nullptr, 10) * kMiB;
    } else if (a == "--uring-inline") {
      uring.dispatch = wc::os::UringDispatch::kInline;
    } else if (a == "--streams") {
      options.copy_streams = std::atoi(next().c_str());
    } else if (a == "--chunk-mib") {
      options.mapped_chunk_bytes = std::strtoull(next().c_str(), nullptr, 10) * kMiB;
    } else if (a == "--depth") {
      options.mapped_depth = std::atoi(next().c_str());
    } else if (a == "--checksum-threads") {
      options.checksum_threads = std::atoi(next().c_str());
    } else if (a == "--warm-only") {
      warm_only = true;
    } else if (a == "--device-checksum") {
      options.checksums = cu::ChecksumMode::kDevice;
    } else if (a == "--no-checksum") {
      options.checksums = cu::ChecksumMode::kNone;
    } else if (!a.empty() && a[0] != '-') {
      dir = a;
    } else {
      std::fprintf(
          stderr,
          "usage: load_bench [DATA_DIR] [--gib N] [--files F] [--threads T] [--buffer-mib M] "
          "[--buffers K] [--direct | --mapped | --auto] [--streams S] [--chunk-mib M] "
          "[--depth D] [--checksum-threads H] [--warm-only] [--reps R] "
          "[--device-checksum | --no-checksum] [--hybrid F [--mapped-threads M]] "
          "[--io-uring [--uring-depth D] [--uring-piece-mib P] [--uring-inline]]\n");
      return 2;
    }
  }

  if (io_uring) {
    // Refused here, before any GPU work, when this build or kernel has no io_uring.
    if (auto probe = wc::os::UringReader::Create(uring); !probe.ok()) {
      std::fprintf(stderr, "load_bench: --io-uring: %s\n", probe.status().ToString().c_str());
      return 1;
    }
    options.run_reader = [uring]() -> wc::Result<std::unique_ptr<wc::os::RunReader>> {
      WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<wc::os::UringReader> r,
                                   wc::os::UringReader::Create(uring));
      return std::unique_ptr<wc::os::RunReader>(std::move(r));
    };
  }

  auto api_or = cu::LoadDriver();
  if (!api_or.ok()) {
    Emit({{"kind", "setup"}, {"skipped", api_or.status().ToString()}});
    return 0;
  }
  const cu::DriverApi* api = *api_or;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (api->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      api->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      api->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    Emit({{"kind", "setup"}, {"skipped", "no usable GPU 0"}});
    return 0;
  }

  bool temp_dir = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/wc-load-bench-XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) Die("mkdtemp: " + std::string(std::strerror(errno)));
    temp_dir = true;
  }
  std::filesystem::create_directories(dir);
  std::vector<File> files = OpenDataset(dir);
  if (files.empty()) {
    const auto t0 = Clock::now();
    WriteDataset(dir, gib * kGiB, file_count);
    Emit({{"kind", "dataset"},
          {"dir", dir},
          {"bytes", gib * kGiB},
          {"files", file_count},
          {"write_s", Seconds(t0)}});
    files = OpenDataset(dir);
  }
  uint64_t total = 0;
  std::vector<cu::UploadSource> sources;
  for (const File& f : files) {
    sources.push_back({f.fd.get(), f.path});
    total += f.size;
  }

  // One device region for everything, each file's tensors at 256-byte aligned offsets.
  std::vector<cu::UploadItem> items;
  uint64_t device_bytes = 0;
  for (size_t s = 0; s < files.size(); ++s) {
    for (uint64_t off = 0; off < files[s].size; off += kItemBytes) {
      const uint64_t len = std::min(kItemBytes, files[s].size - off);
      cu::UploadItem& item = items.emplace_back();
      item.source = s;
      item.file_offset = off;
      item.length = len;
      item.dst = device_bytes;
      device_bytes += (len + 255) / 256 * 256;
    }
  }
  CUdeviceptr region = 0;
  if (CUresult rc = api->cuMemAlloc(&region, device_bytes); rc != CUDA_SUCCESS) {
    Die(cu::DriverError(api, rc, "cuMemAlloc of the load region").ToString());
  }
  for (cu::UploadItem& it : items) it.dst += region;

  const auto tp = Clock::now();
  auto pipeline = cu::UploadPipeline::Create(api, options);
  if (!pipeline.ok()) Die(pipeline.status().ToString());
  // --hybrid: which items the mapped pipeline takes (the last fraction of each file's).
  std::vector<size_t> staged_index, mapped_index;
  std::vector<cu::UploadItem> staged_items, mapped_items;
  std::optional<cu::UploadPipeline> mapped_pipeline;
  if (hybrid > 0) {
    for (size_t s = 0; s < files.size(); ++s) {
      const uint64_t cut = static_cast<uint64_t>(static_cast<double>(files[s].size) * (1 - hybrid));
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].source != s) continue;
        const bool mapped = items[i].file_offset >= cut;
        (mapped ? mapped_index : staged_index).push_back(i);
        (mapped ? mapped_items : staged_items).push_back(items[i]);
      }
    }
    cu::UploadOptions m = options;
    m.read_mode = cu::ReadMode::kMapped;
    m.reader_threads = mapped_threads;
    auto made = cu::UploadPipeline::Create(api, m);
    if (!made.ok()) Die(made.status().ToString());
    mapped_pipeline.emplace(std::move(made).value());
  }
  const double pipeline_create_s = Seconds(tp);
  const int threads = pipeline->options().reader_threads;
  const bool direct = options.read_mode == cu::ReadMode::kDirect;
  Emit({{"kind", "config"},
        {"files", files.size()},
        {"bytes", total},
        {"items", items.size()},
        {"reader_threads", threads},
        {"staging_buffer_mib", options.staging_buffer_bytes / kMiB},
        {"staging_buffers", options.staging_buffers},
        {"read_mode", cu::ReadModeName(options.read_mode)},
        {"copy_streams", options.copy_streams},
        {"mapped_chunk_mib", options.mapped_chunk_bytes / kMiB},
        {"mapped_depth", options.mapped_depth},
        {"io_uring", io_uring},
        {"uring_depth", io_uring ? uring.depth : 0},
        {"uring_piece_mib", io_uring ? uring.piece_bytes / kMiB : 0},
        {"uring_dispatch", !io_uring                                          ? "none"
                           : uring.dispatch == wc::os::UringDispatch::kInline ? "inline"
                                                                              : "workers"},
        {"checksums", options.checksums == cu::ChecksumMode::kNone     ? "none"
                      : options.checksums == cu::ChecksumMode::kDevice ? "device"
                                                                       : "host"},
        {"hybrid_mapped_fraction", hybrid},
        {"hybrid_mapped_threads", hybrid > 0 ? mapped_threads : 0},
        {"pipeline_create_s", pipeline_create_s}});

  const double h2d = MeasureH2D(api, region, std::min<uint64_t>(kGiB, device_bytes));
  Emit({{"kind", "pinned_h2d"},
        {"bytes", std::min<uint64_t>(kGiB, device_bytes)},
        {"gb_per_s", h2d}});

  std::vector<uint64_t> checksums;
  for (const char* cache : {"cold", "warm"}) {
    const bool cold = std::strcmp(cache, "cold") == 0;
    if (cold && warm_only) continue;
    nlohmann::json resident = cold ? nlohmann::json(DropCache(files)) : nlohmann::json(nullptr);
    const double read = MeasureRead(api, files, threads, options.staging_buffer_bytes, direct);
    Emit({{"kind", "file_read"},
          {"cache", cache},
          {"resident_before", resident},
          {"threads", threads},
          {"gb_per_s", read}});
    if (!cold) {
      const uint64_t bytes = std::min<uint64_t>(256 * kMiB, device_bytes);
      const Concurrent both = MeasureReadUnderH2D(api, ctx, files, threads,
                                                  options.staging_buffer_bytes, region, bytes);
      Emit({{"kind", "read_under_h2d"},
            {"cache", cache},
            {"threads", threads},
            {"read_gb_per_s", both.read_gb_per_s},
            {"h2d_gb_per_s", both.h2d_gb_per_s}});
    }

    for (int rep = 0; rep < (cold ? 1 : reps); ++rep) {
      resident = cold ? nlohmann::json(DropCache(files)) : nlohmann::json(nullptr);
      auto report = [&]() -> wc::Result<cu::UploadReport> {
        if (!mapped_pipeline) return pipeline->Run(sources, items);
        // Both pipelines at once, one report: the wall time of the two, the checksums merged
        // back into item order.
        const auto t0 = Clock::now();
        std::optional<wc::Result<cu::UploadReport>> mapped_report;
        std::thread mapped_thread([&] {
          if (api->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
            mapped_report.emplace(wc::InternalError("cuCtxSetCurrent on the mapped thread"));
            return;
          }
          mapped_report.emplace(mapped_pipeline->Run(sources, mapped_items));
        });
        auto staged_report = pipeline->Run(sources, staged_items);
        mapped_thread.join();
        if (!staged_report.ok()) return staged_report.status();
        if (!mapped_report->ok()) return mapped_report->status();
        cu::UploadReport both = std::move(staged_report).value();
        both.seconds = Seconds(t0);
        both.bytes = total;
        both.gb_per_s = static_cast<double>(total) / both.seconds / 1e9;
        if (!both.checksums.empty()) {
          std::vector<uint64_t> merged(items.size());
          for (size_t k = 0; k < staged_index.size(); ++k) {
            merged[staged_index[k]] = both.checksums[k];
          }
          for (size_t k = 0; k < mapped_index.size(); ++k) {
            merged[mapped_index[k]] = (**mapped_report).checksums[k];
          }
          both.checksums = std::move(merged);
        }
        return both;
      }();
      if (!report.ok()) Die(report.status().ToString());
      checksums = report->checksums;
      const double limit = std::min(read, h2d);
      Emit({{"kind", "pipeline"},
            {"cache", cache},
            {"rep", rep},
            {"resident_before", resident},
            {"bytes", report->bytes},
            {"seconds", report->seconds},
            {"gb_per_s", report->gb_per_s},
            {"staging_s", report->staging_seconds},
            {"direct_sources", report->direct_sources},
            {"path", mapped_pipeline ? "hybrid" : cu::ReadModeName(report->path)},
            {"ratio_to_h2d", report->gb_per_s / h2d},
            {"limit_gb_per_s", limit},
            {"ratio", report->gb_per_s / limit},
            {"target_ratio", 0.9}});
    }
  }

  // The GPU checksum kernel over everything just loaded; it must agree with the pipeline.
  std::vector<cu::DeviceRange> ranges;
  for (const cu::UploadItem& it : items) ranges.push_back({it.dst, it.length});
  auto kernel = cu::ChecksumKernel::Create(api);
  if (!kernel.ok()) {
    Emit({{"kind", "gpu_checksum"}, {"skipped", kernel.status().ToString()}});
  } else {
    auto warm = kernel->Checksums(nullptr, ranges);
    if (!warm.ok()) Die(warm.status().ToString());
    const auto t0 = Clock::now();
    auto got = kernel->Checksums(nullptr, ranges);
    const double s = Seconds(t0);
    if (!got.ok()) Die(got.status().ToString());
    Emit({{"kind", "gpu_checksum"},
          {"bytes", total},
          {"ranges", ranges.size()},
          {"seconds", s},
          {"gb_per_s", total / s / 1e9},
          // null: the pipeline computed none (--no-checksum)
          {"matches_pipeline",
           checksums.empty() ? nlohmann::json(nullptr) : nlohmann::json(*got == checksums)}});
  }

  api->cuMemFree(region);
  if (temp_dir) std::filesystem::remove_all(dir);
  return 0;
}
