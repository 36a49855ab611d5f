// ParallelFor — the small fork-join helper of the client (checksums, verification).
// Thread-safe as long as fn is safe to run concurrently for distinct indices.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace weightcache::client {

// Runs fn(i) for every i in [0, n) on up to `threads` threads, the caller's included.
template <typename Fn>
void ParallelFor(size_t n, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  size_t workers = std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1)));
  std::vector<std::thread> pool;
  for (size_t i = 1; i < workers; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace weightcache::client
