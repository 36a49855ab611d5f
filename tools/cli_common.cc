#include "cli_common.h"

#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <iostream>
#include <map>

#include "identity/paths.h"

namespace weightcache::cli {
namespace {
std::map<CLI::App*, CommandAction>& Actions() {
  static std::map<CLI::App*, CommandAction> actions;
  return actions;
}
std::vector<std::string>& MutableCommandLine() {
  static std::vector<std::string> command_line;
  return command_line;
}
}  // namespace

void SetCommandLine(int argc, const char* const* argv) {
  MutableCommandLine().assign(argv, argv + argc);
}

const std::vector<std::string>& CommandLine() { return MutableCommandLine(); }

Result<std::string> SelfExe() {
  std::string buf(4096, '\0');
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return IoError("readlink /proc/self/exe", errno);
  buf.resize(static_cast<size_t>(n));
  return buf;
}

Status MakePrivateDirWithParents(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) {
    return IoError("creating " + std::filesystem::path(path).parent_path().string(), ec.value());
  }
  return identity::EnsurePrivateDir(path);
}

int ExitCodeFor(const Status& status) { return weightcache::ExitCodeFor(status.code()); }

int Fail(std::string_view command, const Status& status) {
  std::cerr << "weightcache " << command << ": " << status.ToString() << std::endl;
  return ExitCodeFor(status);
}

Result<UniqueFd> TakeShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
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

}  // namespace weightcache::cli
