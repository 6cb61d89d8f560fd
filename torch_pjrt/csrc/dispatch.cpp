// Native hit path of eager dispatch: one boxed PrivateUse1 kernel per lowered aten overload, and torch.empty.
//
// Python (torch_pjrt/eager/dispatch.py) stays the one source of truth: it builds every program.
// This file owns the per-overload cache from a call's signature (each tensor's dtype, sizes,
// strides, offset and storage; static arguments; the kinds of traced scalars; device; default
// dtype) to what Python built for it (the jitted program, which storages it takes, the layouts of
// its results), and the hit path, entering no Python code of ours. In strict eager a hit calls that
// program with the storages' arrays and the traced scalars; in DEFER_AND_FUSE it appends the call to
// its device's pending graph in Python (eager/fusion.py) as PendingGraph.record does, its results unresolved
// fused results. Either way it then points mutated storages at their new arrays and wraps the
// results as tensors. A padded storage (a dynamic dim held at its bucket size) keys by its layout
// as well, and its programs also take the call's true lengths, remembered with the entry: a call of
// the same true sizes replays natively (its padded results ask Python's layout for their holder and
// keep their lengths live as Python's `note_padded` does, natively). A program with device-side checks hands
// its code to Python's pending checks (`native_checks_issued`). Every call the cache cannot describe
// (launch-blocking mode, bfloat16 or large CPU tensors, failed fused results, explicit generators,
// results placed on another device, factories of a live length's size) and every miss goes to Python's `native_miss`, which runs the op as before and hands
// back what to install.
// All state is guarded by the GIL, which every call holds (autograd's threads included), and the
// pending graph by its own lock besides, as in Python.

#include <ATen/Context.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/SDPBackend.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/safe_numerics.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/utils/tensor_numpy.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <pthread.h>

#include <algorithm>
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

// Where fusion.PendingGraph's members sit in its objects, and Replay's nodes: a recorded call reads its graph's
// lists through them, not by name.
struct GraphSlots {
  Py_ssize_t lock, nodes, inputs, input_slots, outputs, check_lines, replay, replay_nodes;
};

GraphSlots graph_slots_of(py::handle fusion) {
  py::object graph = fusion.attr("PendingGraph");
  auto at = [&graph](const char* name) { return slot_offset(graph.ptr(), name); };
  return GraphSlots{at("lock"), at("nodes"), at("inputs"), at("input_slots"), at("outputs"), at("check_lines"),
                    at("replay"), slot_offset(py::object(fusion.attr("Replay")).ptr(), "nodes")};
}

// What Python hands over once, at set-up (all references kept for the process).
struct Runtime {
  PyObject* miss = nullptr;  // dispatch.native_miss(plan, args, kwargs) -> (result, install or None)
  PyObject* storage_type = nullptr;  // storage.DeviceStorage (plain slots, no accounting of its own)
  PyObject* array_type = nullptr;  // the type of jax's device arrays
  bool blocking = false;  // eager.modes.state's flags, handed over at each mode change (modes.on_change)
  bool fusing = false;
  // the counters a hit bumps, kept here (metrics reads them through `native_counts`)
  int64_t ops_executed = 0;
  int64_t cache_hits = 0;
  int64_t dynamic_padded_ops = 0;
  PyObject* op_counts = nullptr;  // metrics.op_counts
  PyObject* last_output = nullptr;  // device._last_output
  PyObject* random_key = nullptr;  // random_key(device_index) -> key data
  PyObject* padded_type = nullptr;  // storage.Padded: a storage's array held at bucket sizes
  PyObject* checks_issued = nullptr;  // dispatch.native_checks_issued(code, checks): a checked program ran
  PyObject* fusion = nullptr;  // eager.fusion: its graph(index), a device's PendingGraph made on first use
  PyObject* fusion_globals = nullptr;  // eager.fusion's __dict__: MAX_NODES and DEBUG_RECOMPILE, read at every recorded call
  PyObject* graphs = nullptr;  // fusion.graphs(): the PendingGraph of each device, by index
  PyObject* deferred_type = nullptr;  // fusion.Deferred: one result of a recorded op
  PyObject* check_caller = nullptr;  // checks.caller(): the user line a recorded checked op reports
  PyObject* live_lengths = nullptr;  // dynamic.live_lengths(): a dict keyed by the lengths marked lately
  PyObject* python_counts = nullptr;  // metrics' own counters (ops_executed: those Python ran)
  Py_ssize_t live_limit = 0;  // how many lengths live_lengths keeps, the newest (dynamic._LIVE_LIMIT)
  PyObject* scalar_array = nullptr;  // client.scalar_array(number, device_index): its weakly typed device array
  // where DeviceStorage's slots are in its objects (read and written without attribute lookups)
  DeviceStorageSlots storage_slots;
  // and where fusion.Deferred's are: every recorded result is made, and every fused input read, through them
  Py_ssize_t at_graph = 0;
  Py_ssize_t at_node = 0;
  Py_ssize_t at_index = 0;
  Py_ssize_t at_value = 0;
  Py_ssize_t at_failure = 0;
  GraphSlots graph_slots;
  PyObject* s_array = nullptr;
  PyObject* s_shape = nullptr;
  PyObject* s_padded = nullptr;
  PyObject* s_bounds = nullptr;
  PyObject* s_holding = nullptr;
  PyObject* s_compiled = nullptr;
  PyObject* s_jitted = nullptr;
  PyObject* s_aval = nullptr;
  PyObject* s_dtype = nullptr;
  PyObject* s_weak_type = nullptr;
  PyObject* s_call_for = nullptr;
  PyObject* s_acquire = nullptr;
  PyObject* s_release = nullptr;
  PyObject* s_graph = nullptr;
  PyObject* s_max_nodes = nullptr;
  PyObject* s_debug_recompile = nullptr;
  PyObject* s_flush = nullptr;
  PyObject* s_size_cap = nullptr;
  PyObject* s_ref_node = nullptr;  // the wiring refs of fusion.PendingGraph._ref: "n", "s", "c"
  PyObject* s_ref_scalar = nullptr;
  PyObject* s_ref_input = nullptr;
  std::vector<PyObject*> devices;  // torch.device("pjrt", i), made on first use
  bool forked = false;  // set in a forked child (pthread_atfork): a syscall per call would cost more
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

// A slot's value as a new reference, None while unset (as reading an unset slot never happens in Python).
py::object slot_or_none(PyObject* object, Py_ssize_t offset) {
  PyObject* value = slot_at(object, offset);
  return py::reinterpret_borrow<py::object>(value == nullptr ? Py_None : value);
}

// The __slots__ member of `object` at `offset` (see slot_offset), raising AttributeError `name` while it is unset.
py::object member_at(PyObject* object, Py_ssize_t offset, const char* name) {
  PyObject* value = slot_at(object, offset);
  if (value == nullptr) {
    PyErr_SetString(PyExc_AttributeError, name);
    throw py::error_already_set();
  }
  return py::reinterpret_borrow<py::object>(value);
}

// `object.name`, raising Python's error when it has none.
py::object attribute_of(PyObject* object, PyObject* name) {
  PyObject* found = PyObject_GetAttr(object, name);
  if (found == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(found);
}

struct OutSpec {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t numel;
  PyObject* dtype_object;
  PyObject* layout;  // a padded result's storage.Padded (its array unset), or nullptr
  int64_t nbytes;
  PyObject* numel_object;  // numel and nbytes as the Python ints every result's DeviceStorage holds
  PyObject* nbytes_object;
  // a padded result's dynamic lengths (its layout's true sizes of 2 or more with a bound) and their bounds: a
  // new result keeps them live (dynamic.note_padded)
  std::vector<std::pair<PyObject*, PyObject*>> lengths;
};

// One schema return: an alias of argument `alias`, None, one new tensor, or a list of them.
struct Return {
  enum Kind : int { Alias = 0, None = 1, One = 2, List = 3 } kind;
  int alias = -1;
  std::vector<OutSpec> specs;
};

// What Python built for one signature (never freed: it holds Python objects).
struct Entry {
  mutable PyObject* jitted;  // a stored op's entry swaps in the executable for other array shapes
  PyObject* program;
  std::vector<int> passed;
  bool random;
  std::vector<Return> returns;
  std::vector<int> mutated;
  size_t fresh;
  PyObject* lengths;  // a tuple: the true lengths a padded program takes after the traced scalars
  std::vector<bool> mutated_padded;  // per mutated storage: written in its padded layout
  PyObject* checks;  // the program's device-side checks (its last output is their code), or nullptr
  PyObject* recorded;  // Python's dispatch.Entry, what a fused graph records
  bool compiled;  // whether `jitted` has run once through Program.call (which compiles and counts)
  PyObject* stored;  // eager/dispatch.StoredOp when `jitted` is one of its executables, or nullptr
  // Once a stored op has met several sets of input shapes (`jitted` is then the StoredOp itself): the
  // C++ call of the executable StoredOp picked for each set met (its avals key, `avals_key`), so a hit
  // picks it here instead of StoredOp.load building the same key in Python.
  mutable std::vector<std::pair<std::vector<intptr_t>, PyObject*>> by_avals;
};

// A call's words live inline, so a hit allocates nothing from the C heap for its key (nor for its
// Signature's slots and numbers); a key kept in the cache is as large.
struct Key {
  c10::SmallVector<int64_t, 64> words;
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

// A traced Python number of a call: where it is in `traced`, and its type and bits (the key of its
// device array, as client.scalar_array keeps them: -0.0 is not 0.0).
struct Number {
  size_t position;
  int64_t words[4];  // tag, bits, imaginary bits, device
};

// One call's signature, as the arguments are read.
struct Signature {
  Key key;
  c10::SmallVector<Slot, 4> slots;
  c10::SmallVector<py::object, 4> traced;
  c10::SmallVector<Number, 4> numbers;
  c10::DeviceIndex device = -1;
  bool fusing = false;  // recording into the pending graph: storages may hold unresolved fused results
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
  std::vector<size_t> length_args;  // a factory's sizes: one equal to a live length is padded by Python
  std::unordered_map<Key, Entry*, KeyHash> cache;
};

c10::IValue none_of(bool is_tensor) {
  return is_tensor ? c10::IValue(at::Tensor()) : c10::IValue();
}

// 0 and 1 (int or float, not -0.0) are static, as eager/dispatch.py's `_is_unit` says why.
bool is_unit(const c10::IValue& value) {
  if (value.isInt()) {
    return value.toInt() == 0 || value.toInt() == 1;
  }
  if (value.isDouble()) {
    const int64_t bits = double_bits(value.toDouble());
    return bits == double_bits(0.0) || bits == double_bits(1.0);
  }
  return false;
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
    sig.numbers.push_back(Number{sig.traced.size(), {tag, bits[0], bits[1], 0}});
    sig.traced.push_back(std::move(owned));
  }
  return true;
}

struct NumberKey {
  int64_t words[4];
  bool operator==(const NumberKey& other) const {
    return std::memcmp(words, other.words, sizeof(words)) == 0;
  }
};

struct NumberKeyHash {
  size_t operator()(const NumberKey& key) const {
    size_t hash = 0;
    for (const int64_t word : key.words) {
      hash = hash * 1000003u ^ std::hash<int64_t>()(word);
    }
    return hash;
  }
};

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

// A storage's array as a program input: a device array as is, a fused result by its value once its
// graph has run, or (recording) unresolved as it is; false where Python must resolve it first.
bool usable_array(py::object& array, bool fusing) {
  auto& rt = runtime();
  PyTypeObject* type = Py_TYPE(array.ptr());
  if (type == reinterpret_cast<PyTypeObject*>(rt.array_type)) {
    return true;
  }
  if (rt.deferred_type == nullptr || type != reinterpret_cast<PyTypeObject*>(rt.deferred_type)) {
    return false;
  }
  py::object value = slot_or_none(array.ptr(), rt.at_value);
  if (!value.is_none()) {
    array = std::move(value);
    return Py_TYPE(array.ptr()) == reinterpret_cast<PyTypeObject*>(rt.array_type);
  }
  return fusing;
}

// A tuple of ints into the key, its length first; false if it holds anything else.
bool add_ints(PyObject* items, c10::SmallVectorImpl<int64_t>& words) {
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
// int, or a ladder of sizes), and its bucket-size array; false when that array cannot be used yet.
bool add_layout(PyObject* layout, c10::SmallVectorImpl<int64_t>& words, py::object& inner, bool fusing) {
  auto& rt = runtime();
  py::object shape = attribute_of(layout, rt.s_shape);
  py::object padded = attribute_of(layout, rt.s_padded);
  py::object bounds = attribute_of(layout, rt.s_bounds);
  inner = attribute_of(layout, rt.s_array);
  if (!usable_array(inner, fusing)) {
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
    const c10::IValue number(tensor.item());
    return add_number(number, op.static_scalars || is_unit(number), sig);
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
    PyObject* found = device_storage_of(impl);
    if (found == nullptr || !PyObject_TypeCheck(found, reinterpret_cast<PyTypeObject*>(rt.storage_type))) {
      return false;
    }
    py::object device_storage = py::reinterpret_borrow<py::object>(found);
    PyObject* array_slot = slot_at(found, rt.storage_slots.array);
    PyObject* dtype = slot_at(found, rt.storage_slots.dtype);
    PyObject* numel = slot_at(found, rt.storage_slots.numel);
    if (array_slot == nullptr || dtype == nullptr || numel == nullptr || !THPDtype_Check(dtype)) {
      return false;
    }
    py::object array = py::reinterpret_borrow<py::object>(array_slot);
    const bool uninitialised = array.is_none();
    words.push_back(-2);  // a storage met for the first time: its own layout follows
    words.push_back(static_cast<int64_t>(reinterpret_cast<THPDtype*>(dtype)->scalar_type));
    words.push_back(PyLong_AsLongLong(numel));
    words.push_back(uninitialised ? 1 : 0);
    py::object layout;
    if (!uninitialised && Py_TYPE(array.ptr()) == reinterpret_cast<PyTypeObject*>(rt.padded_type)) {
      py::object inner;
      if (!add_layout(array.ptr(), words, inner, sig.fusing)) {
        return false;
      }
      layout = std::move(array);
      array = std::move(inner);
    } else if (!uninitialised && !usable_array(array, sig.fusing)) {
      return false;
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
bool add_static(const c10::IValue& value, c10::SmallVectorImpl<int64_t>& words) {
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

// Whether a factory's size equals a length marked dynamic lately (Python then pads its result).
bool sizes_are_live(const OpState& op, c10::ArrayRef<c10::IValue> arguments) {
  PyObject* live = runtime().live_lengths;
  if (op.length_args.empty() || PyDict_GET_SIZE(live) == 0) {
    return false;
  }
  auto is_live = [live](int64_t size) {
    py::object key = py::reinterpret_steal<py::object>(PyLong_FromLongLong(size));
    const int found = PyDict_Contains(live, key.ptr());
    if (found < 0) {
      throw py::error_already_set();
    }
    return found == 1;
  };
  for (const size_t index : op.length_args) {
    const c10::IValue& value = arguments[index];
    if (value.isIntList()) {
      for (const int64_t size : value.toIntList()) {
        if (is_live(size)) {
          return true;
        }
      }
    } else if (value.isInt()) {
      if (is_live(value.toInt())) {
        return true;
      }
    } else if (!value.isDouble() && !value.isNone()) {
      return true;  // symbolic sizes: Python decides
    }
  }
  return false;
}

bool describe(const OpState& op, c10::ArrayRef<c10::IValue> arguments, Signature& sig) {
  auto& words = sig.key.words;
  words.reserve(64);
  c10::DeviceIndex target = -1;  // an explicit pjrt device argument: where the results go
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
        } else if (!add_number(value, op.static_scalars || is_unit(value), sig)) {
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
        if (value.isNone()) {
          words.push_back(0);
        } else if (!value.isDevice() || value.toDevice().type() != c10::DeviceType::PrivateUse1) {
          return false;  // a result placed on another device: Python runs it there
        } else {
          const c10::Device device = value.toDevice();
          target = device.has_index() ? device.index()
                                      : c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
          words.push_back(8);
          words.push_back(target);
        }
        break;
      case Kind::Static:
        if (!add_static(value, words)) {
          return false;
        }
        break;
    }
  }
  if (target >= 0) {
    if (sig.device >= 0 && sig.device != target) {
      return false;  // a copy between pjrt devices: Python moves it
    }
    sig.device = target;
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

// eager.fusion's global `name` as it is now (a test may have patched it), borrowed.
PyObject* fusion_setting(PyObject* name) {
  PyObject* found = PyDict_GetItemWithError(runtime().fusion_globals, name);
  if (found == nullptr) {
    if (!PyErr_Occurred()) {
      PyErr_SetObject(PyExc_AttributeError, name);
    }
    throw py::error_already_set();
  }
  return found;
}

// Where a call may go: Python only, the native strict hit, or native recording into the fused graph.
enum class Path { Python, Strict, Fused };

Path fast_path() {
  auto& rt = runtime();
  if (!rt.enabled || rt.forked) {
    return Path::Python;  // a forked child: Python refuses with the clear message
  }
  if (rt.blocking) {
    return Path::Python;
  }
  if (!rt.fusing) {
    return Path::Strict;
  }
  // TORCH_PJRT_DEBUG_RECOMPILE records each op's user line, which Python finds
  return PyObject_IsTrue(fusion_setting(rt.s_debug_recompile)) ? Path::Python : Path::Fused;
}

// Calls a Python function with borrowed arguments; its result.
py::object call_python(PyObject* function, std::initializer_list<PyObject*> arguments) {
  py::tuple packed(arguments.size());
  size_t i = 0;
  for (PyObject* argument : arguments) {
    packed[i++] = py::reinterpret_borrow<py::object>(argument);
  }
  PyObject* called = PyObject_Call(function, packed.ptr(), nullptr);
  if (called == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(called);
}

// The device's next default random key (a random op without a generator).
py::object random_key(c10::DeviceIndex device) {
  py::object index = py::reinterpret_steal<py::object>(PyLong_FromLong(device));
  return call_python(runtime().random_key, {index.ptr()});
}

// dynamic.note_padded(device_storage) natively: each dynamic length of a new padded result becomes the newest
// live length, as (bound, ops executed so far, a weak reference to the storage); the oldest beyond the limit
// are dropped.
void note_padded(const OutSpec& spec, PyObject* device_storage) {
  auto& rt = runtime();
  if (spec.lengths.empty()) {
    return;
  }
  static PyObject* const executed = PyUnicode_InternFromString("ops_executed");
  PyObject* counted = PyDict_GetItemWithError(rt.python_counts, executed);
  if (counted == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  py::object native_ops = py::reinterpret_steal<py::object>(PyLong_FromLongLong(rt.ops_executed));
  py::object ops_now = counted == nullptr ? native_ops
                                          : py::reinterpret_steal<py::object>(PyNumber_Add(counted, native_ops.ptr()));
  py::object owner = py::reinterpret_steal<py::object>(PyWeakref_NewRef(device_storage, nullptr));
  if (!ops_now || !owner) {
    throw py::error_already_set();
  }
  for (const auto& [size, bound] : spec.lengths) {
    const int found = PyDict_Contains(rt.live_lengths, size);
    if (found < 0 || (found == 1 && PyObject_DelItem(rt.live_lengths, size) != 0)) {
      throw py::error_already_set();
    }
    py::object seen = py::reinterpret_steal<py::object>(PyTuple_Pack(3, bound, ops_now.ptr(), owner.ptr()));
    if (!seen || PyObject_SetItem(rt.live_lengths, size, seen.ptr()) != 0) {
      throw py::error_already_set();
    }
  }
  static PyObject* const popitem = PyUnicode_InternFromString("popitem");
  while (PyDict_GET_SIZE(rt.live_lengths) > rt.live_limit) {
    py::object dropped = py::reinterpret_steal<py::object>(PyObject_CallMethodOneArg(rt.live_lengths, popitem, Py_False));
    if (!dropped) {
      throw py::error_already_set();
    }
  }
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
  py::object holder = spec.layout == nullptr ? py::reinterpret_borrow<py::object>(array)
                                             : padded_holder(spec.layout, array);
  py::object device_storage = new_device_storage(rt.storage_type, rt.storage_slots, holder.ptr(), spec.dtype_object,
                                                 spec.numel_object, device_object(device), spec.nbytes_object);
  at::Tensor tensor = linked_tensor(device, spec.dtype, spec.sizes, spec.strides, spec.nbytes, device_storage.ptr());
  if (spec.layout != nullptr) {
    note_padded(spec, device_storage.ptr());
  }
  return tensor;
}

// Strict calls pass a traced number seen before as its device array (client.scalar_array, which
// says why); one met for the first time is passed as it is and remembered (an empty object here).
void numbers_as_arrays(Signature& sig) {
  static auto* arrays = new std::unordered_map<NumberKey, py::object, NumberKeyHash>();  // holds Python objects
  constexpr size_t kept = 1024;
  for (const Number& number : sig.numbers) {
    NumberKey key;
    std::memcpy(key.words, number.words, sizeof(key.words));
    key.words[3] = sig.device;
    auto found = arrays->find(key);
    if (found == arrays->end()) {
      if (arrays->size() >= kept) {
        arrays->clear();
      }
      arrays->emplace(key, py::object());
      continue;
    }
    if (!found->second) {
      found->second = call_python(runtime().scalar_array, {sig.traced[number.position].ptr(),
                                                           py::int_(static_cast<int>(sig.device)).ptr()});
    }
    sig.traced[number.position] = found->second;
  }
}

// Whether a strict hit may call `jitted` directly: only once Program.call has run it (an entry first
// met while fusing has been traced, not compiled).
// An entry first met while fusing comes without `jitted` (Py_None): its jax.jit, made when first read, is
// read here once it has compiled.
bool program_compiled(Entry& entry) {
  if (!entry.compiled) {
    entry.compiled = attribute_of(entry.program, runtime().s_compiled).ptr() == Py_True;
    if (entry.compiled && entry.jitted == Py_None) {
      Py_SETREF(entry.jitted, attribute_of(entry.program, runtime().s_jitted).release().ptr());
    }
  }
  return entry.compiled;
}

// The key StoredOp.load picks an executable by, read natively: each jax array's aval (shape, dtype,
// weak type), each Python bool, int or float by its type. False for any other input (Python picks then).
bool avals_key(const c10::SmallVector<PyObject*, 8>& inputs, c10::SmallVectorImpl<intptr_t>& words) {
  auto& rt = runtime();
  for (PyObject* input : inputs) {
    if (PyBool_Check(input) || PyLong_CheckExact(input) || PyFloat_CheckExact(input)) {
      words.push_back(-1);
      words.push_back(reinterpret_cast<intptr_t>(Py_TYPE(input)));
      continue;
    }
    if (!PyObject_TypeCheck(input, reinterpret_cast<PyTypeObject*>(rt.array_type))) {
      return false;
    }
    py::object aval = attribute_of(input, rt.s_aval);
    py::object shape = attribute_of(aval.ptr(), rt.s_shape);
    if (!PyTuple_Check(shape.ptr())) {
      return false;
    }
    const Py_ssize_t rank = PyTuple_GET_SIZE(shape.ptr());
    words.push_back(rank);
    for (Py_ssize_t i = 0; i < rank; ++i) {
      const intptr_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape.ptr(), i));
      if (size == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      words.push_back(size);
    }
    // dtypes are numpy's (and ml_dtypes') interned objects: the key keeps a reference (stored_call)
    words.push_back(reinterpret_cast<intptr_t>(attribute_of(aval.ptr(), rt.s_dtype).ptr()));
    words.push_back(attribute_of(aval.ptr(), rt.s_weak_type).ptr() == Py_True);
  }
  return true;
}

// What a strict hit of a stored op that has met several sets of shapes calls: the executable for these
// inputs' avals, kept natively once StoredOp has picked (loaded or compiled) it; the StoredOp itself for
// a set not met here yet (it picks and runs; `call_for` then hands over the executable's C++ call).
constexpr size_t kAvalsKept = 16;

// `words` is left holding the inputs' key where the call is one to keep (keep_stored_call), empty otherwise
// (inline: a hit allocates nothing for it).
using AvalsKey = c10::SmallVector<intptr_t, 32>;

PyObject* stored_call(const Entry& entry, const c10::SmallVector<PyObject*, 8>& inputs, AvalsKey& words) {
  if (!avals_key(inputs, words)) {
    words.clear();
    return entry.stored;
  }
  for (const auto& [key, call] : entry.by_avals) {
    if (std::equal(key.begin(), key.end(), words.begin(), words.end())) {
      words.clear();
      return call;
    }
  }
  if (entry.by_avals.size() >= kAvalsKept) {
    words.clear();
  }
  return entry.stored;
}

// Keeps the executable StoredOp picked for these inputs under their key, `words` (stored_call's).
void keep_stored_call(const Entry& entry, const c10::SmallVector<PyObject*, 8>& inputs, const AvalsKey& words) {
  py::tuple arguments(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    arguments[i] = py::reinterpret_borrow<py::object>(inputs[i]);
  }
  py::object call = py::handle(entry.stored).attr(runtime().s_call_for)(arguments);
  for (PyObject* input : inputs) {  // the dtypes the key names stay alive with it
    if (!PyBool_Check(input) && !PyLong_CheckExact(input) && !PyFloat_CheckExact(input)) {
      attribute_of(attribute_of(input, runtime().s_aval).ptr(), runtime().s_dtype).release();
    }
  }
  entry.by_avals.emplace_back(std::vector<intptr_t>(words.begin(), words.end()), call.release().ptr());
}

// The strict hit: run the cached program; its results (the check code, when it makes one, handed
// to Python's pending checks).
py::object run_program(const Entry& entry, Signature& sig) {
  auto& rt = runtime();
  const Py_ssize_t n_lengths = PyTuple_GET_SIZE(entry.lengths);
  // borrowed: the slots, the signature and the entry hold them through the call (vectorcall: no tuple)
  c10::SmallVector<PyObject*, 8> inputs;
  for (const int slot : entry.passed) {
    inputs.push_back(sig.slots[slot].array.ptr());
  }
  py::object key;
  if (entry.random) {
    key = random_key(sig.device);
    inputs.push_back(key.ptr());
  }
  numbers_as_arrays(sig);
  for (const auto& value : sig.traced) {
    inputs.push_back(value.ptr());
  }
  for (Py_ssize_t i = 0; i < n_lengths; ++i) {
    inputs.push_back(PyTuple_GET_ITEM(entry.lengths, i));
  }
  AvalsKey keep_words;
  PyObject* target = entry.stored != nullptr && entry.jitted == entry.stored ? stored_call(entry, inputs, keep_words)
                                                                           : entry.jitted;
  PyObject* called = PyObject_Vectorcall(target, inputs.data(), inputs.size(), nullptr);
  if (called != nullptr && !keep_words.empty()) {
    py::object held = py::reinterpret_steal<py::object>(called);
    keep_stored_call(entry, inputs, keep_words);
    called = held.release().ptr();
  }
  if (called == nullptr && target == entry.jitted && entry.stored != nullptr &&
      PyErr_ExceptionMatches(PyExc_TypeError)) {
    // a stored executable refused arrays of other shapes unrun: load the one for theirs (as jit retraces)
    PyErr_Clear();
    py::tuple arguments(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      arguments[i] = py::reinterpret_borrow<py::object>(inputs[i]);
    }
    py::object current = py::handle(entry.stored).attr("reload")(arguments);
    Py_SETREF(entry.jitted, current.release().ptr());
    called = PyObject_Vectorcall(entry.jitted, inputs.data(), inputs.size(), nullptr);
  }
  if (called == nullptr) {
    // Program.reraise translates a device allocation failure into torch.OutOfMemoryError.
    py::error_already_set failure;
    py::tuple arguments(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      arguments[i] = py::reinterpret_borrow<py::object>(inputs[i]);
    }
    py::handle(entry.program).attr("reraise")(failure.value(), arguments);
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
    call_python(rt.checks_issued, {PyTuple_GET_ITEM(called, n_outputs), entry.checks});
  }
  return outputs;
}

// A value's wiring ref in the pending graph, as fusion.PendingGraph._ref makes it: an earlier op's
// result ("n", node, index), a traced Python number ("s", position, type), or an array input ("c",
// position), each array once however often it is passed. Held as its parts until it is compared with
// the last flushed graph's ref at the same place (`same_ref`), and made a tuple only where it differs.
struct GraphRef {
  PyObject* kind = nullptr;  // rt.s_ref_node, s_ref_scalar or s_ref_input (borrowed)
  Py_ssize_t first = 0;  // the node, or the input's position
  Py_ssize_t second = 0;  // a node's result index
  PyObject* type = nullptr;  // a number's type (borrowed)
};

// The ref of `value`, appending it to the graph's inputs (a number always, an array once).
GraphRef input_ref(PyObject* value, PyObject* inputs, PyObject* input_slots) {
  auto& rt = runtime();
  const Py_ssize_t position = PyList_GET_SIZE(inputs);
  if (PyBool_Check(value) || PyLong_Check(value) || PyFloat_Check(value) || PyComplex_Check(value)) {
    if (PyList_Append(inputs, value) != 0) {
      throw py::error_already_set();
    }
    return GraphRef{rt.s_ref_scalar, position, 0, reinterpret_cast<PyObject*>(Py_TYPE(value))};
  }
  py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(value));
  PyObject* slot = PyDict_GetItemWithError(input_slots, id.ptr());
  if (slot == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    py::object created = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(position));
    if (PyDict_SetItem(input_slots, id.ptr(), created.ptr()) != 0 || PyList_Append(inputs, value) != 0) {
      throw py::error_already_set();
    }
    return GraphRef{rt.s_ref_input, position, 0, nullptr};
  }
  return GraphRef{rt.s_ref_input, PyLong_AsSsize_t(slot), 0, nullptr};
}

// The ref as the tuple PendingGraph._ref makes.
py::object ref_tuple(const GraphRef& ref) {
  auto& rt = runtime();
  if (ref.kind == rt.s_ref_node) {
    return py::make_tuple(py::handle(ref.kind), ref.first, ref.second);
  }
  if (ref.kind == rt.s_ref_scalar) {
    return py::make_tuple(py::handle(ref.kind), ref.first, py::handle(ref.type));
  }
  return py::make_tuple(py::handle(ref.kind), ref.first);
}

// Whether `recorded` (a ref tuple of an earlier graph) equals the tuple `ref` would make.
bool same_ref(PyObject* recorded, const GraphRef& ref) {
  auto& rt = runtime();
  const Py_ssize_t size = ref.kind == rt.s_ref_input ? 2 : 3;
  if (!PyTuple_CheckExact(recorded) || PyTuple_GET_SIZE(recorded) != size) {
    return false;
  }
  PyObject* kind = PyTuple_GET_ITEM(recorded, 0);
  PyObject* first = PyTuple_GET_ITEM(recorded, 1);
  if (!PyUnicode_CheckExact(kind) || PyUnicode_Compare(kind, ref.kind) != 0 || !PyLong_CheckExact(first) ||
      PyLong_AsSsize_t(first) != ref.first) {
    PyErr_Clear();  // (an int too large for Py_ssize_t is not ours)
    return false;
  }
  if (ref.kind == rt.s_ref_input) {
    return true;
  }
  PyObject* second = PyTuple_GET_ITEM(recorded, 2);
  if (ref.kind == rt.s_ref_scalar) {
    return second == ref.type;
  }
  if (!PyLong_CheckExact(second) || PyLong_AsSsize_t(second) != ref.second) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// The last flush's node at `position` (fusion.Replay.nodes[position]) where it is this op wired as `refs`,
// else nullptr: a decode or training loop records the same graph again and again, and appending that
// node object again spares making its tuples and lets the flush compare the graphs by identity.
PyObject* replayed_node(PyObject* graph, Py_ssize_t position, PyObject* recorded,
                        const c10::SmallVectorImpl<GraphRef>& refs) {
  auto& rt = runtime();
  py::object replay = member_at(graph, rt.graph_slots.replay, "replay");
  if (replay.is_none()) {
    return nullptr;
  }
  py::object nodes = member_at(replay.ptr(), rt.graph_slots.replay_nodes, "nodes");
  if (!PyList_CheckExact(nodes.ptr()) || position >= PyList_GET_SIZE(nodes.ptr())) {
    return nullptr;
  }
  PyObject* node = PyList_GET_ITEM(nodes.ptr(), position);
  if (!PyTuple_CheckExact(node) || PyTuple_GET_SIZE(node) != 2 || PyTuple_GET_ITEM(node, 0) != recorded) {
    return nullptr;
  }
  PyObject* wiring = PyTuple_GET_ITEM(node, 1);
  if (!PyTuple_CheckExact(wiring) || PyTuple_GET_SIZE(wiring) != static_cast<Py_ssize_t>(refs.size())) {
    return nullptr;
  }
  for (size_t i = 0; i < refs.size(); ++i) {
    if (!same_ref(PyTuple_GET_ITEM(wiring, static_cast<Py_ssize_t>(i)), refs[i])) {
      return nullptr;
    }
  }
  return node;  // (borrowed: the replay's list holds it while the graph's lock is held)
}

// One result of a recorded op, made as fusion.Deferred's __init__ would, without running Python code.
py::object new_deferred(PyObject* graph, PyObject* node, Py_ssize_t index) {
  auto& rt = runtime();
  auto* type = reinterpret_cast<PyTypeObject*>(rt.deferred_type);
  py::object created = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!created) {
    throw py::error_already_set();
  }
  py::object position = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(index));
  if (!position) {
    throw py::error_already_set();
  }
  set_slot(created.ptr(), rt.at_graph, graph);
  set_slot(created.ptr(), rt.at_node, node);
  set_slot(created.ptr(), rt.at_index, position.ptr());
  set_slot(created.ptr(), rt.at_value, Py_None);
  set_slot(created.ptr(), rt.at_failure, Py_None);
  return created;
}

// The pending graph of pjrt:device, as fusion.graph(device) gives it (which makes it on first use).
py::object graph_of(c10::DeviceIndex device) {
  auto& rt = runtime();
  py::object index = py::reinterpret_steal<py::object>(PyLong_FromLong(device));
  PyObject* found = PyDict_GetItemWithError(rt.graphs, index.ptr());
  if (found != nullptr) {
    return py::reinterpret_borrow<py::object>(found);
  }
  if (PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return call_python(attribute_of(rt.fusion, rt.s_graph).ptr(), {index.ptr()});
}

// The graph's lock is held from here to the end of the scope (it is an RLock: a flush this thread
// starts while holding it re-enters).
struct GraphLock {
  PyObject* lock;
  bool held = false;
  explicit GraphLock(PyObject* graph) : lock(member_at(graph, runtime().graph_slots.lock, "lock").release().ptr()) {
    PyObject* got = PyObject_CallMethodOneArg(lock, runtime().s_acquire, Py_False);
    if (got == nullptr) {
      Py_DECREF(lock);
      throw py::error_already_set();
    }
    held = got == Py_True;
    Py_DECREF(got);
  }
  ~GraphLock() {
    if (held) {
      PyObject* done = PyObject_CallMethodNoArgs(lock, runtime().s_release);
      if (done == nullptr) {
        PyErr_WriteUnraisable(lock);
      }
      Py_XDECREF(done);
    }
    Py_DECREF(lock);
  }
};

// The fused hit: the call appended to Python's pending graph as PendingGraph.record appends it (the
// same lists, the same refs), its results unresolved Deferreds. Empty (nothing recorded) when another
// thread holds the graph or an input is a fused result that failed: Python's path handles those.
py::object record_call(const Entry& entry, Signature& sig) {
  auto& rt = runtime();
  py::object device_graph = graph_of(sig.device);
  PyObject* graph = device_graph.ptr();
  py::object results;
  bool full = false;  // the size cap reached: flushed once the lock is let go, as PendingGraph.record does
  {
    GraphLock lock(graph);
    if (!lock.held) {
      return results;
    }
    // the inputs in dispatch._inputs' order, fused results of this graph as refs to their node
    c10::SmallVector<py::object, 8> values;
    c10::SmallVector<GraphRef, 8> refs;  // (a kind of nullptr until the value's input ref is made)
    for (const int slot : entry.passed) {
      py::object value = sig.slots[slot].array;
      GraphRef ref;
      if (Py_TYPE(value.ptr()) == reinterpret_cast<PyTypeObject*>(rt.deferred_type)) {
        if (!slot_or_none(value.ptr(), rt.at_failure).is_none()) {
          return results;
        }
        py::object resolved = slot_or_none(value.ptr(), rt.at_value);
        if (!resolved.is_none()) {
          value = std::move(resolved);  // its graph ran since the call was described
        } else if (slot_at(value.ptr(), rt.at_graph) != graph) {
          return results;
        } else {
          ref = GraphRef{rt.s_ref_node, PyLong_AsSsize_t(slot_at(value.ptr(), rt.at_node)),
                         PyLong_AsSsize_t(slot_at(value.ptr(), rt.at_index)), nullptr};
        }
      }
      refs.push_back(ref);
      values.push_back(std::move(value));
    }
    if (entry.random) {
      values.push_back(random_key(sig.device));
    }
    for (const auto& value : sig.traced) {
      values.push_back(value);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entry.lengths); ++i) {
      values.push_back(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry.lengths, i)));
    }
    refs.resize(values.size());
    py::object inputs = member_at(graph, rt.graph_slots.inputs, "inputs");
    py::object input_slots = member_at(graph, rt.graph_slots.input_slots, "input_slots");
    for (size_t i = 0; i < values.size(); ++i) {
      if (refs[i].kind == nullptr) {
        refs[i] = input_ref(values[i].ptr(), inputs.ptr(), input_slots.ptr());
      }
    }
    py::object nodes = member_at(graph, rt.graph_slots.nodes, "nodes");
    const Py_ssize_t position = PyList_GET_SIZE(nodes.ptr());
    py::object node = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(position));
    py::object recorded = py::reinterpret_borrow<py::object>(replayed_node(graph, position, entry.recorded, refs));
    if (!recorded) {
      py::tuple wiring(refs.size());
      for (size_t i = 0; i < refs.size(); ++i) {
        wiring[i] = ref_tuple(refs[i]);
      }
      recorded = py::make_tuple(py::handle(entry.recorded), wiring);
    }
    if (PyList_Append(nodes.ptr(), recorded.ptr()) != 0) {
      throw py::error_already_set();
    }
    if (entry.checks != nullptr) {
      py::object line = call_python(rt.check_caller, {});
      if (PyList_Append(member_at(graph, rt.graph_slots.check_lines, "check_lines").ptr(), line.ptr()) != 0) {
        throw py::error_already_set();
      }
    }
    const size_t n_outputs = entry.fresh + entry.mutated.size();
    py::object outputs = member_at(graph, rt.graph_slots.outputs, "outputs");
    results = py::reinterpret_steal<py::object>(PyTuple_New(static_cast<Py_ssize_t>(n_outputs)));
    for (size_t i = 0; i < n_outputs; ++i) {
      py::object deferred = new_deferred(graph, node.ptr(), static_cast<Py_ssize_t>(i));
      py::object weak = py::reinterpret_steal<py::object>(PyWeakref_NewRef(deferred.ptr(), nullptr));
      if (!weak || PyList_Append(outputs.ptr(), weak.ptr()) != 0) {
        throw py::error_already_set();
      }
      PyTuple_SET_ITEM(results.ptr(), static_cast<Py_ssize_t>(i), deferred.release().ptr());
    }
    const Py_ssize_t max_nodes = PyLong_AsSsize_t(fusion_setting(rt.s_max_nodes));
    if (max_nodes == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    full = PyList_GET_SIZE(nodes.ptr()) >= max_nodes;
  }
  if (full) {
    call_python(attribute_of(graph, rt.s_flush).ptr(), {rt.s_size_cap});
  }
  return results;
}

// After a hit (run or recorded): point mutated storages at their new arrays, wrap the fresh
// results as tensors, and leave the op's returns on the stack.
void finish_hit(const OpState& op, const Entry& entry, Signature& sig, PyObject* outputs, torch::jit::Stack* stack,
                size_t n_arguments) {
  auto& rt = runtime();
  ++rt.ops_executed;
  ++rt.cache_hits;
  bump(rt.op_counts, op.name_object);
  if (PyTuple_GET_SIZE(entry.lengths) > 0) {
    ++rt.dynamic_padded_ops;
  }
  py::object index = py::reinterpret_steal<py::object>(PyLong_FromLong(sig.device));
  if (PyDict_SetItem(rt.last_output, index.ptr(), outputs) != 0) {
    throw py::error_already_set();
  }
  for (size_t j = 0; j < entry.mutated.size(); ++j) {
    const Slot& slot = sig.slots[entry.mutated[j]];
    PyObject* array = PyTuple_GET_ITEM(outputs, entry.fresh + j);
    py::object holder = entry.mutated_padded[j] ? padded_holder(slot.layout.ptr(), array)
                                                : py::reinterpret_borrow<py::object>(array);
    set_slot(slot.device_storage.ptr(), rt.storage_slots.array, holder.ptr());
  }
  c10::SmallVector<c10::IValue, 4> results;
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
        results.emplace_back(wrap_output(ret.specs[0], PyTuple_GET_ITEM(outputs, next++), sig.device));
        break;
      case Return::List: {
        c10::List<at::Tensor> list;
        list.reserve(ret.specs.size());
        for (const OutSpec& spec : ret.specs) {
          list.push_back(wrap_output(spec, PyTuple_GET_ITEM(outputs, next++), sig.device));
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
  const auto scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  const auto numel = fields[3].cast<int64_t>();
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(scalar_type));
  std::vector<std::pair<PyObject*, PyObject*>> lengths;
  if (layout != nullptr) {
    py::tuple shape = py::reinterpret_borrow<py::object>(layout).attr("shape");
    py::tuple bounds = py::reinterpret_borrow<py::object>(layout).attr("bounds");
    for (size_t i = 0; i < shape.size() && i < bounds.size(); ++i) {
      if (!bounds[i].is_none() && shape[i].cast<int64_t>() >= 2) {
        lengths.emplace_back(py::object(shape[i]).release().ptr(), py::object(bounds[i]).release().ptr());
      }
    }
  }
  return OutSpec{scalar_type,
                 fields[1].cast<std::vector<int64_t>>(),
                 fields[2].cast<std::vector<int64_t>>(),
                 numel,
                 dtype,
                 layout,
                 nbytes,
                 PyLong_FromLongLong(numel),
                 PyLong_FromLongLong(nbytes),
                 std::move(lengths)};
}

// install = (jitted (None until the program has compiled), program, passed_slots, random, returns, mutated_slots, n_fresh_outputs, lengths,
// mutated_padded, checks or None, Python's Entry, compiled, StoredOp or None), each return (kind, alias, specs) with spec (dtype, sizes, strides, numel[, layout]).
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
  entry->recorded = py::object(fields[10]).release().ptr();
  entry->compiled = fields[11].cast<bool>();
  entry->stored = fields[12].is_none() ? nullptr : py::object(fields[12]).release().ptr();
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

// A call's arguments as Python sees them: the positional ones, and the keyword-only ones by name.
std::pair<py::tuple, py::dict> python_arguments(const OpState& op, c10::ArrayRef<c10::IValue> arguments) {
  py::list positional;
  py::dict keywords;
  for (size_t i = 0; i < arguments.size(); ++i) {
    py::object value = to_python(arguments[i], op.converts[i]);
    if (op.kwarg_only[i]) {
      keywords[op.arg_names[i]] = value;
    } else {
      positional.append(value);
    }
  }
  return {py::tuple(positional), std::move(keywords)};
}

// Replaces a call's arguments on the stack by a Python kernel's result.
void push_python_result(const OpState& op, const c10::FunctionSchema& schema, py::handle result,
                        torch::jit::Stack* stack) {
  torch::jit::drop(*stack, schema.arguments().size());
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

// The miss: Python's execute runs the op; what it built is installed under the call's key.
void run_miss(OpState& op, const c10::OperatorHandle& handle, torch::jit::Stack* stack, Signature* keyed) {
  const auto& schema = handle.schema();
  auto [positional, keywords] = python_arguments(op, torch::jit::last(*stack, schema.arguments().size()));
  PyObject* called =
      PyObject_CallFunctionObjArgs(runtime().miss, op.plan, positional.ptr(), keywords.ptr(), nullptr);
  if (called == nullptr) {
    throw py::error_already_set();
  }
  py::tuple answer = py::reinterpret_steal<py::tuple>(called);
  if (keyed != nullptr && !answer[1].is_none() && op.cache.find(keyed->key) == op.cache.end()) {
    op.cache.emplace(std::move(keyed->key), read_entry(answer[1]));
  }
  push_python_result(op, schema, answer[0], stack);
}

struct Kernel final : public c10::OperatorKernel {
  explicit Kernel(OpState* state) : state_(state) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    OpState& op = *state_;
    const size_t n = op.kinds.size();
    Signature sig;
    const Path path = fast_path();
    sig.fusing = path == Path::Fused;
    const auto arguments = torch::jit::last(*stack, n);
    if (path != Path::Python && !sizes_are_live(op, arguments) && describe(op, arguments, sig)) {
      auto found = op.cache.find(sig.key);
      if (found == op.cache.end()) {
        sig.traced.clear();
        sig.numbers.clear();
        sig.slots.clear();
        run_miss(op, handle, stack, &sig);
        return;
      }
      Entry& entry = *found->second;
      py::object outputs;
      if (sig.fusing) {
        outputs = record_call(entry, sig);
      } else if (program_compiled(entry)) {
        outputs = run_program(entry, sig);
      }
      if (outputs) {
        finish_hit(op, entry, sig, outputs.ptr(), stack, n);
        return;
      }
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

// The PrivateUse1 IMPL library of one of our own op namespaces (aten's is `library()`).
torch::Library& library_of(const std::string& space) {
  static std::unordered_map<std::string, torch::Library*> libraries;
  auto& found = libraries[space];
  if (found == nullptr) {
    found = new torch::Library(torch::Library::IMPL, space, c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  }
  return *found;
}

// How a call of `schema` reaches Python: each argument's conversion, keyword-only flag and name; which
// returns are tensors.
void read_schema(const c10::FunctionSchema& schema, OpState& state) {
  for (const auto& argument : schema.arguments()) {
    state.converts.push_back(convert_of(argument));
    state.kwarg_only.push_back(argument.kwarg_only());
    state.arg_names.push_back(py::str(argument.name()).inc_ref().ptr());
  }
  for (const auto& ret : schema.returns()) {
    state.return_is_tensor.push_back(ret.type()->kind() == c10::TypeKind::TensorType);
  }
}

// Registers the native kernel of aten::name.overload (or of space::op.overload when `name` is qualified), whose
// Python plan (eager/dispatch.OpPlan) runs misses.
void register_kernel(const std::string& name, const std::string& overload, py::object plan,
                     std::vector<int> kinds, bool static_scalars, bool allow_cpu, std::vector<size_t> length_args) {
  const auto separator = name.find("::");
  const std::string qualified = separator == std::string::npos ? "aten::" + name : name;
  const std::string op_name = separator == std::string::npos ? name : name.substr(separator + 2);
  auto& target = separator == std::string::npos ? library() : library_of(name.substr(0, separator));
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), overload.c_str());
  const auto& arguments = handle.schema().arguments();
  TORCH_CHECK(kinds.size() == arguments.size(), "torch_pjrt native dispatch: ", name, ".", overload,
              " has ", arguments.size(), " arguments, its plan ", kinds.size());
  auto* state = new OpState();
  state->plan = plan.inc_ref().ptr();
  state->name_object = py::object(plan.attr("name")).release().ptr();
  for (size_t i = 0; i < arguments.size(); ++i) {
    state->kinds.push_back(static_cast<Kind>(kinds[i]));
  }
  read_schema(handle.schema(), *state);
  state->static_scalars = static_scalars;
  state->allow_cpu = allow_cpu;
  state->length_args = std::move(length_args);
  target.impl(
      overload.empty() ? op_name.c_str() : (op_name + "." + overload).c_str(),
      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(state)));
}

void register_metadata_kernel(const std::string& name, const std::string& overload) {
  library().impl(
      overload.empty() ? name.c_str() : (name + "." + overload).c_str(),
      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<MetadataKernel>()));
}

// --- torch.empty ------------------------------------------------------------------------------------
// aten::empty.memory_format makes an uninitialised storage and runs no program; Hugging Face's generate()
// makes one every token. Its Python kernel (eager/kernels.py empty_memory_format) is the semantics: this
// kernel repeats what that kernel did for calls of the kind it has answered, a contiguous tensor of a dtype
// it accepted (its result's dtype) on a pjrt device, of fewer bytes than the device's allocations that
// skip the free-memory check (client.unchecked_bytes, read once per device). Every other call (another
// memory format, a layout or pinned memory asked for, a negative size, bytes past int64, a dtype not met
// yet, the native dispatch off or in a forked child) runs the Python kernel.

struct EmptyState {
  OpState python;  // how a call reaches the Python kernel (its `plan` is that kernel)
  PyObject* unchecked_bytes = nullptr;  // client.unchecked_bytes(index) -> int
  std::vector<int64_t> limits;  // per device index: client.unchecked_bytes, -1 until read
  std::vector<PyObject*> dtypes;  // per ScalarType: its torch.dtype once the Python kernel made one, or nullptr
};

// The bytes below which pjrt:index allocates without asking for its free memory.
int64_t unchecked_limit(EmptyState& state, c10::DeviceIndex index) {
  if (static_cast<size_t>(index) >= state.limits.size()) {
    state.limits.resize(index + 1, -1);
  }
  if (state.limits[index] < 0) {
    py::object device = py::reinterpret_steal<py::object>(PyLong_FromLong(index));
    state.limits[index] = call_python(state.unchecked_bytes, {device.ptr()}).cast<int64_t>();
  }
  return state.limits[index];
}

// The tensor of a call the Python kernel has answered before, or an undefined tensor: Python answers it.
at::Tensor known_empty(EmptyState& state, c10::ArrayRef<c10::IValue> arguments) {
  const c10::IValue& size = arguments[0];
  const c10::IValue& dtype = arguments[1];
  const c10::IValue& layout = arguments[2];
  const c10::IValue& device = arguments[3];
  const c10::IValue& pin_memory = arguments[4];
  const c10::IValue& memory_format = arguments[5];
  if (!size.isIntList() || !layout.isNone() || !(pin_memory.isNone() || (pin_memory.isBool() && !pin_memory.toBool())) ||
      !(memory_format.isNone() ||
        static_cast<c10::MemoryFormat>(memory_format.toInt()) == c10::MemoryFormat::Contiguous)) {
    return {};
  }
  const c10::ScalarType scalar_type =
      dtype.isNone() ? c10::get_default_dtype_as_scalartype() : static_cast<c10::ScalarType>(dtype.toInt());
  const auto type_index = static_cast<size_t>(scalar_type);
  if (type_index >= state.dtypes.size() || state.dtypes[type_index] == nullptr) {
    return {};
  }
  c10::DeviceIndex index = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  if (!device.isNone()) {
    const c10::Device named = device.toDevice();
    if (named.type() != c10::DeviceType::PrivateUse1) {
      return {};
    }
    if (named.has_index()) {
      index = named.index();
    }
  }
  const auto sizes = size.toIntVector();
  std::vector<int64_t> strides(sizes.size());
  int64_t numel = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] < 0) {
      return {};
    }
    strides[i] = numel;
    if (c10::mul_overflows(numel, std::max<int64_t>(sizes[i], 1), &numel)) {
      return {};
    }
  }
  int64_t nbytes = 0;
  if (c10::mul_overflows(numel, static_cast<int64_t>(c10::elementSize(scalar_type)), &nbytes)) {
    return {};
  }
  if (std::find(sizes.begin(), sizes.end(), 0) != sizes.end()) {
    numel = 0;  // (strides count a zero size as one, the storage holds nothing)
    nbytes = 0;
  }
  if (nbytes >= unchecked_limit(state, index)) {
    return {};
  }
  auto& rt = runtime();
  py::object numel_object = py::reinterpret_steal<py::object>(PyLong_FromLongLong(numel));
  py::object nbytes_object = py::reinterpret_steal<py::object>(PyLong_FromLongLong(nbytes));
  py::object device_storage = new_device_storage(rt.storage_type, rt.storage_slots, Py_None, state.dtypes[type_index],
                                                 numel_object.ptr(), device_object(index), nbytes_object.ptr());
  return linked_tensor(index, scalar_type, sizes, strides, nbytes, device_storage.ptr());
}

struct EmptyKernel final : public c10::OperatorKernel {
  explicit EmptyKernel(EmptyState* state) : state_(state) {}

  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    auto& rt = runtime();
    const auto& schema = handle.schema();
    const auto arguments = torch::jit::last(*stack, schema.arguments().size());
    if (rt.enabled && !rt.forked) {
      at::Tensor made = known_empty(*state_, arguments);
      if (made.defined()) {
        torch::jit::drop(*stack, arguments.size());
        stack->push_back(std::move(made));
        return;
      }
    }
    auto [positional, keywords] = python_arguments(state_->python, arguments);
    PyObject* called = PyObject_Call(state_->python.plan, positional.ptr(), keywords.ptr());
    if (called == nullptr) {
      throw py::error_already_set();
    }
    py::object result = py::reinterpret_steal<py::object>(called);
    push_python_result(state_->python, schema, result, stack);
    const auto type_index = static_cast<size_t>(stack->back().toTensor().scalar_type());
    if (type_index >= state_->dtypes.size()) {
      state_->dtypes.resize(type_index + 1, nullptr);
    }
    state_->dtypes[type_index] = reinterpret_cast<PyObject*>(torch::getTHPDtype(stack->back().toTensor().scalar_type()));
  }

 private:
  EmptyState* state_;  // never freed: it holds Python objects
};

// Registers aten::empty.memory_format's native kernel in front of its Python kernel `kernel`.
void register_empty(py::object kernel, py::object unchecked_bytes) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("aten::empty", "memory_format");
  auto* state = new EmptyState();
  state->python.plan = kernel.inc_ref().ptr();
  read_schema(handle.schema(), state->python);
  state->unchecked_bytes = unchecked_bytes.inc_ref().ptr();
  library().impl("empty.memory_format", torch::CppFunction::makeFromBoxedFunctor(std::make_unique<EmptyKernel>(state)));
}

PyObject* interned(const char* text) {
  return PyUnicode_InternFromString(text);
}

void configure(py::object miss, py::object storage_type, py::object array_type,
               py::object op_counts, py::object last_output, py::object random_key,
               py::object padded_type, py::object checks_issued, py::object fusion,
               py::object deferred_type, py::object check_caller, py::object live_lengths, Py_ssize_t live_limit,
               py::object python_counts, py::object scalar_array) {
  auto& rt = runtime();
  rt.miss = miss.inc_ref().ptr();
  rt.storage_type = storage_type.inc_ref().ptr();
  rt.array_type = array_type.inc_ref().ptr();
  rt.op_counts = op_counts.inc_ref().ptr();
  rt.last_output = last_output.inc_ref().ptr();
  rt.random_key = random_key.inc_ref().ptr();
  rt.padded_type = padded_type.inc_ref().ptr();
  rt.checks_issued = checks_issued.inc_ref().ptr();
  rt.fusion = fusion.inc_ref().ptr();
  rt.fusion_globals = py::object(fusion.attr("__dict__")).release().ptr();
  rt.graphs = fusion.attr("graphs")().release().ptr();
  rt.deferred_type = deferred_type.inc_ref().ptr();
  rt.check_caller = check_caller.inc_ref().ptr();
  rt.live_lengths = live_lengths.inc_ref().ptr();
  rt.live_limit = live_limit;
  rt.python_counts = python_counts.inc_ref().ptr();
  rt.scalar_array = scalar_array.inc_ref().ptr();
  rt.storage_slots = DeviceStorageSlots(rt.storage_type);
  rt.at_graph = slot_offset(rt.deferred_type, "graph");
  rt.at_node = slot_offset(rt.deferred_type, "node");
  rt.at_index = slot_offset(rt.deferred_type, "index");
  rt.at_value = slot_offset(rt.deferred_type, "value");
  rt.at_failure = slot_offset(rt.deferred_type, "failure");
  rt.graph_slots = graph_slots_of(fusion);
  rt.s_array = interned("array");
  rt.s_shape = interned("shape");
  rt.s_padded = interned("padded");
  rt.s_bounds = interned("bounds");
  rt.s_holding = interned("holding");
  rt.s_compiled = interned("compiled");
  rt.s_jitted = interned("jitted");
  rt.s_aval = interned("aval");
  rt.s_dtype = interned("dtype");
  rt.s_weak_type = interned("weak_type");
  rt.s_call_for = interned("call_for");
  rt.s_acquire = interned("acquire");
  rt.s_release = interned("release");
  rt.s_graph = interned("graph");
  rt.s_max_nodes = interned("MAX_NODES");
  rt.s_debug_recompile = interned("DEBUG_RECOMPILE");
  rt.s_flush = interned("flush");
  rt.s_size_cap = interned("size cap");
  rt.s_ref_node = interned("n");
  rt.s_ref_scalar = interned("s");
  rt.s_ref_input = interned("c");
  static const int at_fork = pthread_atfork(nullptr, nullptr, [] { runtime().forked = true; });
  (void)at_fork;
  rt.enabled = true;
}


// --- scaled_dot_product_attention as one op --------------------------------------------------------
// PyTorch's scaled_dot_product_attention (a composite) asks the device's `_fused_sdp_choice` stub which
// route to take. For pjrt tensors it answers "overrideable" where ops/nn/attention.py's one-op attention
// applies (no dropout, 4-D inputs, key and value heads equal to the query's or, with enable_gqa, a divisor
// of them), and "math" elsewhere, as without this stub: in fake tensors (torch.compile's tracing) and under
// a Python dispatch mode too, so graphs and modes see what they saw before, and where the user turned the
// overrideable route off (`torch.nn.attention.sdpa_kernel([SDPBackend.MATH])`). A causal call (a prompt's
// prefill) takes the one op as well: its mask is aligned at the top left, as the math route's, so padded
// queries and keys (a marked prompt length held at its bucket) leave the true rows' mask as it is.
// The overrideable op and its backward run torch_pjrt::fused_attention(_backward), lowered ops with
// native kernels, and hand back the outputs a flash kernel's schema has but the math route does not need
// as undefined tensors.

struct FusedAttentionOps {
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool,
      std::optional<double>)>
      forward;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      std::array<bool, 4>, bool, std::optional<double>)>
      backward;
};

FusedAttentionOps* fused_attention_ops = nullptr;

int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  const auto math = static_cast<int64_t>(at::SDPBackend::math);
  if (!at::globalContext().userEnabledOverrideableSDP() || dropout_p != 0.0 || query.dim() != 4 ||
      key.dim() != 4 || value.dim() != 4 ||
      query.key_set().has(c10::DispatchKey::Python) || c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return math;
  }
  const int64_t heads = query.size(1);
  const int64_t key_heads = key.size(1);
  if (key_heads != value.size(1) || (heads != key_heads && !(enable_gqa && key_heads > 0 && heads % key_heads == 0))) {
    return math;
  }
  return static_cast<int64_t>(at::SDPBackend::overrideable);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor, at::Tensor, at::Tensor>
overrideable_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                       bool return_debug_mask, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0 && !return_debug_mask, "torch_pjrt: _scaled_dot_product_fused_attention_overrideable "
              "runs without dropout or a debug mask only; call scaled_dot_product_attention, which picks it.");
  auto [output, logsumexp] = fused_attention_ops->forward.call(query, key, value, attn_bias, is_causal, scale);
  return {output, logsumexp, at::Tensor(), at::Tensor(), query.sym_size(2), key.sym_size(2),
          at::Tensor(), at::Tensor(), at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> overrideable_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask, const at::Tensor& out,
    const at::Tensor& logsumexp, const at::Tensor& cum_seq_q, const at::Tensor& cum_seq_k, c10::SymInt max_q,
    c10::SymInt max_k, double dropout_p, bool is_causal, const at::Tensor& philox_seed,
    const at::Tensor& philox_offset, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "torch_pjrt: _scaled_dot_product_fused_attention_overrideable_backward runs "
              "without dropout only; call scaled_dot_product_attention, which picks it.");
  const std::optional<at::Tensor> bias = attn_bias.defined() ? std::optional<at::Tensor>(attn_bias) : std::nullopt;
  return fused_attention_ops->backward.call(grad_out, query, key, value, bias, grad_input_mask, is_causal, scale);
}

// Installs the stub's answer and the two kernels (once the torch_pjrt ops are defined and registered).
void install_fused_attention() {
  if (fused_attention_ops != nullptr) {
    return;
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  fused_attention_ops = new FusedAttentionOps{
      dispatcher.findSchemaOrThrow("torch_pjrt::fused_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&, bool, std::optional<double>)>(),
      dispatcher.findSchemaOrThrow("torch_pjrt::fused_attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, std::array<bool, 4>, bool, std::optional<double>)>()};
  library().impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(overrideable_attention));
  library().impl("_scaled_dot_product_fused_attention_overrideable_backward",
                 TORCH_FN(overrideable_attention_backward));
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&sdp_choice);
}

}  // namespace

// The counters the hit path keeps, by their names in metrics.
constexpr std::pair<const char*, int64_t Runtime::*> kNativeCounters[] = {
    {"ops_executed", &Runtime::ops_executed},
    {"cache_hits", &Runtime::cache_hits},
    {"dynamic_padded_ops", &Runtime::dynamic_padded_ops},
};

py::dict native_counts() {
  const auto& rt = runtime();
  py::dict counts;
  for (const auto& [name, counter] : kNativeCounters) {
    counts[name] = rt.*counter;
  }
  return counts;
}

int64_t native_count(const std::string& name) {
  const auto& rt = runtime();
  for (const auto& [counter_name, counter] : kNativeCounters) {
    if (name == counter_name) {
      return rt.*counter;
    }
  }
  return 0;
}

void reset_native_counts() {
  auto& rt = runtime();
  for (const auto& [name, counter] : kNativeCounters) {
    rt.*counter = 0;
  }
}

void set_eager_mode_flags(bool blocking, bool fusing) {
  auto& rt = runtime();
  rt.blocking = blocking;
  rt.fusing = fusing;
}

void init_dispatch(py::module& m) {
  m.def("native_counts", &native_counts, "The counters the hit path bumps (metrics adds them to its own).");
  m.def("native_count", &native_count, py::arg("name"), "One of native_counts (0 for a name it does not keep).");
  m.def("reset_native_counts", &reset_native_counts, "Zero the hit path's counters (metrics.reset).");
  m.def("set_eager_mode_flags", &set_eager_mode_flags, py::arg("blocking"), py::arg("fusing"),
        "The eager mode's flags, which every native call reads (eager.modes hands them over at each change).");
  m.def("configure_dispatch", &configure, py::arg("miss"), py::arg("storage_type"), py::arg("array_type"),
        py::arg("op_counts"), py::arg("last_output"), py::arg("random_key"),
        py::arg("padded_type"), py::arg("checks_issued"), py::arg("fusion"), py::arg("deferred_type"),
        py::arg("check_caller"), py::arg("live_lengths"), py::arg("live_limit"), py::arg("python_counts"),
        py::arg("scalar_array"),
        "Hand the native dispatch the Python objects it reads and calls, and turn it on.");
  m.def("register_kernel", &register_kernel, py::arg("name"), py::arg("overload"), py::arg("plan"),
        py::arg("kinds"), py::arg("static_scalars"), py::arg("allow_cpu"), py::arg("length_args"),
        "Register the native PrivateUse1 kernel of aten::name.overload (or of a qualified name's op).");
  m.def("register_metadata_kernel", &register_metadata_kernel, py::arg("name"), py::arg("overload"),
        "Register aten::name.overload (a view or metadata-only op) to run PyTorch's CPU kernel natively.");
  m.def("register_empty", &register_empty, py::arg("kernel"), py::arg("unchecked_bytes"),
        "Register aten::empty.memory_format's native kernel, which repeats what the Python `kernel` made for calls "
        "of the kind it answered (the allocations below unchecked_bytes(index) of a dtype it made).");
  m.def("set_dispatch_enabled", [](bool on) { runtime().enabled = on && runtime().miss != nullptr; },
        py::arg("on"), "Turn the native hit path on or off (off: every call goes to Python).");
  m.def("dispatch_enabled", []() { return runtime().enabled; });
  m.def("install_fused_attention", &install_fused_attention,
        "Run scaled_dot_product_attention on pjrt tensors as torch_pjrt::fused_attention where it applies.");
}

}  // namespace torch_pjrt
