#include "daemon/peer_fill.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <utility>

#include "common/hash.h"
#include "sharding/gather.h"
#include "weightcache/tier.h"

namespace weightcache::daemon {

Status FillMismatch(std::string message) {
  return Status(StatusCode::kMismatch, std::move(message));
}

namespace {

// A source's manifest against our own plan's: everything but the checksums must be equal,
// else its bytes would land in the wrong places.
Status SameLayout(const protocol::Manifest& ours, const protocol::Manifest& theirs) {
  if (theirs.tier() != ours.tier()) {
    return FillMismatch(std::string("its manifest is of the ") +
                        std::string(TierName(theirs.tier())) + " tier");
  }
  if (theirs.allocation_sizes() != ours.allocation_sizes()) {
    return FillMismatch("its allocations differ from our plan's (" +
                        std::to_string(theirs.allocation_sizes().size()) + " vs " +
                        std::to_string(ours.allocation_sizes().size()) + " allocations)");
  }
  if (theirs.tensor_count() != ours.tensor_count()) {
    return FillMismatch("it holds " + std::to_string(theirs.tensor_count()) + " tensors, we plan " +
                        std::to_string(ours.tensor_count()));
  }
  for (size_t i = 0; i < ours.tensor_count(); ++i) {
    const protocol::TensorEntry a = ours.tensor(i);
    const protocol::TensorEntry b = theirs.tensor(i);
    if (a.name != b.name) {
      return FillMismatch("tensor " + std::to_string(i) + " is " + std::string(b.name) + ", ours " +
                          std::string(a.name));
    }
    if (a.dtype != b.dtype || a.ndim != b.ndim || a.shape != b.shape || a.slice != b.slice) {
      return FillMismatch("tensor " + std::string(a.name) + ": another dtype, shape or slice");
    }
    if (a.allocation != b.allocation || a.offset != b.offset || a.nbytes != b.nbytes) {
      return FillMismatch("tensor " + std::string(a.name) + ": another place in the arena");
    }
  }
  return Status::Ok();
}

}  // namespace

Status FillAcceptor::Accept(std::span<const uint8_t> manifest) {
  if (!accepted.empty()) {
    if (std::equal(manifest.begin(), manifest.end(), accepted.begin(), accepted.end())) {
      return Status::Ok();
    }
    return FillMismatch("its manifest differs from the first accepted source's");
  }
  auto theirs = protocol::Manifest::Decode(manifest);
  if (!theirs.ok()) return Status(theirs.status()).Context("its manifest");
  if (Status same = SameLayout(ours, *theirs); !same.ok()) {
    return same.Context("the source's layout is not our plan's");
  }
  accepted.assign(manifest.begin(), manifest.end());
  return Status::Ok();
}

Status CompareFillChecksums(const FillPlan& plan, const std::vector<uint64_t>& checksums,
                            const protocol::Manifest& theirs) {
  // Position k of the file order holds tensor order[k], the record of rank k among the order's
  // indices (name order).
  const size_t n = plan.order.size();
  if (checksums.size() != n || theirs.tensor_count() != n) {
    return InternalError("the fill's checksums: " + std::to_string(checksums.size()) + " for " +
                         std::to_string(n) + " tensors, the manifest holds " +
                         std::to_string(theirs.tensor_count()));
  }
  std::vector<size_t> positions(n);
  std::iota(positions.begin(), positions.end(), size_t{0});
  std::sort(positions.begin(), positions.end(),
            [&](size_t a, size_t b) { return plan.order[a] < plan.order[b]; });
  for (size_t record = 0; record < n; ++record) {
    const size_t k = positions[record];
    if (checksums[k] != theirs.tensor(record).checksum) {
      return FillMismatch("tensor " + plan.checkpoint.tensors()[plan.order[k]].name +
                          ": the checksum of the filled bytes differs from the source's manifest");
    }
  }
  return Status::Ok();
}

Status CheckFillSample(const FillPlan& plan, const ReadFilled& read) {
  const size_t n = plan.order.size();
  if (n == 0) return Status::Ok();
  std::vector<uint64_t> ends(n);
  std::partial_sum(plan.sizes.begin(), plan.sizes.end(), ends.begin());
  if (ends.back() == 0) return Status::Ok();
  std::random_device entropy;
  std::mt19937_64 random((uint64_t{entropy()} << 32) | entropy());
  const auto expected = std::make_unique<uint8_t[]>(kFillSampleBytes);
  const auto ours = std::make_unique<uint8_t[]>(kFillSampleBytes);
  std::unique_ptr<uint8_t[]> stage;
  for (int s = 0; s < kFillSampleChunks; ++s) {
    const uint64_t at = random() % ends.back();
    const size_t k = std::upper_bound(ends.begin(), ends.end(), at) - ends.begin();
    const uint64_t from = (at - (ends[k] - plan.sizes[k])) / kFillSampleBytes * kFillSampleBytes;
    const uint64_t length = std::min(kFillSampleBytes, plan.sizes[k] - from);
    const auto& t = plan.checkpoint.tensors()[plan.order[k]];
    WEIGHTCACHE_RETURN_IF_ERROR(sharding::ReadHeldBytes(plan.checkpoint, t, plan.copy[k], from,
                                                        length, expected.get(), stage));
    const auto& place = plan.arena.placements[k];
    WEIGHTCACHE_RETURN_IF_ERROR(read(place.allocation, place.offset + from, length, ours.get()));
    if (std::memcmp(ours.get(), expected.get(), length) != 0) {
      return FillMismatch("tensor " + t.name + ": the filled bytes at offset " +
                          std::to_string(from) + " differ from the checkpoint's (" +
                          plan.checkpoint.path() + ")");
    }
  }
  return Status::Ok();
}

bool HoldsWholeFiles(const FillPlan& plan) {
  if (plan.order.size() != plan.checkpoint.tensors().size()) return false;
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const checkpoint::TensorInfo& t = plan.checkpoint.tensors()[plan.order[k]];
    if (plan.sizes[k] != t.nbytes || plan.copy[k].source_offset != 0) return false;
  }
  return true;
}

namespace {

// `length` bytes of our own shard file at `offset` (EINTR and short reads resumed).
Status PreadOurs(const checkpoint::Checkpoint& checkpoint, uint32_t shard, uint64_t offset,
                 uint64_t length, uint8_t* out) {
  const std::string& path = checkpoint.shards()[shard].path;
  while (length > 0) {
    const ssize_t n = ::pread(checkpoint.shard_fd(shard), out, length, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("pread " + path + " at " + std::to_string(offset), errno);
    if (n == 0)
      return Status(StatusCode::kIo, path + " ends before byte " + std::to_string(offset));
    out += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// One shard file's SHA-256 over our header and the filled bytes (ProveFillContent).
Result<std::string> FilledFileSha256(const FillPlan& plan, uint32_t shard,
                                     const std::vector<size_t>& positions, const ReadFilled& read,
                                     uint8_t* buffer) {
  const checkpoint::ShardInfo& info = plan.checkpoint.shards()[shard];
  Sha256 sha;
  // Our own bytes, [from, to) of the file, through the buffer.
  const auto ours = [&](uint64_t from, uint64_t to) -> Status {
    for (uint64_t at = from; at < to; at += kFillProofChunkBytes) {
      const uint64_t n = std::min(kFillProofChunkBytes, to - at);
      WEIGHTCACHE_RETURN_IF_ERROR(PreadOurs(plan.checkpoint, shard, at, n, buffer));
      sha.Update(buffer, n);
    }
    return Status::Ok();
  };
  WEIGHTCACHE_RETURN_IF_ERROR(ours(0, info.data_start));
  uint64_t cursor = info.data_start;
  for (const size_t k : positions) {
    const checkpoint::TensorInfo& t = plan.checkpoint.tensors()[plan.order[k]];
    if (t.offset < cursor) {
      return FillMismatch("shard " + info.file_name + ": tensor " + t.name +
                          " overlaps the one before it");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(ours(cursor, t.offset));  // normally nothing
    const auto& place = plan.arena.placements[k];
    for (uint64_t from = 0; from < t.nbytes; from += kFillProofChunkBytes) {
      const uint64_t n = std::min(kFillProofChunkBytes, t.nbytes - from);
      WEIGHTCACHE_RETURN_IF_ERROR(read(place.allocation, place.offset + from, n, buffer));
      sha.Update(buffer, n);
    }
    cursor = t.offset + t.nbytes;
  }
  WEIGHTCACHE_RETURN_IF_ERROR(ours(cursor, info.file_size));  // normally nothing
  return sha.FinalHex();
}

}  // namespace

Status ProveFillContent(const FillPlan& plan, const checkpoint::ContentAnchor& anchor,
                        const ReadFilled& read, int threads,
                        const std::function<Status()>& on_thread) {
  if (!HoldsWholeFiles(plan)) {
    return FillMismatch(
        "the cache holds slices of tensors, which the files' SHA-256s cannot prove");
  }
  const auto& shards = plan.checkpoint.shards();
  // Each shard's positions in the plan, in file offset order.
  std::vector<std::vector<size_t>> positions(shards.size());
  for (size_t k = 0; k < plan.order.size(); ++k) {
    positions[plan.checkpoint.tensors()[plan.order[k]].shard].push_back(k);
  }
  for (auto& p : positions) {
    std::sort(p.begin(), p.end(), [&](size_t a, size_t b) {
      return plan.checkpoint.tensors()[plan.order[a]].offset <
             plan.checkpoint.tensors()[plan.order[b]].offset;
    });
  }
  std::vector<const checkpoint::ShardDigest*> expected(shards.size());
  for (size_t s = 0; s < shards.size(); ++s) {
    expected[s] = anchor.Find(shards[s].file_name);
    if (expected[s] == nullptr) {
      return FillMismatch("shard " + shards[s].file_name +
                          ": the content anchor has no SHA-256 of it");
    }
  }
  std::vector<Status> results(shards.size());
  std::atomic<size_t> next{0};
  const auto work = [&](bool own_thread) {
    if (own_thread && on_thread) {
      if (Status started = on_thread(); !started.ok()) {
        for (size_t s = next.fetch_add(1); s < shards.size(); s = next.fetch_add(1)) {
          results[s] = started;
        }
        return;
      }
    }
    const auto buffer = std::make_unique<uint8_t[]>(kFillProofChunkBytes);
    for (size_t s = next.fetch_add(1); s < shards.size(); s = next.fetch_add(1)) {
      auto digest =
          FilledFileSha256(plan, static_cast<uint32_t>(s), positions[s], read, buffer.get());
      if (!digest.ok()) {
        results[s] = digest.status();
      } else if (*digest != expected[s]->sha256) {
        results[s] =
            FillMismatch("shard " + shards[s].file_name +
                         ": the SHA-256 of the filled bytes under our header is " + *digest +
                         ", our checkpoint's is " + expected[s]->sha256 + " (" +
                         std::string(checkpoint::AnchorSourceName(expected[s]->source)) + ")");
      }
    }
  };
  const size_t count = std::min(shards.size(), static_cast<size_t>(std::clamp(threads, 1, 256)));
  {
    std::vector<std::thread> pool;
    pool.reserve(count - 1);
    for (size_t t = 1; t < count; ++t) pool.emplace_back(work, true);
    work(false);
    for (auto& t : pool) t.join();
  }
  for (const Status& result : results) {
    if (!result.ok()) return result;
  }
  return Status::Ok();
}

std::vector<FillGap> FillGaps(const FillPlan& plan) {
  const std::vector<uint64_t>& sizes = plan.allocation_sizes;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> used(sizes.size());
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const auto& place = plan.arena.placements[k];
    used[place.allocation].emplace_back(place.offset, place.offset + plan.sizes[k]);
  }
  std::vector<FillGap> gaps;
  for (size_t a = 0; a < used.size(); ++a) {
    std::sort(used[a].begin(), used[a].end());
    used[a].emplace_back(sizes[a], sizes[a]);
    uint64_t at = 0;
    for (const auto& [begin, end] : used[a]) {
      if (begin > at) gaps.push_back({static_cast<uint32_t>(a), at, begin - at});
      at = std::max(at, end);
    }
  }
  return gaps;
}

std::function<void(uint64_t done, uint64_t total)> ScaledFillProgress(
    std::function<void(uint64_t done, uint64_t total)> report, uint64_t held_bytes) {
  return [report = std::move(report), held_bytes](uint64_t done, uint64_t total) {
    if (!report || total == 0) return;
    const long double share = static_cast<long double>(std::min(done, total)) / total;
    report(static_cast<uint64_t>(share * held_bytes), held_bytes);
  };
}

}  // namespace weightcache::daemon
