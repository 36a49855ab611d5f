#include "daemon/byte_size.h"

#include <cctype>
#include <cstdio>
#include <limits>

namespace weightcache::daemon {

Result<uint64_t> ParseByteSize(std::string_view text) {
  const std::string quoted = "\"" + std::string(text) + "\"";
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) {
      return InvalidArgument("byte size " + quoted + " overflows 64 bits");
    }
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) {
    return InvalidArgument("byte size " + quoted +
                           " must start with a whole number of bytes (e.g. 20G, 512M, 4096)");
  }
  std::string suffix;
  for (; i < text.size(); ++i) {
    suffix.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(text[i]))));
  }
  // Accept K, KB, KIB (and the same for M, G, T, P); a bare "B" means bytes.
  int shift = 0;
  if (!suffix.empty()) {
    std::string_view unit = suffix;
    if (unit == "B") {
      unit = "";
    } else if ((unit.size() == 3 && unit.substr(1) == "IB") ||
               (unit.size() == 2 && unit[1] == 'B')) {
      unit = unit.substr(0, 1);
    }
    if (unit == "K") {
      shift = 10;
    } else if (unit == "M") {
      shift = 20;
    } else if (unit == "G") {
      shift = 30;
    } else if (unit == "T") {
      shift = 40;
    } else if (unit == "P") {
      shift = 50;
    } else if (!unit.empty()) {
      return InvalidArgument("byte size " + quoted +
                             " has an unknown unit (use B, K, M, G, T or P; binary multiples)");
    }
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return InvalidArgument("byte size " + quoted + " overflows 64 bits");
  }
  return value << shift;
}

Result<uint64_t> ParseByteSizeOrPercent(std::string_view text, uint64_t total) {
  if (!text.ends_with('%')) return ParseByteSize(text);
  const std::string quoted = "\"" + std::string(text) + "\"";
  const std::string_view digits = text.substr(0, text.size() - 1);
  uint64_t percent = 0;
  for (const char c : digits) {
    if (!std::isdigit(static_cast<unsigned char>(c)) || percent > 100) {
      percent = 0;
      break;
    }
    percent = percent * 10 + static_cast<uint64_t>(c - '0');
  }
  if (digits.empty() || percent == 0 || percent > 100) {
    return InvalidArgument("budget " + quoted + " must be a whole percentage from 1% to 100%");
  }
  if (total == 0) {
    return InvalidArgument("budget " + quoted +
                           " is a percentage, but the device's total memory is unknown: give "
                           "a byte size (e.g. 40G)");
  }
  // total * percent / 100 without overflow: total <= 2^64, percent <= 100.
  return (total / 100) * percent + (total % 100) * percent / 100;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes) / 1024.0;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  return buf;
}

std::string FormatRate(uint64_t bytes, double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB/s", seconds > 0 ? bytes / seconds / 1e9 : 0.0);
  return buf;
}

}  // namespace weightcache::daemon
