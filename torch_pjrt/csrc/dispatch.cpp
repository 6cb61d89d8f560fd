// Native hit path of strict eager dispatch: one boxed PrivateUse1 kernel per lowered aten overload.
//
// Python (torch_pjrt/eager/dispatch.py) stays the one source of truth: it builds every program.
// This file owns the per-overload cache from a call's signature (each tensor's dtype, sizes,
// strides, offset and storage; static arguments; the kinds of traced scalars; device; default
// dtype) to what Python built for it (the jitted program, which storages it takes, the layouts of
// its results), and the hit path: call that program with the storages' arrays and the traced
// scalars, point mutated storages at their new arrays, and wrap the results as tensors, entering
// no Python code of ours. A padded storage (a dynamic dim held at its bucket size) keys by its layout
// as well, and its programs also take the call's true lengths, remembered with the entry: a call of
// the same true sizes replays natively (its padded results ask Python's layout for their holder and
// keep their lengths live through Python's `note_padded`). A program with device-side checks hands
// its code to Python's pending checks (`native_checks_issued`). Every call the cache cannot describe
// (fused or launch-blocking mode, bfloat16 or large CPU tensors, pending storages, explicit
// generators, factories) and every miss goes to Python's `native_miss`, which runs the op as before
// and hands back what to install.
// All state is guarded by the GIL, which every call holds (autograd's threads included).

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/utils/tensor_numpy.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "native.h"

namespace torch_pjrt {
namespace {

// The argument kinds of eager/dispatch.py's `Arg` enum (same numbers).
enum class Kind : int { Tensor = 1, TensorList = 2, Scalar = 3, ScalarList = 4, Generator = 5, Device = 6, Static = 7 };

// How a miss converts an argument to Python where the IValue alone does not say.
enum class Convert : int { Plain, Dtype, Layout, MemoryFormat };

// What Python hands over once, at set-up (all references kept for the process).
struct Runtime {
  PyObject* miss = nullptr;  // dispatch.native_miss(plan, args, kwargs) -> (result, install or None)
  PyObject* storage_type = nullptr;  // storage.DeviceStorage (plain slots, no accounting of its own)
  PyObject* array_type = nullptr;  // the type of jax's device arrays
  PyObject* modes = nullptr;  // eager.modes.state (.fusing, .blocking)
  PyObject* counts = nullptr;  // metrics._counts
  PyObject* op_counts = nullptr;  // metrics.op_counts
  PyObject* last_output = nullptr;  // device._last_output
  PyObject* random_key = nullptr;  // random_key(device_index) -> key data
  PyObject* padded_type = nullptr;  // storage.Padded: a storage's array held at bucket sizes
  PyObject* note_padded = nullptr;  // dynamic.note_padded(device_storage): a new padded result's lengths are live
  PyObject* checks_issued = nullptr;  // dispatch.native_checks_issued(code, checks): a checked program ran
  PyObject* s_pjrt = nullptr;
  PyObject* s_array = nullptr;
  PyObject* s_dtype = nullptr;
  PyObject* s_numel = nullptr;
  PyObject* s_device = nullptr;
  PyObject* s_nbytes = nullptr;
  PyObject* s_fusing = nullptr;
  PyObject* s_blocking = nullptr;
  PyObject* s_ops_executed = nullptr;
  PyObject* s_cache_hits = nullptr;
  PyObject* s_dynamic_padded_ops = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_padded = nullptr;
  PyObject* s_bounds = nullptr;
  PyObject* s_holding = nullptr;
  std::vector<PyObject*> devices;  // torch.device("pjrt", i), made on first use
  pid_t pid = 0;
  bool enabled = false;
};

Runtime& runtime() {
  static auto* instance = new Runtime();  // never destroyed: it holds Python objects
  return *instance;
}

PyObject* device_object(c10::DeviceIndex index) {
  auto& rt = runtime();
  if (static_cast<size_t>(index) >= rt.devices.size()) {
    rt.devices.resize(index + 1, nullptr);
  }
  if (rt.devices[index] == nullptr) {
    rt.devices[index] = THPDevice_New(c10::Device(c10::DeviceType::PrivateUse1, index));
  }
  return rt.devices[index];
}

// Adds one to a counter dict (a collections.Counter) without running Python code.
void bump(PyObject* counter, PyObject* name) {
  PyObject* found = PyDict_GetItemWithError(counter, name);
  if (found == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  py::object next = py::reinterpret_steal<py::object>(PyLong_FromLongLong(
      found == nullptr ? 1 : PyLong_AsLongLong(found) + 1));
  if (PyDict_SetItem(counter, name, next.ptr()) != 0) {
    throw py::error_already_set();
  }
}

struct OutSpec {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t numel;
  PyObject* dtype_object;
  PyObject* layout;  // a padded result's storage.Padded (its array unset), or nullptr
};

// One schema return: an alias of argument `alias`, None, one new tensor, or a list of them.
struct Return {
  enum Kind : int { Alias = 0, None = 1, One = 2, List = 3 } kind;
  int alias = -1;
  std::vector<OutSpec> specs;
};

// What Python built for one signature (never freed: it holds Python objects).
struct Entry {
  PyObject* jitted;
  PyObject* program;
  std::vector<int> passed;
  bool random;
  std::vector<Return> returns;
  std::vector<int> mutated;
  size_t fresh;
  PyObject* lengths;  // a tuple: the true lengths a padded program takes after the traced scalars
  std::vector<bool> mutated_padded;  // per mutated storage: written in its padded layout
  PyObject* checks;  // the program's device-side checks (its last output is their code), or nullptr
};

struct Key {
  std::vector<int64_t> words;
  size_t hash = 0;
  bool operator==(const Key& other) const {
    return hash == other.hash && words == other.words;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    return key.hash;
  }
};

// A storage met in a call: its DeviceStorage and array (None while uninitialised; a padded storage's
// bucket-size array, its layout beside it).
struct Slot {
  c10::StorageImpl* impl;
  py::object device_storage;
  py::object array;
  py::object layout;
};

// One call's signature, as the arguments are read.
struct Signature {
  Key key;
  std::vector<Slot> slots;
  std::vector<py::object> traced;
  c10::DeviceIndex device = -1;
};

int64_t double_bits(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

struct OpState {
  PyObject* plan;
  PyObject* name_object;  // plan.name, the key of metrics.op_counts
  std::vector<Kind> kinds;
  std::vector<Convert> converts;
  std::vector<bool> kwarg_only;
  std::vector<PyObject*> arg_names;
  std::vector<bool> return_is_tensor;  // a None result of a `Tensor` return is an undefined tensor
  bool static_scalars;
  bool allow_cpu;  // takes CPU tensors of any size (indices), not only 0-dim scalars
  bool cacheable;
  std::unordered_map<Key, Entry*, KeyHash> cache;
};

c10::IValue none_of(bool is_tensor) {
  return is_tensor ? c10::IValue(at::Tensor()) : c10::IValue();
}

// A traced Python number, its type in the key (bool, int, float and complex programs differ).
bool add_number(const c10::IValue& value, bool is_static, Signature& sig) {
  auto& words = sig.key.words;
  int64_t tag;
  int64_t bits[2] = {0, 0};
  PyObject* object;
  if (value.isBool()) {
    tag = 1;
    bits[0] = value.toBool();
    object = PyBool_FromLong(value.toBool());
  } else if (value.isInt()) {
    tag = 2;
    bits[0] = value.toInt();
    object = PyLong_FromLongLong(value.toInt());
  } else if (value.isDouble()) {
    tag = 3;
    bits[0] = double_bits(value.toDouble());
    object = PyFloat_FromDouble(value.toDouble());
  } else if (value.isComplexDouble()) {
    tag = 4;
    const auto z = value.toComplexDouble();
    bits[0] = double_bits(z.real());
    bits[1] = double_bits(z.imag());
    object = PyComplex_FromDoubles(z.real(), z.imag());
  } else {
    return false;
  }
  py::object owned = py::reinterpret_steal<py::object>(object);
  words.push_back(tag);
  if (is_static) {
    words.push_back(bits[0]);
    words.push_back(bits[1]);
  } else {
    sig.traced.push_back(std::move(owned));
  }
  return true;
}

// A CPU tensor where PyTorch accepts one (a 0-dim scalar, or an index of the ops that take CPU
// indices): a traced host array of its own copy, its dtype and shape in the key.
bool add_host_tensor(const at::Tensor& tensor, bool allow_cpu, Signature& sig) {
  if ((tensor.dim() != 0 && !allow_cpu) || tensor.is_conj() || tensor.is_neg() ||
      tensor.scalar_type() == c10::ScalarType::BFloat16 || tensor.requires_grad()) {
    return false;  // Python's path knows these (and raises for a CPU tensor where none is allowed)
  }
  auto& words = sig.key.words;
  words.push_back(-5);
  words.push_back(static_cast<int64_t>(tensor.scalar_type()));
  words.push_back(tensor.dim());
  words.insert(words.end(), tensor.sizes().begin(), tensor.sizes().end());
  at::Tensor copy = tensor.clone(at::MemoryFormat::Contiguous);
  sig.traced.push_back(py::reinterpret_steal<py::object>(torch::utils::tensor_to_numpy(copy, false)));
  return true;
}

// A tuple of ints into the key, its length first; false if it holds anything else.
bool add_ints(PyObject* items, std::vector<int64_t>& words) {
  if (items == nullptr || !PyTuple_Check(items)) {
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  words.push_back(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(items, i);
    if (!PyLong_CheckExact(item)) {
      return false;
    }
    words.push_back(PyLong_AsLongLong(item));
  }
  return true;
}

// A padded storage's layout into the key (its true and bucket shapes, each dim's bound: None, an
// int, or a ladder of sizes), and its bucket-size array; false when that array is not a device
// array yet (a fused result: Python resolves it).
bool add_layout(PyObject* layout, std::vector<int64_t>& words, py::object& inner) {
  auto& rt = runtime();
  auto attribute = [layout](PyObject* name) {
    PyObject* found = PyObject_GetAttr(layout, name);
    if (found == nullptr) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(found);
  };
  py::object shape = attribute(rt.s_shape);
  py::object padded = attribute(rt.s_padded);
  py::object bounds = attribute(rt.s_bounds);
  inner = attribute(rt.s_array);
  if (Py_TYPE(inner.ptr()) != reinterpret_cast<PyTypeObject*>(rt.array_type)) {
    return false;
  }
  words.push_back(-7);
  if (!add_ints(shape.ptr(), words) || !add_ints(padded.ptr(), words) || !PyTuple_Check(bounds.ptr())) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bounds.ptr()); ++i) {
    PyObject* bound = PyTuple_GET_ITEM(bounds.ptr(), i);
    if (bound == Py_None) {
      words.push_back(-1);
    } else if (PyLong_CheckExact(bound)) {
      words.push_back(-2);
      words.push_back(PyLong_AsLongLong(bound));
    } else {
      words.push_back(-3);
      if (!add_ints(bound, words)) {
        return false;
      }
    }
  }
  return true;
}

bool add_tensor(const at::Tensor& tensor, Signature& sig, const OpState& op) {
  auto& words = sig.key.words;
  if (!tensor.defined()) {
    words.push_back(-1);
    return true;
  }
  if (tensor.unsafeGetTensorImpl()->is_wrapped_number()) {
    // `x + 2`: Python kernels see the number itself, a weakly typed traced scalar
    words.push_back(-6);
    return add_number(c10::IValue(tensor.item()), op.static_scalars, sig);
  }
  const c10::Device device = tensor.device();
  if (device.type() == c10::DeviceType::CPU) {
    return add_host_tensor(tensor, op.allow_cpu, sig);
  }
  if (device.type() != c10::DeviceType::PrivateUse1) {
    return false;
  }
  if (sig.device < 0) {
    sig.device = device.index();
  } else if (sig.device != device.index()) {
    return false;
  }
  if (tensor.is_neg() || (tensor.is_conj() && !tensor.is_complex())) {
    return false;
  }
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  int64_t slot = -1;
  for (size_t i = 0; i < sig.slots.size(); ++i) {
    if (sig.slots[i].impl == impl) {
      slot = static_cast<int64_t>(i);
      break;
    }
  }
  words.push_back(static_cast<int64_t>(tensor.scalar_type()));
  if (slot < 0) {
    auto& rt = runtime();
    py::object wrapped = py::reinterpret_steal<py::object>(THPStorage_Wrap(tensor.storage()));
    PyObject* found = PyObject_GetAttr(wrapped.ptr(), rt.s_pjrt);
    if (found == nullptr) {
      PyErr_Clear();
      return false;
    }
    py::object device_storage = py::reinterpret_steal<py::object>(found);
    py::object array = py::reinterpret_steal<py::object>(PyObject_GetAttr(found, rt.s_array));
    py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(found, rt.s_dtype));
    py::object numel = py::reinterpret_steal<py::object>(PyObject_GetAttr(found, rt.s_numel));
    if (!array || !dtype || !numel || !THPDtype_Check(dtype.ptr())) {
      PyErr_Clear();
      return false;
    }
    const bool uninitialised = array.is_none();
    words.push_back(-2);  // a storage met for the first time: its own layout follows
    words.push_back(static_cast<int64_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type));
    words.push_back(PyLong_AsLongLong(numel.ptr()));
    words.push_back(uninitialised ? 1 : 0);
    py::object layout;
    if (!uninitialised && Py_TYPE(array.ptr()) == reinterpret_cast<PyTypeObject*>(rt.padded_type)) {
      py::object inner;
      if (!add_layout(array.ptr(), words, inner)) {
        return false;
      }
      layout = std::move(array);
      array = std::move(inner);
    } else if (!uninitialised && Py_TYPE(array.ptr()) != reinterpret_cast<PyTypeObject*>(rt.array_type)) {
      return false;  // a pending (fused) storage: Python resolves it
    }
    slot = static_cast<int64_t>(sig.slots.size());
    sig.slots.push_back({impl, std::move(device_storage), std::move(array), std::move(layout)});
  }
  words.push_back(slot);
  words.push_back(tensor.is_conj() ? 1 : 0);
  const auto sizes = tensor.sizes();
  const auto strides = tensor.strides();
  words.push_back(static_cast<int64_t>(sizes.size()));
  words.insert(words.end(), sizes.begin(), sizes.end());
  words.insert(words.end(), strides.begin(), strides.end());
  words.push_back(tensor.storage_offset());
  return true;
}

// A static argument by value (it is part of the program).
bool add_static(const c10::IValue& value, std::vector<int64_t>& words) {
  if (value.isNone()) {
    words.push_back(0);
  } else if (value.isBool()) {
    words.push_back(1);
    words.push_back(value.toBool());
  } else if (value.isInt()) {
    words.push_back(2);
    words.push_back(value.toInt());
  } else if (value.isSymInt()) {
    const auto concrete = value.toSymInt().maybe_as_int();
    if (!concrete) {
      return false;
    }
    words.push_back(2);
    words.push_back(*concrete);
  } else if (value.isDouble()) {
    words.push_back(3);
    words.push_back(double_bits(value.toDouble()));
  } else if (value.isString()) {
    const auto& text = value.toStringRef();
    words.push_back(4);
    words.push_back(static_cast<int64_t>(text.size()));
    for (size_t i = 0; i < text.size(); i += sizeof(int64_t)) {
      int64_t chunk = 0;
      std::memcpy(&chunk, text.data() + i, std::min(sizeof(int64_t), text.size() - i));
      words.push_back(chunk);
    }
  } else if (value.isIntList()) {
    const auto list = value.toIntList();
    words.push_back(5);
    words.push_back(static_cast<int64_t>(list.size()));
    for (const int64_t item : list) {
      words.push_back(item);
    }
  } else if (value.isList()) {
    const auto list = value.toListRef();
    words.push_back(6);
    words.push_back(static_cast<int64_t>(list.size()));
    for (const auto& item : list) {
      if (!add_static(item, words)) {
        return false;
      }
    }
  } else if (value.isDevice()) {
    words.push_back(7);
    words.push_back(static_cast<int64_t>(value.toDevice().type()));
    words.push_back(value.toDevice().index());
  } else {
    return false;
  }
  return true;
}

bool describe(const OpState& op, c10::ArrayRef<c10::IValue> arguments, Signature& sig) {
  auto& words = sig.key.words;
  words.reserve(64);
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = arguments[i];
    switch (op.kinds[i]) {
      case Kind::Tensor:
        if (value.isNone()) {
          words.push_back(-3);
        } else if (!value.isTensor() || !add_tensor(value.toTensor(), sig, op)) {
          return false;
        }
        break;
      case Kind::TensorList:
        if (value.isTensorList()) {
          const auto list = value.toTensorList();
          words.push_back(static_cast<int64_t>(list.size()));
          for (const at::Tensor& tensor : list) {
            if (!add_tensor(tensor, sig, op)) {
              return false;
            }
          }
        } else if (value.isList()) {
          const auto list = value.toListRef();
          words.push_back(static_cast<int64_t>(list.size()));
          for (const auto& item : list) {
            if (item.isNone()) {
              words.push_back(-3);
            } else if (!item.isTensor() || !add_tensor(item.toTensor(), sig, op)) {
              return false;
            }
          }
        } else {
          return false;
        }
        break;
      case Kind::Scalar:
        if (value.isNone()) {
          words.push_back(0);
        } else if (!add_number(value, op.static_scalars, sig)) {
          return false;
        }
        break;
      case Kind::ScalarList:
        if (value.isNone()) {
          words.push_back(-4);
        } else if (op.static_scalars) {
          if (!add_static(value, words)) {
            return false;
          }
        } else if (value.isList() || value.isIntList() || value.isDoubleList()) {
          const auto list = value.toListRef();
          words.push_back(static_cast<int64_t>(list.size()));
          for (const auto& item : list) {
            if (!add_number(item, false, sig)) {
              return false;
            }
          }
        } else {
          return false;
        }
        break;
      case Kind::Generator:
        if (!value.isNone()) {
          return false;  // a user's generator advances through Python
        }
        words.push_back(0);
        break;
      case Kind::Device:
        return false;
      case Kind::Static:
        if (!add_static(value, words)) {
          return false;
        }
        break;
    }
  }
  if (sig.device < 0) {
    return false;
  }
  words.push_back(sig.device);
  words.push_back(static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));
  // The float32 matmul precision: products trace at it (ops/linalg.py), so it keys programs too. Read
  // through the per-backend API, which every setter updates (the legacy getter throws once it is used).
  const auto& context = at::globalContext();
  words.push_back(static_cast<int64_t>(context.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL)));
  words.push_back(static_cast<int64_t>(context.float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL)));
  words.push_back(static_cast<int64_t>(context.float32Precision(at::Float32Backend::GENERIC, at::Float32Op::ALL)));
  size_t hash = words.size();
  for (const int64_t word : words) {
    hash ^= std::hash<int64_t>{}(word) + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
  }
  sig.key.hash = hash;
  return true;
}

bool fast_path_allowed() {
  auto& rt = runtime();
  if (!rt.enabled || getpid() != rt.pid) {
    return false;  // a forked child: Python refuses with the clear message
  }
  py::object fusing = py::reinterpret_steal<py::object>(PyObject_GetAttr(rt.modes, rt.s_fusing));
  py::object blocking = py::reinterpret_steal<py::object>(PyObject_GetAttr(rt.modes, rt.s_blocking));
  if (!fusing || !blocking) {
    throw py::error_already_set();
  }
  return fusing.ptr() == Py_False && blocking.ptr() == Py_False;
}

// A DeviceStorage made as Python's __init__ would, without running Python code: its type's own
// allocation, then its slots set.
py::object new_device_storage(PyObject* array, const OutSpec& spec, c10::DeviceIndex device, int64_t nbytes) {
  auto& rt = runtime();
  auto* type = reinterpret_cast<PyTypeObject*>(rt.storage_type);
  py::object created = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!created) {
    throw py::error_already_set();
  }
  py::object numel = py::reinterpret_steal<py::object>(PyLong_FromLongLong(spec.numel));
  py::object bytes = py::reinterpret_steal<py::object>(PyLong_FromLongLong(nbytes));
  if (PyObject_SetAttr(created.ptr(), rt.s_array, array) != 0 ||
      PyObject_SetAttr(created.ptr(), rt.s_dtype, spec.dtype_object) != 0 ||
      PyObject_SetAttr(created.ptr(), rt.s_numel, numel.ptr()) != 0 ||
      PyObject_SetAttr(created.ptr(), rt.s_device, device_object(device)) != 0 ||
      PyObject_SetAttr(created.ptr(), rt.s_nbytes, bytes.ptr()) != 0) {
    throw py::error_already_set();
  }
  return created;
}

// `layout.holding(array)`: a padded storage's layout over a new bucket-size array.
py::object padded_holder(PyObject* layout, PyObject* array) {
  PyObject* holder = PyObject_CallMethodOneArg(layout, runtime().s_holding, array);
  if (holder == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(holder);
}

at::Tensor wrap_output(const OutSpec& spec, PyObject* array, c10::DeviceIndex device) {
  auto& rt = runtime();
  const int64_t nbytes = spec.numel * static_cast<int64_t>(c10::elementSize(spec.dtype));
  at::Tensor tensor = make_tensor(device, spec.dtype, spec.sizes, spec.strides, new_address(nbytes), nbytes);
  py::object wrapped = py::reinterpret_steal<py::object>(THPStorage_Wrap(tensor.storage()));
  py::object holder = spec.layout == nullptr ? py::reinterpret_borrow<py::object>(array)
                                             : padded_holder(spec.layout, array);
  py::object device_storage = new_device_storage(holder.ptr(), spec, device, nbytes);
  if (PyObject_SetAttr(wrapped.ptr(), rt.s_pjrt, device_storage.ptr()) != 0) {
    throw py::error_already_set();
  }
  if (spec.layout != nullptr) {
    PyObject* noted = PyObject_CallOneArg(rt.note_padded, device_storage.ptr());
    if (noted == nullptr) {
      throw py::error_already_set();
    }
    Py_DECREF(noted);
  }
  return tensor;
}

// The hit: run the cached program and leave the op's returns on the stack.
void run_hit(const OpState& op, const Entry& entry, Signature& sig, torch::jit::Stack* stack, size_t n_arguments) {
  auto& rt = runtime();
  const Py_ssize_t n_lengths = PyTuple_GET_SIZE(entry.lengths);
  const size_t n_inputs = entry.passed.size() + (entry.random ? 1 : 0) + sig.traced.size() + n_lengths;
  py::tuple inputs(n_inputs);
  size_t position = 0;
  for (const int slot : entry.passed) {
    inputs[position++] = sig.slots[slot].array;
  }
  if (entry.random) {
    py::object index = py::reinterpret_steal<py::object>(PyLong_FromLong(sig.device));
    PyObject* key = PyObject_CallOneArg(rt.random_key, index.ptr());
    if (key == nullptr) {
      throw py::error_already_set();
    }
    inputs[position++] = py::reinterpret_steal<py::object>(key);
  }
  for (auto& value : sig.traced) {
    inputs[position++] = std::move(value);
  }
  for (Py_ssize_t i = 0; i < n_lengths; ++i) {
    inputs[position++] = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry.lengths, i));
  }
  PyObject* called = PyObject_Call(entry.jitted, inputs.ptr(), nullptr);
  if (called == nullptr) {
    // Program.reraise translates a device allocation failure into torch.OutOfMemoryError.
    py::error_already_set failure;
    py::handle(entry.program).attr("reraise")(failure.value(), inputs);
    throw failure;
  }
  py::object outputs = py::reinterpret_steal<py::object>(called);
  const size_t n_outputs = entry.fresh + entry.mutated.size();
  if (!PyTuple_Check(called) ||
      static_cast<size_t>(PyTuple_GET_SIZE(called)) != n_outputs + (entry.checks != nullptr ? 1 : 0)) {
    throw std::runtime_error("torch_pjrt native dispatch: a cached program returned an unexpected result");
  }
  if (entry.checks != nullptr) {
    // the code stays on the device; Python keeps it pending, with the user's line, until a host wait
    PyObject* noted = PyObject_CallFunctionObjArgs(rt.checks_issued, PyTuple_GET_ITEM(called, n_outputs),
                                                   entry.checks, nullptr);
    if (noted == nullptr) {
      throw py::error_already_set();
    }
    Py_DECREF(noted);
  }
  bump(rt.counts, rt.s_ops_executed);
  bump(rt.counts, rt.s_cache_hits);
  bump(rt.op_counts, op.name_object);
  if (n_lengths > 0) {
    bump(rt.counts, rt.s_dynamic_padded_ops);
  }
  py::object index = py::reinterpret_steal<py::object>(PyLong_FromLong(sig.device));
  if (PyDict_SetItem(rt.last_output, index.ptr(), called) != 0) {
    throw py::error_already_set();
  }
  for (size_t j = 0; j < entry.mutated.size(); ++j) {
    const Slot& slot = sig.slots[entry.mutated[j]];
    PyObject* array = PyTuple_GET_ITEM(called, entry.fresh + j);
    py::object holder = entry.mutated_padded[j] ? padded_holder(slot.layout.ptr(), array)
                                                : py::reinterpret_borrow<py::object>(array);
    if (PyObject_SetAttr(slot.device_storage.ptr(), rt.s_array, holder.ptr()) != 0) {
      throw py::error_already_set();
    }
  }
  std::vector<c10::IValue> results;
  results.reserve(entry.returns.size());
  const c10::IValue* arguments = &(*stack)[stack->size() - n_arguments];
  size_t next = 0;
  for (const Return& ret : entry.returns) {
    switch (ret.kind) {
      case Return::Alias:
        results.push_back(arguments[ret.alias]);
        break;
      case Return::None:
        results.push_back(none_of(op.return_is_tensor[results.size()]));
        break;
      case Return::One:
        results.emplace_back(wrap_output(ret.specs[0], PyTuple_GET_ITEM(called, next++), sig.device));
        break;
      case Return::List: {
        c10::List<at::Tensor> list;
        list.reserve(ret.specs.size());
        for (const OutSpec& spec : ret.specs) {
          list.push_back(wrap_output(spec, PyTuple_GET_ITEM(called, next++), sig.device));
        }
        results.emplace_back(std::move(list));
        break;
      }
    }
  }
  torch::jit::drop(*stack, n_arguments);
  for (auto& result : results) {
    stack->push_back(std::move(result));
  }
}

OutSpec read_spec(py::handle spec) {
  py::tuple fields = py::reinterpret_borrow<py::tuple>(spec);
  PyObject* dtype = fields[0].ptr();
  TORCH_CHECK(THPDtype_Check(dtype), "torch_pjrt native dispatch: bad output spec");
  Py_INCREF(dtype);
  PyObject* layout = nullptr;
  if (fields.size() > 4 && !fields[4].is_none()) {
    layout = py::object(fields[4]).release().ptr();
  }
  return OutSpec{
      reinterpret_cast<THPDtype*>(dtype)->scalar_type,
      fields[1].cast<std::vector<int64_t>>(),
      fields[2].cast<std::vector<int64_t>>(),
      fields[3].cast<int64_t>(),
      dtype,
      layout};
}

// install = (jitted, program, passed_slots, random, returns, mutated_slots, n_fresh_outputs, lengths,
// mutated_padded, checks or None), each return (kind, alias, specs) with spec (dtype, sizes, strides, numel[, layout]).
Entry* read_entry(py::handle install) {
  py::tuple fields = py::reinterpret_borrow<py::tuple>(install);
  auto* entry = new Entry();
  entry->jitted = py::object(fields[0]).release().ptr();
  entry->program = py::object(fields[1]).release().ptr();
  entry->passed = fields[2].cast<std::vector<int>>();
  entry->random = fields[3].cast<bool>();
  for (py::handle item : fields[4]) {
    py::tuple ret = py::reinterpret_borrow<py::tuple>(item);
    Return parsed;
    parsed.kind = static_cast<Return::Kind>(ret[0].cast<int>());
    parsed.alias = ret[1].cast<int>();
    for (py::handle spec : ret[2]) {
      parsed.specs.push_back(read_spec(spec));
    }
    entry->returns.push_back(std::move(parsed));
  }
  entry->mutated = fields[5].cast<std::vector<int>>();
  entry->fresh = fields[6].cast<size_t>();
  entry->lengths = py::tuple(fields[7]).release().ptr();
  entry->mutated_padded = fields[8].cast<std::vector<bool>>();
  entry->checks = fields[9].is_none() ? nullptr : py::object(fields[9]).release().ptr();
  return entry;
}

py::object to_python(const c10::IValue& value, Convert convert) {
  if (value.isInt()) {
    switch (convert) {
      case Convert::Dtype:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(value.toInt()))));
      case Convert::Layout:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(value.toInt()))));
      case Convert::MemoryFormat:
        return py::reinterpret_borrow<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(value.toInt())));
      case Convert::Plain:
        break;
    }
  }
  return torch::jit::toPyObject(value);
}

// The miss: Python's execute runs the op; what it built is installed under the call's key.
void run_miss(OpState& op, const c10::OperatorHandle& handle, torch::jit::Stack* stack, Signature* keyed) {
  const auto& schema = handle.schema();
  const size_t n = schema.arguments().size();
  auto arguments = torch::jit::last(*stack, n);
  py::list positional;
  py::dict keywords;
  for (size_t i = 0; i < n; ++i) {
    py::object value = to_python(arguments[i], op.converts[i]);
    if (op.kwarg_only[i]) {
      keywords[op.arg_names[i]] = value;
    } else {
      positional.append(value);
    }
  }
  PyObject* called = PyObject_CallFunctionObjArgs(
      runtime().miss, op.plan, py::tuple(positional).ptr(), keywords.ptr(), nullptr);
  if (called == nullptr) {
    throw py::error_already_set();
  }
  py::tuple answer = py::reinterpret_steal<py::tuple>(called);
  py::object result = answer[0];
  if (keyed != nullptr && !answer[1].is_none() && op.cache.find(keyed->key) == op.cache.end()) {
    op.cache.emplace(std::move(keyed->key), read_entry(answer[1]));
  }
  torch::jit::drop(*stack, n);
  const auto& returns = schema.returns();
  auto push = [&](py::handle value, size_t i) {
    stack->push_back(value.is_none() ? none_of(op.return_is_tensor[i]) : torch::jit::toIValue(value, returns[i].type()));
  };
  if (returns.size() == 1) {
    push(result, 0);
  } else if (!returns.empty()) {
    py::tuple values = py::reinterpret_borrow<py::tuple>(result);
    for (size_t i = 0; i < returns.size(); ++i) {
      push(values[i], i);
    }
  }
}

struct Kernel final : public c10::OperatorKernel {
  explicit Kernel(OpState* state) : state_(state) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    OpState& op = *state_;
    const size_t n = op.kinds.size();
    Signature sig;
    if (op.cacheable && fast_path_allowed() && describe(op, torch::jit::last(*stack, n), sig)) {
      auto found = op.cache.find(sig.key);
      if (found != op.cache.end()) {
        run_hit(op, *found->second, sig, stack, n);
        return;
      }
      sig.traced.clear();
      sig.slots.clear();
      run_miss(op, handle, stack, &sig);
      return;
    }
    run_miss(op, handle, stack, nullptr);
  }

 private:
  OpState* state_;  // never freed: it holds Python objects
};

// Views and other metadata-only ops: PyTorch's own CPU kernel computes the new sizes, strides and
// offset over the same storage (no data is touched, so the device does not matter).
struct MetadataKernel final : public c10::OperatorKernel {
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    handle.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
};

torch::Library& library() {
  static auto* instance =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  return *instance;
}

Convert convert_of(const c10::Argument& argument) {
  c10::TypePtr type = argument.real_type();
  if (auto optional = type->cast<c10::OptionalType>()) {
    type = optional->getElementType();
  }
  switch (type->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return Convert::Dtype;
    case c10::TypeKind::LayoutType:
      return Convert::Layout;
    case c10::TypeKind::MemoryFormatType:
      return Convert::MemoryFormat;
    default:
      return Convert::Plain;
  }
}

// Registers the native kernel of aten::name.overload, whose Python plan (eager/dispatch.OpPlan) runs misses.
void register_kernel(const std::string& name, const std::string& overload, py::object plan,
                     std::vector<int> kinds, bool static_scalars, bool allow_cpu, bool cacheable) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(("aten::" + name).c_str(), overload.c_str());
  const auto& arguments = handle.schema().arguments();
  TORCH_CHECK(kinds.size() == arguments.size(), "torch_pjrt native dispatch: ", name, ".", overload,
              " has ", arguments.size(), " arguments, its plan ", kinds.size());
  auto* state = new OpState();
  state->plan = plan.inc_ref().ptr();
  state->name_object = py::object(plan.attr("name")).release().ptr();
  for (size_t i = 0; i < arguments.size(); ++i) {
    state->kinds.push_back(static_cast<Kind>(kinds[i]));
    state->converts.push_back(convert_of(arguments[i]));
    state->kwarg_only.push_back(arguments[i].kwarg_only());
    state->arg_names.push_back(py::str(arguments[i].name()).inc_ref().ptr());
  }
  for (const auto& ret : handle.schema().returns()) {
    state->return_is_tensor.push_back(ret.type()->kind() == c10::TypeKind::TensorType);
  }
  state->static_scalars = static_scalars;
  state->allow_cpu = allow_cpu;
  state->cacheable = cacheable;
  library().impl(
      overload.empty() ? name.c_str() : (name + "." + overload).c_str(),
      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(state)));
}

void register_metadata_kernel(const std::string& name, const std::string& overload) {
  library().impl(
      overload.empty() ? name.c_str() : (name + "." + overload).c_str(),
      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<MetadataKernel>()));
}

PyObject* interned(const char* text) {
  return PyUnicode_InternFromString(text);
}

void configure(py::object miss, py::object storage_type, py::object array_type, py::object modes,
               py::object counts, py::object op_counts, py::object last_output, py::object random_key,
               py::object padded_type, py::object note_padded, py::object checks_issued) {
  auto& rt = runtime();
  rt.miss = miss.inc_ref().ptr();
  rt.storage_type = storage_type.inc_ref().ptr();
  rt.array_type = array_type.inc_ref().ptr();
  rt.modes = modes.inc_ref().ptr();
  rt.counts = counts.inc_ref().ptr();
  rt.op_counts = op_counts.inc_ref().ptr();
  rt.last_output = last_output.inc_ref().ptr();
  rt.random_key = random_key.inc_ref().ptr();
  rt.padded_type = padded_type.inc_ref().ptr();
  rt.note_padded = note_padded.inc_ref().ptr();
  rt.checks_issued = checks_issued.inc_ref().ptr();
  rt.s_pjrt = interned("_pjrt");
  rt.s_array = interned("array");
  rt.s_dtype = interned("dtype");
  rt.s_numel = interned("numel");
  rt.s_device = interned("device");
  rt.s_nbytes = interned("nbytes");
  rt.s_fusing = interned("fusing");
  rt.s_blocking = interned("blocking");
  rt.s_ops_executed = interned("ops_executed");
  rt.s_cache_hits = interned("cache_hits");
  rt.s_dynamic_padded_ops = interned("dynamic_padded_ops");
  rt.s_shape = interned("shape");
  rt.s_padded = interned("padded");
  rt.s_bounds = interned("bounds");
  rt.s_holding = interned("holding");
  rt.pid = getpid();
  rt.enabled = true;
}

}  // namespace

void init_dispatch(py::module& m) {
  m.def("configure_dispatch", &configure, py::arg("miss"), py::arg("storage_type"), py::arg("array_type"),
        py::arg("modes"), py::arg("counts"), py::arg("op_counts"), py::arg("last_output"), py::arg("random_key"),
        py::arg("padded_type"), py::arg("note_padded"), py::arg("checks_issued"),
        "Hand the native dispatch the Python objects it reads and calls, and turn it on.");
  m.def("register_kernel", &register_kernel, py::arg("name"), py::arg("overload"), py::arg("plan"),
        py::arg("kinds"), py::arg("static_scalars"), py::arg("allow_cpu"), py::arg("cacheable"),
        "Register the native PrivateUse1 kernel of aten::name.overload.");
  m.def("register_metadata_kernel", &register_metadata_kernel, py::arg("name"), py::arg("overload"),
        "Register aten::name.overload (a view or metadata-only op) to run PyTorch's CPU kernel natively.");
  m.def("set_dispatch_enabled", [](bool on) { runtime().enabled = on && runtime().miss != nullptr; },
        py::arg("on"), "Turn the native hit path on or off (off: every call goes to Python).");
  m.def("dispatch_enabled", []() { return runtime().enabled; });
}

}  // namespace torch_pjrt
