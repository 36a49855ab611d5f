#include "client/tensor_table.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace weightcache::client {

void ContiguousStrides(std::span<const int64_t> shape, std::span<int64_t> strides) {
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
}

TensorTable TensorTable::FromViews(std::vector<Tensor> sorted_views) {
  TensorTable table;
  table.tensors_ = std::move(sorted_views);
  return table;
}

void TensorTable::Reserve(size_t count, size_t name_bytes, size_t dims) {
  // One NUL per name; 2 * dims for shape and strides.
  names_capacity_ = name_bytes + count;
  names_ = std::make_unique_for_overwrite<char[]>(std::max<size_t>(names_capacity_, 1));
  names_used_ = 0;
  dims_capacity_ = 2 * dims;
  dims_ = std::make_unique_for_overwrite<int64_t[]>(std::max<size_t>(dims_capacity_, 1));
  dims_used_ = 0;
  tensors_.clear();
  tensors_.reserve(count);
}

Status TensorTable::Add(std::string_view name, checkpoint::DType dtype,
                        std::span<const uint64_t> shape, uint64_t data, uint64_t nbytes,
                        uint64_t checksum, std::optional<TensorSlice> slice) {
  if (tensors_.size() == tensors_.capacity() || name.size() + 1 > names_capacity_ - names_used_ ||
      2 * shape.size() > dims_capacity_ - dims_used_) {
    return InternalError("tensor table: reservation exceeded at tensor " +
                         std::to_string(tensors_.size()) + " (" + std::string(name) + ")");
  }
  char* name_at = names_.get() + names_used_;
  std::memcpy(name_at, name.data(), name.size());
  name_at[name.size()] = '\0';
  names_used_ += name.size() + 1;

  int64_t* shape_at = dims_.get() + dims_used_;
  int64_t* strides_at = shape_at + shape.size();
  dims_used_ += 2 * shape.size();
  for (size_t d = 0; d < shape.size(); ++d) shape_at[d] = static_cast<int64_t>(shape[d]);
  ContiguousStrides({shape_at, shape.size()}, {strides_at, shape.size()});

  Tensor& t = tensors_.emplace_back();
  t.name = std::string_view(name_at, name.size());
  t.dtype = checkpoint::DTypeName(dtype);
  t.shape = std::span<const int64_t>(shape_at, shape.size());
  t.strides = std::span<const int64_t>(strides_at, shape.size());
  t.data = data;
  t.nbytes = nbytes;
  t.checksum = checksum;
  t.slice = slice;
  return Status::Ok();
}

void TensorTable::Finish() {
  auto by_name = [](const Tensor& a, const Tensor& b) { return a.name < b.name; };
  if (!std::is_sorted(tensors_.begin(), tensors_.end(), by_name)) {
    std::sort(tensors_.begin(), tensors_.end(), by_name);
  }
}

const Tensor* TensorTable::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const Tensor& t, std::string_view n) { return t.name < n; });
  if (it == tensors_.end() || it->name != name) return nullptr;
  return &*it;
}

}  // namespace weightcache::client
