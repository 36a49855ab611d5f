// Shared fixtures for the identity tests: a modelled 8-GPU host.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "identity/device_inventory.h"

namespace weightcache::identity::testing {

// Device i of the modelled host: "GPU-iiiiiiii-1111-2222-3333-00000000000i". Every UUID has
// a distinct first hex digit, so "GPU-5" is a unique prefix of device 5.
inline std::string TestUuid(int i) {
  char buf[128];  // room for any int, so the compiler can prove no truncation
  std::snprintf(buf, sizeof(buf), "GPU-%d%d%d%d%d%d%d%d-1111-2222-3333-%012d", i, i, i, i, i, i, i,
                i, i);
  return buf;
}

inline std::vector<std::string> TestUuids(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(TestUuid(i));
  return out;
}

// The inventory file text for n devices, listed in reverse order (order must not matter).
inline std::string InventoryJson(int n) {
  std::string out = "[";
  for (int i = n - 1; i >= 0; --i) {
    out += "{\"index\": " + std::to_string(i) + ", \"uuid\": \"" + TestUuid(i) +
           "\", \"name\": \"NVIDIA H200\", \"memory_bytes\": 150754820096}";
    if (i > 0) out += ", ";
  }
  return out + "]";
}

inline std::vector<DeviceInfo> TestDevices(int n) {
  std::vector<DeviceInfo> out;
  for (int i = 0; i < n; ++i) out.push_back({i, TestUuid(i), "NVIDIA H200", 150754820096, ""});
  return out;
}

}  // namespace weightcache::identity::testing
