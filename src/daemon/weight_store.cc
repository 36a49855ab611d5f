// Pieces shared by both tiers: packing order, budget check, manifest construction.
#include "daemon/weight_store.h"

#include <algorithm>
#include <numeric>

#include "checkpoint/dtype.h"
#include "daemon/byte_size.h"

namespace weightcache::daemon {

Status CheckMemoryBudget(Tier tier, uint64_t plan_bytes, size_t allocations, uint64_t budget) {
  if (budget == 0 || plan_bytes <= budget) return Status::Ok();
  return Status(StatusCode::kOutOfMemory,
                std::string(TierName(tier)) + " tier plan needs " + std::to_string(plan_bytes) +
                    " bytes (" + FormatBytes(plan_bytes) + " in " + std::to_string(allocations) +
                    " allocation(s)), over the memory budget of " + std::to_string(budget) +
                    " bytes (" + FormatBytes(budget) + ", --memory-budget)");
}

std::vector<size_t> FileOrder(const checkpoint::Checkpoint& checkpoint) {
  const auto& tensors = checkpoint.tensors();
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (tensors[a].shard != tensors[b].shard) return tensors[a].shard < tensors[b].shard;
    if (tensors[a].offset != tensors[b].offset) return tensors[a].offset < tensors[b].offset;
    return tensors[a].name < tensors[b].name;  // zero-byte tensors share offsets
  });
  return order;
}

HeldTensors ListHeldTensors(const checkpoint::Checkpoint& checkpoint,
                            const sharding::ShardPlan* plan) {
  HeldTensors held;
  if (plan == nullptr) {
    held.order = FileOrder(checkpoint);
    for (size_t idx : held.order) {
      const uint64_t bytes = checkpoint.tensors()[idx].nbytes;
      held.sizes.push_back(bytes);
      held.copy.push_back({.rows = 1, .row_bytes = bytes, .source_pitch = 0, .source_offset = 0});
    }
    return held;
  }
  // The plan lists the held tensors in file order already.
  for (const sharding::PlannedTensor& p : plan->tensors) {
    held.order.push_back(static_cast<size_t>(p.tensor - checkpoint.tensors().data()));
    held.sizes.push_back(p.bytes);
    held.copy.push_back(p.copy);
    held.planned.push_back(&p);
  }
  return held;
}

Result<ManifestFile> BuildManifest(Tier tier, const checkpoint::Checkpoint& checkpoint,
                                   const std::vector<size_t>& order,
                                   const std::vector<PlacedTensor>& placements,
                                   const std::vector<uint64_t>& checksums,
                                   const std::vector<uint64_t>& allocation_sizes,
                                   std::span<const sharding::PlannedTensor* const> planned) {
  if (placements.size() != order.size() || checksums.size() != order.size() ||
      (!planned.empty() && planned.size() != order.size())) {
    return InternalError("manifest: " + std::to_string(order.size()) + " tensors but " +
                         std::to_string(placements.size()) + " placements and " +
                         std::to_string(checksums.size()) + " checksums");
  }
  std::vector<protocol::TensorEntry> entries;
  entries.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const checkpoint::TensorInfo& t = checkpoint.tensors()[order[i]];
    protocol::TensorEntry e;
    e.name = t.name;
    e.dtype = checkpoint::DTypeName(t.dtype);
    e.ndim = static_cast<uint32_t>(t.shape.size());
    std::copy(t.shape.begin(), t.shape.end(), e.shape.begin());
    e.allocation = placements[i].allocation;
    e.offset = placements[i].offset;
    e.nbytes = t.nbytes;
    e.checksum = checksums[i];
    if (!planned.empty()) {
      const sharding::PlannedTensor& p = *planned[i];
      std::copy(p.shape.begin(), p.shape.end(), e.shape.begin());
      e.nbytes = p.bytes;
      if (p.slice)
        e.slice = protocol::SliceEntry{p.slice->dim, p.slice->offset, t.shape[p.slice->dim]};
    }
    entries.push_back(e);
  }
  auto manifest = protocol::EncodeManifest(tier, allocation_sizes, entries);
  if (!manifest.ok()) {
    Status status = manifest.status();
    return status.Context("building the attach manifest");
  }
  auto fd = protocol::CreateManifestMemfd(*manifest, "weightcache-manifest");
  if (!fd.ok()) {
    Status status = fd.status();
    return status.Context("writing the attach manifest");
  }
  return ManifestFile{std::move(fd).value(), manifest->size()};
}

}  // namespace weightcache::daemon
