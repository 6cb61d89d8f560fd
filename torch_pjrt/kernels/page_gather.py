"""gather_pages: the keys and values of the pages each query token's block table names in a paged KV cache.

The cache is `(layers, blocks, kv_heads, block_size, 2 * head_size)` with a layer index, or one layer's
`(blocks, kv_heads, block_size, 2 * head_size)`; a row holds a cached position's key, then its value. The
op returns keys and values `(tokens, kv_heads, pages * block_size, head_size)`: token t's context position
s is row s % block_size of page block_tables[t, s // block_size] (negative ids count from the end, as in
torch indexing). paged.gathered_attention reads them.

On jaxlib's CPU client the lowering calls an XLA custom call (torch_pjrt/csrc/xla_cpu_kernels.cpp, the
extension torch_pjrt._xla_cpu_kernels): XLA's own gather computes every element's index, while a page of
one kv head is block_size contiguous rows, copied a row at a time. On other platforms, or where the
extension was not built, the lowering is XLA's gather. A block id or layer outside the cache is a
device-side check (IndexError on CPU); the custom call then reads nothing for it (zeros).
"""

from __future__ import annotations

import functools
import importlib

import jax
import torch

from torch_pjrt.kernels import jax_ops
from torch_pjrt.ops.indexing import OUT_OF_BOUNDS, check_index
from torch_pjrt.runtime import disk_store

OP = "torch_pjrt::gather_pages"
# the custom call's name, as torch_pjrt._xla_cpu_kernels.targets() registers it
TARGET = "torch_pjrt_gather_pages"


@functools.cache
def native_target() -> str | None:
    """TARGET, registered with jax for the CPU platform, or None where torch_pjrt._xla_cpu_kernels is absent."""
    try:
        extension = importlib.import_module("torch_pjrt._xla_cpu_kernels")
    except ImportError:
        return None
    for name, capsule in extension.targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        disk_store.STORABLE_CUSTOM_CALLS.add(name)
    return TARGET


def _xla_gather(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values with XLA's gathers: a whole page of one kv head at a time, keys and values apart."""
    jnp = jax.numpy
    tokens, pages = block_tables.shape
    _, _, kv_heads, block_size, row = cache.shape
    size = row // 2
    at = (layer, block_tables[:, None, :], jnp.arange(kv_heads)[None, :, None])
    shape = (tokens, kv_heads, pages * block_size, size)
    return cache[..., :size][at].reshape(shape), cache[..., size:][at].reshape(shape)


def _custom_call(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values with the CPU custom call (ids in range; negative ones already wrapped)."""
    tokens, pages = block_tables.shape
    _, _, kv_heads, block_size, row = cache.shape
    result = jax.ShapeDtypeStruct((tokens, kv_heads, pages * block_size, row // 2), cache.dtype)
    return tuple(jax.ffi.ffi_call(TARGET, (result, result))(cache, layer, block_tables))


def _gather_pages(cache: jax.Array, block_tables: jax.Array, layer: jax.Array | None = None, *, native: bool
                  ) -> tuple[jax.Array, jax.Array]:
    """(keys, values), each (tokens, kv_heads, pages * block_size, head_size), of the pages block_tables
    (tokens, pages) names in the cache's layer `layer` (a 1-element index; None: the cache is one layer);
    `native`: with the CPU custom call on the CPU platform."""
    jnp = jax.numpy
    whole = layer is not None
    if not whole:
        cache, layer = cache[None], jnp.zeros((1,), block_tables.dtype)
    layers, blocks = cache.shape[:2]
    if whole:
        check_index(layer, layers, OP, OUT_OF_BOUNDS, negative=True, dim=0)
    check_index(block_tables, blocks, OP, OUT_OF_BOUNDS, negative=True, dim=int(whole))
    if not native:
        return _xla_gather(cache, layer, block_tables)
    layer = jnp.where(layer < 0, layer + layers, layer)
    block_tables = jnp.where(block_tables < 0, block_tables + blocks, block_tables)
    return jax.lax.platform_dependent(cache, layer, block_tables, cpu=_custom_call, default=_xla_gather)


def _result_shapes(cache: torch.Tensor, block_tables: torch.Tensor, layer: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's fake: keys and values of the cache's dtype, sized from symbolic sizes too."""
    if (cache.dim() != (4 if layer is None else 5) or block_tables.dim() != 2 or cache.shape[-1] % 2
            or (layer is not None and tuple(layer.shape) != (1,))):
        raise ValueError(f"{OP}: the cache must be (layers, blocks, kv_heads, block_size, 2 * head_size) with a "
                         f"1-element layer index, or (blocks, kv_heads, block_size, 2 * head_size) without, and "
                         f"block_tables 2-D; got cache {tuple(cache.shape)}, layer "
                         f"{tuple(layer.shape) if layer is not None else None} and block_tables "
                         f"{tuple(block_tables.shape)}.")
    kv_heads, block_size, row = cache.shape[-3:]
    shape = (block_tables.shape[0], kv_heads, block_tables.shape[1] * block_size, row // 2)
    return cache.new_empty(shape), cache.new_empty(shape)


# `native` bound here is part of the programs' fingerprint: those with the custom call are never reused without it
gather_pages = jax_ops.define(OP, functools.partial(_gather_pages, native=native_target() is not None),
                              fake=_result_shapes)


@gather_pages.register_kernel("cpu")
def _gather_pages_cpu(cache: torch.Tensor, block_tables: torch.Tensor, layer: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on CPU tensors, with torch indexing (the reference the device's result is tested against)."""
    keys, values = _result_shapes(cache, block_tables, layer)
    size = cache.shape[-1] // 2
    at = (block_tables[:, None, :], torch.arange(cache.shape[-3])[None, :, None])
    pages = cache[at if layer is None else (layer, *at)]
    keys.view(*pages.shape[:-1], size).copy_(pages[..., :size])
    values.view(*pages.shape[:-1], size).copy_(pages[..., size:])
    return keys, values
