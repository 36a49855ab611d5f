// Which caches a new cache may seed from (client/peer_caches.h, docs/seeding.md), over a fake
// runtime dir: the sockets named as our cache under every other device key of our namespace,
// sorted by device key. Our own device, other digests, other namespaces, names that are not
// device keys and an explicit-socket identity are never listed. Whether a listed one is live
// and of our config is discovery's question (tests/integration/seed_test.cc asks it).
#include "client/peer_caches.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "identity/paths.h"
#include "support/test_env.h"

namespace weightcache::client {
namespace {

identity::CacheConfig Config(const std::string& revision) {
  identity::CacheConfig config;
  config.model_id = "tiny";
  config.revision = revision;
  config.checkpoint_fingerprint = std::string(64, 'a');
  config.checkpoint_files = std::string(64, 'b');
  config.tier = Tier::kHost;
  return config;
}

// A device key as the inventory gives it ("GPU-" and a UUID).
std::string Gpu(int i) { return "GPU-00000000-0000-0000-0000-00000000000" + std::to_string(i); }

class PeerCachesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ours_.config = Config("main");
    ours_.device_key = Gpu(0);
    ours_.paths.runtime_dir = dir_.path();
    ours_.paths.namespace_name = "default";
    ours_.paths.namespace_dir = dir_.Join("default");
    ours_.paths.device_key = ours_.device_key;
    ours_.paths.device_dir = ours_.paths.namespace_dir + "/" + Gpu(0);
    ours_.paths.socket = ours_.paths.device_dir + "/" + ours_.config.ShortDigest() + ".sock";
  }
  // A file where a cache's socket would be (PeerCacheSockets only looks at names).
  void Put(const std::string& ns, const std::string& key, const std::string& name) {
    const std::string dir = dir_.Join(ns + "/" + key);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/" + name) << "";
  }

  testing::TempDir dir_;
  ResolvedIdentity ours_;
};

TEST_F(PeerCachesTest, OurCacheUnderEveryOtherDeviceKeyOfOurNamespaceInOrder) {
  const std::string mine = ours_.config.ShortDigest() + ".sock";
  Put("default", Gpu(0), mine);                                     // ourselves
  Put("default", "host", mine);                                     // no affinity: a peer
  Put("default", Gpu(2), mine);                                     // a peer
  Put("default", Gpu(1), mine);                                     // a peer
  Put("default", Gpu(3), Config("other").ShortDigest() + ".sock");  // another config
  Put("default", Gpu(4), "");                                       // an empty device dir
  std::filesystem::create_directories(dir_.Join("default/not a key"));
  std::ofstream(dir_.Join("default/not a key/" + mine)) << "";  // not a device key
  Put("job-b", Gpu(5), mine);                                   // another namespace

  auto peers = PeerCacheSockets(ours_);
  ASSERT_TRUE(peers.ok()) << peers.status().ToString();
  std::vector<std::string> keys;
  for (const PeerCache& p : *peers) {
    keys.push_back(p.device_key);
    EXPECT_EQ(p.socket, ours_.paths.namespace_dir + "/" + p.device_key + "/" + mine);
  }
  EXPECT_EQ(keys, (std::vector<std::string>{Gpu(1), Gpu(2), "host"}));

  // Reaching one is our identity at its paths: its lock beside its socket, no keeper.
  const ResolvedIdentity theirs = PeerIdentity(ours_, peers->front());
  EXPECT_EQ(theirs.config, ours_.config);
  EXPECT_EQ(theirs.device_key, Gpu(1));
  EXPECT_EQ(theirs.paths.socket, peers->front().socket);
  EXPECT_EQ(theirs.paths.lock, identity::LockPathFor(peers->front().socket));
  EXPECT_EQ(theirs.paths.device_dir, ours_.paths.namespace_dir + "/" + Gpu(1));
  EXPECT_TRUE(theirs.paths.keeper_socket.empty());
}

TEST_F(PeerCachesTest, NoNamespaceDirOrAnExplicitSocketHasNoPeers) {
  auto none = PeerCacheSockets(ours_);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->empty());

  Put("default", Gpu(1), ours_.config.ShortDigest() + ".sock");
  ours_.paths.namespace_dir.clear();  // an explicit --socket: no layout to look in
  auto explicit_socket = PeerCacheSockets(ours_);
  ASSERT_TRUE(explicit_socket.ok());
  EXPECT_TRUE(explicit_socket->empty());
}

}  // namespace
}  // namespace weightcache::client
