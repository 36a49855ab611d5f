#include "identity/paths.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "common/unique_fd.h"
#include "os/unix_socket.h"
#include "support/test_env.h"
#include "unit/identity/test_devices.h"

namespace weightcache::identity {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestUuid;
using ::weightcache::testing::TempDir;
using ::weightcache::testing::WriteFile;

CacheConfig Config(uint32_t tp_rank = 0) {
  CacheConfig c;
  c.model_id = "m";
  c.checkpoint_fingerprint = std::string(64, 'a');
  c.checkpoint_files = std::string(64, 'b');
  c.tp_size = 2;
  c.tp_rank = tp_rank;
  return c;
}

PathOptions Options(std::map<std::string, std::string, std::less<>> env) {
  PathOptions o;
  o.env = MapEnv(std::move(env));
  o.uid = 1000;
  return o;
}

// Sets the process umask for one test and restores it.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(old_); }

 private:
  mode_t old_;
};

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(RuntimeDirTest, Precedence) {
  auto env = MapEnv({{"WEIGHTCACHE_RUNTIME_DIR", "/env/wc"}, {"XDG_RUNTIME_DIR", "/run/user/7"}});
  EXPECT_EQ(ResolveRuntimeDir("/flag/wc", env, 7)->path, "/flag/wc");
  EXPECT_EQ(ResolveRuntimeDir("/flag/wc", env, 7)->origin, "--runtime-dir");
  EXPECT_EQ(ResolveRuntimeDir("", env, 7)->path, "/env/wc");
  EXPECT_EQ(ResolveRuntimeDir("", MapEnv({{"XDG_RUNTIME_DIR", "/run/user/7"}}), 7)->path,
            "/run/user/7/weightcache");
  EXPECT_EQ(ResolveRuntimeDir("", MapEnv({}), 7)->path, "/tmp/weightcache-7");
  EXPECT_EQ(ResolveRuntimeDir("", MapEnv({}), 7)->origin, "default");
  // Empty variables are unset; a relative XDG_RUNTIME_DIR is ignored as the XDG spec says.
  EXPECT_EQ(ResolveRuntimeDir(
                "", MapEnv({{"WEIGHTCACHE_RUNTIME_DIR", ""}, {"XDG_RUNTIME_DIR", "run/user/7"}}), 7)
                ->path,
            "/tmp/weightcache-7");
  EXPECT_EQ(ResolveRuntimeDir("/a/b/", env, 7)->path, "/a/b");
}

TEST(RuntimeDirTest, RelativeRuntimeDirIsRefused) {
  Result<RuntimeDir> r = ResolveRuntimeDir("rel/dir", MapEnv({}), 7);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("runtime dir \"rel/dir\" (from --runtime-dir) must be an absolute path"));
}

TEST(CachePathsTest, DefaultLayoutMatchesTheSpecAndIs97Bytes) {
  const CacheConfig c = Config();
  Result<CachePaths> p =
      ResolveCachePaths(c, TestUuid(3), Options({{"XDG_RUNTIME_DIR", "/run/user/1000"}}));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::string dir = "/run/user/1000/weightcache/default/" + TestUuid(3);
  EXPECT_EQ(p->runtime_dir, "/run/user/1000/weightcache");
  EXPECT_EQ(p->namespace_dir, "/run/user/1000/weightcache/default");
  EXPECT_EQ(p->device_dir, dir);
  EXPECT_EQ(p->socket, dir + "/" + c.Digest().substr(0, 16) + ".sock");
  EXPECT_EQ(p->lock, dir + "/" + c.Digest().substr(0, 16) + ".lock");
  EXPECT_EQ(p->digest, c.Digest());
  EXPECT_EQ(p->socket.size(), 97u);
  EXPECT_FALSE(p->explicit_socket);
}

TEST(CachePathsTest, DifferentGpusGetDifferentSocketsAndLocksForTheSameRank) {
  // Two jobs, each with its own tp_rank 0, on different GPUs: they must never meet.
  auto options = Options({{"XDG_RUNTIME_DIR", "/run/user/1000"}});
  Result<CachePaths> gpu2 = ResolveCachePaths(Config(0), TestUuid(2), options);
  Result<CachePaths> gpu6 = ResolveCachePaths(Config(0), TestUuid(6), options);
  ASSERT_TRUE(gpu2.ok() && gpu6.ok());
  EXPECT_NE(gpu2->socket, gpu6->socket);
  EXPECT_NE(gpu2->lock, gpu6->lock);
  EXPECT_THAT(gpu2->socket, HasSubstr(TestUuid(2)));
  EXPECT_THAT(gpu6->socket, HasSubstr(TestUuid(6)));
  // The same GPU with a different rank (a different config) is a different cache, too.
  Result<CachePaths> gpu2_rank1 = ResolveCachePaths(Config(1), TestUuid(2), options);
  ASSERT_TRUE(gpu2_rank1.ok());
  EXPECT_NE(gpu2->socket, gpu2_rank1->socket);
  EXPECT_EQ(gpu2->device_dir, gpu2_rank1->device_dir);
}

TEST(CachePathsTest, HostKeyAndNamespace) {
  PathOptions o = Options({});
  o.runtime_dir_flag = "/rt";
  o.namespace_name = "job-7.a_b";
  Result<CachePaths> p = ResolveCachePaths(Config(), kHostDeviceKey, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->device_dir, "/rt/job-7.a_b/host");
}

TEST(CachePathsTest, BadNamespacesAndDeviceKeysAreRefused) {
  for (const std::string ns : {"", ".", "..", "a/b", "a b", "ü"}) {
    PathOptions o = Options({});
    o.namespace_name = ns;
    Result<CachePaths> p = ResolveCachePaths(Config(), TestUuid(0), o);
    ASSERT_FALSE(p.ok()) << ns;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr("namespace \"" + ns + "\" must match"));
  }
  Result<CachePaths> index_key = ResolveCachePaths(Config(), "0", Options({}));
  ASSERT_FALSE(index_key.ok());
  EXPECT_THAT(index_key.status().message(),
              HasSubstr("device key \"0\" is neither \"host\" nor a GPU-/MIG- UUID"));
  Result<CachePaths> legacy =
      ResolveCachePaths(Config(), "MIG-GPU-11111111-1111-2222-3333-000000000001/1/0", Options({}));
  ASSERT_FALSE(legacy.ok());
  EXPECT_THAT(legacy.status().message(), HasSubstr("cannot be a path component"));
}

TEST(CachePathsTest, SocketTemplateExpandsEveryPlaceholder) {
  PathOptions o = Options({});
  o.runtime_dir_flag = "/rt";
  o.namespace_name = "ns";
  o.socket_flag =
      "{runtime_dir}/{namespace}/{device_uuid}/t{tp_rank}p{pp_rank}e{ep_rank}-{digest}.s";
  const CacheConfig c = Config(1);
  Result<CachePaths> p = ResolveCachePaths(c, TestUuid(4), o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::string expected =
      "/rt/ns/" + TestUuid(4) + "/t1p0e0-" + c.Digest().substr(0, 16) + ".s";
  EXPECT_EQ(p->socket, expected);
  EXPECT_EQ(p->lock, expected + ".lock");
  EXPECT_EQ(p->device_dir, "/rt/ns/" + TestUuid(4));
  EXPECT_TRUE(p->explicit_socket);
  EXPECT_EQ(p->socket_origin, "--socket");
}

TEST(CachePathsTest, TemplateWithoutDeviceUuidIsRefused) {
  PathOptions o = Options({});
  o.socket_flag = "/rt/{namespace}/rank{tp_rank}.sock";
  Result<CachePaths> p = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("lacks {device_uuid}"));
  EXPECT_THAT(p.status().message(), HasSubstr("/rt/{namespace}/rank{tp_rank}.sock"));
}

TEST(CachePathsTest, TemplateErrors) {
  PathOptions o = Options({});
  o.socket_flag = "/rt/{device_uuid}/{rank}.sock";
  Result<CachePaths> unknown = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("unknown placeholder {rank}"));
  o.socket_flag = "/rt/{device_uuid}/{digest.sock";
  Result<CachePaths> open = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_FALSE(open.ok());
  EXPECT_THAT(open.status().message(), HasSubstr("unbalanced"));
  o.socket_flag = "rel/{device_uuid}.sock";
  Result<CachePaths> relative = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_FALSE(relative.ok());
  EXPECT_THAT(relative.status().message(), HasSubstr("must be absolute"));
}

TEST(CachePathsTest, LiteralSocketAndEnvironmentSocket) {
  PathOptions o = Options({{"WEIGHTCACHE_SOCKET", "/env/{device_uuid}.sock"}});
  Result<CachePaths> from_env = ResolveCachePaths(Config(), TestUuid(1), o);
  ASSERT_TRUE(from_env.ok()) << from_env.status().ToString();
  EXPECT_EQ(from_env->socket, "/env/" + TestUuid(1) + ".sock");
  EXPECT_EQ(from_env->socket_origin, "WEIGHTCACHE_SOCKET");
  o.socket_flag = "/srv/wc/only.sock";  // a literal path needs no placeholder; flag wins
  Result<CachePaths> literal = ResolveCachePaths(Config(), TestUuid(1), o);
  ASSERT_TRUE(literal.ok()) << literal.status().ToString();
  EXPECT_EQ(literal->socket, "/srv/wc/only.sock");
  EXPECT_EQ(literal->lock, "/srv/wc/only.lock");
  EXPECT_EQ(literal->device_dir, "/srv/wc");
}

// One lock rule (LockPathFor) for every socket: an explicit --socket that names a layout
// path resolves to the layout's own lock, so a daemon started either way excludes the other.
TEST(CachePathsTest, ExplicitSocketAtTheLayoutPathSharesTheLayoutLock) {
  PathOptions layout = Options({});
  layout.runtime_dir_flag = "/rt";
  Result<CachePaths> by_layout = ResolveCachePaths(Config(), TestUuid(2), layout);
  ASSERT_TRUE(by_layout.ok()) << by_layout.status().ToString();
  PathOptions explicit_socket = layout;
  explicit_socket.socket_flag = by_layout->socket;
  Result<CachePaths> by_flag = ResolveCachePaths(Config(), TestUuid(2), explicit_socket);
  ASSERT_TRUE(by_flag.ok()) << by_flag.status().ToString();
  EXPECT_TRUE(by_flag->explicit_socket);
  EXPECT_EQ(by_flag->socket, by_layout->socket);
  EXPECT_EQ(by_flag->lock, by_layout->lock);
  EXPECT_EQ(by_layout->lock, LockPathFor(by_layout->socket));
}

// The keeper's paths (docs/keeper.md) come from the socket by one rule, layout or explicit.
TEST(CachePathsTest, KeeperSocketAndLockSitNextToTheCacheSocket) {
  PathOptions o = Options({});
  o.runtime_dir_flag = "/rt";
  Result<CachePaths> layout = ResolveCachePaths(Config(), TestUuid(1), o);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const std::string stem = layout->device_dir + "/" + layout->digest.substr(0, 16);
  EXPECT_EQ(layout->keeper_socket, stem + ".keeper.sock");
  EXPECT_EQ(layout->keeper_lock, stem + ".keeper.lock");
  EXPECT_EQ(layout->keeper_socket, KeeperSocketFor(layout->socket));
  EXPECT_EQ(layout->keeper_lock, LockPathFor(layout->keeper_socket));
  o.socket_flag = "/srv/wc/only.socket";  // a name without .sock keeps its whole name
  Result<CachePaths> literal = ResolveCachePaths(Config(), TestUuid(1), o);
  ASSERT_TRUE(literal.ok()) << literal.status().ToString();
  EXPECT_EQ(literal->keeper_socket, "/srv/wc/only.socket.keeper.sock");
  EXPECT_EQ(literal->keeper_lock, "/srv/wc/only.socket.keeper.lock");
  EXPECT_TRUE(IsKeeperSocket(layout->keeper_socket));
  EXPECT_FALSE(IsKeeperSocket(layout->socket));
}

// A socket at the limit is still served; only its keeper is off (7 more bytes would not fit).
TEST(CachePathsTest, KeeperPathOverTheSunPathLimitLeavesTheCacheWithoutAKeeper) {
  const std::string tail = "/default/" + TestUuid(0) + "/0123456789abcdef.sock";
  PathOptions o = Options({});
  o.runtime_dir_flag = "/" + std::string(os::kMaxUnixPathLength - tail.size() - 1, 'r');
  Result<CachePaths> at_limit = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_TRUE(at_limit.ok()) << at_limit.status().ToString();
  EXPECT_EQ(at_limit->socket.size(), os::kMaxUnixPathLength);
  EXPECT_EQ(at_limit->keeper_socket, "");
  EXPECT_EQ(at_limit->keeper_lock, "");
}

TEST(CachePathsTest, SocketPathOverTheSunPathLimitIsRefusedAtResolution) {
  // /<pad>/weightcache... : pick a runtime dir that makes the socket exactly 107, then 108.
  const std::string tail = "/default/" + TestUuid(0) + "/0123456789abcdef.sock";
  const std::string runtime_107 = "/" + std::string(os::kMaxUnixPathLength - tail.size() - 1, 'r');
  PathOptions o = Options({});
  o.runtime_dir_flag = runtime_107;
  Result<CachePaths> at_limit = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_TRUE(at_limit.ok()) << at_limit.status().ToString();
  EXPECT_EQ(at_limit->socket.size(), 107u);

  o.runtime_dir_flag = runtime_107 + "x";
  Result<CachePaths> over = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(over.status().message(), HasSubstr("socket path " + runtime_107 + "x/default/"));
  EXPECT_THAT(over.status().message(), HasSubstr("is 108 bytes, over the 107-byte sun_path limit"));

  PathOptions t = Options({});
  t.socket_flag = "/" + std::string(100, 's') + "/{device_uuid}";
  Result<CachePaths> long_template = ResolveCachePaths(Config(), TestUuid(0), t);
  ASSERT_FALSE(long_template.ok());
  EXPECT_THAT(long_template.status().message(), HasSubstr("107-byte sun_path limit"));
}

// ---- directories -------------------------------------------------------------------------

CachePaths PathsUnder(const std::string& runtime_dir, const std::string& key = TestUuid(0)) {
  PathOptions o;
  o.env = MapEnv({});
  o.runtime_dir_flag = runtime_dir;
  return *ResolveCachePaths(Config(), key, o);
}

TEST(CacheDirsTest, CreatesTheLayoutWithMode0700) {
  TempDir tmp;
  const ScopedUmask umask_guard(0);  // the modes must not depend on the caller's umask
  CachePaths p = PathsUnder(tmp.Join("new/rt"));
  ASSERT_TRUE(EnsureCacheDirs(p).ok()) << EnsureCacheDirs(p).ToString();
  EXPECT_EQ(ModeOf(p.runtime_dir), 0700u);
  EXPECT_EQ(ModeOf(p.namespace_dir), 0700u);
  EXPECT_EQ(ModeOf(p.device_dir), 0700u);
  EXPECT_TRUE(EnsureCacheDirs(p).ok());  // idempotent
}

TEST(CacheDirsTest, ModeIsExactEvenUnderARestrictiveUmask) {
  TempDir tmp;
  const ScopedUmask umask_guard(0277);
  CachePaths p = PathsUnder(tmp.Join("rt"));
  ASSERT_TRUE(EnsureCacheDirs(p).ok()) << EnsureCacheDirs(p).ToString();
  EXPECT_EQ(ModeOf(p.device_dir), 0700u);
}

TEST(CacheDirsTest, GroupOrOtherWritableRuntimeDirIsRefused) {
  TempDir tmp;
  const std::string rt = tmp.Join("rt");
  ASSERT_EQ(::mkdir(rt.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(rt.c_str(), 0777), 0);
  Status s = EnsureCacheDirs(PathsUnder(rt));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(rt + " has mode 0777, writable by group or others"));
  ASSERT_EQ(::chmod(rt.c_str(), 0720), 0);
  EXPECT_THAT(EnsureCacheDirs(PathsUnder(rt)).message(), HasSubstr("has mode 0720"));
  // Readable by others is tolerated; only write access lets others plant sockets.
  ASSERT_EQ(::chmod(rt.c_str(), 0755), 0);
  EXPECT_TRUE(EnsureCacheDirs(PathsUnder(rt)).ok());
}

TEST(CacheDirsTest, WritableNamespaceDirIsRefusedToo) {
  TempDir tmp;
  CachePaths p = PathsUnder(tmp.Join("rt"));
  ASSERT_TRUE(EnsureCacheDirs(p).ok());
  ASSERT_EQ(::chmod(p.namespace_dir.c_str(), 0770), 0);
  Status s = EnsureCacheDirs(p);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(p.namespace_dir + " has mode 0770"));
}

TEST(CacheDirsTest, RuntimeDirOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to uid 65534";
  TempDir tmp;
  const std::string rt = tmp.Join("rt");
  ASSERT_EQ(::mkdir(rt.c_str(), 0700), 0);
  ASSERT_EQ(::chown(rt.c_str(), 65534, 65534), 0);
  Status s = EnsureCacheDirs(PathsUnder(rt));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(rt + " is owned by uid 65534, not by this user (uid 0)"));
}

TEST(CacheDirsTest, OwnerCheckUsesTheGivenUidWithoutRoot) {
  // The same rule, exercised without root: a directory we own, checked as if we were 65534.
  TempDir tmp;
  const std::string rt = tmp.Join("rt");
  ASSERT_EQ(::mkdir(rt.c_str(), 0700), 0);
  Status s = EnsurePrivateDir(rt, 65534);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("is owned by uid " + std::to_string(::geteuid())));
}

TEST(CacheDirsTest, SymlinkedRuntimeDirIsRefused) {
  TempDir tmp;
  const std::string real = tmp.Join("real");
  const std::string link = tmp.Join("link");
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  Status s = EnsureCacheDirs(PathsUnder(link));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(link + " is a symbolic link"));
}

TEST(CacheDirsTest, NonDirectoryIsRefused) {
  TempDir tmp;
  WriteFile(tmp.Join("file"), "x");
  Status s = EnsureCacheDirs(PathsUnder(tmp.Join("file")));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(tmp.Join("file") + " exists and is not a directory"));
}

TEST(CacheDirsTest, ExplicitSocketDirectoryIsChecked) {
  TempDir tmp;
  const std::string dir = tmp.Join("shared");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);  // like /tmp
  PathOptions o;
  o.env = MapEnv({});
  o.socket_flag = dir + "/{device_uuid}.sock";
  Result<CachePaths> p = ResolveCachePaths(Config(), TestUuid(0), o);
  ASSERT_TRUE(p.ok());
  Status s = EnsureCacheDirs(*p);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr(dir + " has mode 1777"));
}

// ---- listing -------------------------------------------------------------------------------

void BindSocket(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(fd.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << path;
}

TEST(ListSocketsTest, ListsOnlySocketsNamedDotSock) {
  TempDir tmp;
  CachePaths p = PathsUnder(tmp.path());
  ASSERT_TRUE(EnsureCacheDirs(p).ok());
  BindSocket(p.device_dir + "/bbbbbbbbbbbbbbbb.sock");
  BindSocket(p.device_dir + "/aaaaaaaaaaaaaaaa.sock");
  BindSocket(p.device_dir + "/other.socket");
  BindSocket(p.device_dir + "/aaaaaaaaaaaaaaaa.keeper.sock");  // a keeper's: not a cache
  WriteFile(p.device_dir + "/cccccccccccccccc.sock", "not a socket");
  WriteFile(p.device_dir + "/aaaaaaaaaaaaaaaa.lock", "");
  Result<std::vector<std::string>> sockets = ListCacheSockets(p.device_dir);
  ASSERT_TRUE(sockets.ok()) << sockets.status().ToString();
  EXPECT_THAT(*sockets, ElementsAre(p.device_dir + "/aaaaaaaaaaaaaaaa.sock",
                                    p.device_dir + "/bbbbbbbbbbbbbbbb.sock"));
  Result<std::vector<std::string>> missing = ListCacheSockets(tmp.Join("nope"));
  ASSERT_TRUE(missing.ok());
  EXPECT_TRUE(missing->empty());
}

TEST(ListSocketsTest, ListAllWalksNamespacesAndDeviceKeys) {
  TempDir tmp;
  CachePaths gpu = PathsUnder(tmp.path(), TestUuid(1));
  CachePaths host = PathsUnder(tmp.path(), std::string(kHostDeviceKey));
  ASSERT_TRUE(EnsureCacheDirs(gpu).ok());
  ASSERT_TRUE(EnsureCacheDirs(host).ok());
  BindSocket(gpu.socket);
  BindSocket(host.socket);
  std::filesystem::create_directories(tmp.Join("default/not-a-key"));
  std::filesystem::create_directories(tmp.Join("bad ns/host"));
  Result<std::vector<SocketEntry>> all = ListAllCacheSockets(tmp.path());
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].namespace_name, "default");
  EXPECT_EQ((*all)[0].device_key, TestUuid(1));
  EXPECT_EQ((*all)[0].socket, gpu.socket);
  EXPECT_EQ((*all)[1].device_key, "host");
  EXPECT_EQ((*all)[1].socket, host.socket);
  EXPECT_THAT(*ListNamespaces(tmp.path()), ElementsAre("default"));
  EXPECT_THAT(*ListDeviceKeys(tmp.Join("default")), ElementsAre(TestUuid(1), "host"));
}

// The stale-file sweep's walk (daemon/stale_files.h): every cache with any file of its own in the
// dir — socket, lock, keeper socket or keeper lock — as its cache socket, found by the path rules.
TEST(ListSocketsTest, ListCacheIdentitiesFindsACacheByAnyOfItsFiles) {
  TempDir tmp;
  CachePaths p = PathsUnder(tmp.path());
  ASSERT_TRUE(EnsureCacheDirs(p).ok());
  const std::string d = p.device_dir + "/";
  BindSocket(d + "aaaaaaaaaaaaaaaa.sock");
  WriteFile(d + "aaaaaaaaaaaaaaaa.lock", "");
  BindSocket(d + "bbbbbbbbbbbbbbbb.keeper.sock");          // a keeper's socket only
  WriteFile(d + "cccccccccccccccc.keeper.lock", "");       // a keeper's lock only
  WriteFile(d + "dddddddddddddddd.lock", "");              // a cleanly stopped daemon's
  WriteFile(d + "eeeeeeeeeeeeeeee.sock", "not a socket");  // not a socket, no lock: none
  WriteFile(BudgetLedgerPath(p.device_dir), "{}");         // the device's, no cache's
  WriteFile(BudgetLedgerLockPath(p.device_dir), "");
  WriteFile(BudgetConfigPath(p.device_dir), "");
  Result<std::vector<std::string>> caches = ListCacheIdentities(p.device_dir);
  ASSERT_TRUE(caches.ok()) << caches.status().ToString();
  EXPECT_THAT(*caches, ElementsAre(d + "aaaaaaaaaaaaaaaa.sock", d + "bbbbbbbbbbbbbbbb.sock",
                                   d + "cccccccccccccccc.sock", d + "dddddddddddddddd.sock"));
  for (const std::string& socket : *caches) {
    // Each found file is one the rules give back from the socket.
    const bool ours = std::filesystem::exists(LockPathFor(socket)) ||
                      std::filesystem::exists(socket) ||
                      std::filesystem::exists(KeeperSocketFor(socket)) ||
                      std::filesystem::exists(LockPathFor(KeeperSocketFor(socket)));
    EXPECT_TRUE(ours) << socket;
  }
  Result<std::vector<DeviceDirEntry>> dirs = ListAllDeviceDirs(tmp.path());
  ASSERT_TRUE(dirs.ok()) << dirs.status().ToString();
  ASSERT_EQ(dirs->size(), 1u);
  EXPECT_EQ((*dirs)[0].namespace_name, p.namespace_name);
  EXPECT_EQ((*dirs)[0].device_key, p.device_key);
  EXPECT_EQ((*dirs)[0].path, p.device_dir);
  EXPECT_TRUE(ListCacheIdentities(tmp.Join("nope"))->empty());
}

}  // namespace
}  // namespace weightcache::identity
