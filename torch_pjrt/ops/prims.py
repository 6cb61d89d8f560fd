"""PyTorch prims (torch._prims), the targets of the torch._refs decompositions.

Prims see operands already promoted by the refs, so the elementwise ones reuse the ATen
pointwise lowerings (whose promotion is then the identity) instead of repeating them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.ops import casts, pointwise, reductions
from torch_pjrt.ops.registry import LOWERINGS, register

aten = torch.ops.aten
prims = torch.ops.prims

# prim -> the ATen overload whose lowering computes it
SAME_AS_ATEN: dict[Any, Any] = {
    prims.abs.default: aten.abs.default, prims.acos.default: aten.acos.default,
    prims.acosh.default: aten.acosh.default, prims.asin.default: aten.asin.default,
    prims.asinh.default: aten.asinh.default, prims.atan.default: aten.atan.default,
    prims.atanh.default: aten.atanh.default, prims.bessel_i0.default: aten.i0.default,
    prims.bessel_i0e.default: aten.special_i0e.default, prims.bessel_i1.default: aten.special_i1.default,
    prims.bessel_i1e.default: aten.special_i1e.default, prims.bessel_j0.default: aten.special_bessel_j0.default,
    prims.bessel_j1.default: aten.special_bessel_j1.default, prims.bitwise_not.default: aten.bitwise_not.default,
    prims.ceil.default: aten.ceil.default, prims.conj_physical.default: aten.conj_physical.default,
    prims.cos.default: aten.cos.default, prims.cosh.default: aten.cosh.default,
    prims.digamma.default: aten.digamma.default, prims.erf.default: aten.erf.default,
    prims.erf_inv.default: aten.erfinv.default, prims.erfc.default: aten.erfc.default,
    prims.erfcx.default: aten.special_erfcx.default, prims.exp.default: aten.exp.default,
    prims.exp2.default: aten.exp2.default, prims.expm1.default: aten.expm1.default,
    prims.floor.default: aten.floor.default, prims.isfinite.default: aten.isfinite.default,
    prims.lgamma.default: aten.lgamma.default, prims.log.default: aten.log.default,
    prims.log10.default: aten.log10.default, prims.log1p.default: aten.log1p.default,
    prims.log2.default: aten.log2.default, prims.ndtri.default: aten.special_ndtri.default,
    prims.neg.default: aten.neg.default, prims.reciprocal.default: aten.reciprocal.default,
    prims.round.default: aten.round.default, prims.rsqrt.default: aten.rsqrt.default,
    prims.sign.default: aten.sign.default, prims.signbit.default: aten.signbit.default,
    prims.sin.default: aten.sin.default, prims.sinh.default: aten.sinh.default,
    prims.sqrt.default: aten.sqrt.default, prims.tan.default: aten.tan.default,
    prims.tanh.default: aten.tanh.default, prims.trunc.default: aten.trunc.default,
    prims.add.default: aten.add.Tensor, prims.sub.default: aten.sub.Tensor, prims.mul.default: aten.mul.Tensor,
    prims.atan2.default: aten.atan2.default, prims.bitwise_and.default: aten.bitwise_and.Tensor,
    prims.bitwise_or.default: aten.bitwise_or.Tensor, prims.bitwise_xor.default: aten.bitwise_xor.Tensor,
    prims.eq.default: aten.eq.Tensor, prims.ne.default: aten.ne.Tensor, prims.ge.default: aten.ge.Tensor,
    prims.gt.default: aten.gt.Tensor, prims.le.default: aten.le.Tensor, prims.lt.default: aten.lt.Tensor,
    prims.fmax.default: aten.fmax.default, prims.fmin.default: aten.fmin.default,
    prims.fmod.default: aten.fmod.Tensor, prims.gcd.default: aten.gcd.default,
    prims.hypot.default: aten.hypot.default, prims.igamma.default: aten.igamma.default,
    prims.igammac.default: aten.igammac.default, prims.maximum.default: aten.maximum.default,
    prims.minimum.default: aten.minimum.default, prims.nextafter.default: aten.nextafter.default,
    prims.pow.default: aten.pow.Tensor_Tensor, prims.remainder.default: aten.remainder.Tensor,
    prims.shift_left.default: aten.bitwise_left_shift.Tensor,
    prims.shift_right_arithmetic.default: aten.bitwise_right_shift.Tensor,
    prims.zeta.default: aten.special_zeta.default, prims.where.default: aten.where.self,
}

for _prim, _aten in SAME_AS_ATEN.items():
    LOWERINGS[_prim] = LOWERINGS[_aten]


# --- elementwise prims with no ATen twin -------------------------------------------------------


@register(prims.div.default)
def div(self: Any, other: Any) -> Any:
    """True division for floats, truncation for integers."""
    a, b = pointwise.promote(self, other)
    return jax.lax.div(*jnp.broadcast_arrays(a, b)) if pointwise.is_integral(a) else pointwise.true_divide(a, b)


@register(prims.cbrt.default)
def cbrt(self: Any) -> Any:
    return jnp.cbrt(self)


@register(prims.spherical_bessel_j0.default)
def spherical_bessel_j0(self: Any) -> Any:
    safe = jnp.where(self == 0, 1, self)
    return jnp.where(self == 0, 1, jnp.sin(safe) / safe)


@register(prims.real.default)
def real(self: Any) -> Any:
    return jnp.real(self)


@register(prims.imag.default)
def imag(self: Any) -> Any:
    return jnp.imag(self)


@register(prims.conj.default)
def conj(a: Any) -> Any:
    return jnp.conj(a)


@register(prims.frexp.default)
def frexp(self: Any) -> tuple[Any, Any]:
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(np.int32)


# --- dtype, copies and fills --------------------------------------------------------------------


@register(prims.convert_element_type.default)
def convert_element_type(a: Any, dtype: torch.dtype) -> Any:
    return casts.convert(a, dtype)


@register(prims.view_of_dtype.default)
def view_of_dtype(a: Any, dtype: torch.dtype) -> Any:
    return jax.lax.bitcast_convert_type(a, storage.numpy_dtype(dtype))


@register(prims.clone.default)
def clone(self: Any, *, memory_format: Any = None) -> Any:
    return self


@register(prims.view_of.default, prims.copy_strided.default, prims.device_put.default)
def view_of(a: Any, *_: Any, **__: Any) -> Any:
    """Layout and placement are the caller's business: the values are unchanged."""
    return a


@register(prims.copy_to.default)
def copy_to(a: Any, b: Any) -> Any:
    return jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape)


@register(prims.fill.default)
def fill(self: Any, value: Any) -> Any:
    return jnp.full(self.shape, value, self.dtype)


@register(prims.full.default)
def full(shape: Sequence[int], fill_value: Any, *, dtype: torch.dtype, **_: Any) -> Any:
    return jnp.full(tuple(shape), fill_value, storage.numpy_dtype(dtype))


@register(prims.full_like.default)
def full_like(a: Any, fill_value: Any, *, dtype: torch.dtype, **_: Any) -> Any:
    return jnp.full(a.shape, fill_value, storage.numpy_dtype(dtype))


@register(prims.scalar_tensor.default)
def scalar_tensor(s: Any, *, dtype: torch.dtype | None = None, device: Any = None) -> Any:
    return jnp.asarray(s, storage.numpy_dtype(dtype or torch.get_default_dtype()))


@register(prims.empty.default, prims.empty_strided.default, prims.empty_permuted.default)
def empty(shape: Sequence[int], *_: Any, dtype: torch.dtype, **__: Any) -> Any:
    return jnp.zeros(tuple(shape), storage.numpy_dtype(dtype))


@register(prims.iota.default)
def iota(length: int, *, start: Any, step: Any, dtype: torch.dtype, **_: Any) -> Any:
    return start + step * jnp.arange(length, dtype=storage.numpy_dtype(dtype))


# --- shapes ------------------------------------------------------------------------------------


@register(prims.broadcast_in_dim.default)
def broadcast_in_dim(a: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int]) -> Any:
    return jax.lax.broadcast_in_dim(jnp.asarray(a), tuple(shape), tuple(broadcast_dimensions))


@register(prims.squeeze.default)
def squeeze(a: Any, dimensions: Sequence[int]) -> Any:
    return jnp.squeeze(a, tuple(d % a.ndim for d in dimensions)) if dimensions else a


@register(prims.transpose.default)
def transpose(a: Any, permutation: Sequence[int]) -> Any:
    return jnp.transpose(a, tuple(permutation))


@register(prims.reshape.default)
def reshape(a: Any, shape: Sequence[int]) -> Any:
    return jnp.reshape(a, tuple(shape))


@register(prims.collapse.default, prims.collapse_view.default)
def collapse(a: Any, start: int, end: int) -> Any:
    """Merges dims start..end inclusive."""
    shape = a.shape if a.ndim else (1,)
    return jnp.reshape(a, (*shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:]))


@register(prims.split_dim.default)
def split_dim(a: Any, dim: int, outer_length: int) -> Any:
    return jnp.reshape(a, (*a.shape[:dim], outer_length, a.shape[dim] // outer_length, *a.shape[dim + 1:]))


@register(prims.rev.default)
def rev(a: Any, dims: Sequence[int]) -> Any:
    return jnp.flip(a, tuple(dims)) if dims else a


@register(prims.cat.default)
def cat(tensors: Sequence[Any], dim: int) -> Any:
    return jnp.concatenate([jnp.asarray(t) for t in tensors], axis=dim)


# --- reductions ---------------------------------------------------------------------------------


def _axes(inp: Any, dims: Sequence[int] | None) -> tuple[int, ...]:
    """The refs pass the reduced dims explicitly: an empty list reduces nothing."""
    return reductions.axes(inp, dims, empty_means_all=False)


def _cast(result: Any, output_dtype: torch.dtype | None) -> Any:
    return result if output_dtype is None else result.astype(storage.numpy_dtype(output_dtype))


@register(prims.sum.default)
def sum(inp: Any, dims: Sequence[int] | None, *, output_dtype: torch.dtype | None = None) -> Any:  # noqa: A001
    return _cast(jnp.sum(inp, axis=_axes(inp, dims)), output_dtype)


@register(prims.prod.default)
def prod(inp: Any, dims: Sequence[int] | None, *, output_dtype: torch.dtype | None = None) -> Any:
    return _cast(jnp.prod(inp, axis=_axes(inp, dims)), output_dtype)


@register(prims.amax.default)
def amax(inp: Any, dims: Sequence[int] | None, *, output_dtype: torch.dtype | None = None) -> Any:
    return _cast(reductions.extreme(jnp.max, inp, _axes(inp, dims)), output_dtype)


@register(prims.amin.default)
def amin(inp: Any, dims: Sequence[int] | None, *, output_dtype: torch.dtype | None = None) -> Any:
    return _cast(reductions.extreme(jnp.min, inp, _axes(inp, dims)), output_dtype)


@register(prims.xor_sum.default)
def xor_sum(inp: Any, dims: Sequence[int] | None, *, output_dtype: torch.dtype | None = None) -> Any:
    axes = _axes(inp, dims)
    return _cast(jax.lax.reduce(inp, np.zeros((), inp.dtype), jax.lax.bitwise_xor, axes), output_dtype)


@register(prims.var.default)
def var(inp: Any, dims: Sequence[int] | None, correction: float | None = 1, *,
        output_dtype: torch.dtype | None = None) -> Any:
    return _cast(reductions.var(inp, dims, correction=correction), output_dtype)


@register(prims.maximum_value.default)
def maximum_value(dtype: torch.dtype) -> Any:
    if dtype is torch.bool:
        return True
    return torch.finfo(dtype).max if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).max


@register(prims.minimum_value.default)
def minimum_value(dtype: torch.dtype) -> Any:
    if dtype is torch.bool:
        return False
    return torch.finfo(dtype).min if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


# --- random draws, FFTs and SVD: the ATen lowerings of their families -----------------------------


def _draw_dtype(dtype: torch.dtype) -> Any:
    """Halves are drawn in float32 and rounded once, like the rest of their arithmetic."""
    return np.float32 if dtype in (torch.float16, torch.bfloat16) else storage.numpy_dtype(dtype)


@register(prims.normal.default, random=True)
def normal(shape: Sequence[int], *, mean: Any, std: Any, dtype: torch.dtype, rng: Any, **_: Any) -> Any:
    return jax.random.normal(rng, tuple(shape), _draw_dtype(dtype)) * std + mean


@register(prims.uniform.default, random=True)
def uniform(shape: Sequence[int], *, low: Any, high: Any, dtype: torch.dtype, rng: Any, **_: Any) -> Any:
    return low + jax.random.uniform(rng, tuple(shape), _draw_dtype(dtype)) * (high - low)


@register(prims.fft_c2c.default)
def fft_c2c(self: Any, *, dim: Sequence[int], forward: bool) -> Any:
    return LOWERINGS[aten._fft_c2c.default].fn(self, list(dim), 0, forward)


@register(prims.fft_r2c.default)
def fft_r2c(self: Any, *, dim: Sequence[int], onesided: bool) -> Any:
    return LOWERINGS[aten._fft_r2c.default].fn(self, list(dim), 0, onesided)


@register(prims.fft_c2r.default)
def fft_c2r(self: Any, *, dim: Sequence[int], last_dim_size: int) -> Any:
    return LOWERINGS[aten._fft_c2r.default].fn(self, list(dim), 0, last_dim_size)


@register(prims.svd.default)
def svd(A: Any, *, full_matrices: bool) -> Any:  # noqa: N803
    return LOWERINGS[aten._linalg_svd.default].fn(A, full_matrices, True)


@register(prims.as_strided_scatter.default)
def as_strided_scatter(self: Any, src: Any, size: Sequence[int], stride: Sequence[int], storage_offset: int) -> Any:
    return LOWERINGS[aten.as_strided_scatter.default].fn(self, src, size, stride, storage_offset)
