#include "identity/cuda_visible_devices.h"

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "common/strings.h"

// The rules, and where they come from.
//
// Documented (CUDA Programming Guide, "CUDA Environment Variables", CUDA_VISIBLE_DEVICES):
//  * unset: every device is visible; set to the empty string: no device is visible;
//  * a comma-separated sequence of integer indices or GPU UUID strings ("GPU-8932f937-d72c-
//    4106-c12f-20bd9faed9f6" as nvidia-smi -L prints them); "abbreviated forms are allowed;
//    simply specify enough digits from the beginning of the GPU UUID to uniquely identify
//    that GPU" (e.g. GPU-8932f937). The MPS guide adds that the abbreviation includes the
//    "GPU-" prefix;
//  * devices are enumerated in the order of the sequence ("2,1": device 2 becomes local 0);
//  * "If an invalid index is encountered, only devices with indices that appear before the
//    invalid index in the list are visible" ("0,2,-1,1" → 0 and 2);
//  * MIG instances: "MIG-<GPU-UUID>/<GPU instance ID>/<compute instance ID>" (and, on R470+
//    drivers, the MIG-xxxxxxxx-xxxx-... UUIDs nvidia-smi -L prints).
//
// Observed driver behaviour that the guide does not spell out, as modelled by PyTorch's
// torch/cuda/__init__.py (_parse_visible_devices / _transform_uuid_to_ordinals, written to
// predict cuDeviceGetCount without initialising CUDA):
//  * indices are parsed like strtoul: leading whitespace skipped, an optional sign, digits,
//    and anything after the digits ignored ("1gpu2" is 1); no digits or a negative value is
//    an invalid entry;
//  * the kind of the whole list is decided by its first entry: a list that starts with
//    "GPU-" (or "MIG-") stops at the first entry without that prefix, and an index list stops
//    at the first non-numeric entry — so a UUID without its "GPU-" prefix is parsed as a
//    number (and usually ends the list);
//  * a UUID prefix that matches no device, or more than one, ends the list;
//  * a device named twice (same index, or two spellings of one UUID) makes the whole list
//    empty: no device is visible.
// We also trim surrounding whitespace from UUID entries; the driver's handling of padded
// UUIDs is not documented and a padded UUID is almost certainly meant as that UUID.

namespace weightcache::identity {
namespace {

std::vector<std::string_view> SplitCommas(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    size_t comma = s.find(',', start);
    if (comma == std::string_view::npos) {
      out.push_back(s.substr(start));
      return out;
    }
    out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
}

// strtoul-like: returns -1 for "no digits", a negative value or overflow.
int64_t ParseIndexEntry(std::string_view entry) {
  entry = TrimSpace(entry);
  bool negative = false;
  if (!entry.empty() && (entry.front() == '+' || entry.front() == '-')) {
    negative = entry.front() == '-';
    entry.remove_prefix(1);
  }
  int64_t value = 0;
  size_t digits = 0;
  for (char c : entry) {
    if (c < '0' || c > '9') break;
    value = value * 10 + (c - '0');
    if (value > (int64_t{1} << 31)) return -1;
    ++digits;
  }
  if (digits == 0) return -1;
  if (negative && value != 0) return -1;
  return value;
}

std::string Quote(std::string_view s) { return "\"" + std::string(s) + "\""; }

}  // namespace

VisibleSelection SelectVisibleDevices(const std::optional<std::string>& value,
                                      const std::vector<std::string>& physical_uuids) {
  VisibleSelection sel;
  if (!value.has_value()) {
    for (size_t i = 0; i < physical_uuids.size(); ++i) sel.ordinals.push_back(i);
    return sel;
  }
  if (value->empty()) {
    sel.note = "CUDA_VISIBLE_DEVICES is set to the empty string: no device is visible";
    return sel;
  }
  const std::vector<std::string_view> entries = SplitCommas(*value);
  const std::string_view first = TrimSpace(entries.front());
  std::string_view uuid_kind;  // "GPU-" or "MIG-" for a UUID list, empty for an index list
  if (first.starts_with("GPU-")) uuid_kind = "GPU-";
  if (first.starts_with("MIG-")) uuid_kind = "MIG-";

  const std::string prefix_note = "CUDA_VISIBLE_DEVICES=" + Quote(*value) + ": ";
  for (size_t n = 0; n < entries.size(); ++n) {
    const std::string_view raw = entries[n];
    const std::string where = "entry " + std::to_string(n) + " " + Quote(raw);
    const std::string ignored =
        n + 1 < entries.size() ? "; it and later entries are ignored" : "; it is ignored";
    size_t ordinal = 0;
    if (uuid_kind.empty()) {
      const int64_t index = ParseIndexEntry(raw);
      if (index < 0) {
        sel.note = prefix_note + where + " is not a device index" + ignored;
        return sel;
      }
      if (static_cast<uint64_t>(index) >= physical_uuids.size()) {
        sel.note = prefix_note + where + " is out of range (" +
                   std::to_string(physical_uuids.size()) + " devices)" + ignored;
        return sel;
      }
      ordinal = static_cast<size_t>(index);
    } else {
      const std::string_view entry = TrimSpace(raw);
      if (!entry.starts_with(uuid_kind)) {
        sel.note = prefix_note + where + " does not start with " + Quote(uuid_kind) +
                   " like the first entry" + ignored;
        return sel;
      }
      size_t matches = 0;
      for (size_t i = 0; i < physical_uuids.size(); ++i) {
        if (physical_uuids[i].starts_with(entry)) {
          ordinal = i;
          ++matches;
        }
      }
      if (matches == 0) {
        sel.note = prefix_note + where + " matches no device UUID" + ignored;
        return sel;
      }
      if (matches > 1) {
        sel.note = prefix_note + where + " is an ambiguous UUID prefix (matches " +
                   std::to_string(matches) + " devices)" + ignored;
        return sel;
      }
    }
    if (std::find(sel.ordinals.begin(), sel.ordinals.end(), ordinal) != sel.ordinals.end()) {
      sel.ordinals.clear();
      sel.note = prefix_note + where + " names device " + std::to_string(ordinal) +
                 " a second time; CUDA then shows no device at all";
      return sel;
    }
    sel.ordinals.push_back(ordinal);
  }
  return sel;
}

}  // namespace weightcache::identity
