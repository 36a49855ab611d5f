#include "daemon/publish_store.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <string_view>
#include <utility>

#include "common/checksum.h"
#include "daemon/host_store.h"
#include "os/memfd.h"

namespace weightcache::daemon {
namespace {

// The manifest of a publication: its placements, with `checksums` (plan order) or 0s.
Result<ManifestFile> PublicationManifest(const HostPublication& pub,
                                         std::span<const uint64_t> checksums,
                                         const std::string& name) {
  std::vector<protocol::TensorEntry> entries;
  entries.reserve(pub.plan.tensors.size());
  for (size_t i = 0; i < pub.plan.tensors.size(); ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    protocol::TensorEntry e;
    e.name = t.name;
    e.dtype = t.dtype;
    e.ndim = static_cast<uint32_t>(t.shape.size());
    std::copy(t.shape.begin(), t.shape.end(), e.shape.begin());
    e.allocation = pub.layout.placements[i].allocation;
    e.offset = pub.layout.placements[i].offset;
    e.nbytes = t.nbytes;
    e.checksum = checksums.empty() ? 0 : checksums[i];
    entries.push_back(e);
  }
  auto manifest = protocol::EncodeManifest(Tier::kHost, pub.layout.allocation_bytes, entries,
                                           pub.plan.metadata);
  if (!manifest.ok()) {
    Status status = manifest.status();
    return status.Context("building the manifest of the published arena");
  }
  auto fd = protocol::CreateManifestMemfd(*manifest, name);
  if (!fd.ok()) {
    Status status = fd.status();
    return status.Context("writing the manifest of the published arena");
  }
  return ManifestFile{std::move(fd).value(), manifest->size()};
}

}  // namespace

Result<HostPublication> CreateHostPublication(protocol::PublishBegin plan,
                                              const std::string& cache_name,
                                              uint64_t memory_budget) {
  HostPublication pub;
  pub.plan = std::move(plan);
  // Only tensors with bytes of their own are planned; an alias takes its target's placement.
  const size_t n = pub.plan.tensors.size();
  std::vector<uint64_t> sizes;
  std::vector<size_t> owner(n);  // plan index → index into sizes
  std::map<std::string_view, size_t> own;
  for (size_t i = 0; i < n; ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    if (!t.alias_of.empty()) continue;
    owner[i] = sizes.size();
    own.emplace(t.name, sizes.size());
    sizes.push_back(t.nbytes);
    pub.tensor_bytes += t.nbytes;
  }
  for (size_t i = 0; i < n; ++i) {
    const protocol::PlannedTensor& t = pub.plan.tensors[i];
    if (t.alias_of.empty()) continue;
    auto target = own.find(t.alias_of);
    if (target == own.end()) {  // ValidatePublishPlan refuses this first
      return InvalidArgument("publish plan: tensor '" + t.name.substr(0, 256) +
                             "': alias_of names no tensor with bytes of its own");
    }
    owner[i] = target->second;
  }
  checkpoint::ArenaPlan planned =
      checkpoint::PlanArena(sizes, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  pub.layout.allocation_bytes = std::move(planned.allocation_bytes);
  pub.layout.total_bytes = planned.total_bytes;
  pub.layout.placements.reserve(n);
  for (size_t i = 0; i < n; ++i) pub.layout.placements.push_back(planned.placements[owner[i]]);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckMemoryBudget(Tier::kHost, pub.layout.total_bytes,
                                                pub.layout.allocation_bytes.size(), memory_budget));
  WEIGHTCACHE_ASSIGN_OR_RETURN(pub.memfds, CreateHostMemfds(cache_name, pub.layout));
  WEIGHTCACHE_ASSIGN_OR_RETURN(pub.arena_manifest,
                               PublicationManifest(pub, {}, "weightcache-publish-manifest"));
  return pub;
}

Result<WeightStore> CommitHostPublication(HostPublication pub,
                                          std::span<const uint64_t> checksums) {
  const size_t n = pub.plan.tensors.size();
  if (checksums.size() != n) {
    return InvalidArgument("PublishCommit: " + std::to_string(checksums.size()) +
                           " checksums for a plan of " + std::to_string(n) + " tensors");
  }
  // Sealed first: from here on nobody, the publisher included, can change a byte, so the
  // checksums below are of what every client will map.
  for (size_t a = 0; a < pub.memfds.size(); ++a) {
    Status sealed = os::SealReadOnly(pub.memfds[a].get());
    if (!sealed.ok()) {
      return sealed.Context("publish commit: sealing allocation " + std::to_string(a) +
                            " (the publisher must unmap the arena before PublishCommit)");
    }
    auto size = os::FileSize(pub.memfds[a].get());
    if (!size.ok()) return size.status().Context("allocation " + std::to_string(a));
    if (*size != pub.layout.allocation_bytes[a]) {
      return InvalidArgument("publish commit: allocation " + std::to_string(a) + " is " +
                             std::to_string(*size) + " bytes, the arena planned " +
                             std::to_string(pub.layout.allocation_bytes[a]) +
                             " (resized by the publisher)");
    }
  }
  {
    std::vector<os::MappedRegion> regions;
    regions.reserve(pub.memfds.size());
    for (size_t a = 0; a < pub.memfds.size(); ++a) {
      auto region = os::MapReadOnly(pub.memfds[a].get(), pub.layout.allocation_bytes[a]);
      if (!region.ok()) return region.status().Context("allocation " + std::to_string(a));
      regions.push_back(std::move(region).value());
    }
    for (size_t i = 0; i < n; ++i) {
      const checkpoint::TensorPlacement& place = pub.layout.placements[i];
      const auto* base = static_cast<const uint8_t*>(regions[place.allocation].data());
      const uint64_t actual = TensorChecksum(base + place.offset, place.bytes);
      if (actual != checksums[i]) {
        return InvalidArgument(
            "publish commit refused: tensor '" + pub.plan.tensors[i].name.substr(0, 256) +
            "' (plan index " + std::to_string(i) + "): the publisher's checksum " +
            std::to_string(checksums[i]) + " but the arena holds " + std::to_string(actual));
      }
    }
  }  // the daemon's read-only mappings go here: it serves the fds, never maps them
  StoreSummary summary;
  WEIGHTCACHE_ASSIGN_OR_RETURN(summary.manifest,
                               PublicationManifest(pub, checksums, "weightcache-manifest"));
  summary.tensor_count = n;
  summary.tensor_bytes = pub.tensor_bytes;
  summary.resident_bytes = pub.layout.total_bytes;
  return WeightStore(Tier::kHost, std::move(pub.memfds), std::move(summary));
}

}  // namespace weightcache::daemon
