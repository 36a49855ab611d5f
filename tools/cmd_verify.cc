// `weightcache verify`: attach to the daemon of an identity (never a fallback: there would be
// nothing to verify) and compare its memory with the checkpoint on disk — the same tensor
// names, dtypes, shapes and sizes, and for every tensor the checksum of the file bytes against
// the checksum of the mapped memory (host tier: CPU; gpu tier: the GPU kernel). Exit 0 when
// everything matches, 1 naming every differing tensor, or the attach exit codes (3, 4, 6).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint/checkpoint.h"
#include "cli_common.h"
#include "client/verify.h"
#include "identity_flags.h"
#include "weightcache/client.h"

namespace weightcache::cli {
namespace {

struct VerifyArgs {
  AttachOptions options;
  double wait_seconds = 60;
  bool json = false;
  int threads = 8;
};

int Run(VerifyArgs& args) {
  args.options.on_missing = OnMissing::kError;
  args.options.on_mismatch = OnMismatch::kError;
  args.options.wait_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(args.wait_seconds * 1000));
  auto attached = Attachment::Attach(args.options);
  if (!attached.ok()) return Fail("verify", attached.status());
  auto ckpt = checkpoint::Checkpoint::Open(args.options.identity.model_dir);
  if (!ckpt.ok()) return Fail("verify", ckpt.status());
  auto report = client::VerifyAgainstCheckpoint(*attached, *ckpt, args.threads);
  if (!report.ok()) return Fail("verify", report.status());

  if (args.json) {
    nlohmann::json problems = nlohmann::json::array();
    for (const auto& p : report->problems) {
      problems.push_back({{"tensor", p.name}, {"problem", p.what}});
    }
    std::cout << nlohmann::json{{"ok", report->ok()},
                                {"socket", attached->socket_path()},
                                {"device", attached->device_key()},
                                {"daemon_pid", attached->daemon_pid()},
                                {"tensors", report->tensors_checked},
                                {"bytes", report->bytes_checked},
                                {"seconds", report->seconds},
                                {"problems", problems}}
                     .dump()
              << std::endl;
  } else {
    std::printf("%s: %zu tensors, %llu bytes of daemon pid %d at %s vs %s (%.3f s)\n",
                report->ok() ? "ok" : "FAILED", report->tensors_checked,
                static_cast<unsigned long long>(report->bytes_checked), attached->daemon_pid(),
                attached->socket_path().c_str(), args.options.identity.model_dir.c_str(),
                report->seconds);
  }
  for (const auto& p : report->problems) {
    std::cerr << "weightcache verify: " << p.name << ": " << p.what << "\n";
  }
  return report->ok() ? kExitOk : kExitError;
}

}  // namespace

void RegisterVerifyCommand(CLI::App& root) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* sub =
      root.add_subcommand("verify", "Compare a daemon's memory with the checkpoint files on disk");
  AddIdentityFlags(sub, &args->options.identity, IdentityScope::kOneCache);
  sub->add_option("--wait", args->wait_seconds, "seconds to wait for a loading daemon")
      ->check(AtLeast(0));
  sub->add_flag("--json", args->json, "print one JSON object");
  sub->add_option("--threads", args->threads, "reader threads")->check(InRange(1, 256));
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
