// `weightcache devices`: the GPUs this process can see, in local-index order, with the
// physical UUID each local index resolves to, and which source enumerated them (inventory
// file, CUDA driver, /proc) — plus any remark on why a source was skipped or where
// CUDA_VISIBLE_DEVICES cut the list. It is the quickest answer to "which GPU is --device 3?".
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli_common.h"
#include "identity/device_inventory.h"

namespace weightcache::cli {
namespace {

struct DevicesArgs {
  std::string device_inventory;
  bool json = false;
};

std::string GiB(uint64_t bytes) {
  if (bytes == 0) return "?";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

int Run(const DevicesArgs& args) {
  identity::InventoryOptions options;
  options.inventory_file = args.device_inventory;
  auto inv = identity::LoadDeviceInventory(options);
  if (!inv.ok()) return Fail("devices", inv.status());
  const std::optional<std::string> cvd = options.env("CUDA_VISIBLE_DEVICES");

  if (args.json) {
    nlohmann::json devices = nlohmann::json::array();
    for (const auto& d : inv->devices) {
      devices.push_back({{"index", d.index},
                         {"uuid", d.uuid},
                         {"name", d.name},
                         {"memory_bytes", d.memory_bytes},
                         {"pci_bus_id", d.pci_bus_id}});
    }
    nlohmann::json out = {
        {"source", identity::InventorySourceName(inv->source)},
        {"source_detail", inv->source_detail},
        {"cuda_visible_devices", cvd ? nlohmann::json(*cvd) : nlohmann::json(nullptr)},
        {"devices", devices},
        {"notes", inv->notes},
    };
    std::cout << out.dump(2) << std::endl;
    return kExitOk;
  }
  std::cout << "source: " << identity::InventorySourceName(inv->source);
  if (!inv->source_detail.empty()) std::cout << " (" << inv->source_detail << ")";
  std::cout << "\nCUDA_VISIBLE_DEVICES: " << (cvd ? "\"" + *cvd + "\"" : "(unset)") << "\n";
  for (const auto& note : inv->notes) std::cout << "note: " << note << "\n";
  if (inv->devices.empty()) std::cout << "no visible devices\n";
  for (const auto& d : inv->devices) {
    std::cout << d.index << "  " << d.uuid << "  " << d.name << "  " << GiB(d.memory_bytes);
    if (!d.pci_bus_id.empty()) std::cout << "  " << d.pci_bus_id;
    std::cout << "\n";
  }
  std::cout << std::flush;
  return kExitOk;
}

}  // namespace

void RegisterDevicesCommand(CLI::App& root) {
  auto args = std::make_shared<DevicesArgs>();
  CLI::App* sub = root.add_subcommand(
      "devices", "List the GPUs this process can see (local index → physical UUID)");
  sub->add_option("--device-inventory", args->device_inventory,
                  "JSON device inventory standing in for CUDA enumeration");
  sub->add_flag("--json", args->json, "print one JSON object");
  SetAction(sub, [args] { return Run(*args); });
}

}  // namespace weightcache::cli
