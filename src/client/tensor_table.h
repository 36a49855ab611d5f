// TensorTable — the storage behind Attachment::tensors(). Two ways to fill it:
//  * copying (the fallback loader): every weightcache::Tensor is a view into three flat
//    buffers owned by the table (NUL-terminated names, int64 shape and stride dims, the Tensor
//    records), so a table of N tensors costs three allocations, not 4·N;
//  * adopting views (an attach): FromViews takes Tensor records whose names, shapes and
//    strides point into storage the table's owner keeps alive — the mapped attach manifest —
//    so nothing per tensor is copied but the record itself (docs/design.md "Performance targets":
//    attach flat in tensor count).
//
// Contract:
//  * Copying: Reserve(count, name_bytes, dims) — the exact totals: tensor count, the sum of
//    the names' lengths, the sum of the ranks — then Add() each tensor, then Finish(). Adding
//    beyond what was reserved is a programming error (checked, kInternal). After Finish the
//    table is sorted by name (byte order) and immutable.
//  * FromViews: the caller guarantees names strictly ascending and each name NUL-terminated
//    in its storage; nothing is checked (the manifest decoder checked exactly that).
//  * Views stay valid as long as the table, moves included (the buffers move, not the bytes).
//    Every Tensor::name is NUL-terminated in the table (name.data()[name.size()] == '\0'), and
//    every Tensor::dtype views a static string literal (checkpoint::DTypeName), so the C ABI
//    hands out both as C strings without copying.
//  * Thread-safety: building is single-threaded; a finished table may be read from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "checkpoint/dtype.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::client {

// Contiguous row-major strides, in elements: strides[i] = product of shape[i+1..]. `strides`
// has shape.size() entries.
void ContiguousStrides(std::span<const int64_t> shape, std::span<int64_t> strides);

class TensorTable {
 public:
  TensorTable() = default;
  TensorTable(TensorTable&&) noexcept = default;
  TensorTable& operator=(TensorTable&&) noexcept = default;
  TensorTable(const TensorTable&) = delete;
  TensorTable& operator=(const TensorTable&) = delete;

  static TensorTable FromViews(std::vector<Tensor> sorted_views);

  void Reserve(size_t count, size_t name_bytes, size_t dims);
  // `shape` entries must fit in int64 (the checkpoint parser and the manifest decoder bound
  // them far below that). kInternal when the reservation is exceeded.
  Status Add(std::string_view name, checkpoint::DType dtype, std::span<const uint64_t> shape,
             uint64_t data, uint64_t nbytes, uint64_t checksum,
             std::optional<TensorSlice> slice = std::nullopt);
  // Sorts by name unless already sorted.
  void Finish();

  const std::vector<Tensor>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  // Binary search by name; null when absent.
  const Tensor* Find(std::string_view name) const;

 private:
  std::unique_ptr<char[]> names_;
  size_t names_used_ = 0, names_capacity_ = 0;
  std::unique_ptr<int64_t[]> dims_;  // shape then strides of each tensor
  size_t dims_used_ = 0, dims_capacity_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace weightcache::client
