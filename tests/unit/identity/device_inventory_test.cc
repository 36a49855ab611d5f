#include "identity/device_inventory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>

#include "support/test_env.h"
#include "unit/identity/test_devices.h"

namespace weightcache::identity {
namespace {

using ::testing::HasSubstr;
using testing::InventoryJson;
using testing::TestDevices;
using testing::TestUuid;
using ::weightcache::testing::TempDir;
using ::weightcache::testing::WriteFile;

Result<const cuda::DriverApi*> NoDriver() {
  return Status(StatusCode::kUnavailable, "CUDA driver not available (test)");
}

InventoryOptions DriverlessOptions(std::map<std::string, std::string, std::less<>> env,
                                   std::string proc_root = "/nonexistent-proc") {
  InventoryOptions o;
  o.env = MapEnv(std::move(env));
  o.proc_root = std::move(proc_root);
  o.load_driver = NoDriver;
  return o;
}

TEST(DeviceInventoryTest, ParsesAndSortsAValidInventory) {
  Result<std::vector<DeviceInfo>> devices = ParseInventoryJson(InventoryJson(8), "inv.json");
  ASSERT_TRUE(devices.ok()) << devices.status().ToString();
  ASSERT_EQ(devices->size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ((*devices)[i].index, i);
    EXPECT_EQ((*devices)[i].uuid, TestUuid(i));
    EXPECT_EQ((*devices)[i].memory_bytes, 150754820096u);
  }
}

void ExpectInventoryError(const std::string& json, const std::string& substring) {
  Result<std::vector<DeviceInfo>> r = ParseInventoryJson(json, "/x/inv.json");
  ASSERT_FALSE(r.ok()) << "accepted: " << json;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("device inventory /x/inv.json"));
  EXPECT_THAT(r.status().message(), HasSubstr(substring));
}

TEST(DeviceInventoryTest, RejectsMalformedInventories) {
  const std::string u0 = TestUuid(0), u1 = TestUuid(1);
  auto entry = [](int index, const std::string& uuid) {
    return "{\"index\":" + std::to_string(index) + ",\"uuid\":\"" + uuid +
           "\",\"name\":\"n\",\"memory_bytes\":1}";
  };
  ExpectInventoryError("not json", "not valid JSON");
  ExpectInventoryError("{}", "expected a JSON list");
  ExpectInventoryError("[" + entry(0, u0) + "," + entry(1, "GPU-1234") + "]",
                       "entry 1: \"uuid\" \"GPU-1234\" is not");
  ExpectInventoryError("[" + entry(0, "GPU-AAAAAAAA-1111-2222-3333-444444444444") + "]",
                       "lowercase hex");
  ExpectInventoryError("[" + entry(0, u0) + "," + entry(0, u1) + "]", "index 1 is duplicated");
  ExpectInventoryError("[" + entry(0, u0) + "," + entry(2, u1) + "]", "index 1 is missing");
  ExpectInventoryError("[" + entry(0, u0) + "," + entry(1, u0) + "]",
                       "uuid " + u0 + " is listed twice");
  ExpectInventoryError("[{\"index\":0,\"uuid\":\"" + u0 + "\",\"name\":\"n\"}]",
                       "entry 0: missing field \"memory_bytes\"");
  ExpectInventoryError(
      "[{\"index\":0,\"uuid\":\"" + u0 + "\",\"name\":\"n\",\"memory_bytes\":1,\"bus\":1}]",
      "entry 0: unknown field \"bus\"");
  ExpectInventoryError("[{\"index\":-1,\"uuid\":\"" + u0 + "\",\"name\":\"n\",\"memory_bytes\":1}]",
                       "\"index\" must be a small non-negative integer");
  ExpectInventoryError(
      "[{\"index\":0,\"uuid\":\"" + u0 + "\",\"name\":\"n\",\"memory_bytes\":\"1\"}]",
      "\"memory_bytes\" must be a non-negative integer");
}

TEST(DeviceInventoryTest, AcceptsMigUuids) {
  const std::string json =
      "[{\"index\":0,\"uuid\":\"MIG-0a1b2c3d-1111-2222-3333-444444444444\",\"name\":\"1g.18gb\","
      "\"memory_bytes\":1},{\"index\":1,\"uuid\":\"MIG-GPU-11111111-1111-2222-3333-"
      "000000000001/1/0\",\"name\":\"legacy\",\"memory_bytes\":1}]";
  Result<std::vector<DeviceInfo>> r = ParseInventoryJson(json, "mig.json");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)[0].uuid, "MIG-0a1b2c3d-1111-2222-3333-444444444444");
}

TEST(DeviceInventoryTest, InventoryFileWinsAndCudaVisibleDevicesApplies) {
  TempDir dir;
  WriteFile(dir.Join("inv.json"), InventoryJson(8));
  InventoryOptions o = DriverlessOptions({{"CUDA_VISIBLE_DEVICES", "5,3"}});
  o.inventory_file = dir.Join("inv.json");
  // A driver that would be used otherwise must not be consulted.
  o.load_driver = []() -> Result<const cuda::DriverApi*> {
    ADD_FAILURE() << "driver consulted although an inventory file was given";
    return NoDriver();
  };
  Result<DeviceInventory> inv = LoadDeviceInventory(o);
  ASSERT_TRUE(inv.ok()) << inv.status().ToString();
  EXPECT_EQ(inv->source, InventorySource::kInventoryFile);
  EXPECT_EQ(inv->source_detail, dir.Join("inv.json"));
  ASSERT_EQ(inv->devices.size(), 2u);
  EXPECT_EQ(inv->devices[0].index, 0);
  EXPECT_EQ(inv->devices[0].uuid, TestUuid(5));
  EXPECT_EQ(inv->devices[1].index, 1);
  EXPECT_EQ(inv->devices[1].uuid, TestUuid(3));
}

TEST(DeviceInventoryTest, FlagWinsOverEnvironmentVariable) {
  TempDir dir;
  WriteFile(dir.Join("good.json"), InventoryJson(2));
  WriteFile(dir.Join("bad.json"), "garbage");
  InventoryOptions o = DriverlessOptions({{"WEIGHTCACHE_DEVICE_INVENTORY", dir.Join("bad.json")}});
  Result<DeviceInventory> from_env = LoadDeviceInventory(o);
  ASSERT_FALSE(from_env.ok());
  EXPECT_THAT(from_env.status().message(), HasSubstr(dir.Join("bad.json") + ": not valid JSON"));

  o.inventory_file = dir.Join("good.json");
  Result<DeviceInventory> from_flag = LoadDeviceInventory(o);
  ASSERT_TRUE(from_flag.ok()) << from_flag.status().ToString();
  EXPECT_EQ(from_flag->devices.size(), 2u);
}

TEST(DeviceInventoryTest, MissingInventoryFileIsNotFoundNamingThePath) {
  InventoryOptions o = DriverlessOptions({});
  o.inventory_file = "/nonexistent/inv.json";
  Result<DeviceInventory> r = LoadDeviceInventory(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("/nonexistent/inv.json"));
}

TEST(ResolveDeviceTest, LocalIndexFiveOfEightIsDeviceFivesUuid) {
  std::vector<DeviceInfo> visible = TestDevices(8);
  Result<DeviceInfo> d = ResolveDevice("5", visible);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->uuid, TestUuid(5));
  EXPECT_NE(d->uuid, TestUuid(0));
  EXPECT_EQ(d->index, 5);
}

TEST(ResolveDeviceTest, LocalIndexIsIntoTheVisibleListNotThePhysicalOne) {
  TempDir dir;
  WriteFile(dir.Join("inv.json"), InventoryJson(8));
  InventoryOptions o = DriverlessOptions({{"CUDA_VISIBLE_DEVICES", "5,3"}});
  o.inventory_file = dir.Join("inv.json");
  Result<std::vector<DeviceInfo>> visible = VisibleDevices(o);
  ASSERT_TRUE(visible.ok()) << visible.status().ToString();
  EXPECT_EQ(ResolveDevice("0", *visible)->uuid, TestUuid(5));
  EXPECT_EQ(ResolveDevice("1", *visible)->uuid, TestUuid(3));
  Result<DeviceInfo> hidden = ResolveDevice("GPU-7", *visible);
  ASSERT_FALSE(hidden.ok());
  EXPECT_EQ(hidden.status().code(), StatusCode::kNotFound);
}

TEST(ResolveDeviceTest, UuidAndPrefixes) {
  std::vector<DeviceInfo> visible = TestDevices(8);
  EXPECT_EQ(ResolveDevice(TestUuid(6), visible)->index, 6);
  EXPECT_EQ(ResolveDevice("GPU-66", visible)->index, 6);
  EXPECT_EQ(ResolveDevice("66666666-1111", visible)->index, 6);  // without "GPU-"
  // Digits only are always a local index, never a UUID prefix.
  Result<DeviceInfo> digits = ResolveDevice("6666", visible);
  ASSERT_FALSE(digits.ok());
  EXPECT_THAT(digits.status().message(), HasSubstr("not a visible local index"));
}

TEST(ResolveDeviceTest, ErrorsNameTheSpecAndTheVisibleDevices) {
  std::vector<DeviceInfo> visible = TestDevices(8);
  Result<DeviceInfo> out_of_range = ResolveDevice("8", visible);
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_EQ(out_of_range.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(out_of_range.status().message(),
              HasSubstr("device \"8\" is not a visible local index (8 visible)"));
  EXPECT_THAT(out_of_range.status().message(), HasSubstr("[7] " + TestUuid(7)));

  Result<DeviceInfo> unknown = ResolveDevice("GPU-9", visible);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("device \"GPU-9\" matches no visible"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("[0] " + TestUuid(0)));

  std::vector<DeviceInfo> twins = {{0, "GPU-abcd0000-1111-2222-3333-444444444444", "a", 1, ""},
                                   {1, "GPU-abcd1111-1111-2222-3333-444444444444", "b", 1, ""}};
  Result<DeviceInfo> ambiguous = ResolveDevice("abcd", twins);
  ASSERT_FALSE(ambiguous.ok());
  EXPECT_EQ(ambiguous.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(ambiguous.status().message(), HasSubstr("device \"abcd\" is an ambiguous"));
  EXPECT_EQ(ResolveDevice("abcd1", twins)->index, 1);  // without the GPU- prefix

  Result<DeviceInfo> none = ResolveDevice("0", {});
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("no devices are visible"));
}

// ---- the CUDA driver source, through a fake driver table ----------------------------------

CUresult FakeCount(int* n) {
  *n = 2;
  return CUDA_SUCCESS;
}
CUresult FakeGet(CUdevice* dev, int ordinal) {
  *dev = ordinal;
  return CUDA_SUCCESS;
}
CUresult FakeUuid(CUuuid* uuid, CUdevice dev) {
  static const unsigned char kBytes[2][16] = {{0x89, 0x32, 0xf9, 0x37, 0xd7, 0x2c, 0x41, 0x06, 0xc1,
                                               0x2f, 0x20, 0xbd, 0x9f, 0xae, 0xd9, 0xf6},
                                              {0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,
                                               0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0xff}};
  std::memcpy(uuid->bytes, kBytes[dev], 16);
  return CUDA_SUCCESS;
}
CUresult FakeUuidFailsOnDevice1(CUuuid* uuid, CUdevice dev) {
  if (dev == 1) return CUDA_ERROR_INVALID_DEVICE;
  return FakeUuid(uuid, dev);
}
CUresult FakeName(char* name, int len, CUdevice dev) {
  std::snprintf(name, static_cast<size_t>(len), "Fake GPU %d", dev);
  return CUDA_SUCCESS;
}
CUresult FakeTotalMem(size_t* bytes, CUdevice dev) {
  *bytes = (size_t{80} << 30) + static_cast<size_t>(dev);
  return CUDA_SUCCESS;
}
CUresult FakeBusId(char* bus, int len, CUdevice dev) {
  std::snprintf(bus, static_cast<size_t>(len), "0000:%02X:00.0", 0x3B + dev);
  return CUDA_SUCCESS;
}

cuda::DriverApi FakeDriver() {
  cuda::DriverApi api;
  api.cuDeviceGetCount = FakeCount;
  api.cuDeviceGet = FakeGet;
  api.cuDeviceGetUuid = FakeUuid;
  api.cuDeviceGetName = FakeName;
  api.cuDeviceTotalMem = FakeTotalMem;
  api.cuDeviceGetPCIBusId = FakeBusId;
  return api;
}

TEST(DeviceInventoryTest, DriverUuidsAreFormattedLikeNvidiaSmi) {
  static const cuda::DriverApi api = FakeDriver();
  // The driver applies CUDA_VISIBLE_DEVICES itself: we must not apply it a second time.
  InventoryOptions o = DriverlessOptions({{"CUDA_VISIBLE_DEVICES", "1"}});
  o.load_driver = []() -> Result<const cuda::DriverApi*> { return &api; };
  Result<DeviceInventory> inv = LoadDeviceInventory(o);
  ASSERT_TRUE(inv.ok()) << inv.status().ToString();
  EXPECT_EQ(inv->source, InventorySource::kCudaDriver);
  ASSERT_EQ(inv->devices.size(), 2u);
  EXPECT_EQ(inv->devices[0].uuid, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6");
  EXPECT_EQ(inv->devices[1].uuid, "GPU-00010203-0405-0607-0809-0a0b0c0d0eff");
  EXPECT_EQ(inv->devices[1].index, 1);
  EXPECT_EQ(inv->devices[1].name, "Fake GPU 1");
  EXPECT_EQ(inv->devices[1].memory_bytes, (uint64_t{80} << 30) + 1);
  EXPECT_EQ(inv->devices[1].pci_bus_id, "0000:3c:00.0");
}

TEST(DeviceInventoryTest, DriverCallFailureNamesTheDeviceAndCall) {
  static cuda::DriverApi api = [] {
    cuda::DriverApi a = FakeDriver();
    a.cuDeviceGetUuid = FakeUuidFailsOnDevice1;
    return a;
  }();
  InventoryOptions o = DriverlessOptions({});
  o.load_driver = []() -> Result<const cuda::DriverApi*> { return &api; };
  Result<DeviceInventory> inv = LoadDeviceInventory(o);
  ASSERT_FALSE(inv.ok());
  EXPECT_EQ(inv.status().code(), StatusCode::kCuda);
  EXPECT_THAT(inv.status().message(), HasSubstr("device 1: cuDeviceGetUuid"));
  EXPECT_EQ(inv.status().driver_error(), CUDA_ERROR_INVALID_DEVICE);
}

// ---- the /proc fallback ---------------------------------------------------------------------

void WriteProcGpu(const TempDir& root, const std::string& bus, const std::string& model,
                  const std::string& uuid) {
  const std::string dir = root.Join("driver/nvidia/gpus/" + bus);
  std::filesystem::create_directories(dir);
  WriteFile(dir + "/information", "Model: \t\t " + model + "\nIRQ:   \t\t 42\nGPU UUID: \t " +
                                      uuid +
                                      "\nVideo BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\n"
                                      "Bus Location: \t " +
                                      bus + "\nDevice Minor: \t 0\n");
}

TEST(DeviceInventoryTest, ProcFallbackUsesPciOrderAndAppliesCudaVisibleDevices) {
  TempDir root;
  WriteProcGpu(root, "0000:9b:00.0", "NVIDIA H200", TestUuid(2));
  WriteProcGpu(root, "0000:18:00.0", "NVIDIA H200", TestUuid(0));
  WriteProcGpu(root, "0000:3b:00.0", "NVIDIA H200", TestUuid(1));
  InventoryOptions o = DriverlessOptions({{"CUDA_VISIBLE_DEVICES", "2,0"}}, root.path());
  Result<DeviceInventory> inv = LoadDeviceInventory(o);
  ASSERT_TRUE(inv.ok()) << inv.status().ToString();
  EXPECT_EQ(inv->source, InventorySource::kProcFs);
  ASSERT_EQ(inv->devices.size(), 2u);
  EXPECT_EQ(inv->devices[0].uuid, TestUuid(2));
  EXPECT_EQ(inv->devices[0].pci_bus_id, "0000:9b:00.0");
  EXPECT_EQ(inv->devices[0].name, "NVIDIA H200");
  EXPECT_EQ(inv->devices[0].index, 0);
  EXPECT_EQ(inv->devices[1].uuid, TestUuid(0));
  ASSERT_FALSE(inv->notes.empty());
  EXPECT_THAT(inv->notes[0], HasSubstr("CUDA driver not used: CUDA driver not available (test)"));
}

TEST(DeviceInventoryTest, ProcFallbackWarnsWhenModelsDifferAndOrderIsNotPci) {
  TempDir root;
  WriteProcGpu(root, "0000:18:00.0", "NVIDIA A100", TestUuid(0));
  WriteProcGpu(root, "0000:3b:00.0", "NVIDIA H200", TestUuid(1));
  Result<DeviceInventory> mixed = LoadDeviceInventory(DriverlessOptions({}, root.path()));
  ASSERT_TRUE(mixed.ok());
  EXPECT_THAT(mixed->notes.back(), HasSubstr("CUDA_DEVICE_ORDER=PCI_BUS_ID"));
  Result<DeviceInventory> pci =
      LoadDeviceInventory(DriverlessOptions({{"CUDA_DEVICE_ORDER", "PCI_BUS_ID"}}, root.path()));
  ASSERT_TRUE(pci.ok());
  EXPECT_EQ(pci->notes.size(), 1u);  // only "driver not used"
}

TEST(DeviceInventoryTest, NoSourceYieldsAnEmptyListWithReasons) {
  Result<DeviceInventory> inv = LoadDeviceInventory(DriverlessOptions({}));
  ASSERT_TRUE(inv.ok()) << inv.status().ToString();
  EXPECT_EQ(inv->source, InventorySource::kNone);
  EXPECT_TRUE(inv->devices.empty());
  ASSERT_EQ(inv->notes.size(), 2u);
  EXPECT_THAT(inv->notes[1],
              HasSubstr("no GPUs listed under /nonexistent-proc/driver/nvidia/gpus"));
}

TEST(DeviceInventoryTest, UuidValidation) {
  EXPECT_TRUE(IsValidDeviceUuid("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"));
  EXPECT_TRUE(IsValidDeviceUuid("MIG-8932f937-d72c-4106-c12f-20bd9faed9f6"));
  EXPECT_TRUE(IsValidDeviceUuid("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/2"));
  EXPECT_FALSE(IsValidDeviceUuid("GPU-8932f937-d72c-4106-c12f-20bd9faed9f"));
  EXPECT_FALSE(IsValidDeviceUuid("GPU-8932f937d72c-4106-c12f-20bd9faed9f6a"));
  EXPECT_FALSE(IsValidDeviceUuid("8932f937-d72c-4106-c12f-20bd9faed9f6"));
  EXPECT_FALSE(IsValidDeviceUuid("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1"));
  EXPECT_FALSE(IsValidDeviceUuid("host"));
}

}  // namespace
}  // namespace weightcache::identity
