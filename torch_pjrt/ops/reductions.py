"""Reductions and scans: sum/mean/prod/var/std/norm, max/min/arg*, any/all, cumsum/cumprod, softmax.

Like PyTorch, float16/bfloat16 accumulate in float32 and integers/bools sum in int64; the
caller casts results to the dtype PyTorch's meta kernel gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.ops import factories, pointwise
from torch_pjrt.ops.registry import register

aten = torch.ops.aten

_HALF = ("float16", "bfloat16")


def axes(x: Any, dim: int | Sequence[int] | None, empty_means_all: bool = True) -> tuple[int, ...]:
    """Normalized reduction axes; None (and, for most ops, []) means every axis."""
    if dim is None:
        return tuple(range(x.ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims and empty_means_all:
        return tuple(range(x.ndim))
    if x.ndim == 0:
        return ()
    return tuple(sorted({d % x.ndim for d in dims}))


def accumulate(x: Any, dtype: torch.dtype | None = None) -> Any:
    """x in the dtype a sum-like reduction runs in: the requested dtype, float32 for halves, int64 for ints."""
    if dtype is not None:
        x = x.astype(storage.numpy_dtype(dtype))
    kind = np.dtype(x.dtype)
    if kind.name in _HALF:
        return x.astype(np.float32)
    if kind.kind in "biu":
        return x.astype(np.int64)
    return x


def _opmath(x: Any) -> Any:
    """Floats in at least float32, integers in PyTorch's default dtype."""
    kind = np.dtype(x.dtype)
    if kind.kind in "biu":
        return x.astype(storage.numpy_dtype(torch.get_default_dtype()))
    return x.astype(np.float32) if kind.name in _HALF else x


def _count(x: Any, dims: tuple[int, ...]) -> int:
    return math.prod(x.shape[d] for d in dims)


# --- sums, means, products --------------------------------------------------------------------


@register(aten.sum.default, aten.sum.dim_IntList)
def sum(self: Any, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:  # noqa: A001
    return jnp.sum(accumulate(self, dtype), axis=axes(self, dim), keepdims=keepdim)


@register(aten.nansum.default)
def nansum(self: Any, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    x = accumulate(self, dtype)
    if np.dtype(x.dtype).kind in "fc":
        x = jnp.where(jnp.isnan(x), 0, x)
    return jnp.sum(x, axis=axes(self, dim), keepdims=keepdim)


@register(aten.mean.default, aten.mean.dim)
def mean(self: Any, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    dims = axes(self, dim)
    return jnp.sum(accumulate(self, dtype), axis=dims, keepdims=keepdim) / _count(self, dims)


@register(aten.prod.default)
def prod(self: Any, *, dtype: torch.dtype | None = None) -> Any:
    return jnp.prod(accumulate(self, dtype))


@register(aten.prod.dim_int)
def prod_dim(self: Any, dim: int, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    return jnp.prod(accumulate(self, dtype), axis=axes(self, dim), keepdims=keepdim)


def _moments(self: Any, dim: Any, correction: Any, keepdim: bool, name: str = "std and var") -> tuple[Any, Any]:
    """(variance, mean); the divisor is max(0, N - correction) as in PyTorch."""
    if np.dtype(self.dtype).kind not in "fc" and self.dtype != jnp.bfloat16:
        raise RuntimeError(f"{name} only support floating point and complex dtypes")
    x = _opmath(self)
    dims = axes(self, dim)
    average = jnp.mean(x, axis=dims, keepdims=True)
    deviation = jnp.abs(x - average) ** 2 if np.dtype(x.dtype).kind == "c" else (x - average) ** 2
    correction = 1 if correction is None else correction
    divisor = jnp.maximum(_count(self, dims) - correction, 0)
    variance = jnp.sum(deviation, axis=dims, keepdims=keepdim) / divisor
    return variance, average if keepdim else jnp.squeeze(average, dims)


@register(aten.var.correction)
def var(self: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    return _moments(self, dim, correction, keepdim)[0]


@register(aten.std.correction)
def std(self: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    return jnp.sqrt(var(self, dim, correction=correction, keepdim=keepdim))


@register(aten.var_mean.correction)
def var_mean(self: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> tuple[Any, Any]:
    return _moments(self, dim, correction, keepdim, "var_mean")


@register(aten.std_mean.correction)
def std_mean(self: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> tuple[Any, Any]:
    variance, average = _moments(self, dim, correction, keepdim, "std_mean")
    return jnp.sqrt(variance), average


# --- norms and logsumexp ----------------------------------------------------------------------


@register(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(self: Any, ord: float = 2, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
                       dtype: torch.dtype | None = None) -> Any:
    """The ord is static: inf/-inf/0/1/2 have their own formulas."""
    x = jnp.abs(_opmath(self if dtype is None else self.astype(storage.numpy_dtype(dtype))))
    dims = axes(self, dim)
    if ord == math.inf:
        return extreme(jnp.max, x, dims, keepdim)
    if ord == -math.inf:
        return extreme(jnp.min, x, dims, keepdim)
    if ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=dims, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(x, axis=dims, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=dims, keepdims=keepdim))
    return jnp.sum(x**ord, axis=dims, keepdims=keepdim) ** (1.0 / ord)


@register(aten.norm.Scalar, aten.norm.ScalarOpt_dim, static_scalars=True)
def norm(self: Any, p: float | None = 2, dim: Any = None, keepdim: bool = False) -> Any:
    return linalg_vector_norm(self, 2 if p is None else p, dim, keepdim)


@register(aten.norm.ScalarOpt_dtype, static_scalars=True)
def norm_dtype(self: Any, p: float | None, *, dtype: torch.dtype) -> Any:
    return linalg_vector_norm(self, 2 if p is None else p, None, False, dtype=dtype)


@register(aten.norm.ScalarOpt_dim_dtype, static_scalars=True)
def norm_dim_dtype(self: Any, p: float | None, dim: Any, keepdim: bool, *, dtype: torch.dtype) -> Any:
    return linalg_vector_norm(self, 2 if p is None else p, dim, keepdim, dtype=dtype)


def _logsumexp(x: Any, dims: tuple[int, ...], keepdim: bool) -> Any:
    """Shifted by the max (of the real part, for complex), with infinite maxima left unshifted."""
    shift = jnp.max(jnp.real(x), axis=dims, keepdims=True) if x.size else jnp.zeros((1,) * x.ndim, x.real.dtype)
    shift = jnp.where(jnp.isinf(shift), 0, shift)
    total = jnp.log(jnp.sum(jnp.exp(x - shift), axis=dims, keepdims=True)) + shift
    return total if keepdim else jnp.squeeze(total, dims)


@register(aten.logsumexp.default)
def logsumexp(self: Any, dim: Any, keepdim: bool = False) -> Any:
    return _logsumexp(_opmath(self), axes(self, dim), keepdim)


# --- extrema ----------------------------------------------------------------------------------


def extreme(reduce: Callable, x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """`reduce` (jnp.max or jnp.min) with NaN winning wherever one is, as in PyTorch: XLA's CPU backend runs
    a max or min reduce as a YNNPACK fusion whose result skips NaN (jaxlib 0.10.2: the max of a 32 x 256 row
    holding one NaN is its largest number), so the NaN test is a reduce of its own."""
    result = reduce(x, axis=axis, keepdims=keepdims)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return result
    return jnp.where(jnp.isnan(x).any(axis=axis, keepdims=keepdims), jnp.nan, result)


@register(aten.amax.default)
def amax(self: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return extreme(jnp.max, self, axes(self, dim), keepdim)


@register(aten.amin.default)
def amin(self: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return extreme(jnp.min, self, axes(self, dim), keepdim)


@register(aten.max.default)
def max(self: Any) -> Any:  # noqa: A001
    return extreme(jnp.max, self)


@register(aten.min.default)
def min(self: Any) -> Any:  # noqa: A001
    return extreme(jnp.min, self)


# Inputs up to this many elements take the extreme's first index in two passes (the extreme, then the least index
# holding it), larger ones XLA's one variadic reduce (jnp.argmax). bench/arg_extreme.py on XLA's CPU backend (load
# 16): the two passes take 0.24-0.84x the reduce's time from 8 x 256 to 2048 x 1024 elements (32 x 256: 47 against
# 109 us; 32 x 32000: 1.35 against 3.35 ms) and 1.35-1.42x at 4M (4096 x 1024, 16384 x 256): the bound sits below.
TWO_PASS_ARG_EXTREME_ELEMENTS = 1 << 20


def _arg_extreme(reduce: Callable, fn: Callable, x: Any, dim: int | None, keepdim: bool) -> Any:
    """First index of the extreme (NaN counts as the extreme, as in PyTorch): `reduce` (jnp.max or jnp.min), then
    the least index holding it, where the input is small enough to be read twice; else `fn` (jnp.argmax or
    jnp.argmin), XLA's one-pass variadic reduce."""
    if dim is None:
        index = _arg_extreme(reduce, fn, x.reshape(-1), 0, False)
        return jnp.reshape(index, (1,) * x.ndim) if keepdim else index
    if x.ndim == 0:
        return jnp.zeros((), np.int64)
    axis = dim % x.ndim
    length = x.shape[axis]
    if x.size > TWO_PASS_ARG_EXTREME_ELEMENTS or 2 * length >= 2**31:
        return fn(x, axis=axis, keepdims=keepdim)
    positions = jax.lax.broadcasted_iota(np.int32, x.shape, axis)
    held = x == reduce(x, axis=axis, keepdims=True)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.min(jnp.where(held, positions, length), axis=axis, keepdims=keepdim).astype(np.int64)
    # A NaN wins wherever one is: NaNs rank by their index below every held extreme (index + length), so the
    # least rank is the first NaN, else the first extreme. (XLA's CPU max reduce does not always propagate NaN.)
    ranks = jnp.where(jnp.isnan(x), positions, jnp.where(held, positions + length, 2 * length))
    first = jnp.min(ranks, axis=axis, keepdims=keepdim)
    return jnp.where(first >= length, first - length, first).astype(np.int64)


@register(aten.argmax.default)
def argmax(self: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg_extreme(jnp.max, jnp.argmax, self, dim, keepdim)


@register(aten.argmin.default)
def argmin(self: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg_extreme(jnp.min, jnp.argmin, self, dim, keepdim)


@register(aten.max.dim)
def max_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return _with_values_at(self, argmax(self, dim, True), dim, keepdim)


@register(aten.min.dim)
def min_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return _with_values_at(self, argmin(self, dim, True), dim, keepdim)


def _with_values_at(x: Any, index: Any, dim: int, keepdim: bool) -> tuple[Any, Any]:
    """The values at the extreme's index (kept dim) and the index: NaN where a NaN won, which XLA's CPU max and
    min reduces (YNNPACK's fusions) do not always give."""
    if x.ndim == 0:
        return x, index
    axis = dim % x.ndim
    values = jnp.take_along_axis(x, index, axis=axis)
    return (values, index) if keepdim else (jnp.squeeze(values, axis), jnp.squeeze(index, axis))


@register(aten.aminmax.default)
def aminmax(self: Any, *, dim: int | None = None, keepdim: bool = False) -> tuple[Any, Any]:
    dims = axes(self, dim)
    if dim is None and keepdim:
        return extreme(jnp.min, self, dims, True), extreme(jnp.max, self, dims, True)
    return extreme(jnp.min, self, dims, keepdim), extreme(jnp.max, self, dims, keepdim)


# --- predicates ------------------------------------------------------------------------------


@register(aten.any.default, aten.any.dim, aten.any.dims)
def any(self: Any, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    return jnp.any(self != 0, axis=axes(self, dim, empty_means_all=False), keepdims=keepdim)


@register(aten.all.default, aten.all.dim, aten.all.dims)
def all(self: Any, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    return jnp.all(self != 0, axis=axes(self, dim, empty_means_all=False), keepdims=keepdim)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self: Any, dim: Any = None) -> Any:
    return jnp.sum((self != 0).astype(np.int64), axis=axes(self, dim))


def _float64_bits(x: Any) -> Any:
    """The bits of each float as the float64 PyTorch widens it to, built from integer fields: a float
    convert on the device may flush subnormals to zero. NaNs come out quiet, as a hardware widening makes them."""
    info = jnp.finfo(x.dtype)
    if info.bits == 64:
        return jax.lax.bitcast_convert_type(x, np.uint64)
    bits = jax.lax.bitcast_convert_type(x, np.dtype(f"uint{info.bits}")).astype(np.uint64)
    sign = bits >> (info.bits - 1)
    exponent = ((bits >> info.nmant) & ((1 << info.nexp) - 1)).astype(np.int64)
    mantissa = bits & ((1 << info.nmant) - 1)
    bias = (1 << (info.nexp - 1)) - 1
    top = 63 - jax.lax.clz(mantissa).astype(np.int64)
    subnormal_shift = (52 - top).astype(np.uint64)
    wide_exponent = jnp.where(exponent == 0, top - info.nmant + 1 - bias + 1023, exponent - bias + 1023)
    wide_mantissa = jnp.where(exponent == 0, (mantissa << subnormal_shift) & ((1 << 52) - 1),
                              mantissa << (52 - info.nmant))
    special = exponent == (1 << info.nexp) - 1
    wide_exponent = jnp.where(special, 2047, jnp.where((exponent == 0) & (mantissa == 0), 0, wide_exponent))
    wide_mantissa = jnp.where(special & (mantissa != 0), wide_mantissa | (1 << 51), wide_mantissa)
    return (sign << 63) | (wide_exponent.astype(np.uint64) << 52) | wide_mantissa


@register(aten.hash_tensor.default)
def hash_tensor(self: Any, dim: Any = (), *, keepdim: bool = False, mode: int = 0) -> Any:
    """Mode 0, PyTorch's only one: xor of every element's bits as float64 (floats) or int64 (integers)."""
    if mode != 0:
        raise NotImplementedError(f"hash_tensor: mode {mode} (PyTorch defines mode 0 only)")
    kind = np.dtype(self.dtype).kind
    if kind == "f" or np.dtype(self.dtype).name == "bfloat16":
        bits = _float64_bits(self)
    else:
        bits = jax.lax.bitcast_convert_type(self.astype(np.int64), np.uint64)
    dims = axes(self, dim)
    hashed = jax.lax.reduce(bits, np.uint64(0), jax.lax.bitwise_xor, dims)
    return jnp.expand_dims(hashed, dims) if keepdim else hashed


# --- histograms ------------------------------------------------------------------------------
# Bin counts are fixed by the arguments, so every histogram has a static shape; only the outer edges of
# bins given as counts come from the data (its min and max per dimension). PyTorch refuses a NaN or
# infinite data range, a check that needs the values on the host: here such a range gives NaN edges.


def _outer_edges(column: Any, low: float | None, high: float | None) -> tuple[Any, Any]:
    """PyTorch's choice of outer edges: the range if given, else the data's min and max ([0, 1] when empty),
    widened by 1/2 either side when they coincide."""
    if low is None:
        if column.size == 0:
            low, high = jnp.asarray(0, column.dtype), jnp.asarray(1, column.dtype)
        else:
            low, high = jnp.min(column), jnp.max(column)
    else:
        if low == high:
            low, high = low - 0.5, high + 0.5
        return jnp.asarray(low, column.dtype), jnp.asarray(high, column.dtype)
    equal = low == high
    return jnp.where(equal, low - 0.5, low), jnp.where(equal, high + 0.5, high)


def _uniform_edges(points: Any, bins: Sequence[int], bounds: Sequence[float] | None) -> list[Any]:
    """Edges of `bins[d] + 1` points per dimension, by linspace in the input's dtype like PyTorch."""
    edges = []
    for d, count in enumerate(bins):
        low, high = _outer_edges(points[:, d], *((bounds[2 * d], bounds[2 * d + 1]) if bounds else (None, None)))
        edges.append(factories.two_ended(low, high, (high - low) / count, count + 1))
    return edges


def _histogram_nd(points: Any, edges: Sequence[Any], weight: Any, density: bool) -> Any:
    """Counts (or weight sums) of points (N, D) in the bins between consecutive edges per dimension; a
    point on a dimension's last edge falls in its last bin, one outside any dimension's edges in none."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((points.shape[0],), np.int64)
    inside = jnp.ones((points.shape[0],), bool)
    for d, e in enumerate(edges):
        column = points[:, d]
        index = jnp.clip(jnp.searchsorted(e, column, side="right") - 1, 0, shape[d] - 1)
        inside = inside & (column >= e[0]) & (column <= e[-1])
        flat = flat * shape[d] + index
    values = jnp.ones_like(points[:, 0]) if weight is None else weight.reshape(-1).astype(points.dtype)
    hist = jnp.zeros((math.prod(shape),), points.dtype).at[flat].add(jnp.where(inside, values, 0))
    hist = hist.reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape(tuple(-1 if k == d else 1 for k in range(len(edges))))
    return hist


def _points(self: Any, dims: int) -> Any:
    return self.reshape(-1, dims)


def _fail(message: str) -> None:
    raise RuntimeError(message)


def _check_histogram(self: Any, bins: Sequence[Any], bounds: Sequence[float] | None, weight: Any) -> None:
    """PyTorch's argument checks, on meta tensors (its histogram kernels exist on CPU only)."""
    dims = self.shape[-1] if self.dim() else 1
    if not (self.dtype.is_floating_point and self.dtype.itemsize >= 4):
        raise NotImplementedError(f'"histogramdd" not implemented for {self.dtype}')
    if len(bins) != dims:
        _fail("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    for d, b in enumerate(bins):
        if not isinstance(b, torch.Tensor):
            if b <= 0:
                _fail(f"torch.histogram(): bins must be > 0, but got {b} for dimension {d}")
        elif b.dtype != self.dtype:
            _fail(f"torch.histogramdd: input tensor and bins tensors should have the same dtype, but got input with "
                  f"dtype {self.dtype} and bins for dimension {d} with dtype {b.dtype}")
        elif b.dim() != 1:
            _fail(f"torch.histogramdd: bins tensor should have one dimension, but got {b.dim()} dimensions in the "
                  f"bins tensor for dimension {d}")
    for d in range(len(bounds or ()) // 2):
        low, high = bounds[2 * d], bounds[2 * d + 1]
        if not (math.isfinite(low) and math.isfinite(high)):
            _fail(f"torch.histogramdd: dimension {d}'s range [{low}, {high}] is not finite")
        if low > high:
            _fail(f"torch.histogramdd: min should not exceed max, but got min {low} max {high} for dimension {d}")
    if weight is not None and weight.numel() * dims != self.numel():
        _fail("torch.histogramdd: if weight tensor is provided it should have the same shape as the input tensor "
              "excluding its innermost dimension")


def _histogram_meta(self: Any, edges: Sequence[int]) -> Any:
    return self.new_empty(tuple(e - 1 for e in edges))


@torch.library.register_fake("aten::histogram.bin_ct")
def _histogram_bin_ct_meta(self: Any, bins: int = 100, *, range: Any = None, weight: Any = None,  # noqa: A002
                           density: bool = False) -> tuple[Any, Any]:
    _check_histogram(self.reshape(-1, 1), [bins], range, weight)
    return _histogram_meta(self, [bins + 1]), self.new_empty((bins + 1,))


@torch.library.register_fake("aten::histogram.bins_tensor")
def _histogram_bins_tensor_meta(self: Any, bins: Any, *, weight: Any = None, density: bool = False) -> tuple[Any, Any]:
    _check_histogram(self.reshape(-1, 1), [bins], None, weight)
    return _histogram_meta(self, [bins.numel()]), self.new_empty((bins.numel(),))


@torch.library.register_fake("aten::_histogramdd_bin_edges")
def _histogramdd_bin_edges_meta(self: Any, bins: Sequence[int], *, range: Any = None,  # noqa: A002
                                weight: Any = None, density: bool = False) -> list[Any]:
    _check_histogram(self, bins, range, weight)
    return [self.new_empty((b + 1,)) for b in bins]


@torch.library.register_fake("aten::_histogramdd_from_bin_cts")
def _histogramdd_from_bin_cts_meta(self: Any, bins: Sequence[int], *, range: Any = None,  # noqa: A002
                                   weight: Any = None, density: bool = False) -> Any:
    _check_histogram(self, bins, range, weight)
    return _histogram_meta(self, [b + 1 for b in bins])


@torch.library.register_fake("aten::_histogramdd_from_bin_tensors")
def _histogramdd_from_bin_tensors_meta(self: Any, bins: Sequence[Any], *, weight: Any = None,
                                       density: bool = False) -> Any:
    _check_histogram(self, bins, None, weight)
    return _histogram_meta(self, [b.numel() for b in bins])


@register(aten.histogram.bin_ct)
def histogram(self: Any, bins: int = 100, *, range: Sequence[float] | None = None,  # noqa: A002
              weight: Any = None, density: bool = False) -> tuple[Any, Any]:
    points = _points(self, 1)
    (edges,) = _uniform_edges(points, [bins], range)
    return _histogram_nd(points, [edges], weight, density), edges


@register(aten.histogram.bins_tensor)
def histogram_bins_tensor(self: Any, bins: Any, *, weight: Any = None, density: bool = False) -> tuple[Any, Any]:
    edges = bins.astype(self.dtype)
    return _histogram_nd(_points(self, 1), [edges], weight, density), edges


@register(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self: Any, bins: Sequence[int], *, range: Sequence[float] | None = None,  # noqa: A002
                          weight: Any = None, density: bool = False) -> list[Any]:
    return _uniform_edges(_points(self, self.shape[-1]), bins, range)


@register(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self: Any, bins: Sequence[int], *, range: Sequence[float] | None = None,  # noqa: A002
                             weight: Any = None, density: bool = False) -> Any:
    points = _points(self, self.shape[-1])
    return _histogram_nd(points, _uniform_edges(points, bins, range), weight, density)


@register(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self: Any, bins: Sequence[Any], *, weight: Any = None,
                                 density: bool = False) -> Any:
    return _histogram_nd(_points(self, self.shape[-1]), [b.astype(self.dtype) for b in bins], weight, density)


# --- segment reductions ----------------------------------------------------------------------
# PyTorch's checks that lengths are non-negative and cover the axis exactly need their values on the
# host and are not made; elements outside every [offsets[s], offsets[s+1]) are left out, as on CPU.


def _segments(data: Any, lengths: Any, offsets: Any, indices: Any, axis: int) -> tuple[Any, Any, Any, tuple]:
    """data as rows (elements x trailing), the segment of each row (B*S where it belongs to none), every
    segment's element count, and the output shape."""
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    axis = axis % data.ndim
    if offsets is None:
        ends = jnp.cumsum(lengths.astype(np.int64), axis=-1)
        offsets = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends], axis=-1)
    lead, size, trailing = data.shape[:axis], data.shape[axis], data.shape[axis + 1:]
    batches, count = math.prod(lead), offsets.shape[-1] - 1
    bounds = offsets.reshape(batches, count + 1).astype(np.int64)
    positions = jnp.arange(size, dtype=np.int64)
    segment = jax.vmap(lambda row: jnp.searchsorted(row, positions, side="right"))(bounds) - 1
    inside = (segment >= 0) & (segment < count)
    ids = jnp.where(inside, segment + count * jnp.arange(batches)[:, None], batches * count).reshape(-1)
    rows = data.reshape(batches * size, math.prod(trailing))
    sizes = jnp.diff(bounds, axis=-1).reshape(-1)
    return rows, ids, sizes, (*lead, count, *trailing)


def _rounded_fold(kind: str, rows: Any, ids: Any, segments: int, start: Any, dtype: Any) -> Any:
    """Each segment's sum or product folded from `start` element by element in order, rounding every step to
    `dtype` (a half type) as PyTorch's CPU kernel accumulates: a float32 total would round once and differ."""
    combine = jnp.multiply if kind == "prod" else jnp.add
    first = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
    start = jnp.asarray(start, rows.dtype)

    def step(total: Any, row: tuple[Any, Any]) -> tuple[Any, Any]:
        value, fresh = row
        total = pointwise.rounded_like(combine(jnp.where(fresh, start, total), value), dtype)
        return total, total

    _, running = jax.lax.scan(step, jnp.zeros_like(rows[0]), (rows, first))
    last = jax.ops.segment_max(jnp.arange(rows.shape[0]), ids, num_segments=segments)
    return jnp.where((last >= 0)[:, None], running[jnp.clip(last, 0)], start)


def _segment_total(kind: str, rows: Any, ids: Any, segments: int) -> Any:
    reduce = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum, "max": jax.ops.segment_max,
              "min": jax.ops.segment_min, "prod": jax.ops.segment_prod}[kind]
    return reduce(rows, ids, num_segments=segments)


@register(aten.segment_reduce.default)
def segment_reduce(data: Any, reduce: str, *, lengths: Any = None, indices: Any = None, offsets: Any = None,
                   axis: int = 0, unsafe: bool = False, initial: Any = None) -> Any:
    """`initial` joins every segment's reduction (a mean counts only the elements); an empty segment gives
    `initial`, else the reduction's identity (NaN for a mean)."""
    rows, ids, sizes, shape = _segments(_opmath(data), lengths, offsets, indices, axis)
    segments = sizes.shape[0]
    if np.dtype(data.dtype).name in _HALF and reduce in ("sum", "mean", "prod"):
        start = (1 if reduce == "prod" else 0) if initial is None else initial
        total = _rounded_fold(reduce, rows, ids, segments, start, data.dtype)
    else:
        total = _segment_total(reduce, rows, ids, segments)
        if initial is not None:
            combine = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "prod": jnp.multiply}
            total = combine[reduce](total, jnp.asarray(initial, total.dtype))
    if reduce == "mean":
        count = sizes[:, None].astype(total.dtype)
        total = jnp.where(count == 0, jnp.nan if initial is None else total, total / jnp.maximum(count, 1))
    return total.reshape(shape)


@register(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad: Any, output: Any, data: Any, reduce: str, *, lengths: Any = None,
                            offsets: Any = None, axis: int = 0, initial: Any = None) -> Any:
    """PyTorch's gradients: a max/min's shared evenly by the elements equal to it (NaN counting as equal), a
    product's as output / x, or for a zero or NaN x the product of the others (with `initial`)."""
    rows, ids, sizes, _ = _segments(_opmath(data), lengths, offsets, None, axis)
    segments = sizes.shape[0]
    # one dropped row past the segments: elements outside every segment gather zeros
    pad = lambda x: jnp.concatenate([x.reshape(segments, -1), jnp.zeros_like(x.reshape(segments, -1)[:1])])
    g, out = pad(_opmath(grad))[ids], pad(_opmath(output))[ids]
    if reduce == "sum":
        result = g
    elif reduce == "mean":
        result = g / jnp.maximum(pad(sizes.astype(g.dtype))[ids], 1)
    elif reduce in ("max", "min"):
        hit = (rows == out) | (jnp.isnan(rows) & jnp.isnan(out))
        ties = jax.ops.segment_sum(hit.astype(g.dtype), ids, num_segments=segments)
        result = jnp.where(hit, g / pad(jnp.maximum(ties, 1))[ids], 0)
    else:
        special = (rows == 0) | jnp.isnan(rows)
        count = lambda mask: pad(jax.ops.segment_sum(mask.astype(np.int64), ids, num_segments=segments))[ids] - mask
        zeros, nans = count(rows == 0), count(jnp.isnan(rows))
        regular = jax.ops.segment_prod(jnp.where(special, 1, rows), ids, num_segments=segments)
        if initial is not None:
            regular = regular * jnp.asarray(initial, regular.dtype)
        regular = pad(regular)[ids]
        others = jnp.where(nans > 0, jnp.nan, jnp.where(zeros > 0, 0 * regular, regular))
        result = jnp.where(special, g * others, g * out / jnp.where(special, 1, rows))
    return result.reshape(data.shape)


# --- scans -----------------------------------------------------------------------------------


def _along(fn: Callable, dim: int, x: Any, *others: Any) -> Any:
    """fn(x, *others, axis=dim); 0-d tensors (where PyTorch accepts dim 0 or -1) act as 1-vectors."""
    if x.ndim == 0:
        return fn(x.reshape(1), *(o.reshape(1) for o in others), axis=0).reshape(())
    return fn(x, *others, axis=dim % x.ndim)


@register(aten.cumsum.default)
def cumsum(self: Any, dim: int, *, dtype: torch.dtype | None = None) -> Any:
    return _along(jnp.cumsum, dim, accumulate(self, dtype))


@register(aten.cumprod.default)
def cumprod(self: Any, dim: int, *, dtype: torch.dtype | None = None) -> Any:
    return _along(jnp.cumprod, dim, accumulate(self, dtype))


def _cumulative_logaddexp(x: Any, axis: int) -> Any:
    """Complex values fold left one step at a time like PyTorch, so the branch of the log matches."""
    if np.dtype(x.dtype).kind != "c":
        return jax.lax.cumlogsumexp(x, axis=axis)

    def step(total: Any, value: Any) -> tuple[Any, Any]:
        total = pointwise.logaddexp(total, value)
        return total, total

    moved = jnp.moveaxis(x, axis, 0)
    _, folded = jax.lax.scan(step, jnp.full(moved.shape[1:], -jnp.inf, x.dtype), moved)
    return jnp.moveaxis(folded, 0, axis)


@register(aten.logcumsumexp.default)
def logcumsumexp(self: Any, dim: int) -> Any:
    return _along(_cumulative_logaddexp, dim, _opmath(self))


def _running_extreme(x: Any, dim: int, better: Callable) -> tuple[Any, Any]:
    """Running extreme with the index of its latest occurrence; NaN wins and sticks, as in PyTorch."""
    floating = np.dtype(x.dtype).kind in "fc"

    def combine(earlier: tuple[Any, Any], later: tuple[Any, Any]) -> tuple[Any, Any]:
        (v1, i1), (v2, i2) = earlier, later
        take = jnp.isnan(v2) | (~jnp.isnan(v1) & better(v2, v1)) if floating else better(v2, v1)
        return jnp.where(take, v2, v1), jnp.where(take, i2, i1)

    def scan(values: Any, axis: int) -> tuple[Any, Any]:
        index = jax.lax.broadcasted_iota(np.int64, values.shape, axis)
        return jax.lax.associative_scan(combine, (values, index), axis=axis)

    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return scan(x, dim % x.ndim)


@register(aten.cummax.default)
def cummax(self: Any, dim: int) -> tuple[Any, Any]:
    return _running_extreme(self, dim, jnp.greater_equal)


@register(aten.cummin.default)
def cummin(self: Any, dim: int) -> tuple[Any, Any]:
    return _running_extreme(self, dim, jnp.less_equal)


# --- softmax ---------------------------------------------------------------------------------


def _softmax_along(x: Any, axis: int) -> Any:
    shifted = jnp.exp(x - jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf))
    return shifted / jnp.sum(shifted, axis=axis, keepdims=True)


def _log_softmax_along(x: Any, axis: int) -> Any:
    shifted = x - jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def _softmax_grad_along(g: Any, y: Any, axis: int) -> Any:
    return y * (g - jnp.sum(g * y, axis=axis, keepdims=True))


def _log_softmax_grad_along(g: Any, y: Any, axis: int) -> Any:
    return g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True)


@register(aten._softmax.default)
def _softmax(self: Any, dim: int, half_to_float: bool) -> Any:
    return _along(_softmax_along, dim, _opmath(self))


@register(aten._log_softmax.default)
def _log_softmax(self: Any, dim: int, half_to_float: bool) -> Any:
    return _along(_log_softmax_along, dim, _opmath(self))


@register(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output: Any, output: Any, dim: int, input_dtype: torch.dtype) -> Any:
    return _along(_softmax_grad_along, dim, _opmath(grad_output), _opmath(output))


@register(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output: Any, output: Any, dim: int, input_dtype: torch.dtype) -> Any:
    return _along(_log_softmax_grad_along, dim, _opmath(grad_output), _opmath(output))
