// TCP listening sockets (the metrics endpoint, docs/metrics.md).
//
// Contract:
//  * ListenTcp binds `host:port` (an IPv4 or IPv6 literal, or a name resolved with
//    getaddrinfo; IPv6 literals may be bracketed) with SO_REUSEADDR, listens, and returns the
//    socket (CLOEXEC, non-blocking) and the port it is bound to (port 0 picks a free one).
//  * SplitHostPort parses "HOST:PORT" / "[V6]:PORT" strictly (the port 0..65535, digits only).
//  * IsWildcardHost: the host is the IPv4 or IPv6 "any" address (0.0.0.0, ::, in any textual
//    form inet_pton takes): fine to bind, meaningless to connect to from another machine.
//  * Thread-safe: no shared state.
#pragma once

#include <cstdint>
#include <string>

#include "common/unique_fd.h"
#include "weightcache/status.h"

namespace weightcache::os {

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

Result<HostPort> SplitHostPort(const std::string& text);
bool IsWildcardHost(const std::string& host);

struct TcpListener {
  UniqueFd fd;
  uint16_t port = 0;  // the bound port
};

Result<TcpListener> ListenTcp(const HostPort& where, int backlog = 16);

}  // namespace weightcache::os
