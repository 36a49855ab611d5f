#include "identity_flags.h"

#include <string>
#include <variant>

#include "flag_checks.h"

namespace weightcache::cli {
namespace {

// What a flag's value is, and the check CLI11 makes on it.
enum class Check { kNone, kRequired, kPositive, kNonNegative };

struct IdentityFlag {
  const char* name;       // the kOneCache spelling, which ServeArgsFor writes
  const char* job_names;  // the kJob spelling when it differs ("--tp,--tp-size"), else nullptr
  bool per_daemon;        // kOneCache only: launch sets it per daemon, never from the job
  std::variant<std::string IdentityOptions::*, int IdentityOptions::*, Tier IdentityOptions::*>
      field;
  Check check;
  const char* help;
};

// Every identity flag, once. Order = registration order = forwarding order.
const IdentityFlag kIdentityFlags[] = {
    // Not required by CLI11: a published source (--source published:<tag>) has no checkpoint;
    // ResolveIdentity asks for it otherwise.
    {"--model", nullptr, false, &IdentityOptions::model_dir, Check::kNone,
     "checkpoint dir or .safetensors file (not for --source published:<tag>)"},
    {"--model-id", nullptr, false, &IdentityOptions::model_id, Check::kNone,
     "model id (default: the model dir's basename)"},
    {"--revision", nullptr, false, &IdentityOptions::revision, Check::kNone, "model revision"},
    {"--dtype", nullptr, false, &IdentityOptions::dtype, Check::kNone,
     "dtype (default: as stored)"},
    {"--quantization", nullptr, false, &IdentityOptions::quantization, Check::kNone,
     "quantization method"},
    {"--quantization-config", nullptr, false, &IdentityOptions::quantization_config, Check::kNone,
     "JSON file of the quantization method"},
    {"--tp-size", "--tp,--tp-size", false, &IdentityOptions::tp_size, Check::kPositive,
     "tensor-parallel size"},
    {"--pp-size", "--pp,--pp-size", false, &IdentityOptions::pp_size, Check::kPositive,
     "pipeline-parallel size"},
    {"--ep-size", nullptr, false, &IdentityOptions::ep_size, Check::kPositive,
     "expert-parallel size"},
    {"--dp-size", nullptr, false, &IdentityOptions::dp_size, Check::kPositive,
     "data-parallel size (no rank: replicas share weights)"},
    {"--tp-rank", nullptr, true, &IdentityOptions::tp_rank, Check::kNonNegative,
     "this process's tensor-parallel rank"},
    {"--pp-rank", nullptr, true, &IdentityOptions::pp_rank, Check::kNonNegative,
     "this process's pipeline-parallel rank"},
    {"--ep-rank", nullptr, true, &IdentityOptions::ep_rank, Check::kNonNegative,
     "this process's expert-parallel rank"},
    {"--shard-rules", nullptr, false, &IdentityOptions::shard_rules, Check::kNone,
     "sharding rules: a built-in set's name or a rules file (default: config.json's "
     "model_type; `replicate` holds every tensor whole on every rank; see shard-plan "
     "--list-rules)"},
    {"--layout-tag", nullptr, false, &IdentityOptions::layout_tag, Check::kNone,
     "arena layout tag"},
    {"--source", nullptr, false, &IdentityOptions::source, Check::kNone,
     "disk or published:<producer tag>"},
    {"--tier", nullptr, false, &IdentityOptions::tier, Check::kNone,
     "gpu (VMM arena on a GPU) or host (sealed memfds); default gpu"},
    {"--device", nullptr, true, &IdentityOptions::device, Check::kNone,
     "local index into the visible devices, or a GPU UUID (prefix)"},
    {"--namespace", nullptr, false, &IdentityOptions::namespace_name, Check::kNone,
     "cache namespace (default: default)"},
    {"--runtime-dir", nullptr, false, &IdentityOptions::runtime_dir, Check::kNone,
     "runtime dir (default: $WEIGHTCACHE_RUNTIME_DIR, $XDG_RUNTIME_DIR/weightcache, "
     "/tmp/weightcache-<uid>)"},
    {"--socket", nullptr, true, &IdentityOptions::socket, Check::kNone,
     "explicit socket path or template"},
    {"--device-inventory", nullptr, false, &IdentityOptions::device_inventory, Check::kNone,
     "JSON device inventory standing in for CUDA enumeration"},
};

CLI::Option* Register(CLI::App* sub, const IdentityFlag& f, const std::string& names,
                      IdentityOptions* o) {
  struct Visitor {
    CLI::App* sub;
    const std::string& names;
    const char* help;
    IdentityOptions* o;
    CLI::Option* operator()(std::string IdentityOptions::*m) const {
      return sub->add_option(names, o->*m, help);
    }
    CLI::Option* operator()(int IdentityOptions::*m) const {
      return sub->add_option(names, o->*m, help);
    }
    CLI::Option* operator()(Tier IdentityOptions::*m) const {
      // By name only: a transformer onto the enum would also accept its integer values ("1").
      return sub
          ->add_option_function<std::string>(
              names, [o = o, m](const std::string& tier) { o->*m = ParseTier(tier).value(); }, help)
          ->check(CLI::IsMember(
              {std::string(TierName(Tier::kGpu)), std::string(TierName(Tier::kHost))}));
    }
  };
  CLI::Option* opt = std::visit(Visitor{sub, names, f.help, o}, f.field);
  switch (f.check) {
    case Check::kNone:
      break;
    case Check::kRequired:
      opt->required();
      break;
    case Check::kPositive:
      opt->check(AtLeast(1));
      break;
    case Check::kNonNegative:
      opt->check(AtLeast(0));
      break;
  }
  return opt;
}

}  // namespace

void AddIdentityFlags(CLI::App* sub, IdentityOptions* o, IdentityScope scope) {
  const bool job = scope == IdentityScope::kJob;
  for (const IdentityFlag& f : kIdentityFlags) {
    if (job && f.per_daemon) continue;
    Register(sub, f, job && f.job_names != nullptr ? f.job_names : f.name, o);
  }
}

std::vector<std::string> ServeArgsFor(const IdentityOptions& options) {
  static const IdentityOptions kDefaults;
  std::vector<std::string> args;
  for (const IdentityFlag& f : kIdentityFlags) {
    std::visit(
        [&](auto IdentityOptions::*m) {
          using T = std::remove_cvref_t<decltype(options.*m)>;
          if constexpr (std::is_same_v<T, std::string>) {
            if (options.*m == kDefaults.*m) return;
            args.insert(args.end(), {f.name, options.*m});
          } else if constexpr (std::is_same_v<T, int>) {
            args.insert(args.end(), {f.name, std::to_string(options.*m)});
          } else {
            args.insert(args.end(), {f.name, std::string(TierName(options.*m))});
          }
        },
        f.field);
  }
  return args;
}

}  // namespace weightcache::cli
