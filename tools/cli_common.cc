#include "cli_common.h"

#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace weightcache::cli {
namespace {
std::map<CLI::App*, CommandAction>& Actions() {
  static std::map<CLI::App*, CommandAction> actions;
  return actions;
}
}  // namespace

int ExitCodeFor(const Status& status) { return weightcache::ExitCodeFor(status.code()); }

int Fail(std::string_view command, const Status& status) {
  std::cerr << "weightcache " << command << ": " << status.ToString() << std::endl;
  return ExitCodeFor(status);
}

Result<UniqueFd> TakeShutdownSignals(UpgradeSignal upgrade) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  if (upgrade == UpgradeSignal::kYes) sigaddset(&set, SIGUSR2);
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0) {
    return IoError("pthread_sigmask", rc);
  }
  UniqueFd fd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!fd) return IoError("signalfd", errno);
  ::signal(SIGPIPE, SIG_IGN);
  return fd;
}

void SetAction(CLI::App* sub, CommandAction action) { Actions()[sub] = std::move(action); }

int RunSelected(CLI::App& root) {
  for (auto& [app, action] : Actions()) {
    if (app->parsed()) return action();
  }
  std::cerr << root.help() << std::endl;
  return kExitUsage;
}

namespace {
std::vector<std::string>& ProgramArgsStorage() {
  static std::vector<std::string> args;
  return args;
}
std::chrono::steady_clock::time_point& StartTime() {
  static std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  return start;
}
}  // namespace

void RecordProgramArgs(int argc, char** argv) {
  StartTime() = std::chrono::steady_clock::now();
  ProgramArgsStorage().assign(argv, argv + argc);
}

const std::vector<std::string>& ProgramArgs() { return ProgramArgsStorage(); }

std::chrono::steady_clock::time_point ProcessStart() { return StartTime(); }

}  // namespace weightcache::cli
