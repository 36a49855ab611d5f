// weightcache._weightcache — the nanobind layer over the C++ client (include/weightcache/client.h).
//
// The options, Tensor and Attachment bindings and the module; the objects they bind are in
// attachment_objects.h, load_state_dict's bulk builders in bulk_bindings.cc and the publisher's
// in publish_bindings.cc.
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

#include "attachment_objects.h"
#include "weightcache/client.h"
#include "weightcache/status.h"

namespace weightcache::python {
namespace {

using namespace nb::literals;  // NOLINT(google-build-using-namespace): nanobind's "name"_a

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

std::vector<std::string> DTypeNames() {
  std::vector<std::string> names;
  for (const DTypeInfo& d : kDTypes) names.emplace_back(d.name);
  return names;
}

}  // namespace
}  // namespace weightcache::python

namespace weightcache::python {
void RegisterPublish(nb::module_& m);  // publish_bindings.cc
void RegisterBulk(nb::module_& m);     // bulk_bindings.cc
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
      .def_rw("wait_for_publisher", &AttachOptions::wait_for_publisher,
              "A published cache awaiting its publisher with no publication in progress: "
              "True (default) waits for one within wait_timeout; False treats it as absent at "
              "once, for a caller that publishes after its own load (docs/engines.md).")
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
  RegisterBulk(m);
  m.def("dtype_names", &DTypeNames, "Every safetensors dtype this module knows.");
  RegisterPublish(m);
  m.def("status_codes", &StatusCodes,
        "One row per status code: (value, name, code, exit_code, python_class), from the C++ "
        "table that also decides the CLI's exit codes (weightcache.errors reads it).");
}
