// Byte sizes as operators write them ("20G", "512MiB", "1073741824") and as logs print them.
//
// Contract: pure functions, thread-safe. Suffixes are binary (K = 1024), matching how GPU and
// host memory are sized; "B" and an optional "iB" are accepted ("20G", "20GB", "20GiB" are
// all 20 * 2^30), case-insensitive. Overflow, negative numbers, fractions and unknown
// suffixes are kInvalidArgument naming the text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "weightcache/status.h"

namespace weightcache::daemon {

Result<uint64_t> ParseByteSize(std::string_view text);

// A budget as operators write it: a byte size (ParseByteSize) or a whole percentage "N%"
// (1 … 100) of `total` bytes (the device's memory), rounded down. A percentage with total == 0
// (the total is unknown) is kInvalidArgument, as is 0%, over 100% or a fraction ("12.5%").
Result<uint64_t> ParseByteSizeOrPercent(std::string_view text, uint64_t total);

// "1.50 GiB", "512.00 MiB", "17 B": for humans, not for parsing back.
std::string FormatBytes(uint64_t bytes);

// "1.52 GB/s" (decimal GB, as the benchmarks report rates) for `bytes` in `seconds`; "0.00 GB/s"
// when no time has passed.
std::string FormatRate(uint64_t bytes, double seconds);

}  // namespace weightcache::daemon
