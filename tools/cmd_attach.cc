// `weightcache attach`: connect exactly as an engine's client would (the same library call,
// weightcache::Attachment::Attach) and print what it got: source, socket, device, tensors,
// bytes, attach time, and with --verify every tensor's checksum recomputed over the mapped
// memory against the daemon's record. Exit codes (docs/design.md "Exit codes"): 3 no daemon with
// --on-missing error, 4 config mismatch (the fields on stderr), 6 still loading or not
// answering at the --wait deadline with --on-missing error, a failed daemon's own code with
// --on-missing error (5 invalid checkpoint, 8 memory budget, …), 1 a verification failure
// (the tensors on stderr).
//
// --hold keeps the attachment open after the summary until stdin closes: each line read
// re-verifies the mapped memory, and "daemon-gone" is printed when the daemon goes away. Tests
// use it to prove that mappings survive the daemon; operators to pin a cache while debugging.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_common.h"
#include "client/verify.h"
#include "identity_flags.h"
#include "weightcache/client.h"

namespace weightcache::cli {
namespace {

struct AttachArgs {
  AttachOptions options;
  std::string on_missing = "fallback";
  std::string on_mismatch = "error";
  double wait_seconds = 60;
  bool verify = false;
  bool json = false;
  bool hold = false;
  int threads = 8;
};

nlohmann::json VerifyJson(const client::VerifyReport& r) {
  nlohmann::json problems = nlohmann::json::array();
  for (const auto& p : r.problems) problems.push_back({{"tensor", p.name}, {"problem", p.what}});
  return {{"ok", r.ok()},
          {"tensors", r.tensors_checked},
          {"bytes", r.bytes_checked},
          {"seconds", r.seconds},
          {"problems", problems}};
}

void PrintProblems(const client::VerifyReport& r) {
  for (const auto& p : r.problems) {
    std::cerr << "weightcache attach: verify: " << p.name << ": " << p.what << "\n";
  }
}

int Run(AttachArgs& args) {
  args.options.on_missing = args.on_missing == "error" ? OnMissing::kError : OnMissing::kFallback;
  args.options.on_mismatch =
      args.on_mismatch == "fallback" ? OnMismatch::kFallback : OnMismatch::kError;
  args.options.wait_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(args.wait_seconds * 1000));
  args.options.fallback_threads = args.threads;

  auto attached = Attachment::Attach(args.options);
  if (!attached.ok()) return Fail("attach", attached.status());
  const Attachment& a = *attached;

  std::optional<client::VerifyReport> report;
  if (args.verify) {
    auto r = client::VerifyChecksums(a, args.threads);
    if (!r.ok()) return Fail("attach", r.status().Context("verify"));
    report = std::move(r).value();
  }

  if (args.json) {
    nlohmann::json out = {{"source", AttachSourceName(a.source())},
                          {"reason", a.source_reason()},
                          {"socket", a.socket_path()},
                          {"device", a.device_key()},
                          {"tier", TierName(a.tier())},
                          {"daemon_pid", a.daemon_pid()},
                          {"config_digest", a.config_digest()},
                          {"tensors", a.tensors().size()},
                          {"bytes", a.total_bytes()},
                          {"attach_ms", a.attach_ms()},
                          {"timings",
                           {{"resolve_ms", a.timings().resolve_ms},
                            {"discover_ms", a.timings().discover_ms},
                            {"map_ms", a.timings().map_ms},
                            {"table_ms", a.timings().table_ms},
                            {"table_concurrent", a.timings().table_concurrent},
                            {"fallback_ms", a.timings().fallback_ms}}}};
    if (report) out["verify"] = VerifyJson(*report);
    std::cout << out.dump() << std::endl;
  } else {
    std::printf("source:     %s (%s)\n", std::string(AttachSourceName(a.source())).c_str(),
                a.source_reason().c_str());
    std::printf("socket:     %s\n", a.socket_path().c_str());
    std::printf("device:     %s\n", a.device_key().c_str());
    std::printf("tier:       %s\n", std::string(TierName(a.tier())).c_str());
    std::printf("config:     %s\n", a.config_digest().c_str());
    std::printf("tensors:    %zu\n", a.tensors().size());
    std::printf("bytes:      %llu\n", static_cast<unsigned long long>(a.total_bytes()));
    std::printf("attach:     %.3f ms\n", a.attach_ms());
    if (report) {
      std::printf("verify:     %s (%zu tensors, %llu bytes, %.3f s)\n",
                  report->ok() ? "ok" : "FAILED", report->tensors_checked,
                  static_cast<unsigned long long>(report->bytes_checked), report->seconds);
    }
    std::fflush(stdout);
  }
  if (report && !report->ok()) {
    PrintProblems(*report);
    return kExitError;
  }

  if (args.hold) {
    attached->OnDaemonGone([] {
      std::printf("daemon-gone\n");
      std::fflush(stdout);
    });
    std::string line;
    while (std::getline(std::cin, line)) {
      auto r = client::VerifyChecksums(a, args.threads);
      if (!r.ok()) return Fail("attach", r.status().Context("verify"));
      std::printf("verify %s alive=%d\n", r->ok() ? "ok" : "FAILED", a.daemon_alive() ? 1 : 0);
      std::fflush(stdout);
      if (!r->ok()) PrintProblems(*r);
    }
  }
  return kExitOk;
}

}  // namespace

void RegisterAttachCommand(CLI::App& root) {
  auto args = std::make_shared<AttachArgs>();
  CLI::App* sub = root.add_subcommand(
      "attach", "Attach to the daemon of an identity as an engine would, and print a summary");
  AddIdentityFlags(sub, &args->options.identity, IdentityScope::kOneCache);
  sub->add_option(
         "--on-missing", args->on_missing,
         "no daemon for this identity (none, a stale socket, or one that went away during the "
         "attach): load from disk (fallback, logged) or exit 3 (error)")
      ->check(CLI::IsMember({"fallback", "error"}));
  sub->add_option("--on-mismatch", args->on_mismatch,
                  "a daemon holds a different config: exit 4 naming each field (error) or load "
                  "from disk (fallback)")
      ->check(CLI::IsMember({"error", "fallback"}));
  sub->add_option("--wait", args->wait_seconds,
                  "the attach's deadline in seconds: waiting for a loading daemon and every "
                  "exchange with a daemon (one that does not answer by then is absent)")
      ->check(AtLeast(0));
  sub->add_flag("--verify", args->verify,
                "recompute every tensor's checksum over the mapped memory and compare");
  sub->add_flag("--json", args->json, "print one JSON object");
  sub->add_flag("--hold", args->hold,
                "stay attached until stdin closes; each stdin line re-verifies");
  sub->add_option("--threads", args->threads, "threads for verify and fallback reads")
      ->check(InRange(1, 256));
  sub->add_option("--trust-uid", args->options.identity.trusted_uids,
                  "also use a daemon run by this uid, e.g. a service user's (repeatable; "
                  "default: WEIGHTCACHE_TRUSTED_UIDS, else our uid only)");
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
