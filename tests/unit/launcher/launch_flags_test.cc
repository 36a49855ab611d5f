// What `launch` forwards to each `serve` daemon, checked with the real parser: the daemons'
// command lines (BuildDaemonSpecs + ServeArgsFor) are parsed back with the identity flags
// exactly as `serve` registers them (AddIdentityFlags, tools/identity_flags.h), and every
// option must come out with the value the launch was given. No list of flags is kept here:
// the options are enumerated from the CLI11 apps, so a flag that is registered but not
// forwarded fails (its serve-side result is empty).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "identity_flags.h"
#include "launcher/serve_daemons.h"

namespace weightcache::cli {
namespace {

using launcher::AddrForRank;
using launcher::BuildDaemonSpecs;
using launcher::DaemonPlacement;
using launcher::JobFiles;
using launcher::JobRank;
using launcher::RankedAddr;
using launcher::ServeFlags;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr const char* kGpu0 = "GPU-1a2b3c4d-0000-4000-8000-000000000000";
constexpr const char* kGpu2 = "GPU-5e6f7a8b-0000-4000-8000-000000000002";

// Parses `args` (without the program name) into `app`; the parse must succeed.
void Parse(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"weightcache"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  ASSERT_NO_THROW(app.parse(static_cast<int>(argv.size()), argv.data()));
}

// The identity options of a subcommand (all but --help).
std::vector<CLI::Option*> RegisteredIdentityFlags(CLI::App* sub) {
  std::vector<CLI::Option*> out;
  for (CLI::Option* opt : sub->get_options()) {
    if (opt->get_name() != "--help") out.push_back(opt);
  }
  return out;
}

// The option of `sub` that answers to any long name of `opt` ("--tp" or "--tp-size").
CLI::Option* Counterpart(CLI::App* sub, const CLI::Option* opt) {
  for (const std::string& name : opt->get_lnames()) {
    for (CLI::Option* candidate : sub->get_options()) {
      if (candidate->check_lname(name)) return candidate;
    }
  }
  return nullptr;
}

// Every job-scope identity flag at a non-default value. The test below checks that this line
// sets every registered flag, so a flag added to the table must be added here as well.
const std::vector<std::string> kJobArgs = {"launch",
                                           "--model",
                                           "/models/q",
                                           "--model-id",
                                           "q-model",
                                           "--revision",
                                           "r7",
                                           "--dtype",
                                           "bf16",
                                           "--quantization",
                                           "fp8",
                                           "--quantization-config",
                                           "/cfg/quant.json",
                                           "--tp",
                                           "2",
                                           "--pp",
                                           "3",
                                           "--ep-size",
                                           "4",
                                           "--dp-size",
                                           "5",
                                           "--shard-rules",
                                           "/rules/q.json",
                                           "--layout-tag",
                                           "fused-qkv",
                                           "--source",
                                           "published:sglang",
                                           "--tier",
                                           "host",
                                           "--namespace",
                                           "ns",
                                           "--runtime-dir",
                                           "/rt",
                                           "--device-inventory",
                                           "/inv.json"};

TEST(LaunchFlagsTest, EveryJobFlagReachesEveryDaemonAsServeParsesIt) {
  CLI::App launch_app;
  IdentityOptions job;
  CLI::App* launch = launch_app.add_subcommand("launch");
  AddIdentityFlags(launch, &job, IdentityScope::kJob);
  Parse(launch_app, kJobArgs);
  for (CLI::Option* opt : RegisteredIdentityFlags(launch)) {
    EXPECT_EQ(opt->count(), 1u) << opt->get_name() << " is registered for launch but not set "
                                << "by this test's command line: add it to kJobArgs";
  }

  std::vector<DaemonPlacement> plan(2);
  plan[0] = {.tp_rank = 0, .pp_rank = 2, .ep_rank = 3, .local_gpu_id = 0, .device_uuid = kGpu0};
  plan[1] = {.tp_rank = 1, .pp_rank = 1, .ep_rank = 0, .local_gpu_id = 2, .device_uuid = kGpu2};
  ServeFlags flags;
  flags.identity = job;
  flags.identity_args = ServeArgsFor;
  flags.memory_budget = "20G";
  flags.threads = 4;
  flags.gpu_budget = "80%";
  flags.pin = true;
  flags.demote = "host";
  flags.adopt_verify = "behind";
  flags.allow_uids = {1001, 1002};
  flags.allow_gids = {2000};
  flags.metrics_addr = "127.0.0.1:9400";
  JobFiles files{.exe = "/bin/wc", .log_dir = "/logs", .job = "q"};
  std::vector<launcher::DaemonSpec> specs = BuildDaemonSpecs(plan, flags, files);
  ASSERT_EQ(specs.size(), 2u);
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    const std::vector<std::string>& argv = specs[i].spawn.argv;
    ASSERT_GE(argv.size(), 2u);
    EXPECT_EQ(argv[0], "/bin/wc");
    CLI::App serve_app;
    IdentityOptions got;
    CLI::App* serve = serve_app.add_subcommand("serve");
    AddIdentityFlags(serve, &got, IdentityScope::kOneCache);
    serve->allow_extras();  // the load flags are serve's own, registered by cmd_serve.cc
    Parse(serve_app, std::vector<std::string>(argv.begin() + 1, argv.end()));
    // Budget flags as given; the metrics port + the daemon's rank (pp_rank * tp_size + tp_rank).
    const std::string metrics =
        "127.0.0.1:" + std::to_string(9400 + plan[i].pp_rank * 2 + plan[i].tp_rank);
    EXPECT_THAT(
        serve->remaining(),
        ElementsAre("--memory-budget", "20G", "--threads", "4", "--gpu-budget", "80%", "--pin",
                    "--demote", "host", "--adopt-verify", "behind", "--allow-uid", "1001",
                    "--allow-uid", "1002", "--allow-gid", "2000", "--metrics-addr", metrics));

    for (CLI::Option* opt : RegisteredIdentityFlags(launch)) {
      CLI::Option* served = Counterpart(serve, opt);
      ASSERT_NE(served, nullptr) << opt->get_name() << " has no serve counterpart";
      EXPECT_EQ(served->results(), opt->results())
          << opt->get_name() << " was given to launch but " << served->get_name()
          << " did not reach the daemon";
    }
    // The per-daemon flags come from the placement, never from the job.
    EXPECT_EQ(got.tp_rank, plan[i].tp_rank);
    EXPECT_EQ(got.pp_rank, plan[i].pp_rank);
    EXPECT_EQ(got.ep_rank, plan[i].ep_rank);
    EXPECT_EQ(got.device, plan[i].device_uuid);
    EXPECT_EQ(got.socket, "") << "the launcher finds each daemon's socket in the layout";
    // And the bound fields agree with the launch's (a spot check beyond the option results).
    EXPECT_EQ(got.model_dir, job.model_dir);
    EXPECT_EQ(got.tier, Tier::kHost);
    EXPECT_EQ(got.tp_size, 2);
    EXPECT_EQ(got.pp_size, 3);
    EXPECT_EQ(got.source, "published:sglang");
  }
  EXPECT_EQ(specs[0].spawn.log_path, "/logs/q-tp0-pp2-1a2b3c4d.log");
  EXPECT_EQ(specs[1].spawn.log_path, "/logs/q-tp1-pp1-5e6f7a8b.log");
  EXPECT_TRUE(specs[0].socket_path.empty()) << "paths are discovered from the running daemon";
}

TEST(LaunchFlagsTest, ListeningAddressesAreMadePerDaemon) {
  EXPECT_EQ(
      JobRank({.tp_rank = 1, .pp_rank = 2, .ep_rank = 0, .local_gpu_id = 0, .device_uuid = ""}, 4),
      9);
  auto metrics = [](const std::string& addr, int rank) {
    return AddrForRank("--metrics-addr", addr, rank, RankedAddr::kHostPortOrUnixPath);
  };
  EXPECT_EQ(*metrics("127.0.0.1:9400", 3), "127.0.0.1:9403");
  EXPECT_EQ(*metrics("[::1]:9400", 0), "[::1]:9400");
  EXPECT_EQ(*metrics("localhost:0", 5), "localhost:0");  // each picks a free port
  EXPECT_EQ(*metrics("/run/wc/metrics.sock", 2), "/run/wc/metrics.sock.2");
  EXPECT_EQ(*metrics("", 2), "");
  auto past = metrics("127.0.0.1:65535", 1);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(),
              HasSubstr("--metrics-addr 127.0.0.1:65535: the daemon of rank 1 would get "
                        "port 65536"));
  auto bad = metrics("metrics", 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("not HOST:PORT nor an absolute Unix socket path"));

  // The fleet's transport endpoints are HOST:PORT only.
  EXPECT_EQ(*AddrForRank("--fill-serve", "10.0.0.5:7400", 6, RankedAddr::kHostPort),
            "10.0.0.5:7406");
  for (const char* not_host_port : {"/run/wc/fill.sock", ":7400", "10.0.0.5", "10.0.0.5:74x"}) {
    auto refused = AddrForRank("--fill-serve", not_host_port, 1, RankedAddr::kHostPort);
    ASSERT_FALSE(refused.ok()) << not_host_port;
    EXPECT_THAT(refused.status().message(),
                HasSubstr("--fill-serve " + std::string(not_host_port) + ": not HOST:PORT"));
    EXPECT_THAT(refused.status().message(), Not(HasSubstr("Unix")));
  }
}

// ServeArgsFor over the whole one-cache scope (per-daemon flags and --socket included): what it
// writes, `serve` parses back to the same option values.
TEST(LaunchFlagsTest, ServeArgsForRoundTripsEveryOneCacheFlag) {
  std::vector<std::string> args = kJobArgs;
  args[0] = "serve";
  args[args.size() - 1] = "/inv2.json";
  for (std::string& a : args) {
    if (a == "--tp") a = "--tp-size";
    if (a == "--pp") a = "--pp-size";
  }
  args.insert(args.end(), {"--tp-rank", "1", "--pp-rank", "2", "--ep-rank", "3", "--device",
                           "GPU-5e6f", "--socket", "/s/{device_uuid}.sock"});
  CLI::App first_app;
  IdentityOptions first;
  CLI::App* first_sub = first_app.add_subcommand("serve");
  AddIdentityFlags(first_sub, &first, IdentityScope::kOneCache);
  Parse(first_app, args);
  for (CLI::Option* opt : RegisteredIdentityFlags(first_sub)) {
    EXPECT_EQ(opt->count(), 1u) << opt->get_name() << " is not set by this test's command line";
  }

  std::vector<std::string> again = {"serve"};
  for (const std::string& a : ServeArgsFor(first)) again.push_back(a);
  CLI::App second_app;
  IdentityOptions second;
  CLI::App* second_sub = second_app.add_subcommand("serve");
  AddIdentityFlags(second_sub, &second, IdentityScope::kOneCache);
  Parse(second_app, again);
  for (CLI::Option* opt : RegisteredIdentityFlags(first_sub)) {
    CLI::Option* other = second_sub->get_option(opt->get_name());
    EXPECT_EQ(other->results(), opt->results()) << opt->get_name() << " was not written back";
  }
}

// Defaults stay defaults: a string flag left at IdentityOptions' default is not written, so the
// daemon's value is serve's own default; numbers and the tier are always written.
TEST(LaunchFlagsTest, DefaultStringsAreLeftToServe) {
  IdentityOptions o;
  o.model_dir = "/m";
  EXPECT_THAT(ServeArgsFor(o), ElementsAre("--model", "/m", "--tp-size", "1", "--pp-size", "1",
                                           "--ep-size", "1", "--dp-size", "1", "--tp-rank", "0",
                                           "--pp-rank", "0", "--ep-rank", "0", "--tier", "gpu"));
}

}  // namespace
}  // namespace weightcache::cli
