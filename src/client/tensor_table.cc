#include "client/tensor_table.h"

#include <algorithm>

namespace weightcache::client {

std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

Tensor MakeTensor(std::string name, std::string dtype, std::span<const uint64_t> shape,
                  uint64_t data, uint64_t nbytes, uint64_t checksum) {
  Tensor t;
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.shape.assign(shape.begin(), shape.end());
  t.strides = ContiguousStrides(t.shape);
  t.data = data;
  t.nbytes = nbytes;
  t.checksum = checksum;
  return t;
}

void SortByName(std::vector<Tensor>& tensors) {
  std::sort(tensors.begin(), tensors.end(),
            [](const Tensor& a, const Tensor& b) { return a.name < b.name; });
}

const Tensor* FindByName(const std::vector<Tensor>& tensors, std::string_view name) {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const Tensor& t, std::string_view n) { return t.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

}  // namespace weightcache::client
