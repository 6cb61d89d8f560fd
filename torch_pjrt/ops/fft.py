"""torch.fft: the three ATen primitives every torch.fft function reaches.

ATen's `normalization` is applied after an unscaled transform in either direction:
0 = none, 1 = 1/sqrt(n), 2 = 1/n, n being the signal size (the output size for c2r).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt.ops.registry import register

aten = torch.ops.aten


def _axes(dim: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(d % ndim for d in dim)


def _normalized(x: Any, normalization: int, n: int) -> Any:
    if normalization == 0 or n == 0:
        return x
    scale = 1 / math.sqrt(n) if normalization == 1 else 1 / n
    return x * jnp.asarray(scale, x.real.dtype)


@register(aten._fft_r2c.default)
def _fft_r2c(self: Any, dim: list[int], normalization: int, onesided: bool) -> Any:
    """onesided halves the last of `dim`, like rfftn."""
    axes = _axes(dim, self.ndim)
    x = self if jnp.issubdtype(self.dtype, jnp.floating) and self.dtype.itemsize >= 4 else self.astype(jnp.float32)
    out = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(x, axes=axes)
    return _normalized(out, normalization, math.prod(self.shape[a] for a in axes))


@register(aten._fft_c2c.default)
def _fft_c2c(self: Any, dim: list[int], normalization: int, forward: bool) -> Any:
    axes = _axes(dim, self.ndim)
    out = jnp.fft.fftn(self, axes=axes) if forward else jnp.fft.ifftn(self, axes=axes, norm="forward")
    return _normalized(out, normalization, math.prod(self.shape[a] for a in axes))


@register(aten._fft_c2r.default)
def _fft_c2r(self: Any, dim: list[int], normalization: int, last_dim_size: int) -> Any:
    axes = _axes(dim, self.ndim)
    sizes = [self.shape[a] for a in axes[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(self, s=sizes, axes=axes, norm="forward")
    return _normalized(out, normalization, math.prod(sizes))
