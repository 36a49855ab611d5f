// Building the public tensor table (weightcache::Tensor) from a shape and an address, and
// looking tensors up by name. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightcache/client.h"

namespace weightcache::client {

// Contiguous row-major strides, in elements: strides[i] = product of shape[i+1..].
std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape);

// A Tensor with its strides filled in. `shape` entries must fit in int64 (the checkpoint
// parser and the manifest decoder bound them far below that).
Tensor MakeTensor(std::string name, std::string dtype, std::span<const uint64_t> shape,
                  uint64_t data, uint64_t nbytes, uint64_t checksum);

// Sort by name (byte order), the order Attachment::tensors() promises.
void SortByName(std::vector<Tensor>& tensors);

// Binary search in a table sorted by SortByName; null when absent.
const Tensor* FindByName(const std::vector<Tensor>& tensors, std::string_view name);

}  // namespace weightcache::client
