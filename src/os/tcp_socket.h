// TCP sockets: listening (the metrics endpoint, docs/metrics.md; the fleet's fill source) and
// connecting (the fleet's filler).
//
// Contract:
//  * ListenTcp binds `host:port` (an IPv4 or IPv6 literal, or a name resolved with
//    getaddrinfo; IPv6 literals may be bracketed) with SO_REUSEADDR, listens, and returns the
//    socket (CLOEXEC, non-blocking) and the port it is bound to (port 0 picks a free one).
//  * SplitHostPort parses "HOST:PORT" / "[V6]:PORT" strictly (the port 0..65535, digits only).
//  * ResolveTcp resolves "HOST:PORT" into one address (numeric, or getaddrinfo's first result;
//    it may block for the resolver's timeout). ConnectTcp starts a non-blocking connect
//    (CLOEXEC, TCP_NODELAY): the socket is writable once connected, and SO_ERROR then says how.
//  * IsWildcardHost: the host is the IPv4 or IPv6 "any" address (0.0.0.0, ::, in any textual
//    form inet_pton takes): fine to bind, meaningless to connect to from another machine.
//  * Thread-safe: no shared state.
#pragma once

#include <sys/socket.h>

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

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// kInvalidArgument when unparsable or unresolvable, naming `endpoint`.
Result<SocketAddress> ResolveTcp(const std::string& endpoint);
// kIo when no socket can be made or the connect fails at once (not EINPROGRESS); a refused
// connection on loopback may still show only later, as SO_ERROR ECONNREFUSED.
Result<UniqueFd> ConnectTcp(const SocketAddress& to);

}  // namespace weightcache::os
