// RegistryEntry (strict JSON), the fleet key, LookupSources and the Registrar against a real
// etcd on loopback.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "fleet/registrar.h"
#include "fleet/registry_entry.h"
#include "identity/cache_config.h"
#include "support/etcd_server.h"
#include "unit/fleet/fleet_test_util.h"

namespace weightcache::fleet {
namespace {

using ::testing::HasSubstr;
using weightcache::testing::EtcdServer;
using weightcache::testing::StartEtcdOrSkip;

RegistryEntry SampleEntry() {
  RegistryEntry e;
  e.fleet_key = std::string(64, 'f');
  e.digest = std::string(16, '1') + std::string(48, 'd');
  e.node = "node-a.example";
  e.endpoint = "10.0.0.1:7000";
  e.tier = Tier::kHost;
  e.device = "GPU-6c3e1f4a-0b1d-4c2e-9f3a-1234567890ab";
  e.bytes = 1 << 30;
  e.tensors = 291;
  e.state = EntryState::kReady;
  e.pid = 4242;
  e.model_id = "Llama-3.1-8B";
  e.revision = "main";
  e.tp_rank = 1;
  e.tp_size = 2;
  e.manifest_digest = "";
  return e;
}

identity::CacheConfig SampleConfig() {
  identity::CacheConfig c;
  c.model_id = "m";
  c.checkpoint_fingerprint = std::string(64, 'a');
  c.checkpoint_files = std::string(64, 'b');
  return c;
}

TEST(FleetDigestTest, IgnoresOnlyTheNodeLocalFields) {
  const identity::CacheConfig a = SampleConfig();
  identity::CacheConfig b = a;
  b.checkpoint_files = std::string(64, 'c');  // the same files seen on another node
  b.tier = Tier::kHost;
  EXPECT_NE(a.Digest(), b.Digest());
  EXPECT_EQ(a.FleetDigest(), b.FleetDigest());
  EXPECT_EQ(a.FleetDigest().size(), 64u);
  for (auto change : std::vector<std::function<void(identity::CacheConfig&)>>{
           [](auto& c) { c.model_id = "other"; }, [](auto& c) { c.revision = "r2"; },
           [](auto& c) { c.checkpoint_fingerprint = std::string(64, 'e'); },
           [](auto& c) { c.dtype = "bf16"; },
           [](auto& c) {
             c.tp_size = 2;
             c.tp_rank = 1;
           },
           [](auto& c) { c.layout_tag = "other"; }, [](auto& c) { c.source = "published:x"; }}) {
    identity::CacheConfig d = a;
    change(d);
    EXPECT_NE(d.FleetDigest(), a.FleetDigest()) << d.Canonical();
  }
  EXPECT_THAT(identity::CacheConfig::NodeLocalFieldNames(),
              ::testing::ElementsAre("checkpoint_files", "tier"));
}

TEST(RegistryEntryTest, JsonRoundTrip) {
  const RegistryEntry e = SampleEntry();
  auto back = RegistryEntry::FromJsonText(e.ToJsonText());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, e);
  EXPECT_EQ(EntryKey("/weightcache", e),
            "/weightcache/v1/caches/" + std::string(64, 'f') + "/node-a.example/1111111111111111");
  const nlohmann::json j = e.ToJson();
  EXPECT_EQ(j["state"], "ready");
  EXPECT_EQ(j["format"], 1);
}

TEST(RegistryEntryTest, StrictRejects) {
  const nlohmann::json good = SampleEntry().ToJson();
  auto with = [&](const std::string& field, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[field] = value;
    return RegistryEntry::FromJson(j);
  };
  auto without = [&](const std::string& field) {
    nlohmann::json j = good;
    j.erase(field);
    return RegistryEntry::FromJson(j);
  };
  EXPECT_THAT(RegistryEntry::FromJson(nlohmann::json::array()),
              StatusIs(StatusCode::kProtocol, HasSubstr("not a JSON object")));
  EXPECT_THAT(with("extra", 1),
              StatusIs(StatusCode::kProtocol, HasSubstr("unknown field \"extra\"")));
  // A writer's bytes reach the log escaped: no newline or terminal escape gets through.
  EXPECT_THAT(with("x\n\x1b[31mfake", 1),
              StatusIs(StatusCode::kProtocol, HasSubstr("unknown field \"x\\x0a\\x1b[31mfake\"")));
  EXPECT_THAT(without("pid"), StatusIs(StatusCode::kProtocol, HasSubstr("lacks field pid")));
  EXPECT_THAT(with("bytes", "1"),
              StatusIs(StatusCode::kProtocol, HasSubstr("bytes is not a non-negative")));
  EXPECT_THAT(with("bytes", -1),
              StatusIs(StatusCode::kProtocol, HasSubstr("bytes is not a non-negative")));
  EXPECT_THAT(with("tp_size", 1ull << 33),
              StatusIs(StatusCode::kProtocol, HasSubstr("tp_size is out of range")));
  EXPECT_THAT(with("node", 7), StatusIs(StatusCode::kProtocol, HasSubstr("node is not a string")));
  EXPECT_THAT(with("format", 2), StatusIs(StatusCode::kProtocol, HasSubstr("format 2")));
  EXPECT_THAT(with("state", "zombie"), StatusIs(StatusCode::kProtocol, HasSubstr("state")));
  EXPECT_THAT(with("fleet_key", "abc"), StatusIs(StatusCode::kProtocol, HasSubstr("fleet_key")));
  EXPECT_THAT(with("node", "a/b"), StatusIs(StatusCode::kProtocol, HasSubstr("node")));
  EXPECT_THAT(with("endpoint", "nohost"), StatusIs(StatusCode::kProtocol, HasSubstr("endpoint")));
  // A bind address, which would send every filler to its own host.
  for (const char* wildcard : {"0.0.0.0:7400", "[::]:7400", "[0:0::0]:7400"}) {
    EXPECT_THAT(with("endpoint", wildcard),
                StatusIs(StatusCode::kProtocol, HasSubstr("endpoint is a wildcard address")))
        << wildcard;
  }
  for (const char* reachable : {"[::1]:7400", "10.0.0.1:7400", "node-b:7400", "0.0.0.1:7400"}) {
    EXPECT_TRUE(with("endpoint", reachable).ok()) << reachable;
  }
  EXPECT_THAT(with("tier", "disk"), StatusIs(StatusCode::kProtocol, HasSubstr("tier")));
  EXPECT_THAT(with("device", "cuda:0"), StatusIs(StatusCode::kProtocol, HasSubstr("device")));
  EXPECT_THAT(with("pid", 0), StatusIs(StatusCode::kProtocol, HasSubstr("pid")));
  EXPECT_THAT(with("tp_rank", 2), StatusIs(StatusCode::kProtocol, HasSubstr("tp_rank")));
  EXPECT_THAT(with("model_id", ""), StatusIs(StatusCode::kProtocol, HasSubstr("model_id")));
  EXPECT_THAT(with("manifest_digest", "xyz"),
              StatusIs(StatusCode::kProtocol, HasSubstr("manifest_digest")));
  EXPECT_THAT(RegistryEntry::FromJsonText("{\"format\":1,\"format\":1}"),
              StatusIs(StatusCode::kProtocol, HasSubstr("duplicate key")));
  EXPECT_THAT(RegistryEntry::FromJsonText("{"),
              StatusIs(StatusCode::kProtocol, HasSubstr("not valid JSON")));
  EXPECT_THAT(RegistryEntry::FromJsonText(std::string(kMaxEntryBytes + 1, ' ')),
              StatusIs(StatusCode::kProtocol, HasSubstr("larger than")));
}

TEST(RegistryNamesTest, PrefixAndNodeRules) {
  EXPECT_TRUE(ValidatePrefix("/weightcache").ok());
  EXPECT_TRUE(ValidatePrefix("/a/b").ok());
  for (const char* bad : {"", "weightcache", "/a/", "/", "//a", "/a b"}) {
    EXPECT_THAT(ValidatePrefix(bad),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("registry prefix")))
        << bad;
  }
  EXPECT_TRUE(ValidateNodeName("gpu-node-7.cluster").ok());
  EXPECT_THAT(ValidateNodeName(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("node name")));
  EXPECT_THAT(ValidateNodeName("a/b"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("node name")));
}

class RegistryEtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = StartEtcdOrSkip();
    if (etcd_ == nullptr) return;
  }

  std::unique_ptr<Registrar> MakeRegistrar(std::chrono::seconds ttl) {
    RegistrarOptions options;
    options.ttl = ttl;
    options.min_backoff = std::chrono::milliseconds(50);
    EtcdOptions client_options;
    client_options.endpoints = {etcd_->endpoint()};
    client_options.timeout = std::chrono::milliseconds(1000);
    auto registrar = Registrar::Create(*EtcdClient::Create(client_options), options);
    EXPECT_TRUE(registrar.ok()) << registrar.status().ToString();
    return std::move(registrar).value();
  }

  // The entry etcd holds under `e`'s key, or std::nullopt.
  std::optional<RegistryEntry> Stored(const RegistryEntry& e) {
    auto kv = etcd_->Client().Get(EntryKey("/weightcache", e));
    if (!kv.ok()) return std::nullopt;
    auto parsed = RegistryEntry::FromJsonText(kv->value);
    if (!parsed.ok()) return std::nullopt;
    return *parsed;
  }

  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(RegistryEtcdTest, LookupSourcesSkipsMalformedValues) {
  const EtcdClient client = etcd_->Client();
  RegistryEntry a = SampleEntry();
  RegistryEntry b = SampleEntry();
  b.node = "node-b";
  RegistryEntry other = SampleEntry();
  other.fleet_key = std::string(64, 'e');
  for (const RegistryEntry& e : {a, b, other}) {
    ASSERT_TRUE(client.Put(EntryKey("/weightcache", e), e.ToJsonText()).ok());
  }
  const std::string under = FleetKeyPrefix("/weightcache", a.fleet_key);
  ASSERT_TRUE(client.Put(under + "garbage/1111111111111111", "{not json").ok());
  RegistryEntry lying = SampleEntry();
  lying.node = "node-c";
  ASSERT_TRUE(client.Put(under + "node-d/1111111111111111", lying.ToJsonText()).ok());  // wrong key

  auto found = LookupSources(client, "/weightcache", a.fleet_key);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_EQ(found->size(), 2u);
  EXPECT_EQ((*found)[0], a);
  EXPECT_EQ((*found)[1], b);
  auto all = LookupEntries(client, "/weightcache", std::nullopt);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);
  EXPECT_THAT(LookupSources(client, "/weightcache", "nothex"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("fleet key")));
}

TEST_F(RegistryEtcdTest, RegistrarPublishesUpdatesAndWithdraws) {
  auto registrar = MakeRegistrar(std::chrono::seconds(30));
  RegistryEntry e = SampleEntry();
  ASSERT_TRUE(registrar->Publish(e).ok());
  ASSERT_TRUE(PollUntil([&] { return Stored(e) == e; })) << etcd_->Log();
  const int64_t lease = registrar->lease();
  EXPECT_NE(lease, 0);
  EXPECT_EQ(etcd_->Client().Get(EntryKey("/weightcache", e))->lease, lease);

  e.state = EntryState::kDemoted;
  e.tier = Tier::kHost;
  ASSERT_TRUE(registrar->Publish(e).ok());
  ASSERT_TRUE(PollUntil([&] { return Stored(e) == e; }));
  EXPECT_EQ(registrar->lease(), lease);  // the same lease

  RegistryEntry moved = e;
  moved.node = "elsewhere";
  EXPECT_THAT(registrar->Publish(moved),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("differs")));
  RegistryEntry invalid = e;
  invalid.pid = 0;
  EXPECT_THAT(registrar->Publish(invalid),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("pid")));

  registrar->Stop();  // revokes: gone at once, no poll
  EXPECT_EQ(Stored(e), std::nullopt);
  EXPECT_EQ(registrar->lease(), 0);
}

TEST_F(RegistryEtcdTest, RegistrarRegistersAgainWhenItsLeaseIsLost) {
  auto registrar = MakeRegistrar(std::chrono::seconds(2));
  const RegistryEntry e = SampleEntry();
  ASSERT_TRUE(registrar->Publish(e).ok());
  ASSERT_TRUE(PollUntil([&] { return Stored(e).has_value(); }));
  const int64_t first = registrar->lease();
  ASSERT_TRUE(etcd_->Client().LeaseRevoke(first).ok());  // an operator, or etcd losing it
  EXPECT_EQ(Stored(e), std::nullopt);
  ASSERT_TRUE(PollUntil([&] { return Stored(e).has_value(); })) << "not registered again";
  EXPECT_NE(registrar->lease(), first);
}

TEST_F(RegistryEtcdTest, RegistrarSurvivesAnEtcdOutage) {
  auto registrar = MakeRegistrar(std::chrono::seconds(2));
  const RegistryEntry e = SampleEntry();
  etcd_->Kill();
  ASSERT_TRUE(registrar->Publish(e).ok());  // etcd is down: Publish does not wait for it
  // A few retries fail while it is down (the registrar only logs them)...
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE(etcd_->Restart().ok()) << etcd_->Log();
  // ...and once etcd is back the entry is registered.
  ASSERT_TRUE(PollUntil([&] { return Stored(e).has_value(); }))
      << "not registered after the restart";
  etcd_->Kill();
  // Down for longer than the TTL: etcd keeps the lease across its restart, and the registrar
  // renews it once etcd answers; Stop then revokes it (the entry is gone, not left to expire).
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  ASSERT_TRUE(etcd_->Restart().ok()) << etcd_->Log();
  ASSERT_TRUE(PollUntil([&] { return Stored(e).has_value(); }))
      << "not back after the second restart";
  registrar->Stop();
  EXPECT_EQ(Stored(e), std::nullopt);
}

TEST(RegistrarCreateTest, RejectsBadOptions) {
  EtcdOptions client_options;
  client_options.endpoints = {"http://127.0.0.1:1"};
  RegistrarOptions options;
  options.prefix = "nope";
  EXPECT_THAT(Registrar::Create(*EtcdClient::Create(client_options), options),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("registry prefix")));
  options = {};
  options.ttl = std::chrono::seconds(0);
  EXPECT_THAT(Registrar::Create(*EtcdClient::Create(client_options), options),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("TTL")));
}

}  // namespace
}  // namespace weightcache::fleet
