// EtcdClient against a real etcd on loopback (support/etcd_server.h): put/range/deleterange,
// leases (grant, keepalive, revoke, expiry), endpoints that are down.
#include "fleet/etcd_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "support/etcd_server.h"
#include "unit/fleet/fleet_test_util.h"

namespace weightcache::fleet {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using weightcache::testing::EtcdServer;
using weightcache::testing::StartEtcdOrSkip;

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = StartEtcdOrSkip();
    if (etcd_ == nullptr) return;
  }

  std::unique_ptr<EtcdServer> etcd_;
};

TEST(Base64Test, RoundTripsAndRejectsMalformedText) {
  for (const std::string& s :
       {std::string(), std::string("a"), std::string("ab"), std::string("abc"),
        std::string("\0\xff/+", 4), std::string(1000, 'x')}) {
    auto back = Base64Decode(Base64Encode(s));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, s);
  }
  EXPECT_EQ(Base64Encode("/weightcache"), "L3dlaWdodGNhY2hl");
  EXPECT_THAT(Base64Decode("abc"), StatusIs(StatusCode::kProtocol, HasSubstr("multiple of 4")));
  EXPECT_THAT(Base64Decode("ab!="), StatusIs(StatusCode::kProtocol, HasSubstr("invalid base64")));
  EXPECT_THAT(Base64Decode("a=bc"), StatusIs(StatusCode::kProtocol, HasSubstr("invalid base64")));
  EXPECT_THAT(Base64Decode("ab=c"), StatusIs(StatusCode::kProtocol, HasSubstr("invalid base64")));
}

TEST(PrefixRangeEndTest, IncrementsTheLastByte) {
  EXPECT_EQ(PrefixRangeEnd("/a/"), "/a0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
}

TEST(RegistryUrlTest, ParsesEndpointsAndRejectsOthers) {
  auto plain = ParseRegistryUrl("etcd://127.0.0.1:2379,node-b:2380");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_THAT(plain->endpoints, ElementsAre("http://127.0.0.1:2379", "http://node-b:2380"));
  auto tls = ParseRegistryUrl("etcds://[::1]:2379");
  ASSERT_TRUE(tls.ok()) << tls.status().ToString();
  EXPECT_THAT(tls->endpoints, ElementsAre("https://[::1]:2379"));
  EXPECT_THAT(ParseRegistryUrl("http://h:1"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("etcd://")));
  EXPECT_THAT(ParseRegistryUrl("etcd://h"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"h\" is not HOST:PORT")));
  EXPECT_THAT(ParseRegistryUrl("etcd://h:99999"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(ParseRegistryUrl("etcd://h:1,"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
  EXPECT_THAT(ParseRegistryUrl("etcd://a b:1"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("HOST:PORT")));
}

TEST(EtcdClientCreateTest, RejectsBadOptions) {
  EXPECT_THAT(EtcdClient::Create({}),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no endpoint")));
  EtcdOptions tls;
  tls.endpoints = {"https://127.0.0.1:1"};
  EXPECT_THAT(EtcdClient::Create(tls),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("CA file")));
  tls.tls.ca_file = "/ca.pem";
  tls.tls.cert_file = "/c.pem";
  EXPECT_THAT(EtcdClient::Create(tls),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("its key")));
  EtcdOptions ftp;
  ftp.endpoints = {"ftp://127.0.0.1:1"};
  EXPECT_THAT(EtcdClient::Create(ftp), StatusIs(StatusCode::kInvalidArgument, HasSubstr("ftp://")));
}

TEST_F(EtcdClientTest, PutRangeAndDeleteRange) {
  const EtcdClient client = etcd_->Client();
  ASSERT_TRUE(client.Put("/t/a", "1").ok());
  ASSERT_TRUE(client.Put("/t/b", std::string("\0binary\xff", 8)).ok());
  ASSERT_TRUE(client.Put("/u/c", "3").ok());
  auto kvs = client.RangePrefix("/t/");
  ASSERT_TRUE(kvs.ok()) << kvs.status().ToString();
  ASSERT_EQ(kvs->size(), 2u);
  EXPECT_EQ((*kvs)[0].key, "/t/a");
  EXPECT_EQ((*kvs)[0].value, "1");
  EXPECT_EQ((*kvs)[0].lease, 0);
  EXPECT_GT((*kvs)[0].mod_revision, 0);
  EXPECT_EQ((*kvs)[1].value, std::string("\0binary\xff", 8));
  auto one = client.Get("/u/c");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->value, "3");
  EXPECT_THAT(client.Get("/u/none"), StatusIs(StatusCode::kNotFound, HasSubstr("/u/none")));
  auto empty = client.RangePrefix("/nothing/");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());

  auto deleted = client.DeletePrefix("/t/");
  ASSERT_TRUE(deleted.ok()) << deleted.status().ToString();
  EXPECT_EQ(*deleted, 2);
  EXPECT_TRUE(client.RangePrefix("/t/")->empty());
  EXPECT_EQ(client.RangePrefix("/u/")->size(), 1u);
}

TEST_F(EtcdClientTest, LeaseGrantKeepAliveRevoke) {
  const EtcdClient client = etcd_->Client();
  auto lease = client.LeaseGrant(30);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  ASSERT_TRUE(client.Put("/l/k", "v", *lease).ok());
  EXPECT_EQ(client.Get("/l/k")->lease, *lease);
  auto ttl = client.LeaseKeepAlive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status().ToString();
  EXPECT_EQ(*ttl, 30);
  ASSERT_TRUE(client.LeaseRevoke(*lease).ok());
  EXPECT_THAT(client.Get("/l/k"), StatusIs(StatusCode::kNotFound, HasSubstr("/l/k")));  // at once
  EXPECT_THAT(client.LeaseKeepAlive(*lease), StatusIs(StatusCode::kNotFound, HasSubstr("is gone")));
  EXPECT_TRUE(client.LeaseRevoke(*lease).ok());  // already gone: no error
  EXPECT_THAT(client.Put("/l/k", "v", *lease),
              StatusIs(StatusCode::kNotFound, HasSubstr("lease not found")));
  EXPECT_THAT(client.LeaseGrant(0), StatusIs(StatusCode::kInvalidArgument, HasSubstr(">= 1")));
}

TEST_F(EtcdClientTest, ALeaseLeftToExpireRemovesItsKey) {
  const EtcdClient client = etcd_->Client();
  auto lease = client.LeaseGrant(1);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  ASSERT_TRUE(client.Put("/e/k", "v", *lease).ok());
  ASSERT_TRUE(client.Get("/e/k").ok());
  // No renewal: etcd expires the lease on its own (its TTL is 1 s; the poll allows 30).
  EXPECT_TRUE(PollUntil([&] {
    return client.Get("/e/k").status().code() == StatusCode::kNotFound;
  })) << "the key outlived its lease";
}

TEST(EtcdClientDownTest, AnUnreachableEndpointIsAnErrorNamingIt) {
  EtcdOptions options;
  const int port = weightcache::testing::FreeLoopbackPort();  // nothing listens there
  options.endpoints = {"http://127.0.0.1:" + std::to_string(port)};
  options.timeout = std::chrono::milliseconds(500);
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  EXPECT_THAT(client->Put("/k", "v"),
              StatusIs(StatusCode::kUnavailable,
                       HasSubstr("etcd http://127.0.0.1:" + std::to_string(port))));
  EXPECT_THAT(client->LeaseGrant(5),
              StatusIs(StatusCode::kUnavailable, HasSubstr("/v3/lease/grant")));
}

TEST_F(EtcdClientTest, TheSecondEndpointServesWhenTheFirstIsDead) {
  EtcdOptions options;
  const int dead = weightcache::testing::FreeLoopbackPort();
  options.endpoints = {"http://127.0.0.1:" + std::to_string(dead), etcd_->endpoint()};
  auto client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(client->Put("/two/k", "v").ok());
  EXPECT_EQ(etcd_->Client().Get("/two/k")->value, "v");
}

TEST(EtcdTlsTest, HttpsWithTheCaAndAClientCertificate) {
  auto server = StartEtcdOrSkip(weightcache::testing::EtcdTransport::kTls);
  if (server == nullptr) return;
  const EtcdClient client = server->Client();
  ASSERT_TRUE(client.Put("/tls/k", "v").ok());
  EXPECT_EQ(client.Get("/tls/k")->value, "v");

  // etcd requires a client certificate (--client-cert-auth): without one, no answer.
  EtcdOptions no_cert;
  no_cert.endpoints = {server->endpoint()};
  no_cert.tls.ca_file = server->tls_files().ca_file;
  EXPECT_THAT(EtcdClient::Create(no_cert)->Get("/tls/k"),
              StatusIs(StatusCode::kUnavailable, HasSubstr("etcd " + server->endpoint())));
  // A server certificate that our CA did not sign is refused.
  EtcdOptions wrong_ca = no_cert;
  wrong_ca.tls = server->tls_files();
  wrong_ca.tls.ca_file = server->tls_files().cert_file;  // not a CA
  EXPECT_THAT(EtcdClient::Create(wrong_ca)->Get("/tls/k"),
              StatusIs(StatusCode::kUnavailable, HasSubstr("etcd " + server->endpoint())));
}

}  // namespace
}  // namespace weightcache::fleet
