// weightcache._weightcache._publish — the nanobind layer over weightcache::Publisher
// (include/weightcache/publisher.h, docs/publish.md); weightcache.publish() and
// publish_state_dict() (python/weightcache/publish.py) build its arguments.
//
// Contract:
//  * _publish(options, tensors, metadata, timeout_s) publishes in one call: `tensors` is a list
//    of (name, array, dtype, alias_of). `array` is any object nanobind takes as an ndarray
//    (DLPack or the buffer protocol: NumPy, torch, CuPy); its shape and bytes make the plan
//    entry, `dtype` the safetensors spelling the Python side chose. An entry with alias_of set
//    shares its target's bytes: it is planned (same dtype, shape, bytes) but not copied.
//  * Every array must be C-contiguous (a ValueError names the tensor: no silent copy) and lie
//    where the tier's arena can be written from this process: host memory for the host tier;
//    CUDA device memory (any device: cuMemcpy with unified addressing) or host memory for the
//    gpu tier. The copies are Publisher::CopyIn, synchronous; the caller has synchronized the
//    streams that produced the arrays (weightcache.publish does for torch).
//  * Nothing is sent before every array is checked. Begin, the copies and Commit run with the
//    GIL released; the arrays stay referenced by `tensors` meanwhile. A refused publish
//    raises the weightcache.errors exception of its status (errors.from_status), the daemon
//    having freed the arena.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "weightcache/client.h"
#include "weightcache/publisher.h"
#include "weightcache/status.h"

namespace nb = nanobind;
using namespace nb::literals;  // NOLINT(google-build-using-namespace): nanobind's "name"_a

namespace weightcache::python {
namespace {

using HostArray = nb::ndarray<nb::ro>;

[[noreturn]] void RaisePublishError(const Status& status) {
  nb::object errors = nb::module_::import_("weightcache.errors");
  nb::object exc =
      errors.attr("from_status")(std::string(StatusCodeName(status.code())), status.message(),
                                 nb::none(), nb::none(), status.sys_errno());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

// Row-major contiguity of `a` (strides in elements; a dimension of size 1 may have any stride).
bool CContiguous(const HostArray& a) {
  int64_t expected = 1;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(d));
  }
  return true;
}

size_t Publish(const AttachOptions& options, const nb::list& tensors, const nb::bytes& metadata,
               double timeout_s) {
  const Tier tier = options.identity.tier;
  PublishOptions o;
  o.identity = options.identity;
  o.metadata.assign(metadata.c_str(), metadata.size());
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  std::vector<PublishTensor> plan;
  std::vector<HostArray> arrays;  // plan order; an alias's is unused
  plan.reserve(tensors.size());
  arrays.reserve(tensors.size());
  for (nb::handle item : tensors) {
    auto [name, object, dtype, alias_of] =
        nb::cast<std::tuple<std::string, nb::object, std::string, std::string>>(item);
    HostArray a;
    if (!nb::try_cast(object, a, false)) {
      throw nb::type_error(("tensor '" + name + "' (" +
                            nb::cast<std::string>(nb::str(object.type())) +
                            ") is not an array (DLPack or the buffer protocol)")
                               .c_str());
    }
    const bool on_host = a.device_type() == nb::device::cpu::value ||
                         a.device_type() == nb::device::cuda_host::value;
    if (tier == Tier::kHost && !on_host) {
      throw nb::value_error(("tensor '" + name +
                             "' is not in host memory: the host tier is published from host "
                             "arrays (move it to the CPU first)")
                                .c_str());
    }
    if (tier == Tier::kGpu && !on_host && a.device_type() != nb::device::cuda::value &&
        a.device_type() != nb::device::cuda_managed::value) {
      throw nb::value_error(("tensor '" + name +
                             "' is neither in CUDA device memory nor in host memory: the gpu "
                             "tier copies from either")
                                .c_str());
    }
    if (!CContiguous(a)) {
      throw nb::value_error(("tensor '" + name +
                             "' is not contiguous: publish its contiguous copy "
                             "(.contiguous(), numpy.ascontiguousarray)")
                                .c_str());
    }
    PublishTensor t;
    t.name = std::move(name);
    t.dtype = std::move(dtype);
    for (size_t d = 0; d < a.ndim(); ++d) t.shape.push_back(a.shape(d));
    t.nbytes = a.nbytes();
    t.alias_of = std::move(alias_of);
    plan.push_back(std::move(t));
    arrays.push_back(std::move(a));
  }
  std::optional<Status> failed;
  {
    nb::gil_scoped_release release;
    auto publisher = Publisher::Begin(o, plan);
    if (!publisher.ok()) {
      failed = publisher.status();
    } else {
      for (size_t i = 0; i < plan.size(); ++i) {
        if (!plan[i].alias_of.empty() || plan[i].nbytes == 0) continue;
        Status copied = publisher->CopyIn(i, arrays[i].data(), plan[i].nbytes);
        if (!copied.ok()) {
          failed = copied;
          break;
        }
      }
      if (!failed) {
        Status committed = publisher->Commit();
        if (!committed.ok()) failed = committed;
      }
    }
  }
  if (failed) RaisePublishError(*failed);
  return plan.size();
}

}  // namespace

void RegisterPublish(nb::module_& m) {
  m.def("_publish", &Publish, "options"_a, "tensors"_a, "metadata"_a, "timeout_s"_a,
        "Publish [(name, array, dtype, alias_of)] into the daemon of options' identity "
        "(weightcache.publish builds the arguments); the tensor count.");
}

}  // namespace weightcache::python
