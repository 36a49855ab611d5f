// SealedCache — what a host-tier daemon holds once its load is ready, built without a daemon:
// real memfds filled with a known pattern and sealed read-only, and the real attach manifest
// (two tensors per allocation, their content checksums) in its sealed memfd. The keeper and
// handoff tests deposit and withdraw it.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/unique_fd.h"
#include "os/memfd.h"
#include "protocol/handoff.h"
#include "protocol/manifest.h"
#include "weightcache/status.h"

namespace weightcache::testing {

// The digest a test cache claims (any 64 lowercase hex characters will do).
inline std::string TestDigest(char c = 'a') { return std::string(64, c); }

struct SealedCache {
  std::vector<std::string> contents;  // per allocation
  std::vector<UniqueFd> allocations;
  UniqueFd manifest_fd;
  uint64_t manifest_size = 0;

  std::vector<int> allocation_fds() const {
    std::vector<int> fds;
    for (const UniqueFd& fd : allocations) fds.push_back(fd.get());
    return fds;
  }
  protocol::DepositInfo Info(const std::string& digest = TestDigest()) const {
    protocol::DepositInfo info;
    info.config_digest = digest;
    info.config_json = R"({"model_id":"test"})";
    info.depositor_pid = ::getpid();
    info.manifest_size = manifest_size;
    info.allocation_count = static_cast<uint32_t>(allocations.size());
    return info;
  }
};

// The byte at `at` of allocation `index` of a cache made with `seed`.
inline char PatternByte(uint8_t seed, size_t index, size_t at) {
  return static_cast<char>(seed + index * 31 + at * 7 + at / 4096);
}

// `sizes` bytes per allocation (even numbers); tensors "t<i>.a" and "t<i>.b" halve each one.
// `corrupt` (an allocation index, or -1): that allocation's first tensor gets a checksum in
// the manifest that its bytes do not have.
inline Result<SealedCache> MakeSealedCache(const std::vector<uint64_t>& sizes, uint8_t seed = 1,
                                           int corrupt = -1, const std::string& name = "test") {
  SealedCache cache;
  std::vector<std::string> names;
  names.reserve(2 * sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    names.push_back("t" + std::to_string(i) + ".a");
    names.push_back("t" + std::to_string(i) + ".b");
  }
  std::vector<protocol::TensorEntry> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::string bytes(sizes[i], '\0');
    for (size_t at = 0; at < bytes.size(); ++at) bytes[at] = PatternByte(seed, i, at);
    WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd fd,
                                 os::CreateMemfd(name + "-" + std::to_string(i), sizes[i]));
    if (::pwrite(fd.get(), bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
      return IoError("pwrite", errno);
    }
    WEIGHTCACHE_RETURN_IF_ERROR(os::SealReadOnly(fd.get()));
    const uint64_t half = sizes[i] / 2;
    for (int k = 0; k < 2; ++k) {
      protocol::TensorEntry t;
      t.name = names[2 * i + k];
      t.dtype = "U8";
      t.ndim = 1;
      t.shape[0] = half;
      t.allocation = static_cast<uint32_t>(i);
      t.offset = k * half;
      t.nbytes = half;
      t.checksum = TensorChecksum(bytes.data() + t.offset, half);
      if (k == 0 && static_cast<int>(i) == corrupt) t.checksum ^= 1;
      tensors.push_back(t);
    }
    cache.contents.push_back(std::move(bytes));
    cache.allocations.push_back(std::move(fd));
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> manifest,
                               protocol::EncodeManifest(Tier::kHost, sizes, tensors));
  cache.manifest_size = manifest.size();
  WEIGHTCACHE_ASSIGN_OR_RETURN(cache.manifest_fd,
                               protocol::CreateManifestMemfd(manifest, name + "-manifest"));
  return cache;
}

// Everything `fd` holds, from offset 0.
inline std::string ReadWhole(int fd) {
  std::string out;
  char buf[65536];
  off_t at = 0;
  while (true) {
    ssize_t n = ::pread(fd, buf, sizeof(buf), at);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    at += n;
  }
  return out;
}

}  // namespace weightcache::testing
