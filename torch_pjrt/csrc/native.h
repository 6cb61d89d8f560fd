// What the parts of torch_pjrt._hooks share: pjrt tensors over fake addresses (hooks.cpp), the
// storages' DataPtrs, their link to Python's DeviceStorage and its members read and written in place
// (storage_link.cpp) and the native dispatch's module set-up (dispatch.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace torch_pjrt {

// A fresh fake address for a storage of nbytes: unique for the process, never dereferenced.
int64_t new_address(int64_t nbytes);

// The bytes new_address(nbytes) reserves: no other storage's address falls within them.
int64_t address_span(int64_t nbytes);

// A pjrt tensor over a new non-owning storage at `address`.
at::Tensor make_tensor(
    c10::DeviceIndex index,
    c10::ScalarType scalar_type,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t address,
    int64_t nbytes);

// A pjrt storage's DataPtr at a fake address: counts its bytes until freed, and holds the link.
c10::DataPtr counted_data_ptr(int64_t address, c10::Device device, int64_t nbytes);

// Resizes a pjrt storage in place to newsize bytes (the PrivateUse1 hook of untyped_storage().resize_):
// its DeviceStorage follows (storage.py: resize_device_storage), the device's figures count the new size.
void resize_storage(c10::StorageImpl* impl, size_t newsize);

// The DeviceStorage linked to a pjrt storage (borrowed), or nullptr: none set, or not a pjrt storage.
PyObject* device_storage_of(const c10::StorageImpl* impl);

// Links `device_storage` (a new reference is taken; nullptr unlinks); false where `impl` is not a
// pjrt storage made here.
bool link_device_storage(c10::StorageImpl* impl, PyObject* device_storage);

// A pjrt tensor over a new storage of nbytes at a fresh address, linked to `device_storage` (a new reference
// is taken): a program's result as a tensor (the native dispatch's and the graph call's outputs).
at::Tensor linked_tensor(
    c10::DeviceIndex index,
    c10::ScalarType scalar_type,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t nbytes,
    PyObject* device_storage);

// Where the __slots__ member `name` of `type` sits in its objects: native code reads and writes it there,
// with no attribute lookup (storage.DeviceStorage's members, fusion's DeferredArray's).
Py_ssize_t slot_offset(PyObject* type, const char* name);

// The slot at `offset` of `object` (borrowed; nullptr while unset).
inline PyObject*& slot_at(PyObject* object, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(object) + offset);
}

// Sets a slot to `value` (a new reference is taken), as `object.name = value` does.
inline void set_slot(PyObject* object, Py_ssize_t offset, PyObject* value) {
  Py_INCREF(value);
  Py_XSETREF(slot_at(object, offset), value);
}

// Where storage.DeviceStorage's members sit in its objects.
struct DeviceStorageSlots {
  Py_ssize_t array = 0, dtype = 0, numel = 0, device = 0, nbytes = 0;
  DeviceStorageSlots() = default;
  explicit DeviceStorageSlots(PyObject* type);
};

// A DeviceStorage of `type` made as its __init__ makes one, without running Python code: the type's own
// allocation, then its members written (each a new reference taken): a program's result's storage.
py::object new_device_storage(PyObject* type, const DeviceStorageSlots& slots, PyObject* array, PyObject* dtype,
                              PyObject* numel, PyObject* device, PyObject* nbytes);

// Adds torch.UntypedStorage's `_pjrt` descriptor and the memory figures to the module.
void init_storage_link(py::module& m);

// Adds the native dispatch's functions to the module.
void init_dispatch(py::module& m);

}  // namespace torch_pjrt
