#include "cli_common.h"

#include <iostream>
#include <map>

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

void SetAction(CLI::App* sub, CommandAction action) { Actions()[sub] = std::move(action); }

int RunSelected(CLI::App& root) {
  for (auto& [app, action] : Actions()) {
    if (app->parsed()) return action();
  }
  std::cerr << root.help() << std::endl;
  return kExitUsage;
}

}  // namespace weightcache::cli
