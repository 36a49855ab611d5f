// TrimSpace — the one rule for trimming the ASCII white space around a token of a config
// value or an environment variable (CUDA_VISIBLE_DEVICES, nvidia-smi and /proc text). Pure.
#pragma once

#include <cctype>
#include <string_view>

namespace weightcache {

constexpr std::string_view TrimSpace(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace weightcache
