// arena_source_tool — one arena source of the fleet transport tests (fleet_transport_test.cc):
// a fleet::ArenaServer serving memfd regions filled with the test pattern (arena_pattern.h), in
// its own process so that a test can kill it with SIGKILL mid-transfer.
//
//   arena_source_tool --regions B1,B2,... --seed S --allow LIST [--manifest TEXT]
//                     [--hostile MODE] [--max-peers N] [--idle-timeout-ms MS] [--listen H:P]
//                     [--ucx 1]
//
// Prints "endpoint HOST:PORT" on stdout once it listens, then serves until its stdin closes.
// The regions are filled through a writable mapping, then served from a read-only one (as the
// daemon's sealed memfds are).
// --hostile sends a malformed hello instead of the real one: bad-magic, bad-version,
// huge-body, zero-regions, many-regions, huge-rkey, truncated (announces more than it sends),
// trailing (bytes past the last region).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "arena_pattern.h"
#include "fleet/arena_transfer.h"
#include "fleet/arena_transfer_hello.h"
#include "os/memfd.h"
#include "protocol/wire.h"

namespace wc = weightcache;
namespace wire = weightcache::protocol::wire;

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "arena_source_tool: %s\n", what.c_str());
  return 1;
}

std::vector<uint8_t> HostileHello(const std::string& mode) {
  std::vector<uint8_t> out;
  wire::PutU32(out, mode == "bad-magic" ? 0xDEADBEEF : wc::fleet::kHelloMagic);
  wire::PutU32(out, mode == "bad-version" ? 99 : wc::fleet::kHelloVersion);
  std::vector<uint8_t> body;
  wire::PutU64(body, 0);  // manifest bytes
  wire::PutU32(body, mode == "zero-regions" ? 0 : mode == "many-regions" ? 0xFFFFFFFF : 1);
  wire::PutU32(body, static_cast<uint32_t>(wc::fleet::HelloProtocol::kTcp));
  wire::PutU64(body, 0);     // remote address (none in the tcp protocol)
  wire::PutU64(body, 4096);  // bytes
  wire::PutU32(body, mode == "huge-rkey" ? 0x7FFFFFFF : 0);
  if (mode == "trailing") wire::PutU64(body, 7);
  uint64_t announced = body.size();
  if (mode == "huge-body") announced = uint64_t{1} << 40;
  if (mode == "truncated") announced = body.size() + 1000;
  wire::PutU64(out, announced);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> sizes;
  uint64_t seed = 0;
  std::string allow;
  std::string manifest;
  std::string hostile;
  std::string listen = "127.0.0.1:0";
  size_t max_peers = 64;
  bool ucx = false;  // the UCX path (CUDA regions') over these host regions
  int64_t idle_timeout_ms = 10000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--regions") {
      for (size_t at = 0; at <= value.size();) {
        const size_t comma = value.find(',', at);
        sizes.push_back(std::stoull(value.substr(at, comma - at)));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else if (flag == "--seed") {
      seed = std::stoull(value);
    } else if (flag == "--allow") {
      allow = value;
    } else if (flag == "--manifest") {
      manifest = value;
    } else if (flag == "--hostile") {
      hostile = value;
    } else if (flag == "--max-peers") {
      max_peers = std::stoull(value);
    } else if (flag == "--idle-timeout-ms") {
      idle_timeout_ms = std::stoll(value);
    } else if (flag == "--listen") {
      listen = value;
    } else if (flag == "--ucx") {
      ucx = value == "1";
    } else {
      return Fail("unknown flag " + flag);
    }
  }
  if (sizes.empty()) return Fail("--regions is required");

  wc::fleet::ArenaServerOptions options;
  auto allow_list = wc::fleet::PeerAllowList::Parse(allow);
  if (!allow_list.ok()) return Fail(allow_list.status().ToString());
  options.allow = *allow_list;
  options.manifest.assign(manifest.begin(), manifest.end());
  options.listen = listen;
  options.max_peers = max_peers;
  options.ucx_for_host_for_test = ucx;
  options.idle_timeout = std::chrono::milliseconds(idle_timeout_ms);
  if (!hostile.empty()) options.hello_override_for_test = HostileHello(hostile);
  std::vector<wc::os::MappedRegion> mappings;
  uint64_t offset = 0;
  for (uint64_t bytes : sizes) {
    auto fd = wc::os::CreateMemfd("arena-source", bytes);
    if (!fd.ok()) return Fail(fd.status().ToString());
    {
      auto writable = wc::os::MapReadWrite(fd->get(), bytes);
      if (!writable.ok()) return Fail(writable.status().ToString());
      wc::testing::FillPattern(seed, offset, static_cast<uint8_t*>(writable->data()), bytes);
    }
    auto mapping = wc::os::MapReadOnly(fd->get(), bytes);
    if (!mapping.ok()) return Fail(mapping.status().ToString());
    offset += bytes;
    options.regions.push_back({mapping->data(), bytes});
    mappings.push_back(std::move(*mapping));
  }
  auto server = wc::fleet::ArenaServer::Start(std::move(options));
  if (!server.ok()) return Fail(server.status().ToString());
  std::printf("endpoint %s\n", (*server)->endpoint().c_str());
  std::fflush(stdout);
  char buffer[256];
  while (read(STDIN_FILENO, buffer, sizeof(buffer)) > 0) {
  }
  (*server)->Stop();
  return 0;
}
