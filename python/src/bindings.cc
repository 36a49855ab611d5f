// weightcache._weightcache — the nanobind layer over the C++ client (include/weightcache/client.h).
//
// Over 800 lines: the options, Tensor and Attachment bindings and the bulk view/DLPack builders
// live together here for now; splitting them by what they do is issue 41's work (with
// publish_bindings.cc already apart).
//
// Contract:
//  * Attachment wraps one weightcache::Attachment. Tensor objects and every DLPack capsule,
//    NumPy array or nb_ndarray they export hold a Python reference to their Attachment, so the
//    mapped memory outlives every consumer (torch, CuPy, JAX, NumPy): the attachment is
//    destroyed only when the last of them is gone. Nothing here copies tensor bytes.
//  * Host tier memory is mapped PROT_READ by the client: every export of it is read-only
//    (DLPack READ_ONLY flag, NumPy writeable=False) so that a write raises instead of faulting.
//    GPU tier memory is mapped read-write (CUDA rejects read-only device mappings) and exported
//    writable; writing it corrupts the weights every other client of the daemon sees.
//  * Errors: a failed attach raises the exception weightcache.errors.from_status builds (the
//    Python side owns the exception classes; which class and exit code a status code gets is
//    the C++ table status_codes() hands over) from the client's AttachDiagnostics: the socket
//    path, the device key and, for a mismatch, the differing fields as data (nothing parses the
//    message). Nothing else here raises but ValueError/TypeError/KeyError for bad arguments.
//  * Threading: attach releases the GIL while it discovers, waits, maps or loads. Callbacks of
//    on_daemon_gone run on the client's watcher thread and take the GIL to run. Destroying an
//    Attachment releases the GIL while the client joins that thread, so a callback that is
//    waiting for the GIL cannot deadlock the destructor.
//  * Python's GC sees what an Attachment (its callbacks) and a Tensor (its Attachment) hold, so
//    a callback that refers to its own Attachment is collected like any other cycle.
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

#include "weightcache/client.h"
#include "weightcache/status.h"

namespace nb = nanobind;
using namespace nb::literals;  // NOLINT(google-build-using-namespace): nanobind's "name"_a

namespace weightcache::python {
namespace {

// DLPack type codes (dlpack.h, version 1.1). Spelled as numbers rather than nanobind's enum
// names so the module builds with nanobind releases that predate the float8 codes.
enum DlCode : uint8_t {
  kDlInt = 0,
  kDlUInt = 1,
  kDlFloat = 2,
  kDlBfloat = 4,
  kDlComplex = 5,
  kDlBool = 6,
  kDlFloat8E4M3Fn = 10,
  kDlFloat8E4M3Fnuz = 11,
  kDlFloat8E5M2 = 12,
  kDlFloat8E5M2Fnuz = 13,
  kDlFloat8E8M0Fnu = 14,
};

// How a safetensors dtype travels. `native` false: no DLPack type of whole bytes per element
// exists (F4 packs two elements per byte, F6 four per three bytes), so the tensor is exported
// only as its raw bytes (raw()).
struct DTypeInfo {
  std::string_view name;
  uint8_t code;
  uint8_t bits;
  bool native;
  bool numpy;  // NumPy has the type (numpy() works)
};

constexpr DTypeInfo kDTypes[] = {
    {"BOOL", kDlBool, 8, true, true},
    {"U8", kDlUInt, 8, true, true},
    {"I8", kDlInt, 8, true, true},
    {"U16", kDlUInt, 16, true, true},
    {"I16", kDlInt, 16, true, true},
    {"U32", kDlUInt, 32, true, true},
    {"I32", kDlInt, 32, true, true},
    {"U64", kDlUInt, 64, true, true},
    {"I64", kDlInt, 64, true, true},
    {"F16", kDlFloat, 16, true, true},
    {"F32", kDlFloat, 32, true, true},
    {"F64", kDlFloat, 64, true, true},
    {"C64", kDlComplex, 64, true, true},
    {"BF16", kDlBfloat, 16, true, false},
    // safetensors' F8_E4M3 is the "fn" variant (no infinities), torch.float8_e4m3fn.
    {"F8_E4M3", kDlFloat8E4M3Fn, 8, true, false},
    {"F8_E5M2", kDlFloat8E5M2, 8, true, false},
    {"F8_E4M3FNUZ", kDlFloat8E4M3Fnuz, 8, true, false},
    {"F8_E5M2FNUZ", kDlFloat8E5M2Fnuz, 8, true, false},
    {"F8_E8M0", kDlFloat8E8M0Fnu, 8, true, false},
    {"F4", kDlUInt, 8, false, false},
    {"F6_E2M3", kDlUInt, 8, false, false},
    {"F6_E3M2", kDlUInt, 8, false, false},
};

const DTypeInfo* FindDType(std::string_view name) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

// One tensor's description: the client's own record (weightcache::Tensor), a view into the
// Attachment's table that lives as long as the Attachment. Nothing is copied per tensor at
// attach time, so an attach from Python stays O(allocations) like the C++ one.
using TensorInfo = weightcache::Tensor;

class PyAttachment {
 public:
  PyAttachment(Attachment attachment, HostMapping host_mapping)
      : cuda_device_(attachment.cuda_device()),
        host_writable_(attachment.tier() == Tier::kHost &&
                       attachment.source() == AttachSource::kDaemon &&
                       host_mapping == HostMapping::kCopyOnWrite),
        attachment_(std::move(attachment)) {}
  PyAttachment(const PyAttachment&) = delete;
  PyAttachment& operator=(const PyAttachment&) = delete;

  ~PyAttachment() {
    // The client joins its watcher thread here; a callback on that thread may be waiting for
    // the GIL. The callbacks themselves (Python objects) are released after, with the GIL.
    nb::gil_scoped_release release;
    attachment_.reset();
  }

  const Attachment& get() const { return *attachment_; }
  const std::vector<TensorInfo>& infos() const { return attachment_->tensors(); }
  // The ordinal the attach resolved (Attachment::cuda_device), -1 on the host tier.
  int cuda_device() const { return cuda_device_; }
  // Host memory this process may write: a copy-on-write mapping of a daemon's cache (a write
  // stays in this process). Exported writable then; every other host export is read-only.
  bool host_writable() const { return host_writable_; }

  // Binary search in the client's table (sorted by name).
  const TensorInfo* Find(std::string_view name) const { return attachment_->Find(name); }

  // Python's GC (tp_traverse / tp_clear below): a callback that refers to its own Attachment
  // (directly, or through one of its tensors) is a reference cycle only the GC can break.
  int Traverse(visitproc visit, void* arg) const {
    for (const nb::object& callback : callbacks_) Py_VISIT(callback.ptr());
    return 0;
  }
  // Drops the callbacks (with the GIL, as the GC calls it). Their slots stay, empty: the watcher
  // thread finds an empty slot and runs nothing. The references are released only once every
  // slot is empty, since releasing one may run Python code (a finalizer) that registers more.
  void ClearCallbacks() {
    std::vector<nb::object> dropped;
    dropped.reserve(callbacks_.size());
    for (nb::object& callback : callbacks_) dropped.push_back(std::move(callback));
  }

  void OnDaemonGone(nb::typed<nb::callable, void()> callback) {
    // Kept here, not in the client's std::function, so that its reference is dropped with the
    // GIL held (see the destructor).
    callbacks_.push_back(std::move(callback));
    size_t index = callbacks_.size() - 1;
    PyAttachment* self = this;
    std::function<void()> run = [self, index] {
      if (!Py_IsInitialized()) return;
      nb::gil_scoped_acquire acquire;
      if (!self->callbacks_[index].is_valid()) return;  // cleared by the GC
      try {
        self->callbacks_[index]();
      } catch (nb::python_error& e) {
        e.discard_as_unraisable("weightcache on_daemon_gone callback");
      }
    };
    // A callback registered after the daemon is known gone runs right here, on this thread,
    // which holds the GIL; gil_scoped_acquire is reentrant.
    attachment_->OnDaemonGone(std::move(run));
  }

 private:
  // Both read from the Attachment before it is moved in.
  int cuda_device_ = -1;
  bool host_writable_ = false;
  std::vector<nb::object> callbacks_;  // destroyed after attachment_ (declared before it)
  std::optional<Attachment> attachment_;
};

// A view of one tensor. `owner` is the Python Attachment object: every export passes it to
// nanobind as the owner, so the memory lives as long as any exported array.
struct PyTensor {
  nb::object owner;
  const TensorInfo* info;

  const PyAttachment& attachment() const { return nb::cast<const PyAttachment&>(owner); }
  bool host() const { return attachment().get().tier() == Tier::kHost; }
  // Read-only exports for host memory this process must not write (a PROT_READ mapping).
  bool read_only() const { return host() && !attachment().host_writable(); }
  const DTypeInfo& dtype() const {
    const DTypeInfo* d = FindDType(info->dtype);
    if (d == nullptr) {
      // The client checks every dtype against the safetensors set; this table mirrors it.
      throw nb::type_error(
          ("tensor " + std::string(info->name) + ": unknown dtype " + std::string(info->dtype))
              .c_str());
    }
    return *d;
  }
  std::pair<int32_t, int32_t> device() const {
    if (host()) return {nb::device::cpu::value, 0};
    return {nb::device::cuda::value, attachment().cuda_device()};
  }

  // The ndarray over this tensor's memory: its own dtype and shape (`raw` false) or its bytes
  // as uint8[nbytes].
  template <typename... Args>
  nb::ndarray<Args...> Array(bool raw) const {
    const DTypeInfo& d = dtype();
    if (!raw && !d.native) {
      throw nb::type_error(("tensor " + std::string(info->name) + " has dtype " +
                            std::string(info->dtype) +
                            ", which has no DLPack type of whole bytes per element; use "
                            "raw() for its bytes")
                               .c_str());
    }
    std::vector<size_t> shape;
    nb::dlpack::dtype dt{};
    dt.lanes = 1;
    if (raw) {
      shape.push_back(static_cast<size_t>(info->nbytes));
      dt.code = kDlUInt;
      dt.bits = 8;
    } else {
      for (int64_t s : info->shape) shape.push_back(static_cast<size_t>(s));
      dt.code = d.code;
      dt.bits = d.bits;
    }
    auto [device_type, device_id] = device();
    // A zero-byte tensor may have no address; DLPack consumers accept null data for size 0.
    void* data = reinterpret_cast<void*>(static_cast<uintptr_t>(info->data));
    return nb::ndarray<Args...>(data, shape.size(), shape.data(), owner, /*strides=*/nullptr, dt,
                                device_type, device_id);
  }

  // The exporter every DLPack call goes through: nanobind's nb_ndarray (the array_api
  // framework: __dlpack__, __dlpack_device__ and the buffer protocol), read-only for the host
  // tier.
  nb::object Exporter(bool raw) const {
    if (read_only()) return nb::cast(Array<nb::array_api, nb::ro>(raw));
    return nb::cast(Array<nb::array_api>(raw));
  }
};

// ---- Python's GC ------------------------------------------------------------------------------
// An Attachment holds its on_daemon_gone callbacks, a Tensor its Attachment: a callback that
// refers to its Attachment (or to one of its tensors) closes a cycle. Both types tell the GC
// what they hold (tp_traverse); the Attachment breaks such a cycle by dropping its callbacks
// (tp_clear), after which the cycle's objects are freed as usual: the client's connection,
// watcher thread and mappings go with them. (nanobind docs, "Reference cycles involving
// functions".)

int AttachmentTraverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));  // a heap type's instances refer to their type
  if (!nb::inst_ready(self)) return 0;
  return nb::inst_ptr<PyAttachment>(self)->Traverse(visit, arg);
}

int AttachmentClear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<PyAttachment>(self)->ClearCallbacks();
  return 0;
}

// A Tensor's owner is never cleared (every method reads it); the cycle is broken at the
// Attachment, which every cycle through a Tensor contains.
int TensorTraverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyTensor>(self)->owner.ptr());
  return 0;
}

PyType_Slot attachment_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(AttachmentTraverse)},
                                  {Py_tp_clear, reinterpret_cast<void*>(AttachmentClear)},
                                  {0, nullptr}};
PyType_Slot tensor_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(TensorTraverse)},
                              {0, nullptr}};

// ---- status codes -----------------------------------------------------------------------------

// weightcache::kStatusCodeTable as data: (value, name, code, exit_code, python class), one row
// per StatusCode. weightcache.errors builds its mapping from it.
std::vector<std::tuple<int, std::string, std::string, int, std::string>> StatusCodes() {
  std::vector<std::tuple<int, std::string, std::string, int, std::string>> rows;
  for (const StatusCodeInfo& info : kStatusCodeTable) {
    rows.emplace_back(static_cast<int>(info.code), std::string(info.name), std::string(info.key),
                      static_cast<int>(info.exit_code), std::string(info.python_class));
  }
  return rows;
}

// ---- options ----------------------------------------------------------------------------------

Tier TierFromPython(const std::string& s) {
  if (const std::optional<Tier> tier = ParseTier(s)) return *tier;
  throw nb::value_error(("tier must be \"gpu\" or \"host\", not \"" + s + "\"").c_str());
}

OnMissing ParseOnMissing(const std::string& s) {
  if (s == "fallback") return OnMissing::kFallback;
  if (s == "error") return OnMissing::kError;
  throw nb::value_error(
      ("on_missing must be \"fallback\" or \"error\", not \"" + s + "\"").c_str());
}

OnMismatch ParseOnMismatch(const std::string& s) {
  if (s == "error") return OnMismatch::kError;
  if (s == "fallback") return OnMismatch::kFallback;
  throw nb::value_error(
      ("on_mismatch must be \"error\" or \"fallback\", not \"" + s + "\"").c_str());
}

// AttachOptions::identity's fields as flat attributes of AttachOptions (the Python API names
// them without the `identity.` level, as weightcache.attach()'s keyword arguments do).
template <auto Field>
auto IdentityGet(const AttachOptions& o) {
  return o.identity.*Field;
}
template <auto Field>
void IdentitySet(AttachOptions& o,
                 std::remove_cvref_t<decltype(std::declval<IdentityOptions>().*Field)> value) {
  o.identity.*Field = std::move(value);
}

// Raises the Python exception for a failed attach, from the client's diagnostics of it.
[[noreturn]] void RaiseAttachError(const Status& status, const AttachDiagnostics& diagnostics) {
  const auto or_none = [](const std::string& s) -> nb::object {
    return s.empty() ? nb::none() : nb::cast(s);
  };
  nb::dict kw;
  // Also set on success when on_mismatch=fallback ignored one: only a mismatch error uses it.
  if (status.code() == StatusCode::kMismatch && diagnostics.mismatch.has_value()) {
    const MismatchDetails& m = *diagnostics.mismatch;
    nb::list fields;
    for (const ConfigFieldDiff& f : m.fields) {
      fields.append(nb::make_tuple(f.field, f.daemon_value, f.client_value));
    }
    kw["fields"] = fields;
    kw["daemon_socket"] = or_none(m.daemon_socket);
    kw["daemon_pid"] = m.daemon_pid != 0 ? nb::cast(m.daemon_pid) : nb::none();
  }
  nb::object errors = nb::module_::import_("weightcache.errors");
  nb::object exc = errors.attr("from_status")(
      std::string(StatusCodeName(status.code())), status.message(),
      or_none(diagnostics.socket_path), or_none(diagnostics.device_key), status.sys_errno(), **kw);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

PyAttachment* Attach(const AttachOptions& options) {
  std::optional<Result<Attachment>> result;
  AttachDiagnostics diagnostics;
  {
    nb::gil_scoped_release release;
    result.emplace(Attachment::Attach(options, &diagnostics));
  }
  if (!result->ok()) RaiseAttachError(result->status(), diagnostics);
  return new PyAttachment(std::move(*result).value(), options.host_mapping);
}

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

std::vector<std::string> DTypeNames() {
  std::vector<std::string> names;
  for (const DTypeInfo& d : kDTypes) names.emplace_back(d.name);
  return names;
}

}  // namespace
}  // namespace weightcache::python

namespace weightcache::python {
void RegisterPublish(nb::module_& m);  // publish_bindings.cc
}  // namespace weightcache::python

NB_MODULE(_weightcache, m) {
  // The binding table names most of the client's types; spelling each out would bury it.
  using namespace weightcache;          // NOLINT(google-build-using-namespace): see above
  using namespace weightcache::python;  // NOLINT(google-build-using-namespace): see above
  m.doc() = "The C++ weightcache client, bound with nanobind (use the weightcache package).";

  nb::class_<AttachOptions>(m, "AttachOptions",
                            "Every field of weightcache::AttachOptions (include/weightcache/"
                            "client.h); weightcache.attach() fills it from keyword arguments.")
      .def(nb::init<>())
      .def_prop_rw("model_dir", IdentityGet<&IdentityOptions::model_dir>,
                   IdentitySet<&IdentityOptions::model_dir>)
      .def_prop_rw("model_id", IdentityGet<&IdentityOptions::model_id>,
                   IdentitySet<&IdentityOptions::model_id>)
      .def_prop_rw("revision", IdentityGet<&IdentityOptions::revision>,
                   IdentitySet<&IdentityOptions::revision>)
      .def_prop_rw("dtype", IdentityGet<&IdentityOptions::dtype>,
                   IdentitySet<&IdentityOptions::dtype>)
      .def_prop_rw("quantization", IdentityGet<&IdentityOptions::quantization>,
                   IdentitySet<&IdentityOptions::quantization>)
      .def_prop_rw("quantization_config", IdentityGet<&IdentityOptions::quantization_config>,
                   IdentitySet<&IdentityOptions::quantization_config>)
      .def_prop_rw("tp_size", IdentityGet<&IdentityOptions::tp_size>,
                   IdentitySet<&IdentityOptions::tp_size>)
      .def_prop_rw("tp_rank", IdentityGet<&IdentityOptions::tp_rank>,
                   IdentitySet<&IdentityOptions::tp_rank>)
      .def_prop_rw("pp_size", IdentityGet<&IdentityOptions::pp_size>,
                   IdentitySet<&IdentityOptions::pp_size>)
      .def_prop_rw("pp_rank", IdentityGet<&IdentityOptions::pp_rank>,
                   IdentitySet<&IdentityOptions::pp_rank>)
      .def_prop_rw("ep_size", IdentityGet<&IdentityOptions::ep_size>,
                   IdentitySet<&IdentityOptions::ep_size>)
      .def_prop_rw("ep_rank", IdentityGet<&IdentityOptions::ep_rank>,
                   IdentitySet<&IdentityOptions::ep_rank>)
      .def_prop_rw("dp_size", IdentityGet<&IdentityOptions::dp_size>,
                   IdentitySet<&IdentityOptions::dp_size>)
      .def_prop_rw("shard_rules", IdentityGet<&IdentityOptions::shard_rules>,
                   IdentitySet<&IdentityOptions::shard_rules>)
      .def_prop_rw("layout_tag", IdentityGet<&IdentityOptions::layout_tag>,
                   IdentitySet<&IdentityOptions::layout_tag>)
      .def_prop_rw("source", IdentityGet<&IdentityOptions::source>,
                   IdentitySet<&IdentityOptions::source>)
      .def_prop_rw("checkpoint_fingerprint", IdentityGet<&IdentityOptions::checkpoint_fingerprint>,
                   IdentitySet<&IdentityOptions::checkpoint_fingerprint>)
      .def_prop_rw(
          "tier", [](const AttachOptions& o) { return std::string(TierName(o.identity.tier)); },
          [](AttachOptions& o, const std::string& s) { o.identity.tier = TierFromPython(s); })
      .def_prop_rw("device", IdentityGet<&IdentityOptions::device>,
                   IdentitySet<&IdentityOptions::device>)
      .def_prop_rw("namespace", IdentityGet<&IdentityOptions::namespace_name>,
                   IdentitySet<&IdentityOptions::namespace_name>)
      .def_prop_rw("runtime_dir", IdentityGet<&IdentityOptions::runtime_dir>,
                   IdentitySet<&IdentityOptions::runtime_dir>)
      .def_prop_rw("socket", IdentityGet<&IdentityOptions::socket>,
                   IdentitySet<&IdentityOptions::socket>)
      .def_prop_rw("device_inventory", IdentityGet<&IdentityOptions::device_inventory>,
                   IdentitySet<&IdentityOptions::device_inventory>)
      .def_prop_rw(
          "on_missing",
          [](const AttachOptions& o) {
            return std::string(o.on_missing == OnMissing::kError ? "error" : "fallback");
          },
          [](AttachOptions& o, const std::string& s) { o.on_missing = ParseOnMissing(s); })
      .def_prop_rw(
          "on_mismatch",
          [](const AttachOptions& o) {
            return std::string(o.on_mismatch == OnMismatch::kFallback ? "fallback" : "error");
          },
          [](AttachOptions& o, const std::string& s) { o.on_mismatch = ParseOnMismatch(s); })
      .def_prop_rw(
          "wait_timeout", [](const AttachOptions& o) { return o.wait_timeout.count() / 1000.0; },
          [](AttachOptions& o, double seconds) {
            if (!(seconds >= 0)) throw nb::value_error("wait_timeout must be >= 0 seconds");
            o.wait_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
          },
          "The attach's deadline in seconds (default 60): waiting for a daemon that "
          "reports `loading`, and every exchange with a daemon; one that does not answer "
          "by then is treated as absent.")
      .def_rw("fallback_threads", &AttachOptions::fallback_threads)
      .def_prop_rw(
          "host_mapping",
          [](const AttachOptions& o) {
            return std::string(o.host_mapping == HostMapping::kCopyOnWrite ? "copy_on_write"
                                                                           : "read_only");
          },
          [](AttachOptions& o, const std::string& s) {
            if (s == "read_only") {
              o.host_mapping = HostMapping::kReadOnly;
            } else if (s == "copy_on_write") {
              o.host_mapping = HostMapping::kCopyOnWrite;
            } else {
              throw nb::value_error(
                  ("host_mapping must be \"read_only\" or \"copy_on_write\", not \"" + s + "\"")
                      .c_str());
            }
          },
          "The host tier's mapping: \"read_only\" (a write faults) or \"copy_on_write\" (a "
          "write copies its page into this process only; the cache is never changed).");

  nb::class_<PyTensor>(m, "Tensor", nb::type_slots(tensor_slots),
                       "One tensor of an Attachment: metadata plus zero-copy DLPack export. "
                       "Keeps its Attachment alive.")
      .def_prop_ro("name", [](const PyTensor& t) { return std::string(t.info->name); })
      .def_prop_ro(
          "dtype", [](const PyTensor& t) { return std::string(t.info->dtype); },
          "The safetensors spelling: \"BF16\", \"F8_E4M3\", ...")
      .def_prop_ro("shape",
                   [](const PyTensor& t) -> nb::typed<nb::tuple, int, nb::ellipsis> {
                     nb::list l;
                     for (int64_t s : t.info->shape) l.append(s);
                     return nb::borrow<nb::typed<nb::tuple, int, nb::ellipsis>>(nb::tuple(l));
                   })
      .def_prop_ro("nbytes", [](const PyTensor& t) { return t.info->nbytes; })
      .def_prop_ro(
          "data_ptr", [](const PyTensor& t) { return t.info->data; },
          "Host address (host tier) or CUdeviceptr (gpu tier).")
      .def_prop_ro(
          "checksum", [](const PyTensor& t) { return t.info->checksum; },
          "Content checksum (docs/integrity.md).")
      .def_prop_ro(
          "slice",
          [](const PyTensor& t)
              -> std::optional<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>> {
            const auto& s = t.info->slice;
            if (!s) return std::nullopt;
            return std::make_tuple(s->dim, s->offset, s->length, s->full_length);
          },
          "Which slice of the full checkpoint tensor this is, for a sharded cache: (dim, offset, "
          "length, full_length), elements [offset, offset + length) along dim; None for a whole "
          "tensor.")
      .def_prop_ro(
          "device", [](const PyTensor& t) { return t.device(); },
          "The DLPack device: (1, 0) for the host tier, (2, cuda ordinal) for the gpu tier.")
      .def_prop_ro(
          "attachment", [](const PyTensor& t) -> const PyAttachment& { return t.attachment(); },
          nb::rv_policy::reference, "The owning Attachment.")
      .def_prop_ro(
          "dlpack_native", [](const PyTensor& t) { return t.dtype().native; },
          "False for F4/F6 tensors, which export only their bytes (raw()).")
      .def_prop_ro(
          "numpy_native", [](const PyTensor& t) { return t.dtype().numpy; },
          "True when NumPy has this dtype (numpy() works on the host tier).")
      .def(
          "__dlpack__",
          [](const PyTensor& t, const nb::kwargs& kwargs) {
            return t.Exporter(false).attr("__dlpack__")(**kwargs);
          },
          nb::sig("def __dlpack__(self, *, stream: object = None, max_version: tuple[int, int] | "
                  "None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = "
                  "None) -> object"),
          "DLPack export (stream, max_version, dl_device, copy as the array API defines them; "
          "copy=True is refused: this is a view).")
      .def("__dlpack_device__", [](const PyTensor& t) { return t.device(); })
      .def(
          "raw", [](const PyTensor& t) { return t.Exporter(true); },
          "The tensor's bytes as a uint8[nbytes] array (DLPack and buffer protocol), zero-copy.")
      .def(
          "numpy",
          [](const PyTensor& t) {
            if (!t.host()) {
              throw nb::type_error(("tensor " + std::string(t.info->name) +
                                    " is in GPU memory; use torch/cupy.from_dlpack")
                                       .c_str());
            }
            if (!t.dtype().numpy) {
              throw nb::type_error(("tensor " + std::string(t.info->name) + " has dtype " +
                                    std::string(t.info->dtype) +
                                    ", which NumPy does not represent; use raw() for its bytes")
                                       .c_str());
            }
            if (!t.read_only()) return nb::cast(t.Array<nb::numpy>(false));
            return nb::cast(t.Array<nb::numpy, nb::ro>(false));
          },
          "A NumPy view (host tier, NumPy dtypes only): read-only, or writable where the "
          "attach mapped a daemon's cache copy-on-write (host_mapping).")
      .def("__repr__", [](const PyTensor& t) {
        std::string shape;
        for (int64_t s : t.info->shape) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
        return "<weightcache.Tensor " + std::string(t.info->name) + " " +
               std::string(t.info->dtype) + "[" + shape + "] " +
               (t.host() ? "host" : "cuda:" + std::to_string(t.attachment().cuda_device())) + ">";
      });

  nb::class_<PyAttachment>(m, "Attachment", nb::is_weak_referenceable(),
                           nb::type_slots(attachment_slots),
                           "Weights mapped from a daemon, or loaded from disk (fallback). The "
                           "memory lives as long as this object or any tensor exported from it.")
      .def_prop_ro("tier",
                   [](const PyAttachment& a) { return std::string(TierName(a.get().tier())); })
      .def_prop_ro(
          "source",
          [](const PyAttachment& a) { return std::string(AttachSourceName(a.get().source())); })
      .def_prop_ro("source_reason", [](const PyAttachment& a) { return a.get().source_reason(); })
      .def_prop_ro("socket_path", [](const PyAttachment& a) { return a.get().socket_path(); })
      .def_prop_ro(
          "device_uuid", [](const PyAttachment& a) { return a.get().device_key(); },
          "The GPU UUID, or \"host\".")
      .def_prop_ro(
          "cuda_device", [](const PyAttachment& a) { return a.cuda_device(); },
          "CUDA ordinal of the device (gpu tier), -1 for the host tier.")
      .def_prop_ro("config_digest", [](const PyAttachment& a) { return a.get().config_digest(); })
      .def_prop_ro("daemon_pid", [](const PyAttachment& a) { return a.get().daemon_pid(); })
      .def_prop_ro(
          "metadata",
          [](const PyAttachment& a) {
            const std::string_view m = a.get().metadata();
            return nb::bytes(m.data(), m.size());
          },
          "The metadata blob the publisher of a published cache sent (bytes; b\"\" otherwise).")
      .def_prop_ro(
          "attach_ms", [](const PyAttachment& a) { return a.get().attach_ms(); },
          "Wall time of the attach (discovery, handshake, mapping or fallback load).")
      .def_prop_ro(
          "timings",
          [](const PyAttachment& a) -> nb::typed<nb::dict, nb::str, float> {
            const AttachTimings& t = a.get().timings();
            nb::dict d;
            d["resolve_ms"] = t.resolve_ms;
            d["discover_ms"] = t.discover_ms;
            d["map_ms"] = t.map_ms;
            d["table_ms"] = t.table_ms;
            d["fallback_ms"] = t.fallback_ms;
            return nb::borrow<nb::typed<nb::dict, nb::str, float>>(d);
          },
          "Where attach_ms went (AttachTimings, docs/client.md): resolve_ms (the identity: "
          "options, devices, the checkpoint fingerprint), discover_ms, map_ms, table_ms, "
          "fallback_ms.")
      .def_prop_ro("total_bytes", [](const PyAttachment& a) { return a.get().total_bytes(); })
      .def_prop_ro(
          "daemon_alive", [](const PyAttachment& a) { return a.get().daemon_alive(); },
          "False for a fallback, and once the daemon's end of the connection closed.")
      .def("on_daemon_gone", &PyAttachment::OnDaemonGone, "callback"_a,
           "Run callback() once when the daemon goes away (on the client's watcher thread). "
           "Never runs for a fallback attachment.")
      .def(
          "names",
          [](const PyAttachment& a) -> nb::typed<nb::list, nb::str> {
            // One pass over the client's table straight into a list: no intermediate copies.
            const std::vector<TensorInfo>& tensors = a.infos();
            nb::list names =
                nb::steal<nb::list>(PyList_New(static_cast<Py_ssize_t>(tensors.size())));
            for (size_t i = 0; i < tensors.size(); ++i) {
              PyObject* name = PyUnicode_FromStringAndSize(
                  tensors[i].name.data(), static_cast<Py_ssize_t>(tensors[i].name.size()));
              if (name == nullptr) throw nb::python_error();
              PyList_SET_ITEM(names.ptr(), static_cast<Py_ssize_t>(i), name);
            }
            return nb::borrow<nb::typed<nb::list, nb::str>>(names);
          },
          "Every tensor's name, sorted, built in one pass (no Tensor objects).")
      .def(
          "tensors",
          [](nb::handle self) {
            const auto& a = nb::cast<const PyAttachment&>(self);
            std::vector<PyTensor> out;
            out.reserve(a.infos().size());
            for (const TensorInfo& t : a.infos()) {
              out.push_back(PyTensor{nb::borrow(self), &t});
            }
            return out;
          },
          "Every tensor, sorted by name.")
      .def("__len__", [](const PyAttachment& a) { return a.infos().size(); })
      .def("__contains__",
           [](const PyAttachment& a, const std::string& name) { return a.Find(name) != nullptr; })
      .def("__getitem__", [](nb::handle self, const std::string& name) {
        const TensorInfo* t = nb::cast<const PyAttachment&>(self).Find(name);
        if (t == nullptr) throw nb::key_error(name.c_str());
        return PyTensor{nb::borrow(self), t};
      });

  m.def("attach", &Attach, "options"_a, nb::rv_policy::take_ownership,
        "Attach as AttachOptions say; raises a weightcache.errors exception on failure.");
  m.def("_view_plan", &ViewPlan, "attachment"_a,
        "(regions, runs, names, rest, order): how weightcache.load_state_dict builds every "
        "tensor as a view of a few region exports (bindings.cc, ViewPlan).");
  m.def("_dlpack_capsules", &DlpackCapsules, "attachment"_a,
        "(groups, rest, order): one DLPack capsule per tensor, grouped by dtype, for "
        "weightcache.load_state_dict (bindings.cc, DlpackCapsules).");
  m.def("dtype_names", &DTypeNames, "Every safetensors dtype this module knows.");
  RegisterPublish(m);
  m.def("status_codes", &StatusCodes,
        "One row per status code: (value, name, code, exit_code, python_class), from the C++ "
        "table that also decides the CLI's exit codes (weightcache.errors reads it).");
}
