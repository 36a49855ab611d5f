// The Python objects of weightcache._weightcache that more than one binding file builds: the
// dtype table (safetensors' names to DLPack codes), PyAttachment (one weightcache::Attachment
// and its on_daemon_gone callbacks) and PyTensor (a view of one tensor that keeps its
// Attachment alive). bindings.cc binds them; bulk_bindings.cc builds load_state_dict's bulk
// views and capsules over them. The contract is bindings.cc's.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightcache/client.h"

namespace weightcache::python {

namespace nb = nanobind;

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

inline constexpr DTypeInfo kDTypes[] = {
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

inline const DTypeInfo* FindDType(std::string_view name) {
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

}  // namespace weightcache::python
