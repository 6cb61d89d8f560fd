// Owns XLA CPU custom calls (XLA's FFI) that jax programs call through jax.ffi, built as the extension
// torch_pjrt._xla_cpu_kernels, which needs jaxlib's FFI headers and neither torch nor libtorch.
//
// gather_pages: the keys and values of a paged KV cache's pages that a step's block table names, for
// kernels/paged.py's gathered_attention. XLA's CPU backend computes the index of every gathered element;
// a page of one kv head is block_size rows of 2 * head_size contiguous elements (key, then value), so here
// each row is two memcpys. Semantics (shapes, dtypes, the device-side check of the block ids) stay in the
// op's lowering, kernels/paged.py; a block id or layer outside the cache reads nothing (its rows are
// zeros) and that lowering's check reports it.

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The i-th element of an integer buffer of S32 or S64 elements, as int64.
int64_t IndexAt(const ffi::AnyBuffer& buffer, int64_t i) {
  if (buffer.element_type() == ffi::DataType::S32) return static_cast<const int32_t*>(buffer.untyped_data())[i];
  return static_cast<const int64_t*>(buffer.untyped_data())[i];
}

bool IsIndexType(ffi::DataType type) { return type == ffi::DataType::S32 || type == ffi::DataType::S64; }

// cache (layers, blocks, kv_heads, block_size, 2 * size), layer (1,), block_tables (tokens, pages) ->
// keys, values (tokens, kv_heads, pages * block_size, size).
ffi::Error GatherPagesImpl(ffi::AnyBuffer cache, ffi::AnyBuffer layer, ffi::AnyBuffer block_tables,
                           ffi::Result<ffi::AnyBuffer> keys, ffi::Result<ffi::AnyBuffer> values) {
  const auto cache_dims = cache.dimensions();
  const auto table_dims = block_tables.dimensions();
  const auto key_dims = keys->dimensions();
  if (cache_dims.size() != 5 || table_dims.size() != 2 || key_dims.size() != 4 || layer.element_count() != 1 ||
      !IsIndexType(layer.element_type()) || !IsIndexType(block_tables.element_type()) ||
      keys->element_type() != cache.element_type() || values->element_type() != cache.element_type() ||
      values->element_count() != keys->element_count()) {
    return ffi::Error::InvalidArgument(
        "gather_pages takes a 5-D cache, a 1-element integer layer and a 2-D integer block table, and returns "
        "two 4-D buffers of the cache's dtype");
  }
  const int64_t layers = cache_dims[0], blocks = cache_dims[1], kv_heads = cache_dims[2];
  const int64_t block_size = cache_dims[3], row = cache_dims[4], size = row / 2;
  const int64_t tokens = table_dims[0], pages = table_dims[1], context = pages * block_size;
  if (row % 2 || key_dims[0] != tokens || key_dims[1] != kv_heads || key_dims[2] != context ||
      key_dims[3] != size) {
    return ffi::Error::InvalidArgument("gather_pages: the results must be (tokens, kv_heads, pages * block_size, "
                                       "head_size) of the cache's rows of 2 * head_size");
  }
  const size_t width = ffi::ByteWidth(cache.element_type());
  const size_t half = static_cast<size_t>(size) * width;
  const size_t page_bytes = static_cast<size_t>(block_size) * half;
  const int64_t layer_index = IndexAt(layer, 0);
  const bool layer_in_cache = 0 <= layer_index && layer_index < layers;
  const char* base = static_cast<const char*>(cache.untyped_data());
  char* key_out = static_cast<char*>(keys->untyped_data());
  char* value_out = static_cast<char*>(values->untyped_data());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t p = 0; p < pages; ++p) {
        const int64_t block = IndexAt(block_tables, t * pages + p);
        const size_t out_offset = static_cast<size_t>((t * kv_heads + h) * context + p * block_size) * half;
        char* key_page = key_out + out_offset;
        char* value_page = value_out + out_offset;
        if (!layer_in_cache || block < 0 || block >= blocks) {  // reported by the lowering's check
          std::memset(key_page, 0, page_bytes);
          std::memset(value_page, 0, page_bytes);
          continue;
        }
        const char* source = base + static_cast<size_t>(((layer_index * blocks + block) * kv_heads + h) *
                                                        block_size) * 2 * half;
        for (int64_t r = 0; r < block_size; ++r, source += 2 * half) {
          std::memcpy(key_page + r * half, source, half);
          std::memcpy(value_page + r * half, source + half, half);
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherPages, GatherPagesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

namespace {

// targets() -> {"name": capsule}: the handlers, for jax.ffi.register_ffi_target(name, capsule, platform="cpu").
PyObject* Targets(PyObject*, PyObject*) {
  PyObject* found = PyDict_New();
  if (found == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(&GatherPages), nullptr, nullptr);
  if (capsule == nullptr || PyDict_SetItemString(found, "torch_pjrt_gather_pages", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(found);
    return nullptr;
  }
  Py_DECREF(capsule);
  return found;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "The XLA FFI handlers of this module, name -> PyCapsule (CPU platform)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "torch_pjrt._xla_cpu_kernels",
                       "XLA CPU custom calls (XLA FFI handlers) of torch_pjrt's kernels.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__xla_cpu_kernels() { return PyModule_Create(&kModule); }
