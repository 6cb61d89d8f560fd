// What the parts of torch_pjrt._hooks share: pjrt tensors over fake addresses (hooks.cpp)
// and the native dispatch's module set-up (dispatch.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace torch_pjrt {

// A fresh fake address for a storage of nbytes: unique for the process, never dereferenced.
int64_t new_address(int64_t nbytes);

// A pjrt tensor over a new non-owning storage at `address`.
at::Tensor make_tensor(
    c10::DeviceIndex index,
    c10::ScalarType scalar_type,
    c10::IntArrayRef sizes,
    c10::IntArrayRef strides,
    int64_t address,
    int64_t nbytes);

// Adds the native dispatch's functions to the module.
void init_dispatch(py::module& m);

}  // namespace torch_pjrt
