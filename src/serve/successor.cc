#include "serve/successor.h"

#include <optional>
#include <string_view>
#include <utility>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "launcher/child_process.h"

namespace weightcache::serve {
namespace {

class SpawnedSuccessor : public daemon::Successor {
 public:
  explicit SpawnedSuccessor(launcher::ChildProcess child) : child_(std::move(child)) {}
  pid_t pid() const override { return child_.pid(); }
  void Release() override { child_.Detach(); }

 private:
  launcher::ChildProcess child_;
};

}  // namespace

Result<std::unique_ptr<daemon::Successor>> StartSuccessor(std::span<const std::string> command_line,
                                                          const std::string& binary, int channel,
                                                          int metrics_listener) {
  launcher::SpawnOptions spawn;
  spawn.argv.push_back(binary);
  // Our own internal flags, with their values, are not passed on: the successor gets its own.
  auto internal = [](std::string_view flag) {
    return flag == "--handover-fd" || flag == "--metrics-fd";
  };
  for (size_t i = 1; i < command_line.size(); ++i) {
    const std::string_view arg = command_line[i];
    if (internal(arg)) {
      ++i;  // and its value
      continue;
    }
    if (internal(arg.substr(0, arg.find('=')))) continue;  // --flag=value
    spawn.argv.push_back(command_line[i]);
  }
  spawn.argv.push_back("--handover-fd");
  spawn.argv.push_back(std::to_string(daemon::kHandoverChannelFd));
  if (metrics_listener >= 0) {
    spawn.argv.push_back("--metrics-fd");
    spawn.argv.push_back(std::to_string(daemon::kMetricsListenerFd));
    spawn.pass_fds.emplace_back(metrics_listener, daemon::kMetricsListenerFd);
  }
  spawn.in = launcher::Stdio::kInherit;
  spawn.out = launcher::Stdio::kInherit;
  spawn.err = launcher::Stdio::kInherit;
  spawn.session = launcher::Session::kInherit;
  spawn.pass_fds.emplace_back(channel, daemon::kHandoverChannelFd);
  WEIGHTCACHE_ASSIGN_OR_RETURN(launcher::ChildProcess child, launcher::ChildProcess::Spawn(spawn));
  return std::unique_ptr<daemon::Successor>(new SpawnedSuccessor(std::move(child)));
}

Result<std::unique_ptr<daemon::Daemon>> TakeOver(int handover_fd,
                                                 const identity::ResolvedIdentity& id,
                                                 const daemon::DaemonOptions& options,
                                                 int64_t* predecessor_pid) {
  const UniqueFd channel(handover_fd);
  std::optional<daemon::GpuAdoptContext> gpu;
  if (options.config.tier == Tier::kGpu && options.device.has_value()) {
    auto driver = options.env.load_driver();
    if (driver.ok()) gpu = daemon::GpuAdoptContext{*driver, *options.device};
  }
  const std::string model_path =
      identity::IsPublishedSource(options.config.source) ? "" : options.model_path;
  auto taken =
      daemon::ReceiveHandover(channel.get(), id.paths, options.config, model_path, options.keeper,
                              gpu ? &*gpu : nullptr, std::chrono::seconds(30));
  if (!taken.ok()) {
    daemon::RefuseHandover(channel.get(), taken.status());
    Status status = taken.status();
    return status.Context("taking over the cache");
  }
  const int64_t predecessor = taken->predecessor_pid;
  auto daemon = daemon::Daemon::CreateFromHandover(options, std::move(taken).value());
  if (!daemon.ok()) {
    daemon::RefuseHandover(channel.get(), daemon.status());
    return daemon;
  }
  Status confirmed = daemon::ConfirmHandover(channel.get());
  if (!confirmed.ok()) {
    // It died after handing over (kill -9 mid-handoff): we hold the lock and serve anyway.
    LOG_WARN << "the old daemon (pid " << predecessor
             << ") did not take the confirmation: " << confirmed.ToString();
  }
  LOG_INFO << "took over from pid " << predecessor << " (upgrade)";
  *predecessor_pid = predecessor;
  return daemon;
}

}  // namespace weightcache::serve
