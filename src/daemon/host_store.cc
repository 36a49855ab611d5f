// The host tier: sealed memfds (see weight_store.h for the contract).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "common/logging.h"
#include "cuda/arena_plan.h"
#include "cuda/checksum.h"
#include "daemon/weight_store.h"
#include "os/memfd.h"

namespace weightcache::daemon {
namespace {

// Reads are issued in batches of about this many bytes so that a cancellation (SIGTERM
// mid-load) is noticed within one batch, and so that each batch's checksums are computed
// while its bytes are still in the CPU caches' reach.
constexpr uint64_t kBatchBytes = uint64_t{256} << 20;
// Checksum work units: whole checksum chunks, so units of one tensor hash independently.
constexpr uint64_t kChunksPerUnit = 64;  // 16 MiB

class HostStore final : public WeightStore {
 public:
  HostStore(std::vector<UniqueFd> memfds, StoreSummary summary)
      : WeightStore(std::move(summary)), memfds_(std::move(memfds)) {}

  protocol::Tier tier() const override { return protocol::Tier::kHost; }
  std::vector<int> fds() const override {
    std::vector<int> fds;
    for (const auto& fd : memfds_) fds.push_back(fd.get());
    return fds;
  }

 private:
  std::vector<UniqueFd> memfds_;
};

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller's included).
template <typename Fn>
void ParallelFor(size_t n, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const size_t extra = std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1))) - 1;
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (size_t t = 0; t < extra; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

bool Cancelled(const LoadControl& control) {
  return control.cancel != nullptr && control.cancel->load(std::memory_order_relaxed);
}

}  // namespace

Result<std::unique_ptr<WeightStore>> LoadHostStore(const checkpoint::Checkpoint& checkpoint,
                                                   const LoadOptions& options,
                                                   const LoadControl& control) {
  const auto& tensors = checkpoint.tensors();
  const std::vector<size_t> order = FileOrder(checkpoint);
  std::vector<uint64_t> sizes;
  sizes.reserve(order.size());
  for (size_t idx : order) sizes.push_back(tensors[idx].nbytes);

  // Page granularity: a memfd is sized in pages anyway, and mmap needs page-aligned lengths.
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const cuda::ArenaPlan plan = cuda::PlanArena(sizes, page);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckMemoryBudget(protocol::Tier::kHost, plan.total_bytes,
                                                plan.allocation_bytes.size(),
                                                options.memory_budget));

  // Acquisition order: memfds, then their writable mappings (destroyed first).
  std::vector<UniqueFd> memfds;
  for (size_t a = 0; a < plan.allocation_bytes.size(); ++a) {
    auto fd =
        os::CreateMemfd(options.cache_name + "-" + std::to_string(a), plan.allocation_bytes[a]);
    if (!fd.ok()) {
      Status status = fd.status();
      return status.Context("host tier: allocation " + std::to_string(a) + " of " +
                            std::to_string(plan.allocation_bytes[a]) + " bytes");
    }
    memfds.push_back(std::move(fd).value());
  }
  std::vector<os::MappedRegion> regions;
  for (size_t a = 0; a < memfds.size(); ++a) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(auto region,
                                 os::MapReadWrite(memfds[a].get(), plan.allocation_bytes[a]));
    regions.push_back(std::move(region));
  }

  const uint64_t total = checkpoint.total_bytes();
  uint64_t done = 0;
  if (control.progress) control.progress(0, total);
  std::vector<uint64_t> checksums(order.size(), 0);

  for (size_t begin = 0; begin < order.size();) {
    if (Cancelled(control)) return Status(StatusCode::kUnavailable, "load cancelled");
    // One batch: [begin, end) in file order, about kBatchBytes.
    size_t end = begin;
    uint64_t batch_bytes = 0;
    while (end < order.size() && (end == begin || batch_bytes < kBatchBytes)) {
      batch_bytes += sizes[end];
      ++end;
    }
    std::vector<checkpoint::ReadRequest> requests;
    for (size_t i = begin; i < end; ++i) {
      if (sizes[i] == 0) continue;
      const auto& t = tensors[order[i]];
      const auto& place = plan.placements[i];
      requests.push_back({t.shard, t.offset, t.nbytes,
                          static_cast<uint8_t*>(regions[place.allocation].data()) + place.offset});
    }
    checkpoint::ReadOptions read_options;
    read_options.threads = std::clamp(options.threads, 1, 256);
    const uint64_t base = done;
    // ReadRanges serializes its progress calls, so no lock is needed here.
    read_options.progress = [&](uint64_t batch_done) {
      if (control.progress) control.progress(base + batch_done, total);
    };
    Status read = checkpoint::ReadRanges(checkpoint, requests, read_options);
    if (!read.ok()) return read.Context("host tier: reading " + checkpoint.path());

    // Checksums of this batch, split into chunk-aligned units so one large tensor still
    // spreads over every thread.
    struct Unit {
      size_t i;        // position in `order`
      uint64_t first;  // first chunk
      uint64_t count;  // chunks
    };
    std::vector<Unit> units;
    std::vector<std::vector<uint64_t>> chunk_hashes(end - begin);
    for (size_t i = begin; i < end; ++i) {
      const uint64_t chunks = cuda::ChecksumChunkCount(sizes[i]);
      chunk_hashes[i - begin].resize(chunks);
      for (uint64_t c = 0; c < chunks; c += kChunksPerUnit) {
        units.push_back({i, c, std::min(kChunksPerUnit, chunks - c)});
      }
    }
    ParallelFor(units.size(), options.threads, [&](size_t u) {
      const Unit& unit = units[u];
      const auto& place = plan.placements[unit.i];
      const uint64_t from = unit.first * cuda::kChecksumChunkBytes;
      const uint64_t bytes = std::min(sizes[unit.i] - from, unit.count * cuda::kChecksumChunkBytes);
      const auto* data =
          static_cast<const uint8_t*>(regions[place.allocation].data()) + place.offset + from;
      cuda::HashChunks(
          data, bytes,
          std::span<uint64_t>(chunk_hashes[unit.i - begin]).subspan(unit.first, unit.count));
    });
    for (size_t i = begin; i < end; ++i) {
      checksums[i] = cuda::CombineChunkHashes(chunk_hashes[i - begin]);
    }
    done += batch_bytes;
    begin = end;
  }
  if (control.progress) control.progress(done, total);

  // The kernel refuses F_SEAL_WRITE while a writable shared mapping exists: unmap first.
  regions.clear();
  for (size_t a = 0; a < memfds.size(); ++a) {
    Status sealed = os::SealReadOnly(memfds[a].get());
    if (!sealed.ok()) return sealed.Context("host tier: sealing allocation " + std::to_string(a));
  }

  std::vector<PlacedTensor> placements;
  placements.reserve(order.size());
  for (const auto& p : plan.placements) placements.push_back({p.allocation, p.offset});
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(summary.manifest,
                               BuildManifest(protocol::Tier::kHost, checkpoint, order, placements,
                                             checksums, plan.allocation_bytes));
  summary.tensor_count = order.size();
  summary.tensor_bytes = total;
  summary.resident_bytes = plan.total_bytes;
  LOG_DEBUG << "host tier: " << order.size() << " tensors in " << memfds.size()
            << " sealed memfd(s), " << plan.total_bytes << " bytes";
  return std::unique_ptr<WeightStore>(new HostStore(std::move(memfds), std::move(summary)));
}

}  // namespace weightcache::daemon
