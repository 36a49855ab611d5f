// The fleet's flag table (registry_flags.h), the same in every build: serve/registration.h acts
// on the options or, without the fleet, refuses each one given.
#include "registry_flags.h"

#include <array>
#include <charconv>
#include <string>
#include <utility>

#include "flag_checks.h"
#include "serve/registration.h"

namespace weightcache::cli {
namespace {

// A number as the shortest text that parses back to it ("3", "0.5").
std::string NumberText(double value) {
  std::array<char, 32> text{};
  auto [end, ec] = std::to_chars(text.data(), text.data() + text.size(), value);
  return std::string(text.data(), ec == std::errc() ? end : text.data());
}

// Without the fleet in this build, each flag's help says so (serve/registration.h refuses them).
void MarkNotBuilt(CLI::App* sub, size_t first) {
  if (serve::FleetBuilt()) return;
  const std::vector<CLI::Option*> options = sub->get_options();
  for (size_t i = first; i < options.size(); ++i) {
    options[i]->description(options[i]->get_description() + " (not in this build: docs/fleet.md)");
  }
}

}  // namespace

void AddRegistryFlags(CLI::App* sub, serve::FleetOptions* flags, RegistryFlagScope scope) {
  // `launch` forwards serve's flags to every daemon (RegistryServeArgs).
  const bool serving = scope != RegistryFlagScope::kList;
  const size_t before = sub->get_options().size();
  const std::string per_rank =
      scope == RegistryFlagScope::kLaunch ? " (launch: each daemon gets PORT + its rank)" : "";
  sub->add_option("--registry", flags->url,
                  serving ? "register this cache in the fleet registry once it is ready: "
                            "etcd://HOST:PORT[,HOST:PORT...] (etcd's JSON gateway over http; the "
                            "next endpoint is tried when one is down) or etcds://... (https, with "
                            "--registry-ca). The entry lives under a lease: `stop` or a drain "
                            "revokes it at once, a killed daemon's expires after --registry-ttl; "
                            "an unreachable registry is retried and never stops the cache "
                            "(docs/fleet.md)"
                          : "the fleet registry: etcd://HOST:PORT[,HOST:PORT...] or etcds://...")
      ->required(!serving);
  sub->add_option("--registry-ca", flags->ca_file,
                  "etcds://: the CA file that signs etcd's server certificate");
  sub->add_option("--registry-cert", flags->cert_file,
                  "etcds://: our client certificate, when etcd requires one "
                  "(--client-cert-auth); with --registry-key");
  sub->add_option("--registry-key", flags->key_file, "etcds://: the client certificate's key");
  sub->add_option("--registry-prefix", flags->prefix,
                  "the registry's key prefix (default /weightcache): entries are "
                  "<prefix>/v1/caches/<fleet key>/<node>/<digest16>");
  sub->add_option("--registry-timeout", flags->timeout_s,
                  "seconds each etcd request may take per endpoint (default 3)")
      ->check(Positive());
  sub->add_option("--fill-content-sha256", flags->fill_content_sha256,
                  "FILE of sha256sum lines (\"<sha256>  <file name>\", one per shard): the "
                  "checkpoint's content anchor, for a layout that records none itself (a Hugging "
                  "Face hub cache snapshot and a `huggingface-cli download --local-dir` directory "
                  "do). It goes into the fleet key, so sources and fillers of the same files "
                  "must agree on it, and a fill proves its bytes against it (--fill-trust)");
  if (!serving) {
    MarkNotBuilt(sub, before);
    return;
  }
  sub->add_option("--registry-ttl", flags->ttl_s,
                  "seconds of the registry lease (default 10), renewed every third of it: a "
                  "killed daemon's entry is gone at most this long after its death")
      ->check(InRange(1, 3600));
  sub->add_option("--advertise", flags->advertise,
                  "HOST:PORT of the transport other nodes fill from, recorded in the entry "
                  "(default: \"\", no transport serves this cache yet)" +
                      per_rank);
  sub->add_option("--node-name", flags->node_name,
                  "this node's name in the registry (default: the hostname)");
  sub->add_option("--fill-from", flags->fill_from,
                  "\"registry\" (with --registry) or HOST:PORT[,HOST:PORT...] (other nodes' "
                  "--fill-serve): before reading the checkpoint, pull the arena from the ready "
                  "sources of the same fleet key and tier, verified (layout, every tensor's "
                  "checksum, each file's SHA-256 against our own checkpoint's (--fill-trust), a "
                  "sample of our own checkpoint) before ready; any failure reads the disk. The gpu "
                  "tier pulls into device memory, which needs a UCX built with "
                  "CUDA (docs/fleet.md \"Fill\")" +
                      (scope == RegistryFlagScope::kLaunch
                           ? std::string(" (launch: each listed PORT becomes PORT + the rank)")
                           : std::string()));
  sub->add_option("--fill-serve", flags->fill_serve,
                  "HOST:PORT (port 0: a free one): once ready, serve the arena to other nodes' "
                  "--fill-from, listening on HOST:PORT only (the host tier over weightcache's "
                  "read-only TCP protocol; the gpu tier over UCX without its tcp and cma "
                  "transports, holding a CUDA context while it does); the bound endpoint is "
                  "logged, and goes into the registry entry unless --advertise is given. Needs "
                  "--fill-allow" +
                      per_rank);
  sub->add_option("--fill-trust", flags->fill_trust,
                  "content|fleet (default content): what --fill-from's bytes must match before "
                  "ready. content: every shard file's SHA-256, recomputed from our own header and "
                  "the filled bytes, equals our checkpoint's own record of it (its content "
                  "anchor: hub cache blob names, --local-dir download metadata or "
                  "--fill-content-sha256); without an anchor, or for a rank that holds slices of "
                  "tensors, nothing is filled (logged) and the disk is read. fleet: the sources' "
                  "checksums and a 4 MiB sample of our own checkpoint, so a source whose files "
                  "differ from ours in few bytes can fill wrong weights: trust every node of the "
                  "fleet to serve the same files (docs/fleet.md \"Fill\")")
      ->check(CLI::IsMember(
          {std::string(serve::kFillTrustContent), std::string(serve::kFillTrustFleet)}));
  sub->add_option(
      "--fill-allow", flags->fill_allow,
      "ADDR|CIDR[,...]: the peers that may fill from --fill-serve (\"0.0.0.0/0,::/0\" "
      "for everyone), checked before a byte is sent; an allowed peer can read the arena "
      "it serves (docs/fleet.md \"Security\")");
  MarkNotBuilt(sub, before);
}

Result<std::vector<std::string>> RegistryServeArgs(const serve::FleetOptions& flags, int rank) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(const serve::FleetOptions ranked,
                               serve::FleetOptionsForRank(flags, rank));
  std::vector<std::string> args;
  auto add = [&args](const char* flag, const std::string& value) {
    if (value.empty()) return;
    args.push_back(flag);
    args.push_back(value);
  };
  if (!ranked.url.empty()) {
    add("--registry", ranked.url);
    add("--registry-ca", ranked.ca_file);
    add("--registry-cert", ranked.cert_file);
    add("--registry-key", ranked.key_file);
    add("--registry-prefix", ranked.prefix);
    add("--registry-timeout", NumberText(ranked.timeout_s));
    add("--registry-ttl", std::to_string(ranked.ttl_s));
    add("--node-name", ranked.node_name);
  }
  add("--fill-from", ranked.fill_from);
  add("--fill-allow", ranked.fill_allow);
  if (ranked.fill_trust != serve::kFillTrustContent) add("--fill-trust", ranked.fill_trust);
  add("--fill-content-sha256", ranked.fill_content_sha256);
  add("--advertise", ranked.advertise);
  add("--fill-serve", ranked.fill_serve);
  return args;
}

}  // namespace weightcache::cli
