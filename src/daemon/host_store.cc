// The host tier: sealed memfds (see weight_store.h for the contract).
//
// Where the time of a host-tier load goes (measured on a 2-vCPU VM, docs/benchmarks.md): not in
// the read — a pread from the page cache into memory that is already faulted in runs at memory
// copy speed — but in getting the memfd's pages. Reading straight into a MAP_SHARED mapping of
// the memfd takes a user page fault per 4 KiB page inside copy_to_user (a trap, and on a VM a
// hypervisor exit), then a munmap of the whole mapping before sealing; pre-populating
// (fallocate, MAP_POPULATE, MADV_POPULATE_WRITE) measured no faster. Writing with pwrite lets
// shmem allocate its pages inside the write, with no user mapping at all: on the same box it
// loads ~1.8x faster than the mapped path, faster even than a plain read into a fresh private
// anonymous buffer. So each reader thread loops over one small bounce buffer that stays in
// its L2: pread a step from the checkpoint into it, hash the step's checksum chunks there (no
// second pass over DRAM), pwrite it into the memfd. No batch barriers: threads take work items
// in file order from one counter until all are done.
#include "daemon/host_store.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "common/checksum.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "daemon/load_memory.h"
#include "daemon/peer_fill.h"
#include "os/memfd.h"
#include "protocol/manifest.h"
#include "sharding/gather.h"
#include "weightcache/tier.h"

namespace weightcache::daemon {
namespace {

static_assert(kHostItemBytes % kChecksumChunkBytes == 0);
static_assert(kHostStepBytes % kChecksumChunkBytes == 0);
static_assert(kHostItemBytes % kHostStepBytes == 0);

bool Cancelled(const LoadControl& control) {
  return control.cancel != nullptr && control.cancel->load(std::memory_order_relaxed);
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// The reader threads of one load: they take items in file order from one counter until all
// are done (no batch barriers), each through its own bounce buffer.
class HostReader {
 public:
  HostReader(const checkpoint::Checkpoint& checkpoint, const HostLayout& layout,
             const std::vector<HostItem>& items, const std::vector<UniqueFd>& memfds,
             const LoadControl& control, std::vector<uint64_t>* chunk_hashes)
      : checkpoint_(checkpoint),
        layout_(layout),
        items_(items),
        memfds_(memfds),
        control_(control),
        chunk_hashes_(*chunk_hashes),
        total_(std::accumulate(layout.sizes.begin(), layout.sizes.end(), uint64_t{0})) {}

  Status Run(int threads) {
    if (control_.progress) control_.progress(0, total_);
    const size_t count = std::min(std::max<size_t>(items_.size(), 1),
                                  static_cast<size_t>(std::clamp(threads, 1, 256)));
    std::vector<std::thread> pool;
    pool.reserve(count - 1);
    for (size_t t = 1; t < count; ++t) pool.emplace_back([this] { Worker(); });
    Worker();
    for (auto& t : pool) t.join();
    MutexLock lock(mu_);
    return first_error_;
  }

 private:
  void Worker() {
    const auto bounce = std::make_unique<uint8_t[]>(kHostStepBytes);
    std::unique_ptr<uint8_t[]> stage;  // sharding::ReadHeldBytes' staging, on first need
    while (!stop_.load(std::memory_order_relaxed)) {
      const size_t n = next_item_.fetch_add(1, std::memory_order_relaxed);
      if (n >= items_.size()) return;
      Status status;
      if (Cancelled(control_)) {
        status = Status(StatusCode::kUnavailable, "load cancelled");
      } else {
        const HostItem& item = items_[n];
        for (size_t i = item.first; i < item.first + item.count && status.ok(); ++i) {
          status = item.count == 1 ? LoadRange(i, item.from, item.length, bounce.get(), stage)
                                   : LoadRange(i, 0, layout_.sizes[i], bounce.get(), stage);
        }
      }
      MutexLock lock(mu_);
      if (!status.ok()) {
        if (first_error_.ok()) first_error_ = std::move(status);
        stop_.store(true, std::memory_order_relaxed);
        return;
      }
      done_ += items_[n].length;
      if (control_.progress) control_.progress(done_, total_);
    }
  }

  // Loads [from, from + length) of the held bytes of the tensor at position i of the order
  // through `bounce` (kHostStepBytes): read (sharding::ReadHeldBytes), hash its chunks, write into
  // its place. `from` is on a chunk boundary. Items write disjoint slices of the chunk hashes, so
  // no lock is needed.
  Status LoadRange(size_t i, uint64_t from, uint64_t length, uint8_t* bounce,
                   std::unique_ptr<uint8_t[]>& stage) {
    const auto& t = checkpoint_.tensors()[layout_.order[i]];
    const auto& place = layout_.plan.placements[i];
    for (uint64_t at = from; at < from + length; at += kHostStepBytes) {
      const uint64_t step = std::min(kHostStepBytes, from + length - at);
      WEIGHTCACHE_RETURN_IF_ERROR(
          sharding::ReadHeldBytes(checkpoint_, t, layout_.copy[i], at, step, bounce, stage));
      const uint64_t first_chunk = layout_.chunk_begin[i] + at / kChecksumChunkBytes;
      HashChunks(bounce, step,
                 std::span<uint64_t>(chunk_hashes_).subspan(first_chunk, ChecksumChunkCount(step)));
      Status written =
          os::PwriteAll(memfds_[place.allocation].get(), bounce, step, place.offset + at);
      if (!written.ok()) {
        return written.Context("tensor " + t.name + " (allocation " +
                               std::to_string(place.allocation) + ")");
      }
    }
    return Status::Ok();
  }

  const checkpoint::Checkpoint& checkpoint_;
  const HostLayout& layout_;
  const std::vector<HostItem>& items_;
  const std::vector<UniqueFd>& memfds_;
  const LoadControl& control_;
  std::vector<uint64_t>& chunk_hashes_;
  const uint64_t total_;
  std::atomic<size_t> next_item_{0};
  std::atomic<bool> stop_{false};
  Mutex mu_;  // guards first_error_ and done_, and serialises progress calls
  Status first_error_ WEIGHTCACHE_GUARDED_BY(mu_);
  uint64_t done_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
};

}  // namespace

HostLayout PlanHostLayout(const checkpoint::Checkpoint& checkpoint, uint64_t page_size,
                          const sharding::ShardPlan* plan) {
  HostLayout layout;
  HeldTensors held = ListHeldTensors(checkpoint, plan);
  layout.order = std::move(held.order);
  layout.sizes = std::move(held.sizes);
  layout.copy = std::move(held.copy);
  layout.planned = std::move(held.planned);
  layout.plan = checkpoint::PlanArena(layout.sizes, page_size);
  layout.chunk_begin.assign(layout.order.size() + 1, 0);
  for (size_t i = 0; i < layout.order.size(); ++i) {
    layout.chunk_begin[i + 1] = layout.chunk_begin[i] + ChecksumChunkCount(layout.sizes[i]);
  }
  return layout;
}

std::vector<HostItem> MakeHostItems(const std::vector<uint64_t>& sizes) {
  std::vector<HostItem> items;
  for (size_t i = 0; i < sizes.size();) {
    if (sizes[i] >= kHostItemBytes) {
      for (uint64_t from = 0; from < sizes[i]; from += kHostItemBytes) {
        items.push_back({i, 1, from, std::min(kHostItemBytes, sizes[i] - from)});
      }
      ++i;
      continue;
    }
    HostItem item{i, 0, 0, 0};
    while (i < sizes.size() && sizes[i] < kHostItemBytes &&
           (item.count == 0 || item.length + sizes[i] <= kHostItemBytes)) {
      item.length += sizes[i];
      ++item.count;
      ++i;
    }
    items.push_back(item);
  }
  return items;
}

Result<std::vector<UniqueFd>> CreateHostMemfds(const std::string& cache_name,
                                               const checkpoint::ArenaPlan& plan) {
  std::vector<UniqueFd> memfds;
  memfds.reserve(plan.allocation_bytes.size());
  for (size_t a = 0; a < plan.allocation_bytes.size(); ++a) {
    auto fd = os::CreateMemfd(cache_name + "-" + std::to_string(a), plan.allocation_bytes[a]);
    if (!fd.ok()) {
      Status status = fd.status();
      return status.Context("host tier: allocation " + std::to_string(a) + " of " +
                            std::to_string(plan.allocation_bytes[a]) + " bytes");
    }
    memfds.push_back(std::move(fd).value());
  }
  return memfds;
}

Status RunHostItems(const checkpoint::Checkpoint& checkpoint, const HostLayout& layout,
                    const std::vector<HostItem>& items, const std::vector<UniqueFd>& memfds,
                    int threads, const LoadControl& control, std::vector<uint64_t>* chunk_hashes) {
  Status status = HostReader(checkpoint, layout, items, memfds, control, chunk_hashes).Run(threads);
  if (status.ok() || status.code() == StatusCode::kUnavailable) return status;
  return status.Context("host tier: reading " + checkpoint.path());
}

Result<FillOutcome> FillHostFromPeers(const checkpoint::Checkpoint& checkpoint,
                                      const HostLayout& layout, const std::vector<UniqueFd>& memfds,
                                      const PeerFill& fill, int threads, const LoadControl& control,
                                      std::vector<uint64_t>* chunk_hashes) {
  const size_t n = layout.order.size();
  if (n == 0 || memfds.empty()) return FillMismatch("nothing to fill: the plan holds no tensor");
  const FillPlan plan{checkpoint,  layout.order, layout.sizes,
                      layout.copy, layout.plan,  layout.plan.allocation_bytes};
  FillAcceptor acceptor;
  {
    // Our plan's manifest, encoded exactly as a source's was (its checksums are zero here).
    std::vector<uint64_t> zeros(layout.chunk_begin.back(), 0);
    WEIGHTCACHE_ASSIGN_OR_RETURN(StoreSummary ours, SummarizeHostStore(checkpoint, layout, zeros));
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        acceptor.ours, protocol::MapManifestMemfd(ours.manifest.fd.get(), ours.manifest.size));
  }
  std::vector<os::MappedRegion> mappings;
  PeerFillRequest request;
  request.memory = FillMemory::kHost;
  for (size_t a = 0; a < memfds.size(); ++a) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        os::MappedRegion region,
        os::MapReadWrite(memfds[a].get(), layout.plan.allocation_bytes[a]));
    request.allocations.emplace_back(static_cast<uint8_t*>(region.data()), region.size());
    request.fds.push_back(memfds[a].get());
    mappings.push_back(std::move(region));
  }
  request.accept = [&acceptor](std::span<const uint8_t> manifest) {
    return acceptor.Accept(manifest);
  };
  request.forget_accepted = [&acceptor] { acceptor.Forget(); };
  request.progress = ScaledFillProgress(
      control.progress, std::accumulate(layout.sizes.begin(), layout.sizes.end(), uint64_t{0}));
  request.cancel = control.cancel;
  request.holds_whole_files = HoldsWholeFiles(plan);
  WEIGHTCACHE_ASSIGN_OR_RETURN(FillOutcome outcome, fill(request));
  if (acceptor.accepted.empty()) return InternalError("the fill accepted no source's manifest");
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Manifest theirs,
                               protocol::Manifest::Decode(acceptor.accepted));

  // Every tensor's checksum over OUR memory against the manifest's: the chunk hashes on up to
  // `threads` threads (the loader's work items, disjoint slices of the hashes), then combined
  // per tensor.
  const std::vector<HostItem> items = MakeHostItems(layout.sizes);
  std::atomic<size_t> next_item{0};
  const auto hash_items = [&] {
    for (size_t m = next_item.fetch_add(1); m < items.size(); m = next_item.fetch_add(1)) {
      const HostItem& item = items[m];
      for (size_t i = item.first; i < item.first + item.count; ++i) {
        const uint64_t from = item.count == 1 ? item.from : 0;
        const uint64_t length = item.count == 1 ? item.length : layout.sizes[i];
        const auto& place = layout.plan.placements[i];
        HashChunks(request.allocations[place.allocation].data() + place.offset + from, length,
                   std::span<uint64_t>(*chunk_hashes)
                       .subspan(layout.chunk_begin[i] + from / kChecksumChunkBytes,
                                ChecksumChunkCount(length)));
      }
    }
  };
  {
    const size_t count = std::min(std::max<size_t>(items.size(), 1),
                                  static_cast<size_t>(std::clamp(threads, 1, 256)));
    std::vector<std::thread> pool;
    pool.reserve(count - 1);
    for (size_t t = 1; t < count; ++t) pool.emplace_back(hash_items);
    hash_items();
    for (auto& t : pool) t.join();
  }
  std::vector<uint64_t> checksums(n);
  for (size_t k = 0; k < n; ++k) {
    checksums[k] = CombineChunkHashes(
        std::span<const uint64_t>(*chunk_hashes)
            .subspan(layout.chunk_begin[k], layout.chunk_begin[k + 1] - layout.chunk_begin[k]));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CompareFillChecksums(plan, checksums, theirs));
  const ReadFilled read = [&request](uint32_t allocation, uint64_t offset, uint64_t length,
                                     uint8_t* out) {
    std::memcpy(out, request.allocations[allocation].data() + offset, length);
    return Status::Ok();
  };
  if (outcome.content_anchor) {
    WEIGHTCACHE_RETURN_IF_ERROR(ProveFillContent(plan, *outcome.content_anchor, read, threads));
  }
  WEIGHTCACHE_RETURN_IF_ERROR(CheckFillSample(plan, read));
  for (const FillGap& gap : FillGaps(plan)) {
    std::memset(request.allocations[gap.allocation].data() + gap.offset, 0, gap.length);
  }
  return outcome;
}

Status SealHostMemfds(const std::vector<UniqueFd>& memfds) {
  for (size_t a = 0; a < memfds.size(); ++a) {
    Status sealed = os::SealReadOnly(memfds[a].get());
    if (!sealed.ok()) return sealed.Context("host tier: sealing allocation " + std::to_string(a));
  }
  return Status::Ok();
}

Result<StoreSummary> SummarizeHostStore(const checkpoint::Checkpoint& checkpoint,
                                        const HostLayout& layout,
                                        const std::vector<uint64_t>& chunk_hashes) {
  // Position k of the file order holds tensor order[k] of checkpoint.tensors(), which is in
  // name order: the positions sorted by that index give the manifest's name order. A sharded
  // load holds a subset of the tensors; the manifest lists those it holds.
  const size_t n = layout.order.size();
  std::vector<size_t> positions(n);
  std::iota(positions.begin(), positions.end(), size_t{0});
  std::sort(positions.begin(), positions.end(),
            [&](size_t a, size_t b) { return layout.order[a] < layout.order[b]; });
  std::vector<size_t> by_name;
  std::vector<PlacedTensor> placements;
  std::vector<uint64_t> checksums;
  std::vector<const sharding::PlannedTensor*> planned;
  by_name.reserve(n);
  placements.reserve(n);
  checksums.reserve(n);
  for (size_t k : positions) {
    by_name.push_back(layout.order[k]);
    placements.push_back({layout.plan.placements[k].allocation, layout.plan.placements[k].offset});
    checksums.push_back(CombineChunkHashes(
        std::span<const uint64_t>(chunk_hashes)
            .subspan(layout.chunk_begin[k], layout.chunk_begin[k + 1] - layout.chunk_begin[k])));
    if (!layout.planned.empty()) planned.push_back(layout.planned[k]);
  }
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      summary.manifest, BuildManifest(Tier::kHost, checkpoint, by_name, placements, checksums,
                                      layout.plan.allocation_bytes, planned));
  summary.tensor_count = n;
  summary.tensor_bytes = std::accumulate(layout.sizes.begin(), layout.sizes.end(), uint64_t{0});
  summary.resident_bytes = layout.plan.total_bytes;
  return summary;
}

// The load's buffers and vectors are locals that die on return. The memfds' pages are shmem
// that the daemon never maps, so they count in no RSS figure of the daemon.
Result<WeightStore> LoadHostStore(const checkpoint::Checkpoint& checkpoint,
                                  const LoadOptions& options, const LoadControl& control,
                                  std::string* memory) {
  const auto start = std::chrono::steady_clock::now();
  const HostLayout layout = PlanHostLayout(
      checkpoint, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)), options.shard_plan);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckMemoryBudget(Tier::kHost, layout.plan.total_bytes,
                                                layout.plan.allocation_bytes.size(),
                                                options.memory_budget));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<UniqueFd> memfds,
                               CreateHostMemfds(options.cache_name, layout.plan));

  const std::vector<HostItem> items = MakeHostItems(layout.sizes);
  std::vector<uint64_t> chunk_hashes(layout.chunk_begin.back());
  std::optional<FillOutcome> fill;
  const uint64_t total_held =
      std::accumulate(layout.sizes.begin(), layout.sizes.end(), uint64_t{0});
  if (options.peer_fill) {
    auto filled = FillHostFromPeers(checkpoint, layout, memfds, options.peer_fill, options.threads,
                                    control, &chunk_hashes);
    if (filled.ok()) {
      fill = std::move(filled).value();
      if (control.progress) control.progress(total_held, total_held);
    } else if (control.cancel != nullptr && control.cancel->load()) {
      return Status(StatusCode::kUnavailable, "load cancelled (during the fill)");
    } else {
      // Never ready with unverified bytes: new memfds, and the disk load as without a fill.
      LOG_WARN << "fill: " << filled.status().ToString() << "; loading from disk";
      WEIGHTCACHE_ASSIGN_OR_RETURN(memfds, CreateHostMemfds(options.cache_name, layout.plan));
    }
  }
  const auto read_start = std::chrono::steady_clock::now();
  if (!fill) {
    WEIGHTCACHE_RETURN_IF_ERROR(
        RunHostItems(checkpoint, layout, items, memfds, options.threads, control, &chunk_hashes));
  }
  const double read_ms = MsSince(read_start);

  const auto seal_start = std::chrono::steady_clock::now();
  WEIGHTCACHE_RETURN_IF_ERROR(SealHostMemfds(memfds));
  const double seal_ms = MsSince(seal_start);

  WEIGHTCACHE_ASSIGN_OR_RETURN(StoreSummary summary,
                               SummarizeHostStore(checkpoint, layout, chunk_hashes));
  if (fill) {
    summary.origin = std::move(fill->origin);
    summary.filled_from = "filled from " + fill->description;
  }
  const uint64_t total = summary.tensor_bytes;
  LOG_INFO << "host tier: " << layout.order.size() << " tensors in " << memfds.size()
           << " sealed memfd(s), " << layout.plan.total_bytes << " bytes; read+checksum " << read_ms
           << " ms (" << (read_ms > 0 ? static_cast<double>(total) / read_ms / 1e6 : 0.0)
           << " GB/s, " << items.size() << " items), seal " << seal_ms << " ms, total "
           << MsSince(start) << " ms";
  *memory = "loaded=" + DescribeProcessMemory(ReadProcessMemory());
  return WeightStore(Tier::kHost, std::move(memfds), std::move(summary));
}

}  // namespace weightcache::daemon
