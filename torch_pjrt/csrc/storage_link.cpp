// What a pjrt storage's DataPtr holds: its bytes, counted in the device's memory figures from when
// the storage is made until the DataPtr is freed, and the link to its Python DeviceStorage
// (storage.py: the device array and the storage's dtype, numel and device).
//
// The link lives in the DataPtr's context, so the native dispatch reaches a storage's array from
// its StorageImpl without a Python wrapper of the storage, and a new result needs none either.
// Python reads and sets it as `untyped_storage()._pjrt`, a descriptor this file adds to
// torch.UntypedStorage. The context owns a reference to the DeviceStorage, dropped (under the GIL)
// on whichever thread frees the storage.
//
// Resizing a storage in place (`untyped_storage().resize_(n)`, as FSDP2 frees and re-allocates its
// unsharded parameters) gives it a new DataPtr: the old bytes are uncounted, the new ones counted, the
// DeviceStorage moves over (storage.py updates its numel and array first), and the fake address stays
// while the storage fits the span reserved there, a new one is taken beyond it.

#include <torch/csrc/Storage.h>
#include <torch/extension.h>

#include <torch/csrc/Exceptions.h>
#include <structmember.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <tuple>

#include "native.h"

namespace torch_pjrt {
namespace {

// Per device, lock-free: every op's results are counted, on whichever thread.
struct DeviceBytes {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
};
DeviceBytes bytes_by_device[256];  // a DeviceIndex is 8 bits

DeviceBytes& bytes_of(c10::DeviceIndex index) {
  return bytes_by_device[static_cast<uint8_t>(index)];
}

struct StorageLink {
  c10::DeviceIndex index;
  int64_t nbytes;
  int64_t address;  // the storage's fake address, kept while it holds no bytes (its data pointer is then null)
  int64_t span;     // the bytes reserved at `address`: the storage may grow in place up to this
  PyObject* device_storage = nullptr;  // owned; nullptr until Python or the native dispatch sets it
};

bool interpreter_running() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

void release_link(void* context) {
  auto* link = static_cast<StorageLink*>(context);
  bytes_of(link->index).allocated.fetch_sub(link->nbytes, std::memory_order_relaxed);
  if (link->device_storage != nullptr && interpreter_running()) {
    const PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(link->device_storage);
    PyGILState_Release(state);
  }
  delete link;
}

StorageLink* link_of(const c10::StorageImpl* impl) {
  const c10::DataPtr& data = impl->data_ptr();
  return data.get_deleter() == &release_link ? static_cast<StorageLink*>(data.get_context()) : nullptr;
}

PyObject* get_device_storage(PyObject* self, void*) {
  c10::StorageImpl* impl = THPStorage_Unpack(self).unsafeGetStorageImpl();
  StorageLink* link = link_of(impl);
  if (link != nullptr && link->device_storage == nullptr) {
    // Made by PyTorch through the device's allocator: its bytes are uninitialised until written.
    try {
      py::object made = py::module_::import("torch_pjrt.storage").attr("uninitialised_bytes")(link->nbytes, link->index);
      link_device_storage(impl, made.ptr());
    } catch (py::error_already_set& error) {
      error.restore();
      return nullptr;
    }
  }
  PyObject* found = device_storage_of(impl);
  if (found == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "this storage has no pjrt device storage (torch_pjrt did not make it)");
    return nullptr;
  }
  Py_INCREF(found);
  return found;
}

int set_device_storage(PyObject* self, PyObject* value, void*) {
  if (!link_device_storage(THPStorage_Unpack(self).unsafeGetStorageImpl(), value)) {
    PyErr_SetString(PyExc_AttributeError,
                    "only a pjrt storage made by torch_pjrt holds a device storage; make the tensor on pjrt");
    return -1;
  }
  return 0;
}

PyGetSetDef device_storage_descriptor = {
    "_pjrt", get_device_storage, set_device_storage,
    "The storage's DeviceStorage (torch_pjrt/storage.py), held by its DataPtr.", nullptr};

// (allocated, peak, allocations) of pjrt:index.
std::tuple<int64_t, int64_t, int64_t> memory_counts(int64_t index) {
  const DeviceBytes& bytes = bytes_of(static_cast<c10::DeviceIndex>(index));
  return {bytes.allocated.load(), bytes.peak.load(), bytes.allocations.load()};
}

void reset_peak(int64_t index) {
  DeviceBytes& bytes = bytes_of(static_cast<c10::DeviceIndex>(index));
  bytes.peak.store(bytes.allocated.load());
}

// Counts nbytes on the device (until release_link) and returns a DataPtr at `data` holding the new link.
c10::DataPtr link_data_ptr(void* data, int64_t address, int64_t span, c10::Device device, int64_t nbytes) {
  DeviceBytes& bytes = bytes_of(device.index());
  const int64_t now = bytes.allocated.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t peak = bytes.peak.load(std::memory_order_relaxed);
  while (now > peak && !bytes.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  if (nbytes > 0) {
    bytes.allocations.fetch_add(1, std::memory_order_relaxed);
  }
  return c10::DataPtr(data, new StorageLink{device.index(), nbytes, address, span}, &release_link, device);
}

void* fake_pointer(int64_t address) {
  return reinterpret_cast<void*>(static_cast<intptr_t>(address));
}

}  // namespace

c10::DataPtr counted_data_ptr(int64_t address, c10::Device device, int64_t nbytes) {
  return link_data_ptr(fake_pointer(address), address, address_span(nbytes), device, nbytes);
}

void resize_storage(c10::StorageImpl* impl, size_t newsize) {
  StorageLink* link = link_of(impl);
  TORCH_CHECK(link != nullptr, "this pjrt storage was not made by torch_pjrt, so it cannot be resized.");
  TORCH_CHECK(newsize <= static_cast<size_t>(std::numeric_limits<int64_t>::max()),
              "cannot resize a pjrt storage to ", newsize, " bytes");
  const auto nbytes = static_cast<int64_t>(newsize);
  py::gil_scoped_acquire gil;  // held throughout: Python threads see the storage and its DeviceStorage change together
  if (link->device_storage != nullptr) {
    // The DeviceStorage follows first (it may raise: out of memory), so a failure changes nothing.
    try {
      py::module_::import("torch_pjrt.storage").attr("resize_device_storage")(py::handle(link->device_storage), nbytes);
    } catch (py::error_already_set& error) {
      error.restore();
      throw python_error();
    }
  }
  const bool in_place = nbytes <= link->span;
  const int64_t address = in_place ? link->address : new_address(nbytes);
  const int64_t span = in_place ? link->span : address_span(nbytes);
  // Null at 0 bytes, as a CUDA storage resized to 0.
  c10::DataPtr data = link_data_ptr(nbytes > 0 ? fake_pointer(address) : nullptr, address, span, impl->device(), nbytes);
  auto* fresh = static_cast<StorageLink*>(data.get_context());
  fresh->device_storage = link->device_storage;  // moves: the old link must not drop it when freed below
  link->device_storage = nullptr;
  impl->set_data_ptr_noswap(std::move(data));  // frees the old DataPtr: its bytes leave the figures
  impl->set_nbytes(newsize);
}

PyObject* device_storage_of(const c10::StorageImpl* impl) {
  StorageLink* link = link_of(impl);
  return link == nullptr ? nullptr : link->device_storage;
}

bool link_device_storage(c10::StorageImpl* impl, PyObject* device_storage) {
  StorageLink* link = link_of(impl);
  if (link == nullptr) {
    return false;
  }
  Py_XINCREF(device_storage);
  Py_XSETREF(link->device_storage, device_storage);
  return true;
}

at::Tensor linked_tensor(c10::DeviceIndex index, c10::ScalarType scalar_type, c10::IntArrayRef sizes,
                         c10::IntArrayRef strides, int64_t nbytes, PyObject* device_storage) {
  at::Tensor tensor = make_tensor(index, scalar_type, sizes, strides, new_address(nbytes), nbytes);
  link_device_storage(tensor.storage().unsafeGetStorageImpl(), device_storage);
  return tensor;
}

Py_ssize_t slot_offset(PyObject* type, const char* name) {
  py::object member = py::reinterpret_steal<py::object>(PyObject_GetAttrString(type, name));
  if (!member) {
    throw py::error_already_set();
  }
  TORCH_CHECK(Py_TYPE(member.ptr()) == &PyMemberDescr_Type, "torch_pjrt native code: ", name,
              " is not a __slots__ member of its class");
  return reinterpret_cast<PyMemberDescrObject*>(member.ptr())->d_member->offset;
}

DeviceStorageSlots::DeviceStorageSlots(PyObject* type)
    : array(slot_offset(type, "array")),
      dtype(slot_offset(type, "dtype")),
      numel(slot_offset(type, "numel")),
      device(slot_offset(type, "device")),
      nbytes(slot_offset(type, "nbytes")) {}

py::object new_device_storage(PyObject* type, const DeviceStorageSlots& slots, PyObject* array, PyObject* dtype,
                              PyObject* numel, PyObject* device, PyObject* nbytes) {
  auto* storage_type = reinterpret_cast<PyTypeObject*>(type);
  py::object created = py::reinterpret_steal<py::object>(storage_type->tp_alloc(storage_type, 0));
  if (!created) {
    throw py::error_already_set();
  }
  set_slot(created.ptr(), slots.array, array);
  set_slot(created.ptr(), slots.dtype, dtype);
  set_slot(created.ptr(), slots.numel, numel);
  set_slot(created.ptr(), slots.device, device);
  set_slot(created.ptr(), slots.nbytes, nbytes);
  return created;
}

void init_storage_link(py::module& m) {
  py::object storage_class = py::module_::import("torch").attr("UntypedStorage");
  auto* type = reinterpret_cast<PyTypeObject*>(storage_class.ptr());
  py::object descriptor = py::reinterpret_steal<py::object>(PyDescr_NewGetSet(type, &device_storage_descriptor));
  if (!descriptor || PyObject_SetAttrString(storage_class.ptr(), "_pjrt", descriptor.ptr()) != 0) {
    throw py::error_already_set();
  }
  m.def("memory_counts", &memory_counts, py::arg("index"),
        "(allocated, peak, allocations) bytes and count of the live pjrt storages of a device.");
  m.def("reset_peak", &reset_peak, py::arg("index"), "Set the device's peak to what it holds now.");
}

}  // namespace torch_pjrt
