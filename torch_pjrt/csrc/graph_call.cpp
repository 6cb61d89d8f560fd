// Native replay of a compiled graph's call (compile/backend.py: CompiledGraph, compile/native_call.py).
//
// Python builds everything once per input signature: the program, which storage slot each pjrt input
// reads, the CPU inputs' per-dtype batches, the storages the program writes, the outputs' layouts. It
// hands them over as a GraphPlan; a call with that signature then runs here: each input checked against
// the plan (tensor metadata, its storage's dtype and materialized array, which inputs share a storage),
// the CPU inputs copied into one fresh buffer per dtype, the written storages' arrays donated, the program called
// through its Program.call, and the outputs wrapped as pjrt tensors. A call the plan does not describe
// returns None and takes the Python path, which builds the plan of its own signature.
//
// This file is a module of its own, `torch_pjrt._graph_call`, in the same shared library as
// torch_pjrt._hooks (loaded from it by compile/native_call.py), so it shares the storages' links and the
// address allocator with the other parts through native.h.

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/tensor_numpy.h>
#include <torch/extension.h>
// after Python.h (through torch's headers): the __slots__ members' layout

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "native.h"

namespace torch_pjrt {
namespace {

// The kinds of compile/backend.py's signature entries a plan replays (same numbers as native_call.py's).
enum class InputKind : int { Device = 0, Host = 1, Static = 2 };
// How an output comes back (native_call.py's numbers): a program result, from the eager part, a constant.
enum class OutputKind : int { Device = 0, Eager = 1, Constant = 2 };

struct Input {
  InputKind kind;
  // a device input: its view of the storage in `slot`, and whether it is the slot's first reader
  int slot = 0;
  bool first = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  bool conj = false;
  bool neg = false;
  // a CPU input: where its elements go in its dtype's batch
  int group = 0;
  int64_t start = 0;
  // a static input's value (compared with ==, as the signature's dict key is)
  py::object value;
};

struct Slot {
  py::object storage_dtype;  // the DeviceStorage's dtype (a torch.dtype, compared by identity)
  py::object array_shape;  // the storage array's shape (a tuple): a program is traced per array shape
};

struct Group {
  c10::ScalarType dtype;
  int64_t numel;
};

struct Output {
  OutputKind kind;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  py::object dtype_object;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  py::object numel;  // the storage's elements and bytes, as the Python ints DeviceStorage holds
  py::object nbytes_object;
  int64_t nbytes = 0;
  py::object constant;
};

py::object attribute_name(const char* name) {
  return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(name));
}

c10::ScalarType scalar_type_of(py::handle dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "a graph plan's dtype must be a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

std::vector<int64_t> ints_of(py::handle sequence) {
  std::vector<int64_t> values;
  for (py::handle item : sequence) {
    values.push_back(item.cast<int64_t>());
  }
  return values;
}

// A call's inputs summarized (their kinds, dtypes, sizes, and a pjrt tensor's strides and offset), so a graph's
// plans are looked up by it: a call not replayed by the last plan tries only the plans of its key, not all of them.
// A plan's key is the same summary of its own description (signature_key), so every call it replays has it.
enum class KeyKind : uint64_t { Device = 1, Host = 2, Other = 3 };

uint64_t mixed(uint64_t key, uint64_t value) {
  return key ^ (value + 0x9e3779b97f4a7c15ULL + (key << 6) + (key >> 2));
}

uint64_t with_input(uint64_t key, KeyKind kind, c10::ScalarType dtype, c10::IntArrayRef sizes,
                    c10::IntArrayRef strides, int64_t offset) {
  key = mixed(key, static_cast<uint64_t>(kind));
  if (kind == KeyKind::Other) {
    return key;
  }
  key = mixed(key, static_cast<uint64_t>(dtype));
  key = mixed(key, sizes.size());
  for (const int64_t size : sizes) {
    key = mixed(key, static_cast<uint64_t>(size));
  }
  if (kind == KeyKind::Device) {
    for (const int64_t stride : strides) {
      key = mixed(key, static_cast<uint64_t>(stride));
    }
    key = mixed(key, static_cast<uint64_t>(offset));
  }
  return key;
}

uint64_t call_key(const py::tuple& args) {
  uint64_t key = static_cast<uint64_t>(PyTuple_GET_SIZE(args.ptr()));
  for (py::handle value : args) {
    if (!THPVariable_Check(value.ptr())) {
      key = with_input(key, KeyKind::Other, c10::ScalarType::Undefined, {}, {}, 0);
      continue;
    }
    const at::Tensor& tensor = THPVariable_Unpack(value.ptr());
    const c10::DeviceType type = tensor.device().type();
    const KeyKind kind = type == c10::DeviceType::PrivateUse1 ? KeyKind::Device
                         : type == c10::DeviceType::CPU      ? KeyKind::Host
                                                             : KeyKind::Other;
    key = with_input(key, kind, tensor.scalar_type(), tensor.sizes(), tensor.strides(),
                     kind == KeyKind::Device ? tensor.storage_offset() : 0);
  }
  return key;
}

// One signature's call, replayed.
class GraphPlan {
 public:
  // inputs: per graph input, (0, slot, first, dtype, sizes, strides, offset, conj, neg) for a pjrt tensor,
  // (1, group, start, dtype, sizes) for a CPU tensor, (2, value) for a static value; slots: per storage slot,
  // (storage dtype, array shape); groups: per CPU batch, (dtype, numel); written: the slots the program writes,
  // in its output order; outputs: (0, dtype, sizes, strides, numel), (1,) or (2, constant); call(flats,
  // donated, hosts, key, true) runs the program; next_key() gives a random graph's key (None: not random);
  // eager_part(*args) runs torch's own part (None: none); issue_checks(code) hands a check code on.
  GraphPlan(py::list inputs, py::list slots, py::list groups, std::vector<int> written, py::list outputs,
            int64_t device, py::object device_object, py::object array_type, py::object storage_type,
            py::object call, py::object next_key, py::object eager_part, py::object issue_checks)
      : written_(std::move(written)),
        device_(static_cast<c10::DeviceIndex>(device)),
        device_object_(std::move(device_object)),
        array_type_(std::move(array_type)),
        storage_type_(std::move(storage_type)),
        storage_slots_(storage_type_.ptr()),
        call_(std::move(call)),
        next_key_(std::move(next_key)),
        eager_part_(std::move(eager_part)),
        issue_checks_(std::move(issue_checks)),
        s_aval_(attribute_name("aval")),
        s_shape_(attribute_name("shape")),
        s_copy_(attribute_name("copy")),
        s_materialize_(attribute_name("materialize")) {
    for (py::handle item : inputs) {
      py::tuple entry = py::reinterpret_borrow<py::tuple>(item);
      Input input{static_cast<InputKind>(entry[0].cast<int>())};
      if (input.kind == InputKind::Device) {
        input.slot = entry[1].cast<int>();
        input.first = entry[2].cast<bool>();
        input.dtype = scalar_type_of(entry[3]);
        input.sizes = ints_of(entry[4]);
        input.strides = ints_of(entry[5]);
        input.offset = entry[6].cast<int64_t>();
        input.conj = entry[7].cast<bool>();
        input.neg = entry[8].cast<bool>();
      } else if (input.kind == InputKind::Host) {
        input.group = entry[1].cast<int>();
        input.start = entry[2].cast<int64_t>();
        input.dtype = scalar_type_of(entry[3]);
        input.sizes = ints_of(entry[4]);
      } else {
        TORCH_CHECK(input.kind == InputKind::Static, "unknown graph plan input kind");
        input.value = entry[1];
      }
      inputs_.push_back(std::move(input));
    }
    for (py::handle item : slots) {
      py::tuple entry = py::reinterpret_borrow<py::tuple>(item);
      slots_.push_back({entry[0], entry[1]});
    }
    for (py::handle item : groups) {
      py::tuple entry = py::reinterpret_borrow<py::tuple>(item);
      groups_.push_back({scalar_type_of(entry[0]), entry[1].cast<int64_t>()});
    }
    for (py::handle item : outputs) {
      py::tuple entry = py::reinterpret_borrow<py::tuple>(item);
      Output output{static_cast<OutputKind>(entry[0].cast<int>())};
      if (output.kind == OutputKind::Device) {
        output.dtype_object = entry[1];
        output.dtype = scalar_type_of(entry[1]);
        output.sizes = ints_of(entry[2]);
        output.strides = ints_of(entry[3]);
        output.numel = entry[4];
        output.nbytes = entry[4].cast<int64_t>() * static_cast<int64_t>(c10::elementSize(output.dtype));
        output.nbytes_object = py::int_(output.nbytes);
      } else if (output.kind == OutputKind::Constant) {
        output.constant = entry[1];
      } else {
        TORCH_CHECK(output.kind == OutputKind::Eager, "unknown graph plan output kind");
      }
      outputs_.push_back(std::move(output));
    }
  }

  // The graph's outputs, or None where the call is not this plan's signature (nothing was run then).
  py::object operator()(const py::tuple& args) {
    const size_t n_slots = slots_.size();
    std::vector<PyObject*> storages(n_slots, nullptr);  // borrowed: each input tensor's storage holds its own
    std::vector<py::object> arrays(n_slots);
    std::vector<at::Tensor> batches;
    if (static_cast<size_t>(PyTuple_GET_SIZE(args.ptr())) != inputs_.size() || !read_inputs(args, storages, arrays) ||
        !batch_host_inputs(args, batches)) {
      return py::none();
    }
    py::list flats(n_slots);
    for (size_t slot = 0; slot < n_slots; ++slot) {
      flats[slot] = arrays[slot];
    }
    // The arrays the program writes are donated where only their storage holds them (else a copy is): the
    // rule of compile/backend.py's _donated (change both); here the two references are the storage's and `flat`.
    py::list donated(written_.size());
    for (size_t i = 0; i < written_.size(); ++i) {
      const int slot = written_[i];
      flats[slot] = py::none();
      py::object flat = std::move(arrays[slot]);
      donated[i] = Py_REFCNT(flat.ptr()) == 2 ? flat : flat.attr(s_copy_)();
    }
    py::list hosts(batches.size());
    for (size_t i = 0; i < batches.size(); ++i) {
      hosts[i] = py::reinterpret_steal<py::object>(torch::utils::tensor_to_numpy(batches[i], false));
    }
    py::object key = next_key_.is_none() ? py::none() : next_key_();
    py::sequence result = call_(flats, donated, hosts, key, py::list());
    if (!result[3].is_none()) {
      issue_checks_(result[3]);
    }
    // After the inputs were read: torch's own part writes into CPU inputs the program read as they were.
    py::object computed = eager_part_.is_none() ? py::tuple() : eager_part_(*args);
    py::sequence written = result[1];
    for (size_t i = 0; i < written_.size(); ++i) {
      set_slot(storages[written_[i]], storage_slots_.array, written[i].ptr());
    }
    return outputs(result[0], computed);
  }

  int64_t hits() const { return hits_; }

  // call_key of every call this plan replays.
  uint64_t signature_key() const {
    uint64_t key = static_cast<uint64_t>(inputs_.size());
    for (const Input& input : inputs_) {
      const KeyKind kind = input.kind == InputKind::Device ? KeyKind::Device
                           : input.kind == InputKind::Host ? KeyKind::Host
                                                           : KeyKind::Other;
      key = with_input(key, kind, input.dtype, input.sizes, input.strides, input.offset);
    }
    return key;
  }

 private:
  // Checks every input against the plan; the storages and arrays of the pjrt inputs by slot.
  bool read_inputs(const py::tuple& args, std::vector<PyObject*>& storages, std::vector<py::object>& arrays) {
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const Input& input = inputs_[i];
      PyObject* value = PyTuple_GET_ITEM(args.ptr(), i);
      if (input.kind == InputKind::Static) {
        const int equal = PyObject_RichCompareBool(value, input.value.ptr(), Py_EQ);
        if (equal < 0) {
          PyErr_Clear();
        }
        if (equal != 1) {
          return false;
        }
        continue;
      }
      if (input.kind != InputKind::Device) {
        continue;  // CPU inputs are checked as they are batched
      }
      if (!THPVariable_Check(value)) {
        return false;
      }
      const at::Tensor& tensor = THPVariable_Unpack(value);
      const c10::Device device = tensor.device();
      if (device.type() != c10::DeviceType::PrivateUse1 || device.index() != device_ ||
          tensor.scalar_type() != input.dtype || tensor.sizes() != c10::IntArrayRef(input.sizes) ||
          tensor.strides() != c10::IntArrayRef(input.strides) || tensor.storage_offset() != input.offset ||
          tensor.is_conj() != input.conj || tensor.is_neg() != input.neg) {
        return false;
      }
      PyObject* storage = device_storage_of(tensor.storage().unsafeGetStorageImpl());
      if (storage == nullptr || !PyObject_TypeCheck(storage, reinterpret_cast<PyTypeObject*>(storage_type_.ptr()))) {
        return false;  // made by PyTorch's allocator, not linked yet: Python links it
      }
      if (!input.first) {
        if (storages[input.slot] != storage) {
          return false;
        }
        continue;
      }
      if (storages[input.slot] != nullptr) {
        return false;
      }
      const Slot& slot = slots_[input.slot];
      PyObject* held = slot_at(storage, storage_slots_.array);
      if (held == nullptr || slot_at(storage, storage_slots_.dtype) != slot.storage_dtype.ptr()) {
        return false;
      }
      py::object array = py::reinterpret_borrow<py::object>(held);
      if (Py_TYPE(array.ptr()) != reinterpret_cast<PyTypeObject*>(array_type_.ptr())) {
        // a pending fused result or an uninitialised storage: materialized, as the Python path does
        array = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(storage, s_materialize_.ptr()));
        if (!array) {
          throw py::error_already_set();
        }
        if (Py_TYPE(array.ptr()) != reinterpret_cast<PyTypeObject*>(array_type_.ptr())) {
          return false;
        }
      }
      // aval.shape: two native lookups, where jax's Array.shape is a Python property reading the same
      py::object aval = py::reinterpret_steal<py::object>(PyObject_GetAttr(array.ptr(), s_aval_.ptr()));
      if (!aval) {
        throw py::error_already_set();
      }
      py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(aval.ptr(), s_shape_.ptr()));
      if (!shape) {
        throw py::error_already_set();
      }
      const int same = PyObject_RichCompareBool(shape.ptr(), slot.array_shape.ptr(), Py_EQ);
      if (same != 1) {
        if (same < 0) {
          throw py::error_already_set();
        }
        return false;
      }
      storages[input.slot] = storage;
      arrays[input.slot] = std::move(array);
    }
    // Python gives each distinct storage its own slot: two slots over one storage are another signature.
    std::vector<PyObject*> distinct(storages);
    std::sort(distinct.begin(), distinct.end());
    return std::adjacent_find(distinct.begin(), distinct.end()) == distinct.end();
  }

  // The CPU inputs copied into one fresh buffer per dtype (a private copy: jax may read it later).
  bool batch_host_inputs(const py::tuple& args, std::vector<at::Tensor>& batches) {
    if (groups_.empty()) {
      return true;
    }
    for (const Group& group : groups_) {
      batches.push_back(at::empty({group.numel}, at::TensorOptions().dtype(group.dtype)));
    }
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const Input& input = inputs_[i];
      if (input.kind != InputKind::Host) {
        continue;
      }
      PyObject* value = PyTuple_GET_ITEM(args.ptr(), i);
      if (!THPVariable_Check(value)) {
        return false;
      }
      const at::Tensor& tensor = THPVariable_Unpack(value);
      if (!tensor.is_cpu() || tensor.scalar_type() != input.dtype || tensor.sizes() != c10::IntArrayRef(input.sizes)) {
        return false;
      }
      at::Tensor& batch = batches[input.group];
      const int64_t numel = tensor.numel();
      if (tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg()) {
        const size_t itemsize = batch.element_size();
        std::memcpy(static_cast<char*>(batch.data_ptr()) + input.start * itemsize, tensor.const_data_ptr(),
                    numel * itemsize);
      } else {
        batch.narrow(0, input.start, numel).view(input.sizes).copy_(tensor);
      }
    }
    return true;
  }

  py::list outputs(py::handle tensors, py::handle computed) {
    py::list results(outputs_.size());
    py::iterator produced = py::iter(tensors);
    py::iterator eager = py::iter(computed);
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const Output& output = outputs_[i];
      if (output.kind == OutputKind::Eager) {
        results[i] = *eager;
        ++eager;
      } else if (output.kind == OutputKind::Constant) {
        results[i] = output.constant;
      } else {
        py::object array = py::reinterpret_borrow<py::object>(*produced);
        ++produced;
        py::object storage = device_storage(array.ptr(), output);
        results[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(
            linked_tensor(device_, output.dtype, output.sizes, output.strides, output.nbytes, storage.ptr())));
      }
    }
    ++hits_;
    return results;
  }

  // An output's DeviceStorage, its members filled as its __init__ does.
  py::object device_storage(PyObject* array, const Output& output) const {
    return new_device_storage(storage_type_.ptr(), storage_slots_, array, output.dtype_object.ptr(), output.numel.ptr(),
                              device_object_.ptr(), output.nbytes_object.ptr());
  }

  std::vector<Input> inputs_;
  std::vector<Slot> slots_;
  std::vector<Group> groups_;
  std::vector<int> written_;
  std::vector<Output> outputs_;
  c10::DeviceIndex device_;
  py::object device_object_;
  py::object array_type_;
  py::object storage_type_;
  DeviceStorageSlots storage_slots_;
  py::object call_;
  py::object next_key_;
  py::object eager_part_;
  py::object issue_checks_;
  py::object s_aval_;
  py::object s_shape_;
  py::object s_copy_;
  py::object s_materialize_;
  int64_t hits_ = 0;
};

}  // namespace
}  // namespace torch_pjrt

PYBIND11_MODULE(_graph_call, m) {
  using torch_pjrt::GraphPlan;
  m.doc() = "Native replay of a compiled graph's call for one input signature (compile/native_call.py).";
  py::class_<GraphPlan>(m, "GraphPlan")
      .def(py::init<py::list, py::list, py::list, std::vector<int>, py::list, int64_t, py::object, py::object,
                    py::object, py::object, py::object, py::object, py::object>(),
           py::arg("inputs"), py::arg("slots"), py::arg("groups"), py::arg("written"), py::arg("outputs"),
           py::arg("device"), py::arg("device_object"), py::arg("array_type"), py::arg("storage_type"),
           py::arg("call"), py::arg("next_key"), py::arg("eager_part"), py::arg("issue_checks"))
      .def("__call__", &GraphPlan::operator(), py::arg("args"),
           "The graph's outputs for these inputs, or None where they are not this plan's signature.")
      .def_property_readonly("hits", &GraphPlan::hits, "Calls replayed natively.")
      .def_property_readonly("signature_key", &GraphPlan::signature_key,
                             "call_key of the calls this plan replays (its plans are looked up by it).");
  m.def("call_key", &torch_pjrt::call_key, py::arg("args"),
        "A summary of a call's inputs (kinds, dtypes, sizes, a pjrt tensor's strides and offset): a plan replays "
        "only calls of its signature_key.");
}
