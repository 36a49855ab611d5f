// load_state_dict's bulk paths (python/weightcache/__init__.py): ViewPlan, the few region
// exports every tensor is a view of, and DlpackCapsules, one DLPack capsule per tensor made in
// one call. Both read the Attachment's table and copy no tensor bytes (bindings.cc's contract).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "attachment_objects.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::python {
namespace {

using namespace nb::literals;  // NOLINT(google-build-using-namespace): nanobind's "name"_a

// ---- bulk views (load_state_dict) -------------------------------------------------------------
// A state dict of 10,000 tensors cannot afford a DLPack export and a few Python calls per
// tensor. ViewPlan describes the table so that Python builds every tensor with the fewest calls.
// It returns (regions, runs, names, rest, order):
//  * regions: the memory, as few uint8 exports as possible. Tensors sorted by address are one
//    region while the gap to the next is under kRegionGap bytes: every byte of such a gap lies
//    on a page that also holds a tensor byte, so the whole region is mapped (host pages are 4
//    KiB, VMM granules 2 MiB). In practice: one region per allocation.
//  * runs: tensors of one region, dtype and shape whose names differ only in their numbers
//    (model.layers.#.mlp.up_proj.weight) and whose addresses step by a constant `delta`: one
//    as_strided((count, *shape), (delta, *strides)) over the region viewed as the dtype, then
//    unbind(0), builds them all. A tensor that fits no run is a run of one. Each run is
//    (region, dtype, element bytes, count, shape, strides in elements, offset of its first
//    tensor from the region in bytes, delta in bytes: 0 for a run of one).
//  * names: the runs' tensor names, run after run, then the rest's;
//  * rest: how many names at the end of `names` no view of a dtype-typed region can express
//    (F4/F6, zero bytes, an offset not a multiple of the element size): Python takes the
//    per-tensor path for those;
//  * order: every name in table (name) order. The same str objects as in `names`, so Python's
//    reordering reuses their cached hashes.
// Correctness never depends on the name grouping: every run is checked against the addresses.
constexpr uint64_t kRegionGap = 4096;

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// FNV-1a over the name with every run of digits as one '#'.
uint64_t PatternHash(std::string_view name, uint64_t h) {
  for (size_t c = 0; c < name.size(); ++c) {
    const bool digit = IsDigit(name[c]);
    if (digit && c > 0 && IsDigit(name[c - 1])) continue;
    h = (h ^ static_cast<uint8_t>(digit ? '#' : name[c])) * 1099511628211ULL;
  }
  return h;
}

bool SamePattern(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (IsDigit(a[i]) && IsDigit(b[j])) {
      while (i < a.size() && IsDigit(a[i])) ++i;
      while (j < b.size() && IsDigit(b[j])) ++j;
    } else if (a[i++] != b[j++]) {
      return false;
    }
  }
  return i == a.size() && j == b.size();
}

// Every tensor's name as one str, in table order: the list ViewPlan and DlpackCapsules hand
// back as `order`, whose str objects they reuse elsewhere (shared cached hashes).
nb::list NameList(const std::vector<TensorInfo>& tensors) {
  const size_t n = tensors.size();
  nb::list order = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(n)));
  for (size_t i = 0; i < n; ++i) {
    PyObject* name = PyUnicode_FromStringAndSize(tensors[i].name.data(),
                                                 static_cast<Py_ssize_t>(tensors[i].name.size()));
    if (name == nullptr) throw nb::python_error();
    PyList_SET_ITEM(order.ptr(), static_cast<Py_ssize_t>(i), name);
  }
  return order;
}

nb::tuple ViewPlan(nb::handle self) {
  const auto& a = nb::cast<const PyAttachment&>(self);
  const std::vector<TensorInfo>& tensors = a.infos();
  const bool host = a.get().tier() == Tier::kHost;
  const size_t n = tensors.size();

  // Each name as one str, shared by `names` and `order`.
  nb::list order = NameList(tensors);
  nb::list names = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(n)));
  size_t placed = 0;
  const auto place = [&](uint32_t i) {
    PyObject* name = PyList_GET_ITEM(order.ptr(), static_cast<Py_ssize_t>(i));
    Py_INCREF(name);
    PyList_SET_ITEM(names.ptr(), static_cast<Py_ssize_t>(placed++), name);
  };

  std::vector<uint32_t> by_address;
  std::vector<uint32_t> rest;
  by_address.reserve(n);
  std::vector<const DTypeInfo*> dtype_of(n, nullptr);
  for (uint32_t i = 0; i < n; ++i) {
    const DTypeInfo* d = FindDType(tensors[i].dtype);
    if (d == nullptr || !d->native || tensors[i].nbytes == 0) {
      rest.push_back(i);
    } else {
      dtype_of[i] = d;
      by_address.push_back(i);
    }
  }
  std::sort(by_address.begin(), by_address.end(),
            [&](uint32_t x, uint32_t y) { return tensors[x].data < tensors[y].data; });

  // Regions: [begin, end) address ranges.
  std::vector<std::pair<uint64_t, uint64_t>> regions;
  std::vector<uint32_t> region_of(n, 0);
  for (uint32_t i : by_address) {
    const TensorInfo& t = tensors[i];
    if (regions.empty() || t.data < regions.back().second ||
        t.data - regions.back().second >= kRegionGap) {
      regions.emplace_back(t.data, t.data + t.nbytes);
    } else {
      regions.back().second = std::max(regions.back().second, t.data + t.nbytes);
    }
    region_of[i] = static_cast<uint32_t>(regions.size() - 1);
  }

  // Groups: (region, dtype, shape, name pattern), each in address order. Keyed by a hash; a
  // collision (another key, same hash) probes on.
  const auto same_key = [&](uint32_t x, uint32_t y) {
    const TensorInfo& p = tensors[x];
    const TensorInfo& q = tensors[y];
    return region_of[x] == region_of[y] && dtype_of[x] == dtype_of[y] &&
           std::equal(p.shape.begin(), p.shape.end(), q.shape.begin(), q.shape.end()) &&
           SamePattern(p.name, q.name);
  };
  std::unordered_map<uint64_t, uint32_t> group_index;
  group_index.reserve(n);
  std::vector<std::vector<uint32_t>> groups;
  for (uint32_t i : by_address) {
    const TensorInfo& t = tensors[i];
    uint64_t h = 14695981039346656037ULL;
    h = (h ^ region_of[i]) * 1099511628211ULL;
    h = (h ^ reinterpret_cast<uintptr_t>(dtype_of[i])) * 1099511628211ULL;
    for (int64_t d : t.shape) h = (h ^ static_cast<uint64_t>(d)) * 1099511628211ULL;
    h = PatternHash(t.name, h);
    while (true) {
      auto [it, inserted] = group_index.try_emplace(h, static_cast<uint32_t>(groups.size()));
      if (inserted) {
        groups.emplace_back(1, i);
        break;
      }
      if (same_key(groups[it->second][0], i)) {
        groups[it->second].push_back(i);
        break;
      }
      ++h;
    }
  }

  nb::list runs;
  auto tuple_of = [](std::span<const int64_t> values) {
    nb::list l;
    for (int64_t v : values) l.append(v);
    return nb::tuple(l);
  };
  for (const std::vector<uint32_t>& group : groups) {
    const TensorInfo& t0 = tensors[group[0]];
    const uint64_t element = dtype_of[group[0]]->bits / 8;
    const uint64_t base = regions[region_of[group[0]]].first;
    const nb::tuple shape = tuple_of(t0.shape);
    const nb::tuple strides = tuple_of(t0.strides);
    const nb::str dtype(t0.dtype.data(), t0.dtype.size());
    size_t start = 0;
    while (start < group.size()) {
      const TensorInfo& first = tensors[group[start]];
      const uint64_t offset = first.data - base;
      if (offset % element != 0) {
        rest.push_back(group[start]);
        ++start;
        continue;
      }
      // Extend while the step stays the same, is a whole number of elements and keeps the
      // views apart.
      size_t end = start + 1;
      uint64_t delta = 0;
      if (end < group.size()) {
        delta = tensors[group[end]].data - first.data;
        if (delta % element == 0 && delta >= first.nbytes) {
          while (end < group.size() &&
                 tensors[group[end]].data - tensors[group[end - 1]].data == delta) {
            ++end;
          }
        }
      }
      if (end - start == 1) delta = 0;
      for (size_t k = start; k < end; ++k) place(group[k]);
      runs.append(nb::make_tuple(static_cast<size_t>(region_of[group[start]]), dtype, element,
                                 end - start, shape, strides, offset, delta));
      start = end;
    }
  }
  for (uint32_t i : rest) place(i);
  if (placed != n) {
    throw std::logic_error("ViewPlan placed " + std::to_string(placed) + " of " +
                           std::to_string(n) + " tensors");
  }

  // One uint8 export per region, each holding the Attachment (its owner) like every export.
  nb::list exports;
  for (const auto& [begin, end] : regions) {
    const size_t size = static_cast<size_t>(end - begin);
    void* data = reinterpret_cast<void*>(static_cast<uintptr_t>(begin));
    const nb::dlpack::dtype u8{static_cast<uint8_t>(kDlUInt), 8, 1};
    if (host && !a.host_writable()) {
      exports.append(nb::cast(nb::ndarray<nb::array_api, nb::ro>(
          data, 1, &size, nb::borrow(self), nullptr, u8, nb::device::cpu::value, 0)));
    } else if (host) {
      exports.append(nb::cast(nb::ndarray<nb::array_api>(data, 1, &size, nb::borrow(self), nullptr,
                                                         u8, nb::device::cpu::value, 0)));
    } else {
      exports.append(
          nb::cast(nb::ndarray<nb::array_api>(data, 1, &size, nb::borrow(self), nullptr, u8,
                                              nb::device::cuda::value, a.cuda_device())));
    }
  }
  return nb::make_tuple(exports, runs, names, rest.size(), order);
}

// ---- bulk DLPack capsules (load_state_dict) ---------------------------------------------------
// torch builds a tensor from a DLPack capsule in C++ (no dispatcher, no view bookkeeping), far
// cheaper than any per-tensor Python call: DlpackCapsules makes one capsule per tensor in one
// call, and Python imports them with one map() per dtype. Every capsule's DLManagedTensor lives
// in one block with one strong reference to the Attachment; the block (and that reference) goes
// when the last tensor imported from it, or the last unconsumed capsule, is gone. Shapes and
// strides point into the client's table, which lives as long as the Attachment.

// DLManagedTensor, the unversioned DLPack ABI (dlpack.h): what every DLPack consumer, torch
// since 1.x included, imports from a capsule named "dltensor". Unversioned capsules carry no
// read-only flag; torch has no read-only tensors either (docs/python.md).
struct ManagedDlTensor {
  nb::dlpack::dltensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedDlTensor*);
};

constexpr const char* kDlTensorCapsule = "dltensor";
constexpr const char* kUsedDlTensorCapsule = "used_dltensor";  // renamed so by the consumer

struct DlpackBlock {
  std::atomic<size_t> live{1};  // the capsules and tensors alive, plus the building call's own
  PyObject* owner = nullptr;    // a strong reference to the Python Attachment
  std::unique_ptr<ManagedDlTensor[]> tensors;
};

// Drops one reference to the block. A consumer may call a deleter on any thread without the GIL
// (torch frees storage where its last reference drops): the GIL is taken for the Attachment's
// reference, as nanobind's own exports do (also while the interpreter finalizes, when the
// tensors of a state dict kept in a global are freed).
void UnrefBlock(DlpackBlock* block) {
  if (block->live.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  {
    nb::gil_scoped_acquire gil;
    Py_DECREF(block->owner);
  }
  delete block;
}

void DeleteManagedDlTensor(ManagedDlTensor* m) {
  UnrefBlock(static_cast<DlpackBlock*>(m->manager_ctx));
}

// A capsule never consumed still owns its tensor; a consumed one was renamed by its consumer.
void DlCapsuleDestructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kUsedDlTensorCapsule) != 0) return;
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);  // a destructor must not disturb a pending exception
  void* m = PyCapsule_GetPointer(capsule, kDlTensorCapsule);
  if (m != nullptr) {
    DeleteManagedDlTensor(static_cast<ManagedDlTensor*>(m));
  } else {
    PyErr_WriteUnraisable(capsule);
  }
  PyErr_Restore(type, value, trace);
}

// (groups, rest, order): groups = [(dtype, names, capsules)], one per safetensors dtype with a
// DLPack type of whole bytes (the first seen first), names and capsules in table (name) order;
// rest = the names of the tensors no capsule can express (F4/F6, zero bytes), for the
// per-tensor path; order = every name in table order (the same str objects as in groups and
// rest, so Python's reordering reuses their cached hashes).
nb::tuple DlpackCapsules(nb::handle self) {
  const auto& a = nb::cast<const PyAttachment&>(self);
  const std::vector<TensorInfo>& tensors = a.infos();
  const bool host = a.get().tier() == Tier::kHost;
  const size_t n = tensors.size();

  nb::list order = NameList(tensors);

  std::vector<const DTypeInfo*> group_dtype;
  std::vector<std::vector<uint32_t>> members;
  nb::list rest;
  size_t exported = 0;
  size_t last = 0;  // the group of the previous tensor: a checkpoint has a handful of dtypes
  for (uint32_t i = 0; i < n; ++i) {
    const DTypeInfo* d = FindDType(tensors[i].dtype);
    if (d == nullptr || !d->native || tensors[i].nbytes == 0) {
      rest.append(nb::handle(PyList_GET_ITEM(order.ptr(), static_cast<Py_ssize_t>(i))));
      continue;
    }
    if (last >= group_dtype.size() || group_dtype[last] != d) {
      last = std::find(group_dtype.begin(), group_dtype.end(), d) - group_dtype.begin();
      if (last == group_dtype.size()) {
        group_dtype.push_back(d);
        members.emplace_back();
      }
    }
    members[last].push_back(i);
    ++exported;
  }

  auto* block = new DlpackBlock;
  block->owner = self.ptr();
  Py_INCREF(block->owner);
  block->tensors = std::make_unique<ManagedDlTensor[]>(exported);
  // The building call's own reference, dropped however this function leaves.
  struct Guard {
    DlpackBlock* block;
    ~Guard() { UnrefBlock(block); }
  } guard{block};

  const nb::dlpack::device device{host ? nb::device::cpu::value : nb::device::cuda::value,
                                  host ? 0 : a.cuda_device()};
  nb::list groups;
  size_t k = 0;
  for (size_t g = 0; g < group_dtype.size(); ++g) {
    const DTypeInfo& d = *group_dtype[g];
    const size_t m = members[g].size();
    nb::list names = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(m)));
    nb::list capsules = nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(m)));
    for (size_t j = 0; j < m; ++j) {
      const TensorInfo& t = tensors[members[g][j]];
      ManagedDlTensor& mt = block->tensors[k++];
      mt.dl_tensor.data = reinterpret_cast<void*>(static_cast<uintptr_t>(t.data));
      mt.dl_tensor.device = device;
      mt.dl_tensor.ndim = static_cast<int32_t>(t.shape.size());
      mt.dl_tensor.dtype = nb::dlpack::dtype{d.code, d.bits, 1};
      // Consumers only read them (DLPack: the producer owns shape and strides).
      mt.dl_tensor.shape = const_cast<int64_t*>(t.shape.data());
      mt.dl_tensor.strides = const_cast<int64_t*>(t.strides.data());
      mt.dl_tensor.byte_offset = 0;
      mt.manager_ctx = block;
      mt.deleter = DeleteManagedDlTensor;
      block->live.fetch_add(1, std::memory_order_relaxed);
      PyObject* capsule = PyCapsule_New(&mt, kDlTensorCapsule, DlCapsuleDestructor);
      if (capsule == nullptr) {
        UnrefBlock(block);
        throw nb::python_error();
      }
      PyList_SET_ITEM(capsules.ptr(), static_cast<Py_ssize_t>(j), capsule);
      PyObject* name = PyList_GET_ITEM(order.ptr(), static_cast<Py_ssize_t>(members[g][j]));
      Py_INCREF(name);
      PyList_SET_ITEM(names.ptr(), static_cast<Py_ssize_t>(j), name);
    }
    groups.append(nb::make_tuple(nb::str(d.name.data(), d.name.size()), names, capsules));
  }
  return nb::make_tuple(groups, rest, order);
}

}  // namespace

void RegisterBulk(nb::module_& m) {
  m.def("_view_plan", &ViewPlan, "attachment"_a,
        "(regions, runs, names, rest, order): how weightcache.load_state_dict builds every "
        "tensor as a view of a few region exports (bulk_bindings.cc, ViewPlan).");
  m.def("_dlpack_capsules", &DlpackCapsules, "attachment"_a,
        "(groups, rest, order): one DLPack capsule per tensor, grouped by dtype, for "
        "weightcache.load_state_dict (bulk_bindings.cc, DlpackCapsules).");
}

}  // namespace weightcache::python
