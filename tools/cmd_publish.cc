// `weightcache publish`: publish the tensors of a safetensors checkpoint into a daemon started
// with `serve --source published:<tag>` (docs/publish.md), through weightcache::Publisher, the
// engine's own API. For operators (seeding a published cache from a file) and tests.
//
// Exit codes: 0 published; 2 usage; 3 no daemon; 4 config mismatch; 5 invalid checkpoint;
// 7 the cache is ready already (the daemon runs without --replace); 8 over --memory-budget;
// 1 otherwise (another publisher at work, a checksum refused at commit, I/O).
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/dtype.h"
#include "cli_common.h"
#include "identity_flags.h"
#include "os/strided_read.h"
#include "weightcache/publisher.h"

namespace weightcache::cli {
namespace {

struct PublishArgs {
  IdentityOptions identity;
  std::string file;
  std::string metadata;
  double timeout_s = 60;
};

int Run(PublishArgs& args) {
  constexpr std::string_view kCmd = "publish";
  auto ckpt = checkpoint::Checkpoint::Open(args.file);
  if (!ckpt.ok()) return Fail(kCmd, ckpt.status());
  std::vector<PublishTensor> plan;
  plan.reserve(ckpt->tensors().size());
  for (const checkpoint::TensorInfo& t : ckpt->tensors()) {
    plan.push_back({t.name, std::string(checkpoint::DTypeName(t.dtype)), t.shape, t.nbytes});
  }
  PublishOptions options;
  options.identity = args.identity;
  options.metadata = args.metadata;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  auto publisher = Publisher::Begin(options, plan);
  if (!publisher.ok()) return Fail(kCmd, publisher.status());
  for (size_t i = 0; i < plan.size(); ++i) {
    const checkpoint::TensorInfo& t = ckpt->tensors()[i];
    const std::span<uint8_t> dest = publisher->Data(i);
    const checkpoint::ShardInfo& shard = ckpt->shards()[t.shard];
    Status read =
        os::PreadExact(ckpt->shard_fd(t.shard), shard.path, t.offset, t.nbytes, dest.data());
    if (!read.ok()) return Fail(kCmd, read.Context("tensor " + t.name));
  }
  Status committed = publisher->Commit();
  if (!committed.ok()) return Fail(kCmd, committed);
  std::cout << "published " << plan.size() << " tensors from " << args.file << " to daemon pid "
            << publisher->daemon_pid() << " (" << args.identity.source << ")\n";
  return kExitOk;
}

}  // namespace

void RegisterPublishCommand(CLI::App& root) {
  auto args = std::make_shared<PublishArgs>();
  CLI::App* sub =
      root.add_subcommand("publish",
                          "Publish the tensors of a safetensors file into a daemon started with "
                          "`serve --source published:<tag>`");
  AddIdentityFlags(sub, &args->identity, IdentityScope::kOneCache);
  sub->add_option("file", args->file, "the .safetensors file (or checkpoint dir) to publish")
      ->required();
  sub->add_option("--metadata", args->metadata, "free-form metadata kept with the cache (64 KiB)");
  sub->add_option("--timeout", args->timeout_s,
                  "seconds for the daemon's answers, the commit's checksum pass included "
                  "(default 60)")
      ->check(Positive());
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
