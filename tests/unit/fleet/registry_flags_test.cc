// The fleet flags `launch` forwards (tools/registry_flags.h RegistryServeArgs, over
// serve::FleetOptionsForRank): parsed with the real registrations, every flag launch accepts
// comes out of the forwarding and `serve` parses it back to the same value, per rank where the
// rule says so. Then serve::Registration's fill under --fill-trust content.
#include "registry_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fleet/arena_transfer.h"
#include "identity/resolve.h"
#include "serve/fleet_registry.h"
#include "serve/registration.h"
#include "support/hub_cache.h"
#include "support/test_env.h"

namespace weightcache::cli {
namespace {

using ::testing::HasSubstr;

void Parse(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"weightcache"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  ASSERT_NO_THROW(app.parse(static_cast<int>(argv.size()), argv.data()));
}

// Every fleet flag of launch, with a value that differs from its default.
const std::vector<std::string> kLaunchFleetArgs = {"launch",
                                                   "--registry",
                                                   "etcds://10.0.0.1:2379,10.0.0.2:2379",
                                                   "--registry-ca",
                                                   "ca.pem",
                                                   "--registry-cert",
                                                   "client.pem",
                                                   "--registry-key",
                                                   "client.key",
                                                   "--registry-prefix",
                                                   "/fleet-a",
                                                   "--registry-timeout",
                                                   "0.5",
                                                   "--registry-ttl",
                                                   "7",
                                                   "--advertise",
                                                   "10.0.0.9:7500",
                                                   "--node-name",
                                                   "node-9",
                                                   "--fill-from",
                                                   "registry",
                                                   "--fill-serve",
                                                   "0.0.0.0:7400",
                                                   "--fill-allow",
                                                   "10.0.0.0/8,::1",
                                                   "--fill-trust",
                                                   "fleet",
                                                   "--fill-content-sha256",
                                                   "sums.txt"};

TEST(RegistryFlagsTest, LaunchForwardsEveryFleetFlagAndServeParsesItBack) {
  CLI::App launch_app;
  serve::FleetOptions launch;
  CLI::App* launch_sub = launch_app.add_subcommand("launch");
  AddRegistryFlags(launch_sub, &launch, RegistryFlagScope::kLaunch);
  Parse(launch_app, kLaunchFleetArgs);
  for (const CLI::Option* opt : launch_sub->get_options()) {
    if (opt->get_name() == "--help") continue;
    EXPECT_EQ(opt->count(), 1u) << opt->get_name() << " is not set by this test's command line";
  }

  auto forwarded = RegistryServeArgs(launch, 3);
  ASSERT_TRUE(forwarded.ok()) << forwarded.status().ToString();
  std::vector<std::string> serve_args = {"serve"};
  serve_args.insert(serve_args.end(), forwarded->begin(), forwarded->end());
  CLI::App serve_app;
  serve::FleetOptions serve;
  CLI::App* serve_sub = serve_app.add_subcommand("serve");
  AddRegistryFlags(serve_sub, &serve, RegistryFlagScope::kServe);
  Parse(serve_app, serve_args);
  // Every flag serve registers reached it: none is left out of the forwarding.
  for (const CLI::Option* opt : serve_sub->get_options()) {
    if (opt->get_name() == "--help") continue;
    EXPECT_EQ(opt->count(), 1u) << opt->get_name() << " was not forwarded";
  }
  const std::string cwd = std::filesystem::current_path().string();
  EXPECT_EQ(serve.url, launch.url);
  EXPECT_EQ(serve.ca_file, cwd + "/ca.pem");  // the daemons need not share our directory
  EXPECT_EQ(serve.cert_file, cwd + "/client.pem");
  EXPECT_EQ(serve.key_file, cwd + "/client.key");
  EXPECT_EQ(serve.prefix, "/fleet-a");
  EXPECT_EQ(serve.timeout_s, 0.5);
  EXPECT_EQ(serve.ttl_s, 7);
  EXPECT_EQ(serve.node_name, "node-9");
  EXPECT_EQ(serve.fill_from, "registry");
  EXPECT_EQ(serve.fill_allow, "10.0.0.0/8,::1");
  EXPECT_EQ(serve.fill_trust, "fleet");
  EXPECT_EQ(serve.fill_content_sha256, cwd + "/sums.txt");
  // The listening ports are per daemon: PORT + its job rank.
  EXPECT_EQ(serve.advertise, "10.0.0.9:7503");
  EXPECT_EQ(serve.fill_serve, "0.0.0.0:7403");
}

TEST(RegistryFlagsTest, NoRegistryForwardsNothingAndFillFlagsWithoutItAreRefused) {
  serve::FleetOptions none;
  auto empty = RegistryServeArgs(none, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());

  serve::FleetOptions orphan;
  orphan.fill_from = "registry";
  auto refused = RegistryServeArgs(orphan, 0);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--fill-from registry needs --registry"));

  // Either tier fills: the flags are the same (the daemon pulls into host or device memory).
  serve::FleetOptions fill;
  fill.url = "etcd://127.0.0.1:2379";
  fill.fill_from = "registry";
  auto forwarded = RegistryServeArgs(fill, 0);
  ASSERT_TRUE(forwarded.ok()) << forwarded.status().ToString();
  EXPECT_EQ(forwarded->back(), "registry");
  EXPECT_EQ(forwarded->at(forwarded->size() - 2), "--fill-from");
}

// The registry entry names where fillers connect: a wildcard bind address would send each of
// them to its own host, so it needs --advertise; without a registry nothing is published.
TEST(RegistryFlagsTest, AWildcardFillServeIsPublishedOnlyThroughAdvertise) {
  serve::FleetOptions flags;
  flags.url = "etcd://127.0.0.1:2379";
  flags.fill_allow = "10.0.0.0/8";
  for (const char* wildcard : {"0.0.0.0:7400", "[::]:7400"}) {
    flags.fill_serve = wildcard;
    auto refused = RegistryServeArgs(flags, 0);
    ASSERT_FALSE(refused.ok()) << wildcard;
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(),
                HasSubstr(std::string("--fill-serve ") + wildcard +
                          " listens on every address, and the registry entry needs one other "
                          "nodes can reach: give --advertise HOST:PORT"));
  }
  flags.advertise = "10.0.0.7:7400";
  EXPECT_TRUE(RegistryServeArgs(flags, 0).ok());
  flags.advertise.clear();
  flags.fill_serve = "10.0.0.7:7400";  // a bound address is published as it is
  EXPECT_TRUE(RegistryServeArgs(flags, 0).ok());
  flags.url.clear();
  flags.fill_serve = "0.0.0.0:7400";  // listed sources: the fillers are told where to connect
  EXPECT_TRUE(RegistryServeArgs(flags, 0).ok());
}

// Without a registry the fill flags go alone; a listed source is per rank like --fill-serve
// (rank r of the source node serves at PORT + r).
TEST(RegistryFlagsTest, ListedSourcesAreForwardedPerRankWithoutARegistry) {
  serve::FleetOptions flags;
  flags.fill_from = "10.0.0.1:7400,node-b:7400";
  flags.fill_serve = "0.0.0.0:7400";
  flags.fill_allow = "10.0.0.0/8";
  auto forwarded = RegistryServeArgs(flags, 2);
  ASSERT_TRUE(forwarded.ok()) << forwarded.status().ToString();
  EXPECT_EQ(*forwarded,
            (std::vector<std::string>{"--fill-from", "10.0.0.1:7402,node-b:7402", "--fill-allow",
                                      "10.0.0.0/8", "--fill-serve", "0.0.0.0:7402"}));
  flags.fill_from = "10.0.0.1:7400,10.0.0.1";
  auto bad = RegistryServeArgs(flags, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("(\"10.0.0.1\" is not HOST:PORT)"));
  // One fill connects to at most fleet::kMaxFetchSources.
  flags.fill_from.clear();
  for (size_t i = 0; i <= fleet::kMaxFetchSources; ++i) {
    flags.fill_from +=
        (i == 0 ? "" : ",") + std::string("10.0.0.") + std::to_string(i + 1) + ":7400";
  }
  auto many = RegistryServeArgs(flags, 0);
  ASSERT_FALSE(many.ok());
  EXPECT_EQ(many.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      many.status().message(),
      HasSubstr("--fill-from lists " + std::to_string(fleet::kMaxFetchSources + 1) +
                " sources; a fill connects to at most " + std::to_string(fleet::kMaxFetchSources)));
}

fleet::RegistryEntry Entry(const std::string& node, const std::string& endpoint,
                           Tier tier = Tier::kGpu,
                           fleet::EntryState state = fleet::EntryState::kReady) {
  fleet::RegistryEntry e;
  e.node = node;
  e.endpoint = endpoint;
  e.tier = tier;
  e.state = state;
  return e;
}

std::vector<std::string> Nodes(const std::vector<fleet::RegistryEntry>& entries) {
  std::vector<std::string> nodes;
  nodes.reserve(entries.size());
  for (const fleet::RegistryEntry& e : entries) nodes.push_back(e.node);
  return nodes;
}

// Only ready entries of the filler's tier, with an endpoint, of other nodes are sources; all of
// them, in the registry's order, while they fit.
TEST(RegistryFlagsTest, FillSourcesAreTheOtherNodesReadyEntriesOfTheTier) {
  std::mt19937_64 rng(1);
  const std::vector<fleet::RegistryEntry> entries = {
      Entry("a", "10.0.0.1:7400"),
      Entry("self", "10.0.0.9:7400"),            // this node
      Entry("b", "10.0.0.2:7400", Tier::kHost),  // another tier
      Entry("c", ""),                            // no transport yet
      Entry("d", "10.0.0.4:7400", Tier::kGpu, fleet::EntryState::kLoading),
      Entry("e", "10.0.0.5:7400", Tier::kGpu, fleet::EntryState::kDemoted),
      Entry("f", "10.0.0.6:7400"),
  };
  EXPECT_THAT(Nodes(serve::ChooseFillSources(entries, Tier::kGpu, "self", rng)),
              ::testing::ElementsAre("a", "f"));
  EXPECT_THAT(Nodes(serve::ChooseFillSources(entries, Tier::kHost, "self", rng)),
              ::testing::ElementsAre("b"));
  EXPECT_TRUE(
      serve::ChooseFillSources({Entry("self", "10.0.0.9:7400")}, Tier::kGpu, "self", rng).empty());
}

// More ready sources than a fill uses: kMaxFetchSources distinct ones, a different choice from
// draw to draw, so that every source serves some of the joining nodes.
TEST(RegistryFlagsTest, ManySourcesAreCutToTheMostAFillUsesAtRandom) {
  std::vector<fleet::RegistryEntry> entries;
  entries.reserve(40);
  for (int i = 0; i < 40; ++i) {
    entries.push_back(Entry("n" + std::to_string(i), "10.0.1." + std::to_string(i) + ":7400"));
  }
  std::mt19937_64 rng(7);
  std::set<std::string> ever;
  std::set<std::vector<std::string>> choices;
  for (int draw = 0; draw < 50; ++draw) {
    const std::vector<std::string> chosen =
        Nodes(serve::ChooseFillSources(entries, Tier::kGpu, "self", rng));
    ASSERT_EQ(chosen.size(), fleet::kMaxFetchSources);
    const std::set<std::string> distinct(chosen.begin(), chosen.end());
    EXPECT_EQ(distinct.size(), chosen.size()) << "a source chosen twice";
    ever.insert(chosen.begin(), chosen.end());
    choices.insert(chosen);
  }
  // 50 draws of 8 out of 40: each source is left out of all of them with probability
  // (32/40)^50 ~ 1.4e-5, and the seed is fixed, so this never flakes.
  EXPECT_EQ(ever.size(), entries.size());
  EXPECT_GT(choices.size(), 1u);
}

// The fleet key holds the content anchor where there is one: equal configs with other files
// under equal headers have other keys; without an anchor the key is the headers' alone, as
// before (CacheConfig::FleetDigest()).
TEST(FleetKeyTest, TheContentAnchorIsPartOfTheFleetKey) {
  identity::CacheConfig config;
  config.model_id = "m";
  config.checkpoint_fingerprint = std::string(64, 'a');
  config.checkpoint_files = std::string(64, 'b');
  auto ours = std::make_shared<checkpoint::ContentAnchor>();
  ours->shards.push_back({"model.safetensors", std::string(64, 'c'), {}});
  auto theirs = std::make_shared<checkpoint::ContentAnchor>();
  theirs->shards.push_back({"model.safetensors", std::string(64, 'd'), {}});
  const serve::FleetAnchor none;
  EXPECT_EQ(serve::FleetKey(config, none), config.FleetDigest());
  EXPECT_NE(serve::FleetKey(config, {ours, ""}), config.FleetDigest());
  EXPECT_NE(serve::FleetKey(config, {ours, ""}), serve::FleetKey(config, {theirs, ""}));
  EXPECT_EQ(serve::FleetKey(config, {ours, ""}), config.FleetDigest(ours->Digest()));
  // The node-local fields stay out of it, anchor or not.
  identity::CacheConfig elsewhere = config;
  elsewhere.checkpoint_files = std::string(64, 'e');
  elsewhere.tier = Tier::kHost;
  EXPECT_EQ(serve::FleetKey(elsewhere, {ours, ""}), serve::FleetKey(config, {ours, ""}));
}

// serve's fill under --fill-trust content (the default) refuses at once, contacting nobody (the
// listed source is the discard port), without an anchor, and for a load that holds slices of
// tensors; either way the loader logs the reason and reads the disk.
class FillTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto made = weightcache::testing::WriteCheckpoint(tmp_.Join("plain"), {"--tensors", "3"});
    if (made.exit_code == 77) GTEST_SKIP() << made.err;
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  Result<std::unique_ptr<serve::Registration>> Create(const std::string& model,
                                                      const std::string& trust) {
    IdentityOptions options;
    options.model_dir = model;
    options.model_id = "tiny";
    options.tier = Tier::kHost;
    options.runtime_dir = tmp_.Join("run");
    auto id = identity::ResolveIdentity(options);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    serve::FleetOptions flags;
    flags.fill_from = "127.0.0.1:9";
    flags.fill_trust = trust;
    flags.node_name = "node-b";
    return serve::Registration::Create(flags, *id, model);
  }
  weightcache::testing::TempDir tmp_;
};

TEST_F(FillTrustTest, ContentTrustFillsNothingWithoutAnAnchorOrForASlicedRank) {
  daemon::PeerFillRequest request;
  auto plain = Create(tmp_.Join("plain"), "content");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  Result<daemon::FillOutcome> refused = (*plain)->Filler()(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("fill not attempted: --fill-trust content proves the filled bytes against "
                        "our own checkpoint's SHA-256s, and it records none ('model.safetensors'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--fill-content-sha256 FILE"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--fill-trust fleet"));

  const std::string hub =
      weightcache::testing::LayOutAsHubCache(tmp_.Join("plain"), tmp_.Join("hub"));
  auto anchored = Create(hub, "content");
  ASSERT_TRUE(anchored.ok()) << anchored.status().ToString();
  request.holds_whole_files = false;
  refused = (*anchored)->Filler()(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("fill not attempted: this cache holds slices of tensors (a rank of "
                        "sharding rules), which --fill-trust content cannot prove"));
}

}  // namespace
}  // namespace weightcache::cli
