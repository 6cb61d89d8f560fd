"""Copies, conversions and fills: the ops every other family leans on."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt import storage
from torch_pjrt.ops import casts
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


@register(aten.copy.default)
def copy(self: Any, src: Any, non_blocking: bool = False) -> Any:
    return jnp.broadcast_to(casts.convert(src, storage.torch_dtype(self.dtype)), self.shape)


@register(aten._to_copy.default)
def _to_copy(self: Any, **_: Any) -> Any:
    return self


@register(aten.clone.default)
def clone(self: Any, memory_format: Any = None) -> Any:
    return self


@register(aten.fill.Scalar)
def fill(self: Any, value: Any) -> Any:
    fitted = casts.fitted(value, storage.torch_dtype(self.dtype), "aten::fill_", math.prod(self.shape))
    return jnp.broadcast_to(fitted, self.shape)


@register(aten.fill.Tensor)
def fill_with_tensor(self: Any, value: Any) -> Any:
    """A tensor's value converts unchecked, as on CPU (1e39 in float64 fills float32 with inf)."""
    return jnp.broadcast_to(casts.convert(value, storage.torch_dtype(self.dtype)), self.shape)


@register(aten.zero.default)
def zero(self: Any) -> Any:
    return jnp.zeros_like(self)


@register(aten.full.default)
def full(size: Any, fill_value: Any, *, dtype: Any = None, **_: Any) -> Any:
    """With no dtype, the number's kind decides (a float the default dtype, an int int64)."""
    if dtype is None and jnp.issubdtype(jnp.result_type(fill_value), jnp.floating):
        dtype = torch.get_default_dtype()
    elif dtype is None and type(fill_value) is int:  # (checked as int64: 2**63, a uint64 Scalar, raises as on CPU)
        dtype = torch.int64
    return jnp.full(tuple(size), fill_value if dtype is None else casts.fitted(fill_value, dtype, "aten::full",
                                                                                    math.prod(size)))


@register(aten.ones.default)
def ones(size: Any, **_: Any) -> Any:
    return jnp.ones(tuple(size))


@register(aten.zeros.default)
def zeros(size: Any, **_: Any) -> Any:
    return jnp.zeros(tuple(size))


@register(aten.sym_size.int)
def sym_size(self: Any, dim: int) -> int:
    """Shapes are static inside a program: a symbolic size is the traced array's size."""
    return self.shape[dim]


@register(aten.sym_numel.default)
def sym_numel(self: Any) -> int:
    return self.size


@register(aten.sym_stride.int)
def sym_stride(self: Any, dim: int) -> int:
    return math.prod(self.shape[dim + 1:])


@register(aten.sym_storage_offset.default)
def sym_storage_offset(self: Any) -> int:
    return 0
