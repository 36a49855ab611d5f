#include "identity/paths.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "identity/device_inventory.h"
#include "os/unix_socket.h"

namespace weightcache::identity {
namespace {

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

std::string Octal(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string Dirname(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status CheckSocketLength(const std::string& socket) {
  if (socket.size() > os::kMaxUnixPathLength) {
    return InvalidArgument("socket path " + socket + " is " + std::to_string(socket.size()) +
                           " bytes, over the " + std::to_string(os::kMaxUnixPathLength) +
                           "-byte sun_path limit; choose a shorter --runtime-dir, namespace "
                           "or --socket");
  }
  return Status::Ok();
}

// The keeper's paths of a resolved cache; none when its socket path would be too long.
void SetKeeperPaths(CachePaths& p) {
  std::string keeper = KeeperSocketFor(p.socket);
  if (keeper.size() > os::kMaxUnixPathLength) return;
  p.keeper_lock = LockPathFor(keeper);
  p.keeper_socket = std::move(keeper);
}

// The names in `dir` (sorted) whose lstat type is `type` and that pass `keep`.
template <typename Keep>
Result<std::vector<std::string>> ListDir(const std::string& dir, mode_t type, Keep keep) {
  std::vector<std::string> names;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return names;
    return IoError("listing " + dir, ec.value());
  }
  for (std::filesystem::directory_iterator end; it != end; it.increment(ec)) {
    if (ec) return IoError("listing " + dir, ec.value());
    const std::string name = it->path().filename().string();
    struct stat st;
    if (::lstat(it->path().c_str(), &st) != 0) continue;  // vanished meanwhile
    if ((st.st_mode & S_IFMT) == type && keep(name)) names.push_back(name);
  }
  if (ec) return IoError("listing " + dir, ec.value());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

Status ValidateNamespace(std::string_view name) {
  if (name.empty() || name == "." || name == ".." ||
      !std::all_of(name.begin(), name.end(), IsNameChar)) {
    return InvalidArgument("namespace \"" + std::string(name) +
                           "\" must match [A-Za-z0-9._-]+ and not be \".\" or \"..\"");
  }
  return Status::Ok();
}

Status ValidateDeviceKey(std::string_view key) {
  if (key == kHostDeviceKey) return Status::Ok();
  if (!IsValidDeviceUuid(key)) {
    return InvalidArgument("device key \"" + std::string(key) +
                           "\" is neither \"host\" nor a GPU-/MIG- UUID");
  }
  if (key.find('/') != std::string_view::npos) {
    return InvalidArgument("device key \"" + std::string(key) +
                           "\" is a legacy MIG-GPU-…/gi/ci name, which cannot be a path "
                           "component; use the MIG-xxxxxxxx-… UUID nvidia-smi -L prints");
  }
  return Status::Ok();
}

Result<RuntimeDir> ResolveRuntimeDir(std::string_view flag_value, const EnvLookup& env, uid_t uid) {
  RuntimeDir dir;
  if (!flag_value.empty()) {
    dir = {std::string(flag_value), "--runtime-dir"};
  } else if (auto v = env("WEIGHTCACHE_RUNTIME_DIR"); v && !v->empty()) {
    dir = {*v, "WEIGHTCACHE_RUNTIME_DIR"};
  } else if (auto x = env("XDG_RUNTIME_DIR"); x && x->starts_with("/")) {
    dir = {*x + "/weightcache", "XDG_RUNTIME_DIR"};
  } else {
    dir = {"/tmp/weightcache-" + std::to_string(uid), "default"};
  }
  if (!dir.path.starts_with("/")) {
    return InvalidArgument("runtime dir \"" + dir.path + "\" (from " + dir.origin +
                           ") must be an absolute path");
  }
  while (dir.path.size() > 1 && dir.path.back() == '/') dir.path.pop_back();
  return dir;
}

Result<std::string> ExpandSocketTemplate(std::string_view tmpl, const TemplateValues& values) {
  std::string out;
  size_t pos = 0;
  while (pos < tmpl.size()) {
    const char c = tmpl[pos];
    if (c == '}') {
      return InvalidArgument("socket template \"" + std::string(tmpl) + "\": unbalanced '}'");
    }
    if (c != '{') {
      out += c;
      ++pos;
      continue;
    }
    const size_t close = tmpl.find('}', pos);
    if (close == std::string_view::npos) {
      return InvalidArgument("socket template \"" + std::string(tmpl) + "\": unbalanced '{'");
    }
    const std::string_view name = tmpl.substr(pos + 1, close - pos - 1);
    if (name == "runtime_dir") {
      out += values.runtime_dir;
    } else if (name == "namespace") {
      out += values.namespace_name;
    } else if (name == "device_uuid") {
      out += values.device_uuid;
    } else if (name == "digest") {
      out += values.digest;
    } else if (name == "tp_rank") {
      out += std::to_string(values.tp_rank);
    } else if (name == "pp_rank") {
      out += std::to_string(values.pp_rank);
    } else if (name == "ep_rank") {
      out += std::to_string(values.ep_rank);
    } else {
      return InvalidArgument("socket template \"" + std::string(tmpl) +
                             "\": unknown placeholder {" + std::string(name) +
                             "}; known: {runtime_dir} {namespace} {device_uuid} {digest} "
                             "{tp_rank} {pp_rank} {ep_rank}");
    }
    pos = close + 1;
  }
  return out;
}

Result<CachePaths> ResolveCachePaths(const CacheConfig& config, std::string_view device_key,
                                     const PathOptions& options) {
  WEIGHTCACHE_RETURN_IF_ERROR(ValidateNamespace(options.namespace_name));
  WEIGHTCACHE_RETURN_IF_ERROR(ValidateDeviceKey(device_key));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      RuntimeDir runtime, ResolveRuntimeDir(options.runtime_dir_flag, options.env, options.uid));
  CachePaths p;
  p.runtime_dir = runtime.path;
  p.runtime_dir_origin = runtime.origin;
  p.namespace_name = options.namespace_name;
  p.device_key = std::string(device_key);
  p.digest = config.Digest();
  const std::string short_digest = p.digest.substr(0, 16);

  std::string socket_spec = options.socket_flag;
  p.socket_origin = "--socket";
  if (socket_spec.empty()) {
    socket_spec = options.env("WEIGHTCACHE_SOCKET").value_or("");
    p.socket_origin = "WEIGHTCACHE_SOCKET";
  }
  if (socket_spec.empty()) {
    p.socket_origin = "layout";
    p.namespace_dir = p.runtime_dir + "/" + p.namespace_name;
    p.device_dir = p.namespace_dir + "/" + p.device_key;
    p.socket = p.device_dir + "/" + short_digest + ".sock";
    p.lock = LockPathFor(p.socket);
    WEIGHTCACHE_RETURN_IF_ERROR(CheckSocketLength(p.socket));
    SetKeeperPaths(p);
    return p;
  }

  p.explicit_socket = true;
  const bool is_template = socket_spec.find_first_of("{}") != std::string::npos;
  if (is_template && socket_spec.find("{device_uuid}") == std::string::npos) {
    return InvalidArgument("socket template \"" + socket_spec + "\" (from " + p.socket_origin +
                           ") lacks {device_uuid}: caches on different GPUs would share one "
                           "socket");
  }
  TemplateValues values{p.runtime_dir,  p.namespace_name, p.device_key,  short_digest,
                        config.tp_rank, config.pp_rank,   config.ep_rank};
  WEIGHTCACHE_ASSIGN_OR_RETURN(p.socket, ExpandSocketTemplate(socket_spec, values));
  if (!p.socket.starts_with("/")) {
    return InvalidArgument("socket path \"" + p.socket + "\" (from " + p.socket_origin +
                           ") must be absolute");
  }
  if (p.socket.ends_with("/")) {
    return InvalidArgument("socket path \"" + p.socket + "\" (from " + p.socket_origin +
                           ") names a directory");
  }
  p.lock = LockPathFor(p.socket);
  p.device_dir = Dirname(p.socket);
  WEIGHTCACHE_RETURN_IF_ERROR(CheckSocketLength(p.socket));
  SetKeeperPaths(p);
  return p;
}

Status EnsurePrivateDirWithParents(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::filesystem::create_directories(parent, ec);
  if (ec) return IoError("creating " + parent.string(), ec.value());
  return EnsurePrivateDir(path);
}

Status EnsurePrivateDir(const std::string& path, uid_t uid, DirAccess access) {
  const mode_t mode = access == DirAccess::kShared ? 0755 : 0700;
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) return IoError("lstat " + path, errno);
    if (::mkdir(path.c_str(), mode) != 0) {
      if (errno != EEXIST) return IoError("mkdir " + path, errno);
    } else if (::chmod(path.c_str(), mode) != 0) {
      // mkdir's mode is filtered by the umask; a umask like 0277 would leave us a dir we
      // cannot write, so the mode is set exactly.
      return IoError("chmod " + Octal(mode) + " " + path, errno);
    }
    if (::lstat(path.c_str(), &st) != 0) return IoError("lstat " + path, errno);
  }
  if (S_ISLNK(st.st_mode)) {
    return PermissionDenied(path +
                            " is a symbolic link; refusing to use it as a weightcache directory "
                            "(point --runtime-dir at the real directory)");
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument(path + " exists and is not a directory");
  if (st.st_uid != uid) {
    return PermissionDenied(path + " is owned by uid " + std::to_string(st.st_uid) +
                            ", not by this user (uid " + std::to_string(uid) +
                            "); refusing to use another user's weightcache directory");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return PermissionDenied(path + " has mode " + Octal(st.st_mode) +
                            ", writable by group or others; it must be 0700 (chmod 0700 " + path +
                            ")");
  }
  // Shared: the allowed users must be able to reach the socket below (an existing dir of ours
  // from a private daemon is widened; never to writable).
  if (access == DirAccess::kShared && (st.st_mode & 0755) != 0755 &&
      ::chmod(path.c_str(), (st.st_mode & 07777) | 0755) != 0) {
    return IoError("chmod 0755 " + path + " (a daemon with --allow-uid/--allow-gid)", errno);
  }
  return Status::Ok();
}

Status EnsureCacheDirs(const CachePaths& paths, uid_t uid, DirAccess access) {
  if (paths.explicit_socket) return EnsurePrivateDir(paths.device_dir, uid, access);
  // Missing ancestors of the runtime dir (e.g. a fresh --runtime-dir /run/wc/jobA).
  for (size_t slash = paths.runtime_dir.find('/', 1); slash != std::string::npos;
       slash = paths.runtime_dir.find('/', slash + 1)) {
    const std::string ancestor = paths.runtime_dir.substr(0, slash);
    if (::mkdir(ancestor.c_str(), access == DirAccess::kShared ? 0755 : 0700) != 0 &&
        errno != EEXIST) {
      return IoError("mkdir " + ancestor + " (creating runtime dir " + paths.runtime_dir + ")",
                     errno);
    }
  }
  WEIGHTCACHE_RETURN_IF_ERROR(EnsurePrivateDir(paths.runtime_dir, uid, access));
  WEIGHTCACHE_RETURN_IF_ERROR(EnsurePrivateDir(paths.namespace_dir, uid, access));
  return EnsurePrivateDir(paths.device_dir, uid, access);
}

Result<std::vector<std::string>> ListCacheSockets(const std::string& device_dir) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      std::vector<std::string> names, ListDir(device_dir, S_IFSOCK, [](const std::string& name) {
        return name.size() > 5 && name.ends_with(".sock") && !IsKeeperSocket(name);
      }));
  for (std::string& name : names) name = device_dir + "/" + name;
  return names;
}

Result<std::vector<std::string>> ListNamespaces(const std::string& runtime_dir) {
  return ListDir(runtime_dir, S_IFDIR,
                 [](const std::string& name) { return ValidateNamespace(name).ok(); });
}

Result<std::vector<std::string>> ListDeviceKeys(const std::string& namespace_dir) {
  return ListDir(namespace_dir, S_IFDIR,
                 [](const std::string& name) { return ValidateDeviceKey(name).ok(); });
}

namespace {
// Walks the layout <runtime>/<namespace>/<device key>/ and collects what `list` finds in each
// device dir (full socket paths): the one walker of ListAllCacheSockets and ListAllKeeperSockets.
template <typename ListFn>
Result<std::vector<SocketEntry>> WalkDeviceDirs(const std::string& runtime_dir, ListFn list) {
  std::vector<SocketEntry> out;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> namespaces, ListNamespaces(runtime_dir));
  for (const std::string& ns : namespaces) {
    const std::string ns_dir = runtime_dir + "/" + ns;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> keys, ListDeviceKeys(ns_dir));
    for (const std::string& key : keys) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> sockets, list(ns_dir + "/" + key));
      for (std::string& s : sockets) out.push_back({ns, key, std::move(s)});
    }
  }
  return out;
}
}  // namespace

Result<std::vector<SocketEntry>> ListAllCacheSockets(const std::string& runtime_dir) {
  return WalkDeviceDirs(runtime_dir,
                        [](const std::string& device_dir) { return ListCacheSockets(device_dir); });
}

std::string LockPathFor(const std::string& socket_path) {
  constexpr std::string_view kSuffix = ".sock";
  if (socket_path.ends_with(kSuffix)) {
    return socket_path.substr(0, socket_path.size() - kSuffix.size()) + ".lock";
  }
  return socket_path + ".lock";
}

std::string BudgetLedgerPath(const std::string& device_dir) {
  return device_dir + "/budget.ledger";
}

std::string BudgetLedgerLockPath(const std::string& device_dir) {
  return BudgetLedgerPath(device_dir) + ".lock";
}

std::string BudgetConfigPath(const std::string& device_dir) { return device_dir + "/budget.conf"; }

std::string KeeperSocketFor(const std::string& socket_path) {
  constexpr std::string_view kSuffix = ".sock";
  if (socket_path.ends_with(kSuffix)) {
    return socket_path.substr(0, socket_path.size() - kSuffix.size()) + ".keeper.sock";
  }
  return socket_path + ".keeper.sock";
}

bool IsKeeperSocket(std::string_view path) { return path.ends_with(".keeper.sock"); }

std::string CacheSocketForKeeper(const std::string& keeper_socket) {
  constexpr std::string_view kSuffix = ".keeper.sock";
  if (!keeper_socket.ends_with(kSuffix)) return keeper_socket;
  return keeper_socket.substr(0, keeper_socket.size() - kSuffix.size()) + ".sock";
}

Result<std::vector<DeviceDirEntry>> ListAllDeviceDirs(const std::string& runtime_dir) {
  std::vector<DeviceDirEntry> out;
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> namespaces, ListNamespaces(runtime_dir));
  for (const std::string& ns : namespaces) {
    const std::string ns_dir = runtime_dir + "/" + ns;
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> keys, ListDeviceKeys(ns_dir));
    for (const std::string& key : keys) out.push_back({ns, key, ns_dir + "/" + key});
  }
  return out;
}

Result<std::vector<std::string>> ListCacheIdentities(const std::string& device_dir) {
  constexpr std::string_view kSock = ".sock";
  constexpr std::string_view kLock = ".lock";
  constexpr std::string_view kKeeperLock = ".keeper.lock";
  std::vector<std::string> sockets;
  // Sockets: a cache's own, or its keeper's (whose cache socket follows by the keeper rule).
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> socket_names,
                               ListDir(device_dir, S_IFSOCK, [&](const std::string& name) {
                                 return name.size() > kSock.size() && name.ends_with(kSock);
                               }));
  sockets.reserve(socket_names.size());
  for (const std::string& name : socket_names) {
    sockets.push_back(CacheSocketForKeeper(device_dir + "/" + name));
  }
  // Lock files: the cache's (LockPathFor(socket)) or its keeper's
  // (LockPathFor(KeeperSocketFor(socket))). A name is taken for a cache's only when the rules
  // give it back from the socket found, so this inverse never disagrees with them.
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> lock_names,
                               ListDir(device_dir, S_IFREG, [&](const std::string& name) {
                                 return name.size() > kLock.size() && name.ends_with(kLock);
                               }));
  for (const std::string& name : lock_names) {
    const std::string path = device_dir + "/" + name;
    if (path == BudgetLedgerLockPath(device_dir)) continue;  // the device's, no cache's
    const bool keeper = name.ends_with(kKeeperLock) && name.size() > kKeeperLock.size();
    const std::string stem =
        path.substr(0, path.size() - (keeper ? kKeeperLock.size() : kLock.size()));
    const std::string socket = stem + std::string(kSock);
    const std::string expected =
        keeper ? LockPathFor(KeeperSocketFor(socket)) : LockPathFor(socket);
    if (expected == path) sockets.push_back(socket);
  }
  std::sort(sockets.begin(), sockets.end());
  sockets.erase(std::unique(sockets.begin(), sockets.end()), sockets.end());
  return sockets;
}

Result<std::vector<SocketEntry>> ListAllKeeperSockets(const std::string& runtime_dir) {
  return WalkDeviceDirs(
      runtime_dir, [](const std::string& device_dir) -> Result<std::vector<std::string>> {
        WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<std::string> names,
                                     ListDir(device_dir, S_IFSOCK, [](const std::string& name) {
                                       return IsKeeperSocket(name) &&
                                              name.size() > std::string_view(".keeper.sock").size();
                                     }));
        for (std::string& name : names) name = device_dir + "/" + name;
        return names;
      });
}

}  // namespace weightcache::identity
