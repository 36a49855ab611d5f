// Fleet transport: GB/s of a host-tier arena pull over the native TCP protocol (loopback)
// against memcpy GB/s of the same bytes measured in the same run (docs/fleet.md "Measured").
//
//   fleet_bench [--gib G] [--sources N] [--stripe-mib M] [--in-flight K] [--reps R]
//
// The sources are ArenaServers in this process (each with its own server thread), serving
// memfd mappings; the destination is a memfd mapping, as a filling daemon's. Host memory never
// goes through UCX (docs/fleet.md "Transport"). Prints one JSON line per measurement.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fleet/arena_transfer.h"
#include "os/memfd.h"

namespace wc = weightcache;
using Clock = std::chrono::steady_clock;

namespace {

wc::os::MappedRegion MapMemfd(uint64_t bytes) {
  auto fd = wc::os::CreateMemfd("fleet-bench", bytes);
  if (!fd.ok()) {
    std::fprintf(stderr, "%s\n", fd.status().ToString().c_str());
    std::exit(1);
  }
  auto region = wc::os::MapReadWrite(fd->get(), bytes);
  if (!region.ok()) {
    std::fprintf(stderr, "%s\n", region.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*region);
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 1;
  int sources = 1;
  uint64_t stripe_mib = 64;
  size_t in_flight = 4;
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--gib") {
      gib = std::stod(value);
    } else if (flag == "--sources") {
      sources = std::stoi(value);
    } else if (flag == "--stripe-mib") {
      stripe_mib = std::stoull(value);
    } else if (flag == "--in-flight") {
      in_flight = std::stoull(value);
    } else if (flag == "--reps") {
      reps = std::stoi(value);
    } else {
      std::fprintf(stderr, "fleet_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const auto bytes = static_cast<uint64_t>(gib * (1ULL << 30));
  wc::os::MappedRegion source = MapMemfd(bytes);
  wc::os::MappedRegion destination = MapMemfd(bytes);
  auto* src = static_cast<uint8_t*>(source.data());
  for (uint64_t i = 0; i < bytes; i += 4096) src[i] = static_cast<uint8_t>(i >> 12);
  std::memset(destination.data(), 0, bytes);  // both sides' pages allocated before timing

  double best_memcpy = 0;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    std::memcpy(destination.data(), source.data(), bytes);
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best_memcpy = std::max(best_memcpy, static_cast<double>(bytes) / s / 1e9);
  }
  std::printf("{\"what\":\"memcpy\",\"bytes\":%llu,\"gb_per_s\":%.2f}\n",
              static_cast<unsigned long long>(bytes), best_memcpy);

  std::vector<std::unique_ptr<wc::fleet::ArenaServer>> servers;
  wc::fleet::FetchOptions options;
  for (int k = 0; k < sources; ++k) {
    wc::fleet::ArenaServerOptions server;
    server.allow = *wc::fleet::PeerAllowList::Parse("127.0.0.1");
    server.regions = {{source.data(), bytes}};
    auto started = wc::fleet::ArenaServer::Start(std::move(server));
    if (!started.ok()) {
      std::fprintf(stderr, "%s\n", started.status().ToString().c_str());
      return 1;
    }
    options.sources.push_back((*started)->endpoint());
    servers.push_back(std::move(*started));
  }
  options.destination = {{destination.data(), bytes}};
  options.stripe_bytes = stripe_mib << 20;
  options.max_in_flight_per_source = in_flight;
  for (int r = 0; r < reps; ++r) {
    std::memset(destination.data(), 0, bytes);
    auto result = wc::fleet::FetchArena(options);
    if (!result.ok()) {
      std::fprintf(stderr, "%s\n", result.status().ToString().c_str());
      return 1;
    }
    const bool equal = std::memcmp(destination.data(), source.data(), bytes) == 0;
    std::printf(
        "{\"what\":\"fleet_fetch\",\"transport\":\"tcp\",\"sources\":%d,\"stripe_mib\":%llu,"
        "\"in_flight\":%zu,\"bytes\":%llu,\"seconds\":%.3f,\"gb_per_s\":%.2f,"
        "\"vs_memcpy\":%.3f,\"equal\":%s}\n",
        sources, static_cast<unsigned long long>(stripe_mib), in_flight,
        static_cast<unsigned long long>(bytes), result->seconds, result->gb_per_s,
        result->gb_per_s / best_memcpy, equal ? "true" : "false");
  }
  return 0;
}
