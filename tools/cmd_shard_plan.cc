// `weightcache shard-plan --model DIR [--shard-rules NAME|FILE] [--tp-size N --tp-rank R
// --pp-size N --pp-rank R --ep-size N --ep-rank R] [--json]`: which slice of each tensor one
// rank of a TP x PP x EP job holds (docs/sharding.md). `--list-rules` lists the built-in
// rule sets, `--print-rules NAME` prints one. Exit 2 for a missing, unreadable or bad rules
// file, an unknown rule set or a bad rank set (the exit code comes from the status code,
// weightcache::kStatusCodeTable: kInvalidArgument), 5 for a checkpoint the rules cannot shard.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "cli_common.h"
#include "common/terminal_text.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/rules.h"

namespace weightcache::cli {
namespace {

namespace sh = weightcache::sharding;
using OrderedJson = nlohmann::ordered_json;

struct ShardPlanArgs {
  std::string model;
  std::string rules;
  sh::Ranks ranks;
  bool json = false;
  bool list_rules = false;
  std::string print_rules;
};

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string_view SourceName(sh::RuleSource source) {
  return source == sh::RuleSource::kBuiltin ? "builtin" : "file";
}

OrderedJson ToJson(const sh::ShardPlan& plan, const sh::RuleSet& rules,
                   const sh::ModelConfig& config, const sh::Ranks& r) {
  OrderedJson out;
  out["model_type"] = config.model_type;
  out["rules"] = {{"name", rules.name},
                  {"source", std::string(SourceName(rules.source))},
                  {"digest", rules.digest}};
  out["tp_size"] = r.tp_size;
  out["tp_rank"] = r.tp_rank;
  out["pp_size"] = r.pp_size;
  out["pp_rank"] = r.pp_rank;
  out["ep_size"] = r.ep_size;
  out["ep_rank"] = r.ep_rank;
  OrderedJson tensors = OrderedJson::array();
  for (const sh::PlannedTensor& p : plan.tensors) {
    OrderedJson t;
    t["name"] = p.tensor->name;
    t["dtype"] = std::string(checkpoint::DTypeName(p.tensor->dtype));
    t["full_shape"] = p.tensor->shape;
    t["shape"] = p.shape;
    if (p.slice) {
      t["slice"] = {
          {"dim", p.slice->dim}, {"offset", p.slice->offset}, {"length", p.slice->length}};
    } else {
      t["slice"] = nullptr;
    }
    t["rule"] = p.rule;
    t["mode"] = std::string(sh::ModeName(p.mode));
    tensors.push_back(std::move(t));
  }
  out["tensors"] = std::move(tensors);
  out["bytes"] = plan.bytes;
  out["full_bytes"] = plan.full_bytes;
  return out;
}

// Names come from the file: escaped (common/terminal_text.h).
void PrintTable(const sh::ShardPlan& plan, const sh::RuleSet& rules, const sh::ModelConfig& config,
                const sh::Ranks& r) {
  std::cout << "model_type:  " << EscapeForTerminal(config.model_type) << "\n";
  std::cout << "rules:       " << EscapeForTerminal(rules.name) << " (" << SourceName(rules.source)
            << ", digest " << rules.digest << ")\n";
  std::cout << "rank:        tp " << r.tp_rank << "/" << r.tp_size << ", pp " << r.pp_rank << "/"
            << r.pp_size << ", ep " << r.ep_rank << "/" << r.ep_size << "\n";
  std::cout << "holds:       " << plan.tensors.size() << " tensors, " << plan.bytes << " of "
            << plan.full_bytes << " bytes\n\n";
  std::vector<std::string> names;
  names.reserve(plan.tensors.size());
  size_t width = 4;
  for (const sh::PlannedTensor& p : plan.tensors) {
    names.push_back(EscapeForTerminal(p.tensor->name));
    width = std::max(width, names.back().size());
  }
  std::printf("%-*s  %-8s  %-20s  %-20s  %-18s  %4s  %-9s  %12s\n", static_cast<int>(width), "NAME",
              "DTYPE", "FULL SHAPE", "SHAPE", "SLICE dim:off+len", "RULE", "MODE", "BYTES");
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const sh::PlannedTensor& p = plan.tensors[i];
    const std::string slice = p.slice ? std::to_string(p.slice->dim) + ":" +
                                            std::to_string(p.slice->offset) + "+" +
                                            std::to_string(p.slice->length)
                                      : "whole";
    std::printf("%-*s  %-8s  %-20s  %-20s  %-18s  %4zu  %-9s  %12llu\n", static_cast<int>(width),
                names[i].c_str(), std::string(checkpoint::DTypeName(p.tensor->dtype)).c_str(),
                ShapeString(p.tensor->shape).c_str(), ShapeString(p.shape).c_str(), slice.c_str(),
                p.rule, std::string(sh::ModeName(p.mode)).c_str(),
                static_cast<unsigned long long>(p.bytes));
  }
  std::fflush(stdout);
}

int RunShardPlan(const ShardPlanArgs& args) {
  constexpr std::string_view kCommand = "shard-plan";
  if (args.list_rules) {
    for (std::string_view name : sh::BuiltinRuleSetNames()) std::cout << name << "\n";
    return kExitOk;
  }
  if (!args.print_rules.empty()) {
    Result<std::string_view> text = sh::BuiltinRuleSetText(args.print_rules);
    if (!text.ok()) return Fail(kCommand, text.status());
    std::cout << *text;
    return kExitOk;
  }
  if (args.model.empty()) {
    return Fail(kCommand, InvalidArgument("--model is required (or --list-rules / --print-rules)"));
  }
  if (Status s = sh::ValidateRanks(args.ranks); !s.ok()) return Fail(kCommand, s);
  Result<checkpoint::Checkpoint> ckpt = checkpoint::Checkpoint::Open(args.model);
  if (!ckpt.ok()) return Fail(kCommand, ckpt.status());
  Result<sh::ModelConfig> config = sh::ReadModelConfig(args.model);
  if (!config.ok()) return Fail(kCommand, config.status());
  Result<sh::RuleSet> rules = sh::SelectRuleSet(args.rules, config->model_type);
  if (!rules.ok()) return Fail(kCommand, rules.status());
  Result<sh::ShardPlan> plan = sh::PlanShard(*ckpt, *rules, *config, args.ranks);
  if (!plan.ok()) return Fail(kCommand, plan.status());
  if (args.json) {
    std::cout << ToJson(*plan, *rules, *config, args.ranks).dump() << std::endl;
  } else {
    PrintTable(*plan, *rules, *config, args.ranks);
  }
  return kExitOk;
}

}  // namespace

void RegisterShardPlanCommand(CLI::App& root) {
  auto args = std::make_shared<ShardPlanArgs>();
  CLI::App* sub = root.add_subcommand(
      "shard-plan",
      "Show which slice of each checkpoint tensor one rank of a TP x PP x EP job holds.\n"
      "Rules (docs/sharding.md): an ordered list, first match wins, chosen from config.json's\n"
      "model_type or --shard-rules. Modes: split, replicate, vocab, kv_heads, expert, skip.\n"
      "Exit 2: a missing, unreadable or bad rules file, or bad ranks; 5: a checkpoint the rules\n"
      "cannot shard.");
  sub->add_option("--model", args->model,
                  "checkpoint directory (with config.json) or .safetensors file");
  sub->add_option("--shard-rules", args->rules,
                  "a built-in rule set name (see --list-rules; `replicate`: every tensor "
                  "whole on every rank) or a rules JSON file; default: config.json's "
                  "model_type");
  sub->add_option("--tp-size", args->ranks.tp_size, "tensor-parallel size")->default_val(1);
  sub->add_option("--tp-rank", args->ranks.tp_rank, "tensor-parallel rank")->default_val(0);
  sub->add_option("--pp-size", args->ranks.pp_size, "pipeline-parallel size")->default_val(1);
  sub->add_option("--pp-rank", args->ranks.pp_rank, "pipeline stage")->default_val(0);
  sub->add_option("--ep-size", args->ranks.ep_size,
                  "expert-parallel size (ep <= tp: SGLang's moe_tp = tp/ep; ep > tp: vLLM's "
                  "EP over TP x DP)")
      ->default_val(1);
  sub->add_option("--ep-rank", args->ranks.ep_rank, "expert-parallel rank")->default_val(0);
  sub->add_flag("--json", args->json, "print one JSON object instead of a table");
  sub->add_flag("--list-rules", args->list_rules, "list the built-in rule sets and exit");
  sub->add_option("--print-rules", args->print_rules,
                  "print a built-in rule set's JSON (to copy and edit) and exit");
  SetAction(sub, [args] { return RunShardPlan(*args); });
}

}  // namespace weightcache::cli
