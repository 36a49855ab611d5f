#include "daemon/peer_fill.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <utility>

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
