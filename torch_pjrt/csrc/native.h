// What the parts of torch_pjrt._hooks share: pjrt tensors over fake addresses (hooks.cpp), the
// storages' DataPtrs and their link to Python's DeviceStorage (storage_link.cpp) and the native
// dispatch's module set-up (dispatch.cpp).
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

// Adds torch.UntypedStorage's `_pjrt` descriptor and the memory figures to the module.
void init_storage_link(py::module& m);

// Adds the native dispatch's functions to the module.
void init_dispatch(py::module& m);

}  // namespace torch_pjrt
