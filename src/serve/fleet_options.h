// What `serve` is asked of the fleet (docs/fleet.md): the registry it registers its cache in, the
// fill it pulls from other nodes before reading the disk, and the fill source it serves them.
// Plain values, the same in every build: the CLI's one flag table (tools/registry_flags.h) fills
// them for `serve`, `launch` and `fleet ls`, and serve/registration.h acts on them — or, in a
// build without the fleet, refuses each one that is set.
#pragma once

#include <string>
#include <string_view>

namespace weightcache::serve {

// --fill-trust (docs/fleet.md "Fill"): "content" (the default) proves every filled file against
// our own checkpoint's SHA-256s (its content anchor) before ready, and fills nothing without an
// anchor or where the cache holds slices of tensors; "fleet" trusts the sources' checksums, with
// the disk sample the only check of the content (the behaviour before the anchor).
inline constexpr std::string_view kFillTrustContent = "content";
inline constexpr std::string_view kFillTrustFleet = "fleet";

// The registry's key prefix by default (fleet/registry_entry.h kDefaultRegistryPrefix, which
// serve/registration.cc checks is this).
inline constexpr std::string_view kDefaultRegistryPrefix = "/weightcache";

struct FleetOptions {
  std::string url;  // --registry etcd://HOST:PORT[,...] | etcds://...; "" = no registry
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string prefix = std::string(kDefaultRegistryPrefix);
  double timeout_s = 3;  // per etcd request and endpoint
  // serve only:
  int ttl_s = 10;
  std::string advertise;  // HOST:PORT of the transport; "" until one serves
  std::string node_name;  // "" = the hostname
  // The fill (docs/fleet.md "Fill"), either tier:
  std::string fill_from;   // registry|HOST:PORT[,...]: fill before the disk
  std::string fill_serve;  // HOST:PORT: serve our arena to fillers once ready
  std::string fill_allow;  // ADDR|CIDR[,...]: who may fill from us
  std::string fill_trust = std::string(kFillTrustContent);  // content|fleet
  // FILE of sha256sum lines: the shards' SHA-256s pinned by the operator, the content anchor of
  // a checkpoint laid out other than a hub cache or a --local-dir download.
  std::string fill_content_sha256;
};

}  // namespace weightcache::serve
