// Path rules (docs/design.md "Paths"): the runtime dir, the per-cache socket and lock, explicit
// sockets.
//
//   <runtime>/<namespace>/<device key>/<digest[:16]>.sock   (+ <digest[:16]>.lock)
//
// Runtime dir: --runtime-dir > WEIGHTCACHE_RUNTIME_DIR > $XDG_RUNTIME_DIR/weightcache >
// /tmp/weightcache-<uid>. It must be absolute. The device key is the physical GPU UUID
// ("GPU-…" / "MIG-…", from device_inventory.h) or "host" for the host tier without a GPU
// affinity; ranks live inside the digest. An explicit socket (--socket, else
// WEIGHTCACHE_SOCKET) replaces the layout: a literal absolute path, or a template with
// {runtime_dir} {namespace} {device_uuid} {digest} {tp_rank} {pp_rank} {ep_rank} where
// {digest} is the same 16-hex short digest as in the layout and {device_uuid} is the device
// key. A template (anything with a placeholder) must contain {device_uuid}: without it two
// GPUs' caches would share a path, the very bug this system exists to prevent.
//
// Lock path: one rule for every socket, layout or explicit (LockPathFor, below):
// <stem>.sock → <stem>.lock, any other name → <name>.lock. Every reader (daemon, client,
// launcher, ls, stop) takes it from CachePaths::lock or LockPathFor, never by its own rule.
//
// Keeper path (docs/keeper.md): the process that holds a cache's fds so that they outlive its
// daemon listens next to the cache's socket, by one rule for every socket (KeeperSocketFor):
// <stem>.sock → <stem>.keeper.sock, any other name → <name>.keeper.sock; its lock is
// LockPathFor of that (<stem>.keeper.lock). A keeper path over the sun_path limit leaves
// CachePaths::keeper_socket empty: that cache runs without a keeper, it is not an error.
// ListCacheSockets never lists keeper sockets (they do not speak the daemon's protocol).
//
// Every socket path is checked against the sun_path limit (os::kMaxUnixPathLength, 107
// bytes, the one constant; ListenUnix/ConnectUnix enforce it too) here, at resolution time,
// before anything is created or loaded.
//
// Directories (EnsureCacheDirs): created 0700; an existing one is refused with
// kPermissionDenied, naming the path, when it is a symlink, owned by another uid, or
// writable by group or others. The runtime dir's missing ancestors are created 0700 but not
// checked (they are typically /run/user/<uid> or /tmp). Checks use lstat; everything below
// the runtime dir is only writable by us, which is what makes check-then-use safe.
// DirAccess::kShared (a daemon that serves other uids: --allow-uid/--allow-gid) creates them
// 0755 instead and widens an existing one of ours to 0755, so that those users can reach the
// socket (which is then 0666: SO_PEERCRED against the allow lists is the access control);
// still never writable by anyone but us.
//
// Thread-safety: pure functions except EnsureCacheDirs / EnsurePrivateDir / List*, which do
// filesystem I/O and are safe to call concurrently (mkdir races resolve to EEXIST + checks).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "identity/cache_config.h"
#include "identity/env.h"
#include "weightcache/status.h"

namespace weightcache::identity {

inline constexpr std::string_view kHostDeviceKey = "host";
inline constexpr std::string_view kDefaultNamespace = "default";

// [A-Za-z0-9._-]+, not "." or "..". kInvalidArgument naming the namespace.
Status ValidateNamespace(std::string_view name);

// "host" or a device UUID usable as one path component. kInvalidArgument otherwise.
Status ValidateDeviceKey(std::string_view key);

struct RuntimeDir {
  std::string path;
  std::string origin;  // "--runtime-dir", "WEIGHTCACHE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "default"
};

// The precedence above; empty flag / empty variables count as unset, as does a relative
// XDG_RUNTIME_DIR (the XDG spec says to ignore it). A relative --runtime-dir or
// WEIGHTCACHE_RUNTIME_DIR is kInvalidArgument.
Result<RuntimeDir> ResolveRuntimeDir(std::string_view flag_value, const EnvLookup& env,
                                     uid_t uid = ::geteuid());

struct PathOptions {
  std::string runtime_dir_flag;  // --runtime-dir ("" = unset)
  std::string namespace_name = std::string(kDefaultNamespace);
  std::string socket_flag;  // --socket ("" = unset; then WEIGHTCACHE_SOCKET)
  EnvLookup env = ProcessEnv();
  uid_t uid = ::geteuid();
};

struct CachePaths {
  std::string runtime_dir;
  std::string runtime_dir_origin;
  std::string namespace_name;
  std::string namespace_dir;  // <runtime>/<namespace>; "" for an explicit socket
  std::string device_key;
  std::string device_dir;  // <namespace_dir>/<device key>; for an explicit socket its directory
  std::string socket;
  std::string lock;  // LockPathFor(socket)
  // The cache's keeper (KeeperSocketFor(socket), LockPathFor of that); both "" when the
  // keeper's socket path would exceed os::kMaxUnixPathLength.
  std::string keeper_socket;
  std::string keeper_lock;
  std::string digest;  // the full config digest (64 hex)
  bool explicit_socket = false;
  std::string socket_origin;  // "layout", "--socket" or "WEIGHTCACHE_SOCKET"
};

// Every path of one cache. Pure string work: nothing is created. Errors (all
// kInvalidArgument): bad namespace or device key, relative runtime dir or socket, unknown
// placeholder, unbalanced brace, template without {device_uuid}, socket path over
// os::kMaxUnixPathLength (the message names the path, its length and the limit).
Result<CachePaths> ResolveCachePaths(const CacheConfig& config, std::string_view device_key,
                                     const PathOptions& options);

// Expand one socket template (exposed for tests and for `launch`, which shows the template).
struct TemplateValues {
  std::string runtime_dir, namespace_name, device_uuid, digest;
  uint32_t tp_rank = 0, pp_rank = 0, ep_rank = 0;
};
Result<std::string> ExpandSocketTemplate(std::string_view tmpl, const TemplateValues& values);

// Who may reach a daemon's directories: only us, or also the users it allows.
enum class DirAccess { kPrivate, kShared };

// Create (0700; 0755 when shared) or check one directory as described above.
Status EnsurePrivateDir(const std::string& path, uid_t uid = ::geteuid(),
                        DirAccess access = DirAccess::kPrivate);
// The same, after creating the missing ancestors of `path` (mode as mkdir -p gives them): a
// runtime dir or a log dir named by a flag.
Status EnsurePrivateDirWithParents(const std::string& path);
// The runtime dir (with missing ancestors), namespace dir and device dir of `paths`; for an
// explicit socket, the socket's directory.
Status EnsureCacheDirs(const CachePaths& paths, uid_t uid = ::geteuid(),
                       DirAccess access = DirAccess::kPrivate);

// The *.sock sockets directly under one device dir, sorted, as full paths. A missing dir is
// an empty list. Includes stale sockets: liveness is the lock's business, not the name's.
Result<std::vector<std::string>> ListCacheSockets(const std::string& device_dir);
// Subdirectory names that are valid namespaces / device keys, sorted; missing dir = empty.
Result<std::vector<std::string>> ListNamespaces(const std::string& runtime_dir);
Result<std::vector<std::string>> ListDeviceKeys(const std::string& namespace_dir);

struct SocketEntry {
  std::string namespace_name;
  std::string device_key;
  std::string socket;
};
// Every cache socket under a runtime dir (for `ls`), ordered by namespace, key, socket.
Result<std::vector<SocketEntry>> ListAllCacheSockets(const std::string& runtime_dir);

// The lock file of a socket, the one rule: <stem>.sock → <stem>.lock (so the layout's
// <digest16>.sock is guarded by <digest16>.lock); any other name → <name>.lock. The same for
// layout and explicit sockets, so a lock never depends on how its socket was named.
std::string LockPathFor(const std::string& socket_path);

// The memory budget's files of one device dir (docs/budget.md), the one rule:
// <device dir>/budget.ledger (the caches holding memory on the device, JSON), guarded by the
// OFD lock on <device dir>/budget.ledger.lock; <device dir>/budget.conf (the device's budget,
// written by `serve --gpu-budget` / `--host-budget`, shown by `ls`). None ends in .sock, so
// the socket listings never see them.
std::string BudgetLedgerPath(const std::string& device_dir);
std::string BudgetLedgerLockPath(const std::string& device_dir);
std::string BudgetConfigPath(const std::string& device_dir);

// The keeper socket of a cache socket, the one rule: <stem>.sock → <stem>.keeper.sock; any
// other name → <name>.keeper.sock. Its lock is LockPathFor(KeeperSocketFor(socket)).
std::string KeeperSocketFor(const std::string& socket_path);
// Whether `path` names a keeper socket (ends in ".keeper.sock"): the listings skip them.
bool IsKeeperSocket(std::string_view path);
// The cache socket a keeper socket serves: the inverse of KeeperSocketFor
// (<stem>.keeper.sock → <stem>.sock).
std::string CacheSocketForKeeper(const std::string& keeper_socket);
// Every keeper socket under a runtime dir (the layout's device dirs), live or stale: `ls`
// finds orphans (a live keeper whose daemon is gone) with it.
Result<std::vector<SocketEntry>> ListAllKeeperSockets(const std::string& runtime_dir);

// Every device dir of a runtime dir (<runtime>/<namespace>/<device key>), ordered by namespace
// and key.
struct DeviceDirEntry {
  std::string namespace_name;
  std::string device_key;
  std::string path;
};
Result<std::vector<DeviceDirEntry>> ListAllDeviceDirs(const std::string& runtime_dir);
// Every cache of one device dir that has any file of its own there — its socket, its lock, its
// keeper's socket or its keeper's lock, named by the rules above — as the path of the cache's
// socket (which may itself be gone), sorted. A dead daemon can leave any subset of the four;
// the stale-file sweep (daemon/stale_files.h) walks these.
Result<std::vector<std::string>> ListCacheIdentities(const std::string& device_dir);

}  // namespace weightcache::identity
