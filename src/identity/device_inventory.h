// Device inventory: which GPUs this process can see, and the physical UUID of each.
//
// The device key of every cache is the physical GPU UUID (docs/design.md "Discovery by GPU UUID").
// A local index ("--device 3") is only ever an index into the devices this process can see, and is
// resolved to a UUID here, before any path is formed.
//
// Sources, in this precedence (the first that applies wins):
//  1. an inventory file: InventoryOptions::inventory_file (--device-inventory), else the
//     WEIGHTCACHE_DEVICE_INVENTORY variable. A JSON list of
//       {"index": 0, "uuid": "GPU-…", "name": "…", "memory_bytes": N [, "pci_bus_id": "…"]}
//     with indices exactly 0..n-1 in physical order, unique UUIDs. It stands in for
//     enumeration on driverless hosts and in tests (an 8-GPU host on a laptop).
//     CUDA_VISIBLE_DEVICES is applied to it by SelectVisibleDevices.
//  2. the CUDA driver (InventoryOptions::load_driver, else Env::Default()'s; tests inject a
//     fake). The driver applies CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER itself, so what it
//     reports is already the visible list in local-index order.
//  3. /proc/driver/nvidia/gpus/*/information, when the driver cannot be loaded or initialised.
//     Ordered by PCI bus id, then CUDA_VISIBLE_DEVICES is applied. Caveat: CUDA's default
//     order is CUDA_DEVICE_ORDER=FASTEST_FIRST, which equals PCI order only on hosts whose
//     GPUs are all alike; a note says so when the models differ and the order is not
//     PCI_BUS_ID. memory_bytes is 0 (unknown) from this source.
// When none applies (no file, no driver, no /proc entries) the visible list is empty, which
// is a valid answer for the host tier; ResolveDevice then explains why.
//
// UUIDs from the driver are formatted as nvidia-smi prints them ("GPU-" + 8-4-4-4-12
// lowercase hex). The driver does not say whether a device is a MIG instance, so driver
// UUIDs always carry the "GPU-" prefix; inventory files may list "MIG-…" UUIDs.
//
// Thread-safety: every function is reentrant; the driver table is process-wide and
// immutable. Nothing here holds resources.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/driver_api.h"
#include "identity/env.h"
#include "weightcache/status.h"

namespace weightcache::identity {

struct DeviceInfo {
  int index = -1;             // local index: the position among the devices this process sees
  std::string uuid;           // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" or "MIG-…"
  std::string name;           // "NVIDIA H200"
  uint64_t memory_bytes = 0;  // total device memory; 0 = unknown
  std::string pci_bus_id;     // "0000:3b:00.0" (lowercase); empty when unknown
  // The CUDA ordinal of this device in this process (cuDeviceGet's argument), found once when
  // the device is resolved: the driver's own index, or for an inventory file / procfs entry the
  // position of its UUID among the devices the driver shows. -1: unknown (no driver, or the
  // driver does not show this UUID). CudaDevice() is the one step from it to a CUdevice.
  int cuda_ordinal = -1;
};

enum class InventorySource { kInventoryFile, kCudaDriver, kProcFs, kNone };
std::string_view InventorySourceName(InventorySource source);  // "inventory-file", …

struct InventoryOptions {
  std::string inventory_file;  // --device-inventory; wins over WEIGHTCACHE_DEVICE_INVENTORY
  EnvLookup env = ProcessEnv();
  std::string proc_root = "/proc";  // tests point this at a fake tree
  // The driver seam. Empty = Env::Default()'s (identity/env.h). Tests inject a fake table, or
  // a function returning kUnavailable to model a driverless host.
  std::function<Result<const cuda::DriverApi*>()> load_driver;
};

struct DeviceInventory {
  InventorySource source = InventorySource::kNone;
  std::string source_detail;        // the inventory path, "libcuda.so.1", the /proc directory
  std::vector<DeviceInfo> devices;  // visible devices; devices[i].index == i
  // Human-readable remarks: why the driver was not used, where CUDA_VISIBLE_DEVICES cut the
  // list, ordering caveats. Empty when there is nothing to remark.
  std::vector<std::string> notes;
};

// Enumerate the visible devices from the first source that applies (see above).
Result<DeviceInventory> LoadDeviceInventory(const InventoryOptions& options);
// The devices only.
Result<std::vector<DeviceInfo>> VisibleDevices(const InventoryOptions& options);

// Resolve a --device value against the visible devices: a local index ("5"), a full UUID, or
// a unique UUID prefix (with or without its "GPU-"/"MIG-" prefix). Errors name the spec and
// list the visible devices: kNotFound when nothing matches, kInvalidArgument when the spec is
// empty or an ambiguous prefix.
Result<DeviceInfo> ResolveDevice(std::string_view spec, const std::vector<DeviceInfo>& visible);

// The CUDA ordinal of `uuid` among the devices the driver shows this process (the driver
// applies CUDA_VISIBLE_DEVICES itself), or -1 when it shows no such device. Driver errors are
// returned as they are.
Result<int> FindCudaOrdinal(const cuda::DriverApi* api, std::string_view uuid);

// The one step from a resolved device to the CUdevice of this process: cuDeviceGet of its
// cuda_ordinal, checked against its UUID. kNotFound naming the UUID when the ordinal is unknown
// (the driver does not show the device) or now names another device.
Result<CUdevice> CudaDevice(const cuda::DriverApi* api, const DeviceInfo& device);

// Parse and strictly validate an inventory file's text: the PHYSICAL list, sorted by index.
// `origin` (the file name) prefixes every error. Errors are kInvalidArgument.
Result<std::vector<DeviceInfo>> ParseInventoryJson(std::string_view text, std::string_view origin);

// "GPU-" + the 16 bytes as 8-4-4-4-12 lowercase hex, exactly as nvidia-smi prints them.
std::string FormatGpuUuid(const CUuuid& uuid);

// A well-formed device key: GPU-<8-4-4-4-12 lowercase hex>, MIG-<8-4-4-4-12 lowercase hex>,
// or the legacy MIG-GPU-<uuid>/<gpu instance>/<compute instance>.
bool IsValidDeviceUuid(std::string_view uuid);

}  // namespace weightcache::identity
