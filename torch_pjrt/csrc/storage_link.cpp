// What a pjrt storage's DataPtr holds: its bytes, counted in the device's memory figures from when
// the storage is made until the DataPtr is freed, and the link to its Python DeviceStorage
// (storage.py: the device array and the storage's dtype, numel and device).
//
// The link lives in the DataPtr's context, so the native dispatch reaches a storage's array from
// its StorageImpl without a Python wrapper of the storage, and a new result needs none either.
// Python reads and sets it as `untyped_storage()._pjrt`, a descriptor this file adds to
// torch.UntypedStorage. The context owns a reference to the DeviceStorage, dropped (under the GIL)
// on whichever thread frees the storage.

#include <torch/csrc/Storage.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
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
  PyObject* found = device_storage_of(THPStorage_Unpack(self).unsafeGetStorageImpl());
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

}  // namespace

c10::DataPtr counted_data_ptr(int64_t address, c10::Device device, int64_t nbytes) {
  DeviceBytes& bytes = bytes_of(device.index());
  const int64_t now = bytes.allocated.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t peak = bytes.peak.load(std::memory_order_relaxed);
  while (now > peak && !bytes.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  if (nbytes > 0) {
    bytes.allocations.fetch_add(1, std::memory_order_relaxed);
  }
  return c10::DataPtr(reinterpret_cast<void*>(static_cast<intptr_t>(address)),
                      new StorageLink{device.index(), nbytes}, &release_link, device);
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
