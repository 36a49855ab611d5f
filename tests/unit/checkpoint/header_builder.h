// Test helper: builds safetensors bytes by hand (hostile headers the real writer would never
// produce) and writes them to files.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace weightcache::checkpoint::testing {

// 8-byte little-endian length of `json`, then `json`, then `data_bytes` zero bytes.
inline std::string SafetensorsBytes(const std::string& json, uint64_t data_bytes = 0) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;
  out.append(data_bytes, '\0');
  return out;
}

inline std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace weightcache::checkpoint::testing
