#include "unit/daemon/in_process_daemon.h"

#include <fcntl.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <csignal>
#include <utility>

namespace weightcache::testing {

Result<daemon::DaemonOptions> DaemonOptionsFor(const IdentityOptions& options,
                                               const identity::Env& env) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(identity::ResolvedIdentity id,
                               identity::ResolveIdentity(options, env));
  daemon::DaemonOptions o;
  o.config = id.config;
  o.paths = id.paths;
  o.model_path = options.model_dir;
  o.device_key = id.device_key;
  o.device = id.device;
  o.load.threads = 2;
  o.load.cache_name = "weightcache:" + id.config.ShortDigest();
  o.failed_linger = std::chrono::milliseconds(0);
  o.env = env;
  return o;
}

Result<std::unique_ptr<InProcessDaemon>> InProcessDaemon::Start(daemon::DaemonOptions options) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<daemon::Daemon> created,
                               daemon::Daemon::Create(std::move(options)));
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return IoError("pipe2", errno);
  std::unique_ptr<InProcessDaemon> d(
      new InProcessDaemon(std::move(created), UniqueFd(fds[0]), UniqueFd(fds[1])));
  InProcessDaemon* self = d.get();
  d->thread_ = std::thread([self] {
    daemon::DaemonEvents events;
    const auto loaded = [self](Status status) {
      MutexLock lock(self->mu_);
      if (!self->loaded_) self->loaded_ = std::move(status);
      self->loaded_cv_.NotifyAll();
    };
    events.on_ready = [loaded](const daemon::StoreSummary&, double) { loaded(Status::Ok()); };
    events.on_failed = [loaded](const Status& failure) { loaded(failure); };
    Status run = self->daemon_->Run(self->signal_read_.get(), std::move(events));
    self->run_status_ = run;
    loaded(run.ok() ? Status(StatusCode::kUnavailable, "the daemon stopped before its load ended")
                    : run);
  });
  return d;
}

Result<std::unique_ptr<InProcessDaemon>> InProcessDaemon::StartLoaded(
    const IdentityOptions& options, const identity::Env& env) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(daemon::DaemonOptions daemon_options,
                               DaemonOptionsFor(options, env));
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<InProcessDaemon> started,
                               Start(std::move(daemon_options)));
  WEIGHTCACHE_RETURN_IF_ERROR(started->WaitLoaded());
  return started;
}

InProcessDaemon::InProcessDaemon(std::unique_ptr<daemon::Daemon> daemon, UniqueFd signal_read,
                                 UniqueFd signal_write)
    : daemon_(std::move(daemon)),
      signal_read_(std::move(signal_read)),
      signal_write_(std::move(signal_write)) {}

InProcessDaemon::~InProcessDaemon() { (void)Stop(); }

Status InProcessDaemon::WaitReady() {
  MutexLock lock(mu_);
  while (!loaded_) loaded_cv_.Wait(mu_);
  return *loaded_;
}

Status InProcessDaemon::WaitLoaded() {
  Status loaded = WaitReady();
  if (loaded.ok()) daemon_->WaitLoaderSettled();
  return loaded;
}

Status InProcessDaemon::Stop() {
  if (thread_.joinable()) {
    signalfd_siginfo info{};
    info.ssi_signo = SIGTERM;
    info.ssi_pid = static_cast<uint32_t>(::getpid());
    if (::write(signal_write_.get(), &info, sizeof(info)) != static_cast<ssize_t>(sizeof(info))) {
      return IoError("writing the stop signal", errno);
    }
    thread_.join();
  }
  return run_status_.value_or(Status::Ok());
}

}  // namespace weightcache::testing
