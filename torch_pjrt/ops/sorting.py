"""Sorting and selection: sort, topk, kthvalue, median, mode, searchsorted.

Every sort is one stable multi-key lax.sort carrying positions, so values and indices
follow PyTorch's order: NaN above +inf (last ascending, first descending), -0.0 equal
to 0.0, ties in original order.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_pjrt.ops.factories import not_implemented_for
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


# --- shared helpers ----------------------------------------------------------------------------


def _dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _keys(x: Any, descending: bool) -> list[Any]:
    """Sort keys whose ascending order is PyTorch's order for x."""
    if not _is_float(x):
        return [jnp.invert(x) if descending else x]
    nan = jnp.isnan(x)
    value = jnp.where(nan | (x == 0), jnp.zeros((), x.dtype), x)
    if descending:
        return [jnp.logical_not(nan), -value]
    return [nan, value]


def _sort(x: Any, axis: int, descending: bool = False) -> tuple[Any, Any]:
    """(values, int64 indices) sorted along axis, stably."""
    keys = _keys(x, descending)
    iota = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    *_, indices = lax.sort((*keys, iota), dimension=axis, num_keys=len(keys), is_stable=True)
    return jnp.take_along_axis(x, indices, axis=axis), indices


def _nan_count(x: Any, axis: int) -> Any:
    if not _is_float(x):
        return jnp.zeros(x.shape[:axis] + x.shape[axis + 1:], jnp.int64)
    return jnp.sum(jnp.isnan(x), axis=axis)


def _pick(values: Any, indices: Any, position: Any, axis: int, keepdim: bool) -> tuple[Any, Any]:
    """values/indices at `position` (one per slice along axis)."""
    where = jnp.expand_dims(position, axis)
    picked = (jnp.take_along_axis(values, where, axis=axis), jnp.take_along_axis(indices, where, axis=axis))
    return picked if keepdim else tuple(jnp.squeeze(p, axis) for p in picked)


def _as_vector(x: Any) -> Any:
    return x.reshape(1) if x.ndim == 0 else x


# --- sort, topk, kthvalue ----------------------------------------------------------------------


@register(aten.sort.default)
def sort(self: Any, dim: int = -1, descending: bool = False) -> tuple[Any, Any]:
    x = _as_vector(self)
    return _sort(x, _dim(dim, x.ndim), descending)


@register(aten.sort.stable)
def sort_stable(self: Any, *, stable: bool | None = None, dim: int = -1, descending: bool = False) -> tuple[Any, Any]:
    return sort(self, dim, descending)


@register(aten.topk.default)
def topk(self: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple[Any, Any]:
    """Always sorted, which PyTorch allows for sorted=False."""
    x = _as_vector(self)
    axis = _dim(dim, x.ndim)
    values, indices = _sort(x, axis, descending=largest)
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis)


@register(aten.kthvalue.default)
def kthvalue(self: Any, k: int, dim: int = -1, keepdim: bool = False) -> tuple[Any, Any]:
    x = _as_vector(self)
    axis = _dim(dim, x.ndim)
    values, indices = _sort(x, axis)
    position = jnp.full(x.shape[:axis] + x.shape[axis + 1:], k - 1)
    return _pick(values, indices, position, axis, keepdim)


# --- medians and mode --------------------------------------------------------------------------


def _median(self: Any, dim: int, keepdim: bool, ignore_nan: bool, kernel: str = "median_out") -> tuple[Any, Any]:
    """The lower median. With NaNs: median gives the first NaN, nanmedian skips them."""
    if self.dtype == jnp.bool_:
        raise not_implemented_for(kernel, self)
    x = _as_vector(self)
    axis = _dim(dim, x.ndim)
    n = x.shape[axis]
    if n == 0 and self.ndim:
        raise IndexError(f"median(): Expected reduction dim {axis} to have non-zero size.")
    values, indices = _sort(x, axis)
    nans = _nan_count(x, axis)
    if ignore_nan:
        position = jnp.maximum((n - nans - 1) // 2, 0)
    else:
        position = jnp.where(nans > 0, n - nans, (n - 1) // 2)
    return _pick(values, indices, position, axis, keepdim)


def _median_of_all(self: Any, ignore_nan: bool) -> Any:
    """The median of every element; of none, NaN (as CPU's floating kernels)."""
    if self.size == 0 and self.dtype != jnp.bool_:
        return jnp.full((), jnp.nan, self.dtype) if _is_float(self) else jnp.zeros((), self.dtype)
    return _median(self.reshape(-1), 0, False, ignore_nan, "median_cpu")[0]


@register(aten.median.default)
def median(self: Any) -> Any:
    return _median_of_all(self, False)


@register(aten.nanmedian.default)
def nanmedian(self: Any) -> Any:
    return _median_of_all(self, True)


@register(aten.median.dim)
def median_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return _median(self, dim, keepdim, False)


@register(aten.nanmedian.dim)
def nanmedian_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return _median(self, dim, keepdim, True)


@register(aten.mode.default)
def mode(self: Any, dim: int = -1, keepdim: bool = False) -> tuple[Any, Any]:
    """Most frequent value, the smallest on ties; its index is its last occurrence (as on CPU)."""
    x = _as_vector(self)
    axis = _dim(dim, x.ndim)
    values, indices = _sort(x, axis)
    position = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    starts = jnp.concatenate(
        [jnp.ones_like(lax.slice_in_dim(values, 0, 1, axis=axis), jnp.bool_),
         lax.slice_in_dim(values, 1, None, axis=axis) != lax.slice_in_dim(values, 0, -1, axis=axis)], axis=axis)
    run_start = lax.cummax(jnp.where(starts, position, 0), axis=axis)
    run_length = position - run_start
    return _pick(values, indices, jnp.argmax(run_length, axis=axis), axis, keepdim)


# --- searchsorted ------------------------------------------------------------------------------


def _searchsorted(sorted_sequence: Any, values: Any, right: bool, sorter: Any) -> Any:
    values = jnp.asarray(values)
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    dtype = jnp.promote_types(sorted_sequence.dtype, values.dtype)
    sorted_sequence, values = sorted_sequence.astype(dtype), values.astype(dtype)
    side = "right" if right else "left"
    if sorted_sequence.ndim == 1:
        return jnp.searchsorted(sorted_sequence, values, side=side)
    batch = math.prod(sorted_sequence.shape[:-1])
    rows = sorted_sequence.reshape(batch, sorted_sequence.shape[-1])
    found = jax.vmap(lambda row, v: jnp.searchsorted(row, v, side=side))(rows, values.reshape(batch, values.shape[-1]))
    return found.reshape(values.shape)


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence: Any, self: Any, *, out_int32: bool = False, right: bool = False,
                 side: str | None = None, sorter: Any = None) -> Any:
    return _searchsorted(sorted_sequence, self, right or side == "right", sorter)


@register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self: Any, boundaries: Any, *, out_int32: bool = False, right: bool = False) -> Any:
    return _searchsorted(boundaries, self, right, None)


@register(aten.histc.default)
def histc(self: Any, bins: int = 100, min: Any = 0, max: Any = 0) -> Any:
    """min == max means the data's range (widened by 1 each way if flat); values outside are
    dropped and max itself falls in the last bin, as on CPU."""
    x = self.reshape(-1)
    dtype = x.dtype if _is_float(x) else jnp.float32
    x = x.astype(dtype)
    lo, hi = jnp.asarray(min, dtype), jnp.asarray(max, dtype)
    if x.shape[0]:
        use_data = lo == hi
        lo = jnp.where(use_data, jnp.nanmin(x), lo)
        hi = jnp.where(use_data, jnp.nanmax(x), hi)
    flat = lo == hi
    lo, hi = jnp.where(flat, lo - 1, lo), jnp.where(flat, hi + 1, hi)
    position = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    position = jnp.where(x == hi, bins - 1, position)
    inside = (x >= lo) & (x <= hi)
    return jnp.zeros((bins,), dtype).at[jnp.where(inside, position, bins)].add(1, mode="drop")
