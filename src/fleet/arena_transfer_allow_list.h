// PeerAllowList — which peer addresses may connect to a node's arena transport (docs/fleet.md
// "Security"). UCX authenticates nobody; this list is what keeps an arbitrary host from
// reading the weights a source registers.
//
// Contract:
//  * Parse takes a comma-separated list of IPv4/IPv6 addresses and CIDR prefixes
//    ("10.0.0.0/8,127.0.0.1,::1,fd00::/8"); whitespace around entries is ignored. An empty
//    list allows nobody (a source with no peers configured serves no one); "*" is not accepted:
//    "0.0.0.0/0,::/0" says "everyone" explicitly.
//  * Allows() matches an IPv4-mapped IPv6 client address (::ffff:a.b.c.d) against the IPv4
//    entries too, as a dual-stack listener reports IPv4 peers that way.
//  * A value type; const methods are thread-safe.
#pragma once

#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::fleet {

class PeerAllowList {
 public:
  PeerAllowList() = default;  // allows nobody

  // kInvalidArgument naming the bad entry (not an address, a prefix length out of range,
  // host bits set past the prefix, e.g. "10.0.0.1/8").
  static Result<PeerAllowList> Parse(std::string_view text);

  bool Allows(const sockaddr* address) const;
  bool empty() const { return entries_.empty(); }
  // The list as given, normalised: "10.0.0.0/8,127.0.0.1/32".
  std::string ToString() const;

 private:
  struct Entry {
    int family = 0;                   // AF_INET or AF_INET6
    std::array<uint8_t, 16> bytes{};  // network order; the first 4 for AF_INET
    int prefix = 0;                   // bits
  };
  std::vector<Entry> entries_;
};

// "1.2.3.4:5" / "[::1]:5" for an AF_INET/AF_INET6 sockaddr; "<family N>" for another.
std::string FormatSockaddr(const sockaddr* address);

}  // namespace weightcache::fleet
