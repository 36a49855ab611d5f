#include "launcher/placement.h"

#include <algorithm>
#include <set>
#include <string>

namespace weightcache::launcher {
namespace {

std::string Describe(const LaunchTopology& t) {
  return "tp=" + std::to_string(t.tp_size) + " pp=" + std::to_string(t.pp_size) +
         " nnodes=" + std::to_string(t.nnodes);
}

}  // namespace

Result<NodeRankRanges> ComputeNodeRankRanges(const LaunchTopology& t) {
  if (t.tp_size < 1 || t.pp_size < 1 || t.nnodes < 1 || t.ep_size < 1) {
    return InvalidArgument("parallel sizes must be >= 1 (" + Describe(t) +
                           " ep=" + std::to_string(t.ep_size) + ")");
  }
  if (t.node_rank < 0 || t.node_rank >= t.nnodes) {
    return InvalidArgument("node_rank " + std::to_string(t.node_rank) +
                           " is out of range: nnodes is " + std::to_string(t.nnodes));
  }
  if (t.tp_size % t.ep_size != 0) {
    return InvalidArgument("ep size " + std::to_string(t.ep_size) + " does not divide tp size " +
                           std::to_string(t.tp_size));
  }
  // Either each node holds whole PP stages, or each stage spans whole nodes with its TP group
  // split evenly across them; anything else would put part of a TP group's ranks on a node
  // with a different stage, which no engine does.
  if (t.pp_size >= t.nnodes) {
    if (t.pp_size % t.nnodes != 0) {
      return InvalidArgument("pp size is not divisible across nodes (" + Describe(t) +
                             "): each node must hold whole pipeline stages");
    }
  } else {
    if (t.nnodes % t.pp_size != 0) {
      return InvalidArgument("nnodes is not a multiple of pp size (" + Describe(t) +
                             "): each pipeline stage must span whole nodes");
    }
    const int nodes_per_stage = t.nnodes / t.pp_size;
    if (t.tp_size % nodes_per_stage != 0) {
      return InvalidArgument("tp size is not divisible across nodes (" + Describe(t) +
                             "): one stage spans " + std::to_string(nodes_per_stage) +
                             " nodes, which must split its " + std::to_string(t.tp_size) +
                             " TP ranks evenly");
    }
  }
  NodeRankRanges r;
  r.pp_per_node = std::max(t.pp_size / t.nnodes, 1);
  const int nnodes_per_pp = std::max(t.nnodes / t.pp_size, 1);
  r.tp_per_node = t.tp_size / nnodes_per_pp;
  r.pp_begin = r.pp_per_node * (t.node_rank / nnodes_per_pp);
  r.pp_end = r.pp_begin + r.pp_per_node;
  r.tp_begin = r.tp_per_node * (t.node_rank % nnodes_per_pp);
  r.tp_end = r.tp_begin + r.tp_per_node;
  return r;
}

Result<std::vector<DaemonPlacement>> PlanLaunch(const LaunchTopology& t) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(NodeRankRanges ranges, ComputeNodeRankRanges(t));
  if (t.base_gpu_id < 0) {
    return InvalidArgument("base GPU id must be >= 0, got " + std::to_string(t.base_gpu_id));
  }
  if (t.gpu_id_step < 1) {
    return InvalidArgument("GPU id step must be >= 1, got " + std::to_string(t.gpu_id_step));
  }
  const int visible = static_cast<int>(t.visible_device_uuids.size());
  const int tp_per_ep = t.tp_size / t.ep_size;
  std::vector<DaemonPlacement> plan;
  std::set<std::string> used_uuids;
  for (int pp = ranges.pp_begin; pp < ranges.pp_end; ++pp) {
    for (int tp = ranges.tp_begin; tp < ranges.tp_end; ++tp) {
      if (t.without_gpus) {
        plan.push_back({.tp_rank = tp,
                        .pp_rank = pp,
                        .ep_rank = tp / tp_per_ep,
                        .local_gpu_id = -1,
                        .device_uuid = ""});
        continue;
      }
      // 64-bit so that absurd flag values report as "beyond the visible devices", not wrap.
      const long long slot = static_cast<long long>(pp % ranges.pp_per_node) * ranges.tp_per_node +
                             tp % ranges.tp_per_node;
      const long long gpu = t.base_gpu_id + slot * t.gpu_id_step;
      if (gpu >= visible) {
        return InvalidArgument(
            "GPU id " + std::to_string(gpu) + " (tp_rank " + std::to_string(tp) + ", pp_rank " +
            std::to_string(pp) + ") is beyond the visible devices: " + std::to_string(visible) +
            " visible (check CUDA_VISIBLE_DEVICES, --base-gpu-id, --gpu-id-step)");
      }
      DaemonPlacement p;
      p.tp_rank = tp;
      p.pp_rank = pp;
      p.ep_rank = tp / tp_per_ep;
      p.local_gpu_id = static_cast<int>(gpu);
      p.device_uuid = t.visible_device_uuids[p.local_gpu_id];
      // Distinct ids can still name one physical GPU if the visible list repeats a device;
      // two daemons of one job on one GPU is never what the operator meant.
      if (!used_uuids.insert(p.device_uuid).second) {
        return InvalidArgument("GPU " + p.device_uuid + " (local id " + std::to_string(gpu) +
                               ") would serve two ranks of this job");
      }
      plan.push_back(std::move(p));
    }
  }
  return plan;
}

std::string DaemonPlacement::GpuLabel() const {
  return local_gpu_id < 0 ? "no gpu" : "gpu" + std::to_string(local_gpu_id);
}

}  // namespace weightcache::launcher
