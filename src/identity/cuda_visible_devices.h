// CUDA_VISIBLE_DEVICES, applied the way the CUDA driver applies it.
//
// The driver applies CUDA_VISIBLE_DEVICES to itself; this module exists for the enumeration
// paths that do not go through the driver (the device inventory file and the
// /proc/driver/nvidia fallback), so that a local device index means the same device whichever
// source enumerated it. See docs/identity.md for the rules with examples.
//
// Contract: pure functions over strings; no I/O, no environment access, thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weightcache::identity {

struct VisibleSelection {
  // Positions in the physical list, in the order the process will see them: visible local
  // index i is physical device ordinals[i].
  std::vector<size_t> ordinals;
  // Why the list ended before its last entry or came out empty (an invalid index, an
  // unknown or ambiguous UUID prefix, a duplicate); empty when every entry was used.
  std::string note;
};

// `value` is the variable's value (std::nullopt = unset); `physical_uuids` the devices in
// physical enumeration order (index = physical ordinal).
VisibleSelection SelectVisibleDevices(const std::optional<std::string>& value,
                                      const std::vector<std::string>& physical_uuids);

}  // namespace weightcache::identity
