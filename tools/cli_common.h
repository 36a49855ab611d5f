// Shared pieces of the CLI: exit codes (docs/design.md "Exit codes") and printing errors.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "flag_checks.h"
#include "weightcache/status.h"

namespace weightcache::cli {

// The exit codes (kExitOk, kExitUsage, …) are weightcache::ExitCode (weightcache/status.h).
using enum ::weightcache::ExitCode;
// The exit code of `status`, from the one table (weightcache::kStatusCodeTable).
int ExitCodeFor(const Status& status);

// Print "weightcache <command>: <status>" to stderr and return its exit code.
int Fail(std::string_view command, const Status& status);

// For a command that runs until told to stop (serve, keeper): blocks SIGTERM, SIGINT and
// SIGHUP in this thread — call it before any other thread exists, so every thread inherits
// the mask — and returns a signalfd for them; ignores SIGPIPE (a vanished peer or a closed
// stderr pipe must not kill the process; sends use MSG_NOSIGNAL too). `upgrade` adds SIGUSR2
// (serve: SIGUSR2 starts an upgrade, docs/upgrade.md).
enum class UpgradeSignal { kNo, kYes };
Result<UniqueFd> TakeShutdownSignals(UpgradeSignal upgrade = UpgradeSignal::kNo);

// Each subcommand registers itself on the root app and sets the action run when it is chosen.
// The action returns the process exit code.
using CommandAction = std::function<int()>;
void SetAction(CLI::App* sub, CommandAction action);
int RunSelected(CLI::App& root);

// The command line this process was started with (main records it before parsing): what an
// upgrade's successor is started with again (`serve`, docs/upgrade.md).
// It also notes the time, ProcessStart: an adopted ready line says how long the whole process
// took (an adopted cache's figure is mostly the CUDA driver's start, not the adoption).
void RecordProgramArgs(int argc, char** argv);
const std::vector<std::string>& ProgramArgs();
// When RecordProgramArgs ran (the process start, near enough).
std::chrono::steady_clock::time_point ProcessStart();

// Registration functions, one per cmd_<name>.cc.
void RegisterAttachCommand(CLI::App& root);
void RegisterVerifyCommand(CLI::App& root);
void RegisterInspectCommand(CLI::App& root);
void RegisterServeCommand(CLI::App& root);
void RegisterLaunchCommand(CLI::App& root);
void RegisterLsCommand(CLI::App& root);
void RegisterStatusCommand(CLI::App& root);
void RegisterStopCommand(CLI::App& root);
void RegisterPathsCommand(CLI::App& root);
void RegisterDevicesCommand(CLI::App& root);
void RegisterShardPlanCommand(CLI::App& root);
void RegisterPublishCommand(CLI::App& root);
void RegisterKeeperCommand(CLI::App& root);
void RegisterUpgradeCommand(CLI::App& root);
void RegisterFleetCommand(CLI::App& root);

}  // namespace weightcache::cli
