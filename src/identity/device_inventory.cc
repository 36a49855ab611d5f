#include "identity/device_inventory.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "common/strict_json.h"
#include "common/strings.h"
#include "identity/cuda_visible_devices.h"
#include "os/read_file.h"

namespace weightcache::identity {
namespace {

// An inventory models one host; a megabyte is thousands of devices.
constexpr size_t kMaxInventoryBytes = 1 << 20;
constexpr size_t kMaxProcInfoBytes = 64 << 10;
constexpr char kInventoryEnv[] = "WEIGHTCACHE_DEVICE_INVENTORY";

bool IsLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// 8-4-4-4-12 lowercase hex.
bool IsUuidBody(std::string_view s) {
  static constexpr size_t kGroups[] = {8, 4, 4, 4, 12};
  for (size_t g = 0; g < 5; ++g) {
    if (s.size() < kGroups[g] || !IsLowerHex(s.substr(0, kGroups[g]))) return false;
    s.remove_prefix(kGroups[g]);
    if (g < 4) {
      if (s.empty() || s.front() != '-') return false;
      s.remove_prefix(1);
    }
  }
  return s.empty();
}

bool IsDecimal(std::string_view s) {
  return !s.empty() && s.size() <= 9 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Keep the physical devices CUDA_VISIBLE_DEVICES selects, renumbered as local indices.
std::vector<DeviceInfo> ApplyVisibility(const std::vector<DeviceInfo>& physical,
                                        const EnvLookup& env, std::vector<std::string>* notes) {
  std::vector<std::string> uuids;
  uuids.reserve(physical.size());
  for (const DeviceInfo& d : physical) uuids.push_back(d.uuid);
  VisibleSelection sel = SelectVisibleDevices(env("CUDA_VISIBLE_DEVICES"), uuids);
  if (!sel.note.empty()) notes->push_back(sel.note);
  std::vector<DeviceInfo> visible;
  for (size_t ordinal : sel.ordinals) {
    DeviceInfo d = physical[ordinal];
    d.index = static_cast<int>(visible.size());
    visible.push_back(std::move(d));
  }
  return visible;
}

Result<std::vector<DeviceInfo>> FromDriver(const cuda::DriverApi* api) {
  int count = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetCount(&count), "cuDeviceGetCount");
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    const std::string what = "device " + std::to_string(i) + ": ";
    CUdevice dev = 0;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGet(&dev, i), what + "cuDeviceGet");
    CUuuid uuid{};
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetUuid(&uuid, dev), what + "cuDeviceGetUuid");
    char name[256] = {};
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetName(name, sizeof(name) - 1, dev),
                                   what + "cuDeviceGetName");
    size_t memory = 0;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceTotalMem(&memory, dev), what + "cuDeviceTotalMem");
    char bus[64] = {};
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetPCIBusId(bus, sizeof(bus) - 1, dev),
                                   what + "cuDeviceGetPCIBusId");
    DeviceInfo d;
    d.index = i;
    d.cuda_ordinal = i;
    d.uuid = FormatGpuUuid(uuid);
    d.name = name;
    d.memory_bytes = memory;
    d.pci_bus_id = Lower(bus);
    devices.push_back(std::move(d));
  }
  return devices;
}

// The physical list from /proc/driver/nvidia/gpus/<bus id>/information, in PCI bus order.
// Returns an empty list when the directory does not exist (no NVIDIA kernel driver).
Result<std::vector<DeviceInfo>> FromProc(const std::string& gpus_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(gpus_dir, ec)) return std::vector<DeviceInfo>{};
  std::vector<std::string> entries;
  for (fs::directory_iterator it(gpus_dir, ec), end; !ec && it != end; it.increment(ec)) {
    entries.push_back(it->path().string());
  }
  if (ec) return IoError("listing " + gpus_dir, ec.value());
  std::vector<DeviceInfo> devices;
  for (const std::string& dir : entries) {
    const std::string info_path = dir + "/information";
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, os::ReadSmallFile(info_path, kMaxProcInfoBytes));
    DeviceInfo d;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t eol = text.find('\n', pos);
      if (eol == std::string::npos) eol = text.size();
      std::string_view line(text.data() + pos, eol - pos);
      pos = eol + 1;
      size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      std::string_view key = TrimSpace(line.substr(0, colon));
      std::string_view value = TrimSpace(line.substr(colon + 1));
      if (key == "Model") d.name = value;
      if (key == "GPU UUID") d.uuid = value;
      if (key == "Bus Location") d.pci_bus_id = Lower(std::string(value));
    }
    if (!IsValidDeviceUuid(d.uuid)) {
      return Status(StatusCode::kIo,
                    info_path + ": no valid \"GPU UUID:\" line (got \"" + d.uuid + "\")");
    }
    if (d.pci_bus_id.empty()) d.pci_bus_id = Lower(fs::path(dir).filename().string());
    devices.push_back(std::move(d));
  }
  std::sort(devices.begin(), devices.end(),
            [](const DeviceInfo& a, const DeviceInfo& b) { return a.pci_bus_id < b.pci_bus_id; });
  for (size_t i = 0; i < devices.size(); ++i) devices[i].index = static_cast<int>(i);
  return devices;
}

std::string DescribeVisible(const std::vector<DeviceInfo>& visible) {
  if (visible.empty()) return "no devices are visible";
  std::string out = "visible devices:";
  for (const DeviceInfo& d : visible) {
    out += " [" + std::to_string(d.index) + "] " + d.uuid;
    if (!d.name.empty()) out += " (" + d.name + ")";
    if (d.index + 1 < static_cast<int>(visible.size())) out += ",";
  }
  return out;
}

}  // namespace

std::string_view InventorySourceName(InventorySource source) {
  switch (source) {
    case InventorySource::kInventoryFile:
      return "inventory-file";
    case InventorySource::kCudaDriver:
      return "cuda-driver";
    case InventorySource::kProcFs:
      return "procfs";
    case InventorySource::kNone:
      return "none";
  }
  return "unknown";
}

std::string FormatGpuUuid(const CUuuid& uuid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    const auto b = static_cast<unsigned char>(uuid.bytes[i]);
    out += kHex[b >> 4];
    out += kHex[b & 0xf];
  }
  return out;
}

bool IsValidDeviceUuid(std::string_view uuid) {
  if (uuid.starts_with("GPU-")) return IsUuidBody(uuid.substr(4));
  if (!uuid.starts_with("MIG-")) return false;
  std::string_view rest = uuid.substr(4);
  if (!rest.starts_with("GPU-")) return IsUuidBody(rest);
  // Legacy MIG-GPU-<uuid>/<gpu instance id>/<compute instance id>.
  rest.remove_prefix(4);
  size_t slash1 = rest.find('/');
  if (slash1 == std::string_view::npos || !IsUuidBody(rest.substr(0, slash1))) return false;
  rest.remove_prefix(slash1 + 1);
  size_t slash2 = rest.find('/');
  if (slash2 == std::string_view::npos) return false;
  return IsDecimal(rest.substr(0, slash2)) && IsDecimal(rest.substr(slash2 + 1));
}

Result<std::vector<DeviceInfo>> ParseInventoryJson(std::string_view text, std::string_view origin) {
  const std::string where = "device inventory " + std::string(origin);
  nlohmann::json doc;
  if (std::string error = ParseStrictJson(text, doc); !error.empty()) {
    return InvalidArgument(where + ": " + error);
  }
  if (!doc.is_array()) {
    return InvalidArgument(where + ": expected a JSON list of {index, uuid, name, memory_bytes}");
  }
  std::vector<DeviceInfo> devices;
  for (size_t n = 0; n < doc.size(); ++n) {
    const nlohmann::json& e = doc[n];
    const std::string at = where + ": entry " + std::to_string(n);
    if (!e.is_object()) return InvalidArgument(at + ": expected an object");
    for (const auto& [key, value] : e.items()) {
      if (key != "index" && key != "uuid" && key != "name" && key != "memory_bytes" &&
          key != "pci_bus_id") {
        return InvalidArgument(at + ": unknown field \"" + key + "\"");
      }
    }
    for (const char* key : {"index", "uuid", "name", "memory_bytes"}) {
      if (!e.contains(key)) return InvalidArgument(at + ": missing field \"" + key + "\"");
    }
    DeviceInfo d;
    if (!e["index"].is_number_unsigned() || e["index"].get<uint64_t>() > (1u << 20)) {
      return InvalidArgument(at + ": \"index\" must be a small non-negative integer");
    }
    d.index = static_cast<int>(e["index"].get<uint64_t>());
    if (!e["uuid"].is_string()) return InvalidArgument(at + ": \"uuid\" must be a string");
    d.uuid = e["uuid"].get<std::string>();
    if (!IsValidDeviceUuid(d.uuid)) {
      return InvalidArgument(at + ": \"uuid\" \"" + d.uuid +
                             "\" is not GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or MIG-… "
                             "(lowercase hex, as nvidia-smi -L prints it)");
    }
    if (!e["name"].is_string()) return InvalidArgument(at + ": \"name\" must be a string");
    d.name = e["name"].get<std::string>();
    if (!e["memory_bytes"].is_number_unsigned()) {
      return InvalidArgument(at + ": \"memory_bytes\" must be a non-negative integer");
    }
    d.memory_bytes = e["memory_bytes"].get<uint64_t>();
    if (e.contains("pci_bus_id")) {
      if (!e["pci_bus_id"].is_string()) {
        return InvalidArgument(at + ": \"pci_bus_id\" must be a string");
      }
      d.pci_bus_id = Lower(e["pci_bus_id"].get<std::string>());
    }
    devices.push_back(std::move(d));
  }
  std::sort(devices.begin(), devices.end(),
            [](const DeviceInfo& a, const DeviceInfo& b) { return a.index < b.index; });
  std::set<std::string> uuids;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].index != static_cast<int>(i)) {
      return InvalidArgument(
          where + ": indices must be exactly 0.." + std::to_string(devices.size() - 1) +
          ", each once (index " + std::to_string(i) + " is " +
          (devices[i].index < static_cast<int>(i) ? "duplicated" : "missing") + ")");
    }
    if (!uuids.insert(devices[i].uuid).second) {
      return InvalidArgument(where + ": uuid " + devices[i].uuid + " is listed twice");
    }
  }
  return devices;
}

Result<DeviceInventory> LoadDeviceInventory(const InventoryOptions& options) {
  DeviceInventory inv;
  std::string file = options.inventory_file;
  if (file.empty()) file = options.env(kInventoryEnv).value_or("");
  if (!file.empty()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, os::ReadSmallFile(file, kMaxInventoryBytes));
    WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<DeviceInfo> physical, ParseInventoryJson(text, file));
    inv.source = InventorySource::kInventoryFile;
    inv.source_detail = file;
    inv.devices = ApplyVisibility(physical, options.env, &inv.notes);
    return inv;
  }

  Result<const cuda::DriverApi*> driver =
      options.load_driver ? options.load_driver() : Env::Default().load_driver();
  if (driver.ok()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(inv.devices, FromDriver(*driver));
    inv.source = InventorySource::kCudaDriver;
    inv.source_detail = "libcuda.so.1";
    return inv;
  }
  inv.notes.push_back("CUDA driver not used: " + driver.status().message());

  const std::string gpus_dir = options.proc_root + "/driver/nvidia/gpus";
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<DeviceInfo> physical, FromProc(gpus_dir));
  if (physical.empty()) {
    inv.source = InventorySource::kNone;
    inv.notes.push_back("no GPUs listed under " + gpus_dir);
    return inv;
  }
  inv.source = InventorySource::kProcFs;
  inv.source_detail = gpus_dir;
  std::set<std::string> models;
  for (const DeviceInfo& d : physical) models.insert(d.name);
  if (models.size() > 1 && options.env("CUDA_DEVICE_ORDER").value_or("") != "PCI_BUS_ID") {
    inv.notes.push_back(
        "devices listed in PCI bus order, but this host mixes GPU models and CUDA orders them "
        "FASTEST_FIRST unless CUDA_DEVICE_ORDER=PCI_BUS_ID: local indices may differ from "
        "CUDA's; prefer --device <UUID>");
  }
  inv.devices = ApplyVisibility(physical, options.env, &inv.notes);
  return inv;
}

Result<std::vector<DeviceInfo>> VisibleDevices(const InventoryOptions& options) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(DeviceInventory inv, LoadDeviceInventory(options));
  return std::move(inv.devices);
}

Result<DeviceInfo> ResolveDevice(std::string_view spec, const std::vector<DeviceInfo>& visible) {
  if (spec.empty()) {
    return InvalidArgument("empty device spec: give a local index or a GPU UUID; " +
                           DescribeVisible(visible));
  }
  const std::string quoted = "device \"" + std::string(spec) + "\"";
  if (std::all_of(spec.begin(), spec.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    if (spec.size() > 6)
      return NotFound(quoted + " is not a visible local index; " + DescribeVisible(visible));
    const int index = std::stoi(std::string(spec));
    if (index >= static_cast<int>(visible.size())) {
      return NotFound(quoted + " is not a visible local index (" + std::to_string(visible.size()) +
                      " visible); " + DescribeVisible(visible));
    }
    return visible[static_cast<size_t>(index)];
  }
  const bool has_kind = spec.starts_with("GPU-") || spec.starts_with("MIG-");
  std::vector<const DeviceInfo*> matches;
  for (const DeviceInfo& d : visible) {
    if (d.uuid == spec) return d;  // an exact UUID wins even if it prefixes another
    std::string_view candidate = d.uuid;
    if (!has_kind && candidate.size() > 4) candidate.remove_prefix(4);
    if (candidate.starts_with(spec)) matches.push_back(&d);
  }
  if (matches.empty()) {
    return NotFound(quoted + " matches no visible device UUID; " + DescribeVisible(visible));
  }
  if (matches.size() > 1) {
    std::string which;
    for (const DeviceInfo* d : matches) which += (which.empty() ? "" : ", ") + d->uuid;
    return InvalidArgument(quoted + " is an ambiguous UUID prefix: it matches " + which);
  }
  return *matches.front();
}

Result<int> FindCudaOrdinal(const cuda::DriverApi* api, std::string_view uuid) {
  int count = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetCount(&count), "cuDeviceGetCount");
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGet(&dev, i),
                                   "cuDeviceGet(" + std::to_string(i) + ")");
    CUuuid raw{};
    WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetUuid(&raw, dev),
                                   "cuDeviceGetUuid(" + std::to_string(i) + ")");
    if (FormatGpuUuid(raw) == uuid) return i;
  }
  return -1;
}

Result<CUdevice> CudaDevice(const cuda::DriverApi* api, const DeviceInfo& device) {
  if (device.cuda_ordinal < 0) {
    return NotFound("device " + device.uuid +
                    " is not among the devices the CUDA driver shows this process; check "
                    "CUDA_VISIBLE_DEVICES and --device-inventory");
  }
  const std::string what =
      "device " + device.uuid + " (CUDA ordinal " + std::to_string(device.cuda_ordinal) + "): ";
  CUdevice dev = 0;
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGet(&dev, device.cuda_ordinal), what + "cuDeviceGet");
  CUuuid raw{};
  WEIGHTCACHE_CU_RETURN_IF_ERROR(api, cuDeviceGetUuid(&raw, dev), what + "cuDeviceGetUuid");
  if (const std::string seen = FormatGpuUuid(raw); seen != device.uuid) {
    return NotFound(what + "the driver now shows " + seen + " at that ordinal");
  }
  return dev;
}

}  // namespace weightcache::identity
