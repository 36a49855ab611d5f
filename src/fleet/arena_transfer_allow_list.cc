#include "fleet/arena_transfer_allow_list.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <charconv>
#include <cstring>

namespace weightcache::fleet {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Whether the first `prefix` bits of `a` and `b` are equal.
bool PrefixEqual(const uint8_t* a, const uint8_t* b, int prefix) {
  const int whole = prefix / 8;
  if (std::memcmp(a, b, static_cast<size_t>(whole)) != 0) return false;
  const int rest = prefix % 8;
  if (rest == 0) return true;
  const auto mask = static_cast<uint8_t>(0xFF << (8 - rest));
  return (a[whole] & mask) == (b[whole] & mask);
}

}  // namespace

Result<PeerAllowList> PeerAllowList::Parse(std::string_view text) {
  PeerAllowList list;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    const std::string_view item = Trim(text.substr(0, comma));
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    if (item.empty()) continue;
    const size_t slash = item.find('/');
    const std::string address(item.substr(0, slash));
    Entry entry;
    if (inet_pton(AF_INET, address.c_str(), entry.bytes.data()) == 1) {
      entry.family = AF_INET;
    } else if (inet_pton(AF_INET6, address.c_str(), entry.bytes.data()) == 1) {
      entry.family = AF_INET6;
    } else {
      return InvalidArgument("peer allow-list entry '" + std::string(item) +
                             "' is not an IPv4/IPv6 address or CIDR prefix");
    }
    const int bits = entry.family == AF_INET ? 32 : 128;
    entry.prefix = bits;
    if (slash != std::string_view::npos) {
      const std::string_view len = item.substr(slash + 1);
      int prefix = -1;
      const auto [end, ec] = std::from_chars(len.data(), len.data() + len.size(), prefix);
      if (ec != std::errc() || end != len.data() + len.size() || prefix < 0 || prefix > bits) {
        return InvalidArgument("peer allow-list entry '" + std::string(item) +
                               "': the prefix length must be 0.." + std::to_string(bits));
      }
      entry.prefix = prefix;
    }
    // Host bits past the prefix are a typo more often than not ("10.0.0.1/8").
    std::array<uint8_t, 16> masked = entry.bytes;
    for (int bit = entry.prefix; bit < bits; ++bit) {
      masked[static_cast<size_t>(bit / 8)] &= static_cast<uint8_t>(~(0x80 >> (bit % 8)));
    }
    if (masked != entry.bytes) {
      return InvalidArgument("peer allow-list entry '" + std::string(item) +
                             "' has host bits set past its prefix length");
    }
    // Allows() matches an IPv4-mapped peer (::ffff:10.0.0.5, how a dual-stack listener sees an
    // IPv4 client, and how a refusal logs it) as IPv4: an entry written that way is one too.
    // Its prefix is /96 or longer (a shorter one has the ffff bits past it, refused above).
    in6_addr v6{};
    std::memcpy(&v6, entry.bytes.data(), sizeof(v6));
    if (entry.family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&v6)) {
      std::array<uint8_t, 16> v4{};
      std::memcpy(v4.data(), entry.bytes.data() + 12, 4);
      entry.bytes = v4;
      entry.family = AF_INET;
      entry.prefix -= 96;
    }
    list.entries_.push_back(entry);
  }
  return list;
}

bool PeerAllowList::Allows(const sockaddr* address) const {
  if (address == nullptr) return false;
  uint8_t bytes[16] = {};
  int family = 0;
  if (address->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(address);
    std::memcpy(bytes, &in->sin_addr, 4);
    family = AF_INET;
  } else if (address->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      std::memcpy(bytes, in6->sin6_addr.s6_addr + 12, 4);
      family = AF_INET;
    } else {
      std::memcpy(bytes, in6->sin6_addr.s6_addr, 16);
      family = AF_INET6;
    }
  } else {
    return false;
  }
  for (const Entry& entry : entries_) {
    if (entry.family == family && PrefixEqual(entry.bytes.data(), bytes, entry.prefix)) {
      return true;
    }
  }
  return false;
}

std::string PeerAllowList::ToString() const {
  std::string out;
  for (const Entry& entry : entries_) {
    char text[INET6_ADDRSTRLEN] = {};
    inet_ntop(entry.family, entry.bytes.data(), text, sizeof(text));
    if (!out.empty()) out += ',';
    out += text;
    out += '/';
    out += std::to_string(entry.prefix);
  }
  return out;
}

std::string FormatSockaddr(const sockaddr* address) {
  if (address == nullptr) return "<no address>";
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(address);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    return std::string(text) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (address->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
    inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "<family " + std::to_string(address->sa_family) + ">";
}

}  // namespace weightcache::fleet
