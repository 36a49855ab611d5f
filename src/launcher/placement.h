// Placement of one TP×PP job's daemons on this node: which (tp_rank, pp_rank) pairs this node
// runs and on which of its visible GPUs, computed the way SGLang's launcher places its
// scheduler processes, so that a daemon lands on exactly the GPU its engine rank will use.
//
//   pp_per_node     = max(pp / nnodes, 1)        PP stages held whole by one node
//   nnodes_per_pp   = max(nnodes / pp, 1)        nodes one PP stage spans
//   tp_per_node     = tp / nnodes_per_pp         TP ranks of one stage on one node
//   pp ranks here   = [pp_per_node * (node_rank / nnodes_per_pp), ... + pp_per_node)
//   tp ranks here   = [tp_per_node * (node_rank % nnodes_per_pp), ... + tp_per_node)
//   local GPU id    = base + ((pp_rank % pp_per_node) * tp_per_node + tp_rank % tp_per_node) * step
//
// The local GPU id is an index into the devices this process can see (CUDA_VISIBLE_DEVICES
// applied); PlanLaunch resolves it to that device's UUID, the only device key paths use.
// Worked tables: docs/launcher.md.
//
// Contract: pure functions, no I/O, thread-safe. Every error is kInvalidArgument and names
// the offending values.
#pragma once

#include <string>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::launcher {

struct LaunchTopology {
  int tp_size = 1;
  int pp_size = 1;
  // Expert parallelism inside the TP group (SGLang's MoE EP): ep_rank = tp_rank / (tp / ep).
  int ep_size = 1;
  int nnodes = 1;
  int node_rank = 0;
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  // The devices this process can see, by local index (CUDA_VISIBLE_DEVICES applied).
  std::vector<std::string> visible_device_uuids;
  // The host tier's daemons of an engine that runs on CPUs (`launch --no-gpu`): no daemon
  // holds a GPU, so each cache sits where a client without a device looks for it (the engine
  // plugins on CPU, docs/engines.md). base_gpu_id, gpu_id_step and the devices are unused.
  bool without_gpus = false;
};

struct DaemonPlacement {
  int tp_rank = 0;
  int pp_rank = 0;
  int ep_rank = 0;
  int local_gpu_id = 0;     // index into LaunchTopology::visible_device_uuids; -1: no GPU
  std::string device_uuid;  // visible_device_uuids[local_gpu_id]; "" with no GPU

  bool operator==(const DaemonPlacement&) const = default;
  // "gpu3" or "no gpu", for a log line or a progress line.
  std::string GpuLabel() const;
};

// The rank ranges this node runs (SGLang's _calculate_rank_ranges).
struct NodeRankRanges {
  int pp_begin = 0, pp_end = 0;  // [begin, end)
  int tp_begin = 0, tp_end = 0;
  int pp_per_node = 1;
  int tp_per_node = 1;
};

// Validates sizes and node layout: every size >= 1, 0 <= node_rank < nnodes, and either
// whole PP stages per node (pp % nnodes == 0) or whole nodes per stage (nnodes % pp == 0 and
// tp % (nnodes / pp) == 0).
Result<NodeRankRanges> ComputeNodeRankRanges(const LaunchTopology& topology);

// The daemons this node runs, ordered by (pp_rank, tp_rank), each with its local GPU id and
// that GPU's UUID. Fails if the layout is invalid, if base/step are negative or step is 0, if
// a GPU id lands beyond the visible devices (naming the id, the rank and the count), or if
// two ranks would share one GPU.
Result<std::vector<DaemonPlacement>> PlanLaunch(const LaunchTopology& topology);

}  // namespace weightcache::launcher
