// The identity flags of the CLI (docs/design.md "Identity", "Command line"), in one place: every
// command that names a cache (serve, attach, verify, paths, stop) or a job of caches (launch)
// registers them here, bound to the fields of weightcache::IdentityOptions
// (AttachOptions::identity), and resolves them with identity::ResolveIdentity, the one resolution
// the client library's attach uses too. A daemon and an engine given the same flags therefore
// compute the same CacheConfig, device key and socket path by construction, and a flag added here
// reaches every command at once.
//
// One table (identity_flags.cc, kIdentityFlags) lists every flag: its names, help, the
// IdentityOptions field it binds, its check and whether it is per daemon. AddIdentityFlags
// registers from it, and ServeArgsFor writes from it the `serve` arguments that `launch`
// gives each daemon, so a flag added to the table is registered and forwarded at once; there
// is no second list to keep in step (tests/unit/launcher/launch_flags_test.cc parses the
// forwarded command line with these same registrations).
//
// Defaults are the values the bound IdentityOptions holds when the flags are registered (the
// struct's own defaults: tier gpu, source disk, sizes 1), so every command shares them too.
// The bound object must outlive the CLI::App (commands keep it in a shared_ptr captured by
// their action). Not thread-safe; CLI parsing runs on main's thread.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "weightcache/identity_options.h"

namespace weightcache::cli {

// kOneCache: one daemon's identity (serve, attach, verify, paths, stop): every flag.
// kJob: a job's identity (launch): every flag but the per-daemon ones, which the launcher
// sets for each daemon from its placement (--tp-rank, --pp-rank, --ep-rank, --device) or
// leaves to the layout (--socket: the launcher finds each daemon's socket there); the sizes
// are also spelled --tp and --pp (docs/design.md "Launcher").
enum class IdentityScope { kOneCache, kJob };

// Registers on `sub`, bound to `options`:
//   --model (required) --model-id --revision --dtype --quantization --quantization-config
//   --tp-size --pp-size --ep-size --dp-size --shard-rules --layout-tag --source --tier
//   --namespace --runtime-dir --device-inventory
//   and for kOneCache: --tp-rank --pp-rank --ep-rank --device --socket
// Value checks that CLI11 can make (sizes >= 1, ranks >= 0, tier gpu|host) are usage errors
// here; everything else is CacheConfig::Validate()'s, at resolution.
void AddIdentityFlags(CLI::App* sub, IdentityOptions* options, IdentityScope scope);

// The arguments that make `serve` (kOneCache registrations) parse `options` back exactly:
// "--flag value" for every flag of the table, in table order, by its kOneCache name. Numbers
// and the tier are always written (a readable command line); a string only when it differs
// from IdentityOptions' default (so "" stays serve's default). Pure.
std::vector<std::string> ServeArgsFor(const IdentityOptions& options);

}  // namespace weightcache::cli
