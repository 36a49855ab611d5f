// weightcache — keep LLM weights resident in GPU memory. Thin main(): parse, dispatch, map
// the resulting Status to the exit codes of docs/design.md "Exit codes". All logic lives in src/.
#include <CLI/CLI.hpp>

#include "cli_common.h"

// Only CLI11's parse errors are expected here (caught below); anything else thrown is a
// programming error, and terminate() is the right end for it.
// NOLINTNEXTLINE(bugprone-exception-escape): see above
int main(int argc, char** argv) {
  namespace cli = weightcache::cli;
  CLI::App root{
      "weightcache: keep LLM weights resident in GPU memory so engines restart in "
      "milliseconds.\nSee `weightcache <command> --help` for each command.",
      "weightcache"};
  cli::RecordProgramArgs(argc, argv);
  root.require_subcommand(1);
  root.set_version_flag("--version", "weightcache 0.1.0");

  // Subcommands, in the order `--help` lists them.
  cli::RegisterServeCommand(root);
  cli::RegisterLaunchCommand(root);
  cli::RegisterPublishCommand(root);
  cli::RegisterAttachCommand(root);
  cli::RegisterVerifyCommand(root);
  cli::RegisterInspectCommand(root);
  cli::RegisterShardPlanCommand(root);
  cli::RegisterLsCommand(root);
  cli::RegisterStatusCommand(root);
  cli::RegisterStopCommand(root);
  cli::RegisterUpgradeCommand(root);
  cli::RegisterPathsCommand(root);
  cli::RegisterDevicesCommand(root);
  cli::RegisterKeeperCommand(root);
  cli::RegisterFleetCommand(root);

  try {
    root.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = root.exit(e);
    return rc == 0 ? cli::kExitOk : cli::kExitUsage;
  }
  return cli::RunSelected(root);
}
