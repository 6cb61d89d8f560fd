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
from torch_pjrt.ops import pointwise
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


def _moments(self: Any, dim: Any, correction: Any, keepdim: bool) -> tuple[Any, Any]:
    """(variance, mean); the divisor is max(0, N - correction) as in PyTorch."""
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
    return _moments(self, dim, correction, keepdim)


@register(aten.std_mean.correction)
def std_mean(self: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> tuple[Any, Any]:
    variance, average = _moments(self, dim, correction, keepdim)
    return jnp.sqrt(variance), average


# --- norms and logsumexp ----------------------------------------------------------------------


@register(aten.linalg_vector_norm.default, static_scalars=True)
def linalg_vector_norm(self: Any, ord: float = 2, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
                       dtype: torch.dtype | None = None) -> Any:
    """The ord is static: inf/-inf/0/1/2 have their own formulas."""
    x = jnp.abs(_opmath(self if dtype is None else self.astype(storage.numpy_dtype(dtype))))
    dims = axes(self, dim)
    if ord == math.inf:
        return jnp.max(x, axis=dims, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(x, axis=dims, keepdims=keepdim)
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


@register(aten.amax.default)
def amax(self: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return jnp.max(self, axis=axes(self, dim), keepdims=keepdim)


@register(aten.amin.default)
def amin(self: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return jnp.min(self, axis=axes(self, dim), keepdims=keepdim)


@register(aten.max.default)
def max(self: Any) -> Any:  # noqa: A001
    return jnp.max(self)


@register(aten.min.default)
def min(self: Any) -> Any:  # noqa: A001
    return jnp.min(self)


def _arg_extreme(fn: Callable, x: Any, dim: int | None, keepdim: bool) -> Any:
    """First index of the extreme (NaN counts as the extreme, as in PyTorch)."""
    if dim is None:
        index = fn(x.reshape(-1))
        return jnp.reshape(index, (1,) * x.ndim) if keepdim else index
    if x.ndim == 0:
        return jnp.zeros((), np.int64)
    return fn(x, axis=dim % x.ndim, keepdims=keepdim)


@register(aten.argmax.default)
def argmax(self: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg_extreme(jnp.argmax, self, dim, keepdim)


@register(aten.argmin.default)
def argmin(self: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg_extreme(jnp.argmin, self, dim, keepdim)


@register(aten.max.dim)
def max_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return amax(self, [dim], keepdim), argmax(self, dim, keepdim)


@register(aten.min.dim)
def min_dim(self: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
    return amin(self, [dim], keepdim), argmin(self, dim, keepdim)


@register(aten.aminmax.default)
def aminmax(self: Any, *, dim: int | None = None, keepdim: bool = False) -> tuple[Any, Any]:
    dims = axes(self, dim)
    if dim is None and keepdim:
        return jnp.min(self, axis=dims, keepdims=True), jnp.max(self, axis=dims, keepdims=True)
    return jnp.min(self, axis=dims, keepdims=keepdim), jnp.max(self, axis=dims, keepdims=keepdim)


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
