// The identity flags of the CLI (SPEC §2, §5), in one place: every command that names a cache
// (serve, attach, verify, paths, stop) or a job of caches (launch) registers them here, bound
// to the fields of weightcache::AttachOptions, and resolves them with the client library's own
// client::ResolveIdentity. A daemon and an engine given the same flags therefore compute the
// same CacheConfig, device key and socket path by construction, and a flag added here reaches
// every command at once.
//
// Defaults are the values the bound AttachOptions holds when the flags are registered (the
// struct's own defaults: tier gpu, source disk, sizes 1), so every command shares them too.
// The bound object must outlive the CLI::App (commands keep it in a shared_ptr captured by
// their action). Not thread-safe; CLI parsing runs on main's thread.
#pragma once

#include <CLI/CLI.hpp>

#include "weightcache/client.h"

namespace weightcache::cli {

// kOneCache: one daemon's identity (serve, attach, verify, paths, stop): every flag.
// kJob: a job's identity (launch): every flag but the ones the launcher sets per daemon from
// its placement (--tp-rank, --pp-rank, --ep-rank, --device) and --socket (the launcher finds
// each daemon's socket in the layout); the sizes are also spelled --tp and --pp (SPEC §5).
enum class IdentityScope { kOneCache, kJob };

// Registers on `sub`, bound to `options`:
//   --model (required) --model-id --revision --dtype --quantization --quantization-config
//   --tp-size --pp-size --ep-size --dp-size --layout-tag --source --tier
//   --namespace --runtime-dir --device-inventory
//   and for kOneCache: --tp-rank --pp-rank --ep-rank --device --socket
// Value checks that CLI11 can make (sizes >= 1, ranks >= 0, tier gpu|host) are usage errors
// here; everything else is CacheConfig::Validate()'s, at resolution.
void AddIdentityFlags(CLI::App* sub, AttachOptions* options, IdentityScope scope);

}  // namespace weightcache::cli
