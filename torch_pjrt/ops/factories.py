"""Tensor factories: arange, linspace, logspace, eye, full, *_like, scalar_tensor, tril_indices.

The values follow PyTorch's CPU kernels (which end they count from, which type they
compute in); result dtypes and shapes are what PyTorch's meta kernels say.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.ops import casts
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


# --- shared helpers ---------------------------------------------------------------------------


@functools.cache
def _dtype_from_enum(value: int) -> torch.dtype:
    return aten.empty.memory_format([0], dtype=value, device="meta").dtype


def torch_dtype(dtype: Any, default: torch.dtype | None = None) -> torch.dtype:
    """A torch dtype from a dtype argument: a torch.dtype, a ScalarType number (schema defaults) or None."""
    if dtype is None:
        return default if default is not None else torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, int):
        return _dtype_from_enum(dtype)
    return storage.torch_dtype(dtype)


def jax_dtype(dtype: Any, default: torch.dtype | None = None) -> Any:
    return storage.numpy_dtype(torch_dtype(dtype, default))


def is_integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def dtype_of(array: Any) -> torch.dtype:
    return storage.torch_dtype(array.dtype)


def scalar_type_name(dtype: torch.dtype) -> str:
    """PyTorch's C++ name of a dtype, as CPU's messages spell it (Long, Float, BFloat16)."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def not_implemented_for(kernel: str, array: Any) -> NotImplementedError:
    """CPU's error for a dtype its kernel has no instance for (`"frac_cpu" not implemented for 'Int'`)."""
    return NotImplementedError(f'"{kernel}" not implemented for \'{scalar_type_name(dtype_of(array))}\'')


def _to(value: Any, dtype: torch.dtype) -> Any:
    """A scalar converted like Scalar.to<T>(): floats truncate toward zero into integers."""
    return casts.convert(value, dtype)


def two_ended(start: Any, end: Any, step: Any, steps: int) -> Any:
    """Points counted from `start` for the first half and from `end` for the second (exact ends)."""
    index = jnp.arange(steps, dtype=jnp.int64)
    dtype = jnp.result_type(start, end, step)
    forward = start + step * index.astype(dtype)
    backward = end - step * (steps - 1 - index).astype(dtype)
    return jnp.where(index < steps // 2, forward, backward)


# --- arange -----------------------------------------------------------------------------------


def _arange_length(start: Any, end: Any, step: Any, dtype: torch.dtype, integer_args: bool) -> int:
    if dtype == torch.int64 or integer_args:
        start, end, step = int(start), int(end), int(step)
        sign = (step > 0) - (step < 0)
        return max((end - start + step - sign) // step, 0)
    return max(math.ceil((float(end) - float(start)) / float(step)), 0)


def _arange_values(start: Any, end: Any, step: Any, dtype: torch.dtype | None) -> Any:
    integer_args = all(isinstance(v, int) for v in (start, end, step))
    dtype = torch_dtype(dtype, torch.int64 if integer_args else None)
    length = _arange_length(start, end, step, dtype, integer_args)
    index = jnp.arange(length, dtype=jnp.int64)
    if is_integral(dtype):
        return (int(start) + int(step) * index).astype(storage.numpy_dtype(dtype))
    # PyTorch's CPU kernel accumulates half types in float32, the others in double
    compute = jnp.int64 if integer_args else jnp.float32 if dtype in (torch.float16, torch.bfloat16) else jnp.float64
    return (start + step * index.astype(compute)).astype(storage.numpy_dtype(dtype))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, static_scalars=True)
def arange(start: Any, end: Any = None, step: Any = 1, *, dtype: Any = None, **_: Any) -> Any:
    """Static scalars: the length depends on their values."""
    if end is None:
        start, end = 0, start
    return _arange_values(start, end, step, dtype)


@register(aten.arange.start_out, static_scalars=True)
def arange_out(start: Any, end: Any, step: Any = 1, *, out: Any) -> Any:
    return _arange_values(start, end, step, dtype_of(out))


# --- linspace / logspace ------------------------------------------------------------------------


def _linspace_values(start: Any, end: Any, steps: int, dtype: torch.dtype) -> Any:
    """Integral results step in double from truncated ends; floating ones compute in their own type."""
    start, end = _to(start, dtype), _to(end, dtype)
    if steps <= 1:
        return jnp.reshape(start, (1,))[:steps]
    compute = jnp.float64 if is_integral(dtype) else start.dtype
    start, end = start.astype(compute), end.astype(compute)
    step = (end - start) / jnp.asarray(steps - 1, compute)
    return two_ended(start, end, step, steps).astype(storage.numpy_dtype(dtype))


@register(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start: Any, end: Any, steps: int, *, dtype: Any = None, **_: Any) -> Any:
    return _linspace_values(start, end, steps, torch_dtype(dtype))


@register(aten.linspace.out)
def linspace_out(start: Any, end: Any, steps: int, *, out: Any) -> Any:
    return _linspace_values(start, end, steps, dtype_of(out))


def _logspace_values(start: Any, end: Any, steps: int, base: float, dtype: torch.dtype) -> Any:
    """Exponents in double from the ends converted to the result type, then base ** exponent."""
    if dtype.is_complex:
        raise NotImplementedError("torch_pjrt: logspace with a complex dtype is not supported.")
    if steps == 1:
        exponents = jnp.reshape(jnp.asarray(start, jnp.float64), (1,))
    else:
        low, high = _to(start, dtype), _to(end, dtype)
        if is_integral(dtype):
            low, high = low.astype(jnp.int64), high.astype(jnp.int64)
        step = (high - low).astype(jnp.float64) / max(steps - 1, 1)
        exponents = two_ended(low.astype(jnp.float64), high.astype(jnp.float64), step, steps)
    return jnp.power(jnp.float64(base), exponents).astype(storage.numpy_dtype(dtype))


@register(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start: Any, end: Any, steps: int, base: float = 10.0, *, dtype: Any = None, **_: Any) -> Any:
    return _logspace_values(start, end, steps, base, torch_dtype(dtype))


@register(aten.logspace.out)
def logspace_out(start: Any, end: Any, steps: int, base: float = 10.0, *, out: Any) -> Any:
    return _logspace_values(start, end, steps, base, dtype_of(out))


# --- eye, tril/triu indices ---------------------------------------------------------------------


@register(aten.eye.default, aten.eye.m)
def eye(n: int, m: int | None = None, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.eye(n, n if m is None else m, dtype=jax_dtype(dtype))


@register(aten.eye.out, aten.eye.m_out)
def eye_out(n: int, m: int | None = None, *, out: Any) -> Any:
    return jnp.eye(n, n if m is None else m, dtype=out.dtype)


def _trilu_indices(row: int, col: int, offset: int, dtype: Any, upper: bool) -> Any:
    """Row-major (row, column) pairs, as a constant: the arguments are static."""
    rows, cols = (np.triu_indices if upper else np.tril_indices)(row, offset, col)
    return jnp.asarray(np.stack([rows, cols]).reshape(2, -1), jax_dtype(dtype, torch.int64))


@register(aten.tril_indices.default)
def tril_indices(row: int, col: int, offset: int = 0, *, dtype: Any = None, **_: Any) -> Any:
    return _trilu_indices(row, col, offset, dtype, upper=False)


@register(aten.triu_indices.default)
def triu_indices(row: int, col: int, offset: int = 0, *, dtype: Any = None, **_: Any) -> Any:
    return _trilu_indices(row, col, offset, dtype, upper=True)


# --- filled tensors ---------------------------------------------------------------------------


@register(aten.scalar_tensor.default)
def scalar_tensor(s: Any, *, dtype: Any = None, **_: Any) -> Any:
    return casts.fitted(s, torch_dtype(dtype), "aten::scalar_tensor", 1)


@register(aten.full_like.default)
def full_like(self: Any, fill_value: Any, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.full(self.shape, casts.fitted(fill_value, torch_dtype(dtype, dtype_of(self)), "aten::full_like",
                                                 math.prod(self.shape)))


@register(aten.new_full.default)
def new_full(self: Any, size: Any, fill_value: Any, *, dtype: Any = None, **_: Any) -> Any:
    """Its own lowering, not PyTorch's decomposition (whose numbers are static): the fill value is traced."""
    return jnp.full(tuple(size), casts.fitted(fill_value, torch_dtype(dtype, dtype_of(self)), "aten::new_full",
                                                  math.prod(size)))


@register(aten.zeros_like.default, aten.empty_like.default)
def zeros_like(self: Any, *, dtype: Any = None, **_: Any) -> Any:
    """empty_like too: a program cannot leave memory uninitialised."""
    return jnp.zeros(self.shape, jax_dtype(dtype, dtype_of(self)))


@register(aten.ones_like.default)
def ones_like(self: Any, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.ones(self.shape, jax_dtype(dtype, dtype_of(self)))


@register(aten.new_empty.default)
def new_empty(self: Any, size: Any, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.zeros(tuple(size), jax_dtype(dtype, dtype_of(self)))


@register(aten.new_empty_strided.default)
def new_empty_strided(self: Any, size: Any, stride: Any, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.zeros(tuple(size), jax_dtype(dtype, dtype_of(self)))


@register(aten.empty.memory_format, aten._efficientzerotensor.default)
def empty(size: Any, *, dtype: Any = None, **_: Any) -> Any:
    """Eager allocation has its own kernel; this serves traced graphs (decompositions, compile)."""
    return jnp.zeros(tuple(size), jax_dtype(dtype))


@register(aten.empty_strided.default)
def empty_strided(size: Any, stride: Any, *, dtype: Any = None, **_: Any) -> Any:
    return jnp.zeros(tuple(size), jax_dtype(dtype))
