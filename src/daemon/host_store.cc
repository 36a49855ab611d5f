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
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>

#include "checkpoint/arena_plan.h"
#include "common/checksum.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "daemon/load_memory.h"
#include "daemon/weight_store.h"
#include "os/memfd.h"

namespace weightcache::daemon {
namespace {

// A work item covers about this many bytes: big enough that claiming one costs nothing next
// to its read, small enough that two threads share even a single large tensor evenly and a
// cancellation (SIGTERM mid-load) is noticed within milliseconds. A multiple of the checksum
// chunk, so the pieces of one tensor hash independently.
constexpr uint64_t kItemBytes = uint64_t{8} << 20;
// The bounce buffer of each reader thread: one pread, the hash and one pwrite per step. 1 MiB
// still sits in the core's L2 when the checksum and the pwrite walk over it. Also a multiple
// of the checksum chunk.
constexpr uint64_t kStepBytes = uint64_t{1} << 20;
static_assert(kItemBytes % kChecksumChunkBytes == 0);
static_assert(kStepBytes % kChecksumChunkBytes == 0);
static_assert(kItemBytes % kStepBytes == 0);

bool Cancelled(const LoadControl& control) {
  return control.cancel != nullptr && control.cancel->load(std::memory_order_relaxed);
}

// One unit of loader work, in file order: either the whole tensors [first, first + count) of
// `order` (small tensors grouped up to kItemBytes), or the byte range [from, from + length) of
// the single tensor `first` (count == 1) when it is larger than an item.
struct Item {
  size_t first = 0;
  size_t count = 1;
  uint64_t from = 0;
  uint64_t length = 0;
};

std::vector<Item> MakeItems(const std::vector<uint64_t>& sizes) {
  std::vector<Item> items;
  for (size_t i = 0; i < sizes.size();) {
    if (sizes[i] >= kItemBytes) {
      for (uint64_t from = 0; from < sizes[i]; from += kItemBytes) {
        items.push_back({i, 1, from, std::min(kItemBytes, sizes[i] - from)});
      }
      ++i;
      continue;
    }
    Item item{i, 0, 0, 0};
    while (i < sizes.size() && sizes[i] < kItemBytes &&
           (item.count == 0 || item.length + sizes[i] <= kItemBytes)) {
      item.length += sizes[i];
      ++item.count;
      ++i;
    }
    items.push_back(item);
  }
  return items;
}

// Writes all of `data` at `offset` of the memfd, resuming after EINTR and short writes.
Status PwriteExact(int fd, const uint8_t* data, uint64_t length, uint64_t offset) {
  while (length > 0) {
    const ssize_t n = ::pwrite(fd, data, length, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("pwrite into the memfd at offset " + std::to_string(offset), errno);
    }
    data += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

// The load's buffers and vectors are locals that die on return. The memfds' pages are shmem
// that the daemon never maps, so they count in no RSS figure of the daemon.
Result<std::unique_ptr<WeightStore>> LoadHostStore(const checkpoint::Checkpoint& checkpoint,
                                                   const LoadOptions& options,
                                                   const LoadControl& control,
                                                   std::string* memory) {
  const auto start = std::chrono::steady_clock::now();
  const auto& tensors = checkpoint.tensors();
  const std::vector<size_t> order = FileOrder(checkpoint);
  std::vector<uint64_t> sizes;
  sizes.reserve(order.size());
  for (size_t idx : order) sizes.push_back(tensors[idx].nbytes);

  // Page granularity: a memfd is sized in pages anyway, and mmap needs page-aligned lengths.
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const checkpoint::ArenaPlan plan = checkpoint::PlanArena(sizes, page);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckMemoryBudget(
      Tier::kHost, plan.total_bytes, plan.allocation_bytes.size(), options.memory_budget));

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

  // Every tensor's chunk hashes in one flat array: tensor i's are [chunk_begin[i],
  // chunk_begin[i + 1]). Items write disjoint slices, so no lock is needed.
  std::vector<uint64_t> chunk_begin(order.size() + 1, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    chunk_begin[i + 1] = chunk_begin[i] + ChecksumChunkCount(sizes[i]);
  }
  std::vector<uint64_t> chunk_hashes(chunk_begin.back());
  const std::vector<Item> items = MakeItems(sizes);

  const uint64_t total = checkpoint.total_bytes();
  if (control.progress) control.progress(0, total);
  const auto read_start = std::chrono::steady_clock::now();
  std::atomic<size_t> next_item{0};
  std::atomic<bool> stop{false};
  Mutex mu;  // guards first_error and done, and serialises progress calls
  Status first_error;
  uint64_t done = 0;

  // Loads [from, from + length) of the tensor at position i of `order` through `bounce`
  // (kStepBytes): read, hash its chunks, write into its place. `from` is on a chunk boundary.
  auto load_range = [&](size_t i, uint64_t from, uint64_t length, uint8_t* bounce) -> Status {
    const auto& t = tensors[order[i]];
    const auto& place = plan.placements[i];
    for (uint64_t at = from; at < from + length; at += kStepBytes) {
      const uint64_t step = std::min(kStepBytes, from + length - at);
      const checkpoint::ReadRequest request{t.shard, t.offset + at, step, bounce};
      checkpoint::ReadOptions read_options;
      read_options.threads = 1;
      WEIGHTCACHE_RETURN_IF_ERROR(checkpoint::ReadRanges(
          checkpoint, std::span<const checkpoint::ReadRequest>(&request, 1), read_options));
      const uint64_t first_chunk = chunk_begin[i] + at / kChecksumChunkBytes;
      HashChunks(bounce, step,
                 std::span<uint64_t>(chunk_hashes).subspan(first_chunk, ChecksumChunkCount(step)));
      Status written = PwriteExact(memfds[place.allocation].get(), bounce, step, place.offset + at);
      if (!written.ok()) {
        return written.Context("tensor " + t.name + " (allocation " +
                               std::to_string(place.allocation) + ")");
      }
    }
    return Status::Ok();
  };

  auto worker = [&] {
    const auto bounce = std::make_unique<uint8_t[]>(kStepBytes);
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t n = next_item.fetch_add(1, std::memory_order_relaxed);
      if (n >= items.size()) return;
      Status status;
      if (Cancelled(control)) {
        status = Status(StatusCode::kUnavailable, "load cancelled");
      } else {
        const Item& item = items[n];
        for (size_t i = item.first; i < item.first + item.count && status.ok(); ++i) {
          status = item.count == 1 ? load_range(i, item.from, item.length, bounce.get())
                                   : load_range(i, 0, sizes[i], bounce.get());
        }
      }
      MutexLock lock(mu);
      if (!status.ok()) {
        if (first_error.ok()) first_error = std::move(status);
        stop.store(true, std::memory_order_relaxed);
        return;
      }
      done += items[n].length;
      if (control.progress) control.progress(done, total);
    }
  };
  {
    const size_t threads =
        std::min<size_t>(std::max<size_t>(items.size(), 1),
                         static_cast<size_t>(std::clamp(options.threads, 1, 256)));
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (auto& t : pool) t.join();
  }
  if (!first_error.ok()) {
    if (first_error.code() == StatusCode::kUnavailable) return first_error;
    return first_error.Context("host tier: reading " + checkpoint.path());
  }
  const double read_ms = MsSince(read_start);

  std::vector<uint64_t> checksums(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    checksums[i] =
        CombineChunkHashes(std::span<const uint64_t>(chunk_hashes)
                               .subspan(chunk_begin[i], chunk_begin[i + 1] - chunk_begin[i]));
  }

  // No writable mapping exists (the kernel would refuse F_SEAL_WRITE while one did).
  const auto seal_start = std::chrono::steady_clock::now();
  for (size_t a = 0; a < memfds.size(); ++a) {
    Status sealed = os::SealReadOnly(memfds[a].get());
    if (!sealed.ok()) return sealed.Context("host tier: sealing allocation " + std::to_string(a));
  }
  const double seal_ms = MsSince(seal_start);

  // The manifest lists tensors in name order (checkpoint.tensors() order), the order the
  // client's table is kept in, so attaching needs no sort: only an O(N) is_sorted check.
  std::vector<size_t> by_name(order.size());
  std::iota(by_name.begin(), by_name.end(), size_t{0});
  std::vector<PlacedTensor> placements(order.size());
  std::vector<uint64_t> checksums_by_name(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    placements[order[k]] = {plan.placements[k].allocation, plan.placements[k].offset};
    checksums_by_name[order[k]] = checksums[k];
  }
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(summary.manifest,
                               BuildManifest(Tier::kHost, checkpoint, by_name, placements,
                                             checksums_by_name, plan.allocation_bytes));
  summary.tensor_count = order.size();
  summary.tensor_bytes = total;
  summary.resident_bytes = plan.total_bytes;
  LOG_INFO << "host tier: " << order.size() << " tensors in " << memfds.size()
           << " sealed memfd(s), " << plan.total_bytes << " bytes; read+checksum " << read_ms
           << " ms (" << (read_ms > 0 ? static_cast<double>(total) / read_ms / 1e6 : 0.0)
           << " GB/s, " << items.size() << " items), seal " << seal_ms << " ms, total "
           << MsSince(start) << " ms";
  *memory = "loaded=" + DescribeProcessMemory(ReadProcessMemory());
  return std::unique_ptr<WeightStore>(
      new FdStore(Tier::kHost, std::move(memfds), std::move(summary)));
}

}  // namespace weightcache::daemon
