// `weightcache upgrade`: hand a ready cache to a successor daemon, which may be a new binary,
// without moving a byte (docs/upgrade.md).
//
// The daemon named by the identity flags (or --socket PATH) gets an Upgrade request: it starts
// the successor (`--binary PATH`, default: its own executable path, which after a package
// upgrade is the new binary), hands it the arena fds, the manifest and the identity lock over a
// socketpair, and answers once the successor validated them and serves at the socket path.
// The old daemon then serves what waits in its backlog and exits; attached clients keep their
// mappings. Exit codes: 0 handed over; 3 no live daemon; 6 the successor did not take over in
// time; otherwise the successor's refusal (e.g. 4 a changed checkpoint, whose files are part of
// the identity; 1 a checksum the memory does not have) — the old daemon then serves on.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_common.h"
#include "identity/paths.h"
#include "identity/resolve.h"
#include "identity_flags.h"
#include "os/lock_file.h"
#include "protocol/connection.h"
#include "protocol/messages.h"

namespace weightcache::cli {
namespace {

struct UpgradeArgs {
  IdentityOptions identity;
  std::string binary;
  double timeout_s = 90;
  bool json = false;
};

int Run(UpgradeArgs& args) {
  constexpr std::string_view kCmd = "upgrade";
  std::string socket = args.identity.socket;
  if (!args.identity.model_dir.empty()) {
    auto id = identity::ResolveIdentity(args.identity);
    if (!id.ok()) return Fail(kCmd, id.status());
    socket = id->paths.socket;
  } else if (socket.empty() || socket.find('{') != std::string::npos) {
    return Fail(kCmd, InvalidArgument("give the identity flags (--model …) or --socket PATH"));
  }
  if (!args.binary.empty() && args.binary.front() != '/') {
    return Fail(kCmd, InvalidArgument("--binary " + args.binary + " must be an absolute path"));
  }
  if (!os::IsLockHeld(identity::LockPathFor(socket))) {
    return Fail(kCmd, Status(StatusCode::kNoDaemon, "no live daemon at " + socket));
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  auto conn = protocol::Connection::Connect(socket, timeout);
  if (!conn.ok()) return Fail(kCmd, conn.status().Context("connecting to " + socket));
  protocol::UpgradeRequest request;
  request.binary = args.binary;
  auto frame = protocol::EncodeUpgradeRequest(request);
  if (!frame.ok()) return Fail(kCmd, frame.status());
  auto reply =
      conn->Call(*frame, protocol::MessageType::kUpgradeReply, os::Deadline::After(timeout));
  if (!reply.ok()) return Fail(kCmd, reply.status().Context("upgrading " + socket));
  auto decoded = protocol::DecodeUpgradeReply(reply->payload);
  if (!decoded.ok()) return Fail(kCmd, decoded.status());
  if (args.json) {
    const nlohmann::json out = {{"socket", socket},
                                {"successor_pid", decoded->successor_pid},
                                {"handover_us", decoded->handover_us}};
    std::cout << out.dump() << std::endl;
  } else {
    std::cerr << "weightcache upgrade: " << socket << ": served by successor pid "
              << decoded->successor_pid << " (handover took " << decoded->handover_us / 1000.0
              << " ms); the old daemon exits once its backlog is served" << std::endl;
  }
  return kExitOk;
}

}  // namespace

void RegisterUpgradeCommand(CLI::App& root) {
  auto args = std::make_shared<UpgradeArgs>();
  CLI::App* sub = root.add_subcommand(
      "upgrade",
      "Hand a ready cache to a successor daemon (a new binary) without reloading: it validates "
      "the memory, takes the socket over, and the old daemon exits");
  AddIdentityFlags(sub, &args->identity, IdentityScope::kOneCache);
  sub->get_option("--model")->required(false);
  sub->add_option("--binary", args->binary,
                  "absolute path of the successor's weightcache binary (default: the daemon's "
                  "own executable path, i.e. the installed binary)");
  sub->add_option("--timeout", args->timeout_s,
                  "seconds to wait for the handover (default 90; the daemon's own "
                  "--upgrade-timeout bounds the successor's validation)")
      ->check(Positive());
  sub->add_flag("--json", args->json, "print {socket, successor_pid, handover_us} on stdout");
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
