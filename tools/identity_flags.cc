#include "identity_flags.h"

#include <string>

namespace weightcache::cli {

void AddIdentityFlags(CLI::App* sub, AttachOptions* o, IdentityScope scope) {
  const bool one = scope == IdentityScope::kOneCache;
  sub->add_option("--model", o->model_dir, "checkpoint dir or .safetensors file")->required();
  sub->add_option("--model-id", o->model_id, "model id (default: the model dir's basename)");
  sub->add_option("--revision", o->revision, "model revision");
  sub->add_option("--dtype", o->dtype, "dtype (default: as stored)");
  sub->add_option("--quantization", o->quantization, "quantization method");
  sub->add_option("--quantization-config", o->quantization_config,
                  "JSON file of the quantization method");
  sub->add_option(one ? "--tp-size" : "--tp,--tp-size", o->tp_size, "tensor-parallel size")
      ->check(CLI::PositiveNumber);
  sub->add_option(one ? "--pp-size" : "--pp,--pp-size", o->pp_size, "pipeline-parallel size")
      ->check(CLI::PositiveNumber);
  sub->add_option("--ep-size", o->ep_size, "expert-parallel size")->check(CLI::PositiveNumber);
  sub->add_option("--dp-size", o->dp_size, "data-parallel size (no rank: replicas share weights)")
      ->check(CLI::PositiveNumber);
  if (one) {
    sub->add_option("--tp-rank", o->tp_rank, "this process's tensor-parallel rank")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--pp-rank", o->pp_rank, "this process's pipeline-parallel rank")
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--ep-rank", o->ep_rank, "this process's expert-parallel rank")
        ->check(CLI::NonNegativeNumber);
  }
  sub->add_option("--layout-tag", o->layout_tag, "arena layout tag");
  sub->add_option("--source", o->source, "disk or published:<producer tag>");
  // By name only: a transformer onto the enum would also accept its integer values ("1").
  sub->add_option_function<std::string>(
         "--tier",
         [o](const std::string& tier) { o->tier = tier == "host" ? Tier::kHost : Tier::kGpu; },
         "gpu (VMM arena on a GPU) or host (sealed memfds); default gpu")
      ->check(CLI::IsMember({"gpu", "host"}));
  if (one) {
    sub->add_option("--device", o->device,
                    "local index into the visible devices, or a GPU UUID (prefix)");
  }
  sub->add_option("--namespace", o->namespace_name, "cache namespace (default: default)");
  sub->add_option("--runtime-dir", o->runtime_dir,
                  "runtime dir (default: $WEIGHTCACHE_RUNTIME_DIR, $XDG_RUNTIME_DIR/weightcache, "
                  "/tmp/weightcache-<uid>)");
  if (one) sub->add_option("--socket", o->socket, "explicit socket path or template");
  sub->add_option("--device-inventory", o->device_inventory,
                  "JSON device inventory standing in for CUDA enumeration");
}

}  // namespace weightcache::cli
