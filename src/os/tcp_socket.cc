#include "os/tcp_socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace weightcache::os {

Result<HostPort> SplitHostPort(const std::string& text) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return InvalidArgument("\"" + text + "\" is not HOST:PORT");
  }
  HostPort out;
  out.host = text.substr(0, colon);
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  std::string port = text.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoul(port) > 65535) {
    return InvalidArgument("\"" + text + "\": the port must be a number 0..65535");
  }
  if (out.host.empty()) return InvalidArgument("\"" + text + "\" has no host");
  out.port = static_cast<uint16_t>(std::stoul(port));
  return out;
}

bool IsWildcardHost(const std::string& host) {
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6{};
  return ::inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_UNSPECIFIED(&v6);
}

Result<TcpListener> ListenTcp(const HostPort& where, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  std::string port = std::to_string(where.port);
  int rc = ::getaddrinfo(where.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    return InvalidArgument("cannot resolve \"" + where.host + "\": " + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  std::string what = where.host + ":" + port;
  int last_errno = 0;
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      return IoError("getsockname for " + what, errno);
    }
    TcpListener out;
    out.port = bound.ss_family == AF_INET6
                   ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                   : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    out.fd = std::move(fd);
    return out;
  }
  return IoError("listen on " + what, last_errno);
}

Result<SocketAddress> ResolveTcp(const std::string& endpoint) {
  auto split = SplitHostPort(endpoint);
  if (!split.ok()) return split.status().Context("transport endpoint '" + endpoint + "'");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(split->port);
  const int rc = ::getaddrinfo(split->host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return InvalidArgument("transport endpoint '" + endpoint + "': " + ::gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  SocketAddress address;
  std::memcpy(&address.storage, found->ai_addr, found->ai_addrlen);
  address.length = found->ai_addrlen;
  return address;
}

Result<UniqueFd> ConnectTcp(const SocketAddress& to) {
  UniqueFd fd(::socket(to.storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return IoError("socket", errno);
  int one = 1;
  (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (::connect(fd.get(), to.get(), to.length) != 0 && errno != EINPROGRESS) {
    return IoError("connect", errno);
  }
  return fd;
}

}  // namespace weightcache::os
