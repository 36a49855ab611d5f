// The fleet's flags (docs/fleet.md): one table for `serve`, `launch` and `fleet ls`, filling a
// serve::FleetOptions, and the argv writer of launch's forwarding. The same in every build: in
// one without the fleet each flag's help says so, and serve/registration.h refuses a flag given.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "serve/fleet_options.h"
#include "weightcache/status.h"

namespace weightcache::cli {

// kLaunch: serve's flags, which `launch` forwards to every daemon (RegistryServeArgs).
enum class RegistryFlagScope { kServe, kLaunch, kList };
// --registry --registry-ca --registry-cert --registry-key --registry-prefix
// --registry-timeout, and for kServe and kLaunch --registry-ttl --advertise --node-name
// --fill-from --fill-serve --fill-allow --fill-trust, and for every scope
// --fill-content-sha256 (it is part of the fleet key `fleet ls --model` computes).
void AddRegistryFlags(CLI::App* sub, serve::FleetOptions* flags, RegistryFlagScope scope);

// The serve arguments of `flags` for the daemon of job rank `rank` of a launch
// (serve::FleetOptionsForRank, written as the flags serve parses back): every flag given. Empty
// without any fleet flag. serve::CheckFleetOptions's refusals, so that launch refuses what serve
// would before any daemon starts.
Result<std::vector<std::string>> RegistryServeArgs(const serve::FleetOptions& flags, int rank);

}  // namespace weightcache::cli
