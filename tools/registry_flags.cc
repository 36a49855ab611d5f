#include "registry_flags.h"

#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/hash.h"
#include "common/logging.h"
#include "os/file_mapping.h"
#include "os/host_name.h"

namespace weightcache::cli {

void AddRegistryFlags(CLI::App* sub, RegistryFlags* flags, RegistryFlagScope scope) {
  const bool serve = scope == RegistryFlagScope::kServe;
  sub->add_option("--registry", flags->url,
                  serve ? "register this cache in the fleet registry once it is ready: "
                          "etcd://HOST:PORT[,HOST:PORT...] (etcd's JSON gateway over http; the "
                          "next endpoint is tried when one is down) or etcds://... (https, with "
                          "--registry-ca). The entry lives under a lease: `stop` or a drain "
                          "revokes it at once, a killed daemon's expires after --registry-ttl; "
                          "an unreachable registry is retried and never stops the cache "
                          "(docs/fleet.md)"
                        : "the fleet registry: etcd://HOST:PORT[,HOST:PORT...] or etcds://...")
      ->required(!serve);
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
      ->check(CLI::PositiveNumber);
  if (!serve) return;
  sub->add_option("--registry-ttl", flags->ttl_s,
                  "seconds of the registry lease (default 10), renewed every third of it: a "
                  "killed daemon's entry is gone at most this long after its death")
      ->check(CLI::Range(1, 3600));
  sub->add_option("--advertise", flags->advertise,
                  "HOST:PORT of the transport other nodes fill from, recorded in the entry "
                  "(default: \"\", no transport serves this cache yet)");
  sub->add_option("--node-name", flags->node_name,
                  "this node's name in the registry (default: the hostname)");
}

Result<fleet::EtcdClient> RegistryClient(const RegistryFlags& flags) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::EtcdOptions options, fleet::ParseRegistryUrl(flags.url));
  options.tls.ca_file = flags.ca_file;
  options.tls.cert_file = flags.cert_file;
  options.tls.key_file = flags.key_file;
  const bool tls = flags.url.rfind("etcds://", 0) == 0;
  if (!tls && (!flags.ca_file.empty() || !flags.cert_file.empty() || !flags.key_file.empty())) {
    return InvalidArgument(
        "--registry-ca/--registry-cert/--registry-key need an etcds:// registry");
  }
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.timeout_s * 1000));
  for (const std::string* file : {&flags.ca_file, &flags.cert_file, &flags.key_file}) {
    if (!file->empty() && ::access(file->c_str(), R_OK) != 0) {
      return IoError("registry TLS file " + *file, errno);
    }
  }
  auto client = fleet::EtcdClient::Create(std::move(options));
  if (!client.ok()) return Status(client.status()).Context("--registry");
  return client;
}

Result<std::unique_ptr<ServeRegistration>> ServeRegistration::Create(
    const RegistryFlags& flags, const identity::ResolvedIdentity& id) {
  if (flags.url.empty()) return std::unique_ptr<ServeRegistration>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(fleet::EtcdClient client, RegistryClient(flags));
  fleet::RegistryEntry entry;
  entry.fleet_key = id.config.FleetDigest();
  entry.digest = id.config.Digest();
  if (flags.node_name.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(entry.node, os::HostName());
  } else {
    entry.node = flags.node_name;
  }
  if (Status node = fleet::ValidateNodeName(entry.node); !node.ok()) {
    return Status(node).Context(flags.node_name.empty() ? "the hostname (give --node-name)"
                                                        : "--node-name");
  }
  entry.endpoint = flags.advertise;
  entry.tier = std::string(TierName(id.config.tier));
  entry.device = id.device_key;
  entry.pid = ::getpid();
  entry.model_id = id.config.model_id;
  entry.revision = id.config.revision;
  entry.tp_rank = id.config.tp_rank;
  entry.tp_size = id.config.tp_size;
  entry.pp_rank = id.config.pp_rank;
  entry.pp_size = id.config.pp_size;
  entry.ep_rank = id.config.ep_rank;
  entry.ep_size = id.config.ep_size;
  if (Status valid = entry.Validate(); !valid.ok()) {
    return Status(valid).Context(valid.message().find("endpoint") != std::string::npos
                                     ? "--advertise (HOST:PORT)"
                                     : "the registry entry");
  }
  fleet::RegistrarOptions options;
  options.prefix = flags.prefix;
  options.ttl = std::chrono::seconds(flags.ttl_s);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::unique_ptr<fleet::Registrar> registrar,
                               fleet::Registrar::Create(std::move(client), options));
  LOG_INFO << "registry: " << flags.url << ", key " << fleet::EntryKey(flags.prefix, entry)
           << " (registered once the cache is ready)";
  return std::unique_ptr<ServeRegistration>(
      new ServeRegistration(std::move(registrar), std::move(entry), id.config.tier));
}

ServeRegistration::~ServeRegistration() { registrar_->Stop(); }

void ServeRegistration::PublishLocked() {
  Status published = registrar_->Publish(entry_);
  if (!published.ok()) {
    LOG_WARN << "registry: " << published.ToString();
  }
}

namespace {

// The SHA-256 of the manifest the daemon serves its clients (every tensor's name, dtype, shape,
// place and checksum): equal for two caches of the same weights in the same layout. "" when it
// cannot be read (the entry is still worth publishing).
std::string ManifestDigest(const daemon::ManifestFile& manifest) {
  if (!manifest.fd.valid() || manifest.size == 0) return "";
  auto mapping = os::ReadOnlyMapping::Map(manifest.fd.get(), "the cache manifest");
  if (!mapping.ok() || mapping->size() < manifest.size) {
    LOG_WARN << "registry: no manifest digest: "
             << (mapping.ok() ? std::string("short manifest") : mapping.status().ToString());
    return "";
  }
  return Sha256Hex(std::string_view(reinterpret_cast<const char*>(mapping->data()), manifest.size));
}

}  // namespace

void ServeRegistration::Ready(const daemon::StoreSummary& summary) {
  const std::string manifest_digest = ManifestDigest(summary.manifest);
  MutexLock lock(mu_);
  ready_ = true;
  entry_.bytes = summary.tensor_bytes;
  entry_.tensors = summary.tensor_count;
  entry_.manifest_digest = manifest_digest;
  entry_.state = fleet::EntryState::kReady;
  entry_.tier = std::string(TierName(configured_));
  PublishLocked();
}

void ServeRegistration::Moved(Tier tier) {
  MutexLock lock(mu_);
  if (!ready_) return;
  entry_.tier = std::string(TierName(tier));
  entry_.state = tier == configured_ ? fleet::EntryState::kReady : fleet::EntryState::kDemoted;
  PublishLocked();
}

void ServeRegistration::Draining() {
  {
    MutexLock lock(mu_);
    if (ready_) {
      entry_.state = fleet::EntryState::kDraining;
      PublishLocked();
    }
  }
  registrar_->Withdraw();
}

}  // namespace weightcache::cli
