#include "serve/detach.h"

#include <filesystem>
#include <system_error>
#include <utility>

#include "identity/paths.h"
#include "launcher/serve_daemons.h"
#include "os/lock_file.h"

namespace weightcache::serve {

Result<std::string> DetachedLogPath(const std::string& log_file,
                                    const identity::ResolvedIdentity& id) {
  if (!log_file.empty()) {
    std::error_code ec;
    std::filesystem::path path = std::filesystem::absolute(log_file, ec);
    if (ec) return IoError("--log-file " + log_file, ec.value());
    return path.string();
  }
  if (id.paths.namespace_dir.empty()) return id.paths.socket + ".log";
  const std::string dir = id.paths.namespace_dir + "/logs";
  for (const std::string& d : {id.paths.runtime_dir, id.paths.namespace_dir, dir}) {
    WEIGHTCACHE_RETURN_IF_ERROR(identity::EnsurePrivateDirWithParents(d));
  }
  return dir + "/serve-" + id.config.ShortDigest() + ".log";
}

Result<Detached> Detach(const DetachOptions& options, const identity::ResolvedIdentity& id,
                        int signal_fd) {
  if (options.argv.empty()) return InvalidArgument("detach: no command line to run");
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string log, DetachedLogPath(options.log_file, id));

  launcher::DaemonSpec spec;
  spec.name = "serve " + id.config.ShortDigest();
  if (id.device) spec.placement.device_uuid = id.device->uuid;
  spec.socket_path = id.paths.socket;
  spec.lock_path = id.paths.lock;
  spec.spawn.argv.push_back(options.argv.front());
  for (size_t i = 1; i < options.argv.size(); ++i) {
    if (options.argv[i] != "--detach") spec.spawn.argv.push_back(options.argv[i]);
  }
  spec.spawn.log_path = std::move(log);

  launcher::LaunchOptions launch;
  launch.mode = launcher::SupervisionMode::kExitWhenReady;
  launch.ready_timeout = options.ready_timeout;
  std::vector<launcher::DaemonSpec> specs;
  specs.push_back(std::move(spec));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      launcher::Launcher l,
      launcher::Launcher::Create(
          std::move(specs), launch,
          [](const std::string& socket) {
            return launcher::ProbeDaemonState(socket, std::chrono::milliseconds(500),
                                              launcher::AwaitingIs::kReady);
          },
          [](const std::string& lock) -> Result<bool> { return os::IsLockHeld(lock); }));
  Detached out;
  out.report = l.Run(signal_fd);
  out.exit_code = out.report.status.ok() ? kExitOk : ExitCodeFor(out.report.status.code());
  if (!out.report.status.ok() && !out.report.daemons.empty()) {
    const auto& exit = out.report.daemons.front().exit;
    // The daemon's own exit code (it applied the one table where the error was found), and
    // the status code of that exit code's row, where the row is the only one.
    if (exit && exit->exited() && exit->exit_code != kExitOk && exit->exit_code != out.exit_code) {
      out.exit_code = exit->exit_code;
      for (const StatusCodeInfo& row : kStatusCodeTable) {
        if (row.exit_code == out.exit_code && out.exit_code != kExitError) {
          out.report.status = Status(row.code, out.report.status.message());
          break;
        }
      }
    }
  }
  return out;
}

}  // namespace weightcache::serve
