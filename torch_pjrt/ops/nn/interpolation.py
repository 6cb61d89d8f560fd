"""Upsampling (nearest, linear, cubic, antialiased) and grid sampling.

Source positions and weights are trace-time numpy tables, so interpolation is gathers and sums.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt.ops.nn.common import _masked, _transpose_of, _up, _vjp
from torch_pjrt.ops.registry import register

aten = torch.ops.aten

# Source positions are computed at trace time in numpy with PyTorch's formulas and precision
# (float32 scales unless the input is float64), then each spatial dim is interpolated in turn.

CUBIC_A = -0.75


def _index_dtype(x: Any) -> Any:
    return np.float64 if x.dtype == jnp.float64 else np.float32


def _scale(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any) -> Any:
    if align_corners:
        return dtype((size - 1) / (out - 1)) if out > 1 else dtype(0)
    if scale is not None and scale > 0:
        return dtype(1.0 / scale)
    return dtype(size / out)


def _nearest_taps(size: int, out: int, scale: float | None, exact: bool) -> list[tuple[np.ndarray, None]]:
    ratio = _scale(size, out, scale, False, np.float32)
    offset = np.float32(0.5) if exact else np.float32(0)
    source = np.floor((np.arange(out, dtype=np.float32) + offset) * ratio).astype(np.int64)
    return [(np.minimum(source, size - 1), None)]


def _source(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any) -> np.ndarray:
    ratio = _scale(size, out, scale, align_corners, dtype)
    index = np.arange(out, dtype=dtype)
    if align_corners:
        return ratio * index
    return ratio * (index + dtype(0.5)) - dtype(0.5)


def _linear_taps(size: int, out: int, scale: float | None, align_corners: bool,
                 dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    source = np.maximum(_source(size, out, scale, align_corners, dtype), dtype(0))
    low = source.astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    frac = (source - low).astype(dtype)
    return [(low, dtype(1) - frac), (high, frac)]


def _cubic_taps(size: int, out: int, scale: float | None, align_corners: bool,
                dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    source = _source(size, out, scale, align_corners, dtype)
    base = np.floor(source)
    t = (source - base).astype(dtype)
    cubic = _cubic_filter(dtype(CUBIC_A))
    weights = [cubic(t + 1), cubic(t), cubic(1 - t), cubic(2 - t)]
    return [(np.clip(base.astype(np.int64) - 1 + j, 0, size - 1), w.astype(dtype)) for j, w in enumerate(weights)]


def _cubic_filter(a: float, xp: Any = np) -> Callable[[Any], Any]:
    """Keys' cubic convolution kernel with parameter a, on numpy (trace-time weights) or jax arrays."""

    def cubic(v: Any) -> Any:
        v = xp.abs(v)
        near = ((a + 2) * v - (a + 3)) * v * v + 1
        far = ((a * v - 5 * a) * v + 8 * a) * v - 4 * a
        return xp.where(v < 1, near, xp.where(v < 2, far, 0))

    return cubic


def _triangle_filter(v: np.ndarray) -> np.ndarray:
    return np.maximum(1 - np.abs(v), 0)


def _antialias_taps(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any, support: int,
                    kernel: Callable[[np.ndarray], np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """PyTorch's antialiased weights: the filter stretched by the downscale factor, normalized per output."""
    ratio = _scale(size, out, scale, align_corners, dtype)
    stretch = max(float(ratio), 1.0)
    reach = support / 2 * stretch
    center = ratio * (np.arange(out, dtype=dtype) + dtype(0.5))
    low = np.maximum((center - reach + 0.5).astype(np.int64), 0)
    count = np.minimum((center + reach + 0.5).astype(np.int64), size) - low
    offsets = np.arange(int(count.max()))
    weights = kernel(((offsets + low[:, None]).astype(dtype) - center[:, None] + dtype(0.5)) / dtype(stretch))
    weights = np.where(offsets < count[:, None], weights, 0).astype(dtype)
    total = weights.sum(axis=1, keepdims=True)
    weights = np.where(total != 0, weights / np.where(total != 0, total, 1), weights)
    return [(np.clip(low + j, 0, size - 1), weights[:, j]) for j in offsets]


def _bilinear_aa_taps(size: int, out: int, scale: float | None, align_corners: bool,
                      dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    return _antialias_taps(size, out, scale, align_corners, dtype, 2, _triangle_filter)


def _bicubic_aa_taps(size: int, out: int, scale: float | None, align_corners: bool,
                     dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    return _antialias_taps(size, out, scale, align_corners, dtype, 4, _cubic_filter(-0.5))


def _interpolate(x: Any, taps_per_dim: Sequence[list[tuple[np.ndarray, np.ndarray | None]]]) -> Any:
    """Apply per-dimension taps (indices, weights) to x's trailing dims, one dimension at a time."""
    rank = len(taps_per_dim)
    for d, taps in enumerate(taps_per_dim):
        axis = x.ndim - rank + d
        shape = (-1,) + (1,) * (x.ndim - axis - 1)
        total = None
        for index, weight in taps:
            term = jnp.take(x, index, axis=axis)
            if weight is not None:
                term = term * jnp.asarray(weight, x.dtype).reshape(shape)
            total = term if total is None else total + term
        x = total
    return x


def _scales(rank: int, values: Sequence[float | None]) -> list[float | None]:
    return list(values) + [None] * (rank - len(values))


def _nearest(x: Any, output_size: Sequence[int], scales: Sequence[float | None], exact: bool) -> Any:
    rank = len(output_size)
    taps = [_nearest_taps(s, int(o), sc, exact)
            for s, o, sc in zip(x.shape[-rank:], output_size, _scales(rank, scales))]
    return _interpolate(x, taps)


def _smooth(x: Any, output_size: Sequence[int], align_corners: bool, scales: Sequence[float | None],
            taps_for: Callable) -> Any:
    rank = len(output_size)
    dtype = _index_dtype(x)
    taps = [taps_for(s, int(o), sc, align_corners, dtype)
            for s, o, sc in zip(x.shape[-rank:], output_size, _scales(rank, scales))]
    return _interpolate(_up(x), taps)


@register(aten.upsample_nearest1d.default, aten.upsample_nearest2d.default, aten.upsample_nearest3d.default)
def upsample_nearest(self: Any, output_size: Sequence[int], *scales: float | None) -> Any:
    return _nearest(self, output_size, scales, exact=False)


@register(aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact2d.default,
          aten._upsample_nearest_exact3d.default)
def _upsample_nearest_exact(self: Any, output_size: Sequence[int], *scales: float | None) -> Any:
    return _nearest(self, output_size, scales, exact=True)


@register(aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
          aten.upsample_nearest3d_backward.default)
def upsample_nearest_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                              *scales: float | None) -> Any:
    return _transpose_of(lambda x: _nearest(x, output_size, scales, exact=False), grad_output, input_size)


@register(aten._upsample_nearest_exact1d_backward.default, aten._upsample_nearest_exact2d_backward.default,
          aten._upsample_nearest_exact3d_backward.default)
def _upsample_nearest_exact_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                     *scales: float | None) -> Any:
    return _transpose_of(lambda x: _nearest(x, output_size, scales, exact=True), grad_output, input_size)


@register(aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default)
def upsample_linear(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _linear_taps)


@register(aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
          aten.upsample_trilinear3d_backward.default)
def upsample_linear_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                             align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _linear_taps), grad_output,
                         input_size)


@register(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _cubic_taps)


@register(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _cubic_taps), grad_output,
                         input_size)


@register(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self: Any, output_size: Sequence[int], align_corners: bool,
                            *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _bilinear_aa_taps)


@register(aten._upsample_bilinear2d_aa_backward.default)
def _upsample_bilinear2d_aa_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                     align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _bilinear_aa_taps), grad_output,
                         input_size)


@register(aten._upsample_bicubic2d_aa.default)
def _upsample_bicubic2d_aa(self: Any, output_size: Sequence[int], align_corners: bool,
                           *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _bicubic_aa_taps)


@register(aten._upsample_bicubic2d_aa_backward.default)
def _upsample_bicubic2d_aa_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                    align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _bicubic_aa_taps), grad_output,
                         input_size)


# --- grid sampling ----------------------------------------------------------------------------------

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _unnormalize(coord: Any, size: int, align_corners: bool) -> Any:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord: Any, twice_low: int, twice_high: int) -> Any:
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinate(coord: Any, size: int, padding_mode: int, align_corners: bool) -> Any:
    """Map a source coordinate into the image for border/reflection padding (zeros leaves it)."""
    if padding_mode == BORDER:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == REFLECTION:
        reflected = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        return jnp.clip(reflected, 0, size - 1)
    return coord


def _sample(input: Any, indices: Sequence[Any], weights: Any) -> Any:
    """Sum over taps (last dim) of weights * input[n, :, i_1, ..., i_r], out-of-bounds taps reading zero.

    indices (one per spatial dim, outermost first) and weights: (N, *out, taps); one gather for all taps.
    """
    n, c, *sizes = input.shape
    inside = jnp.ones(weights.shape, jnp.bool_)
    flat = jnp.zeros(weights.shape, jnp.int64)
    for index, size in zip(indices, sizes):
        inside = inside & (index >= 0) & (index < size)
        flat = flat * size + jnp.clip(index, 0, size - 1)
    values = jnp.take_along_axis(input.reshape(n, c, -1), flat.reshape(n, 1, -1), axis=2)
    values = values.reshape((n, c) + flat.shape[1:])
    return jnp.sum(values * jnp.where(inside, weights, 0)[:, None], axis=-1)


def _grid_coordinates(input: Any, grid: Any, align_corners: bool) -> list[Any]:
    """Source coordinates per spatial dim, outermost first (the grid's last axis lists them innermost first)."""
    sizes = input.shape[2:]
    rank = len(sizes)
    return [_unnormalize(grid[..., rank - 1 - d], size, align_corners) for d, size in enumerate(sizes)]


def _grid_sample_bicubic(input: Any, grid: Any, padding_mode: int, align_corners: bool) -> Any:
    height, width = input.shape[-2:]
    y, x = _grid_coordinates(input, grid, align_corners)
    x0, y0 = jnp.floor(x), jnp.floor(y)
    cubic = _cubic_filter(CUBIC_A, jnp)
    taps = [(j, i) for j in range(4) for i in range(4)]
    iy = jnp.stack([_pad_coordinate(y0 - 1 + j, height, padding_mode, align_corners) for j, _ in taps], -1)
    ix = jnp.stack([_pad_coordinate(x0 - 1 + i, width, padding_mode, align_corners) for _, i in taps], -1)
    weights = jnp.stack([cubic(x - x0 + 1 - i) * cubic(y - y0 + 1 - j) for j, i in taps], -1)
    return _sample(input, [iy.astype(jnp.int64), ix.astype(jnp.int64)], weights)


def _grid_sample(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    """grid_sampler_2d and _3d: (bi/tri)linear over the 2^rank neighbours, or the nearest (half to even)."""
    if interpolation_mode == BICUBIC:
        return _grid_sample_bicubic(input, grid, padding_mode, align_corners)
    coords = [_pad_coordinate(c, size, padding_mode, align_corners)
              for c, size in zip(_grid_coordinates(input, grid, align_corners), input.shape[2:])]
    if interpolation_mode == NEAREST:
        indices = [jnp.round(c).astype(jnp.int64)[..., None] for c in coords]
        return _sample(input, indices, jnp.ones(indices[0].shape, input.dtype))
    lows = [jnp.floor(c) for c in coords]
    fracs = [c - low for c, low in zip(coords, lows)]
    corners = list(itertools.product((0, 1), repeat=len(coords)))
    indices = [jnp.stack([low.astype(jnp.int64) + corner[d] for corner in corners], -1) for d, low in enumerate(lows)]
    weights = jnp.stack([math.prod(f if b else 1 - f for f, b in zip(fracs, corner)) for corner in corners], -1)
    return _sample(input, indices, weights)


@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    if interpolation_mode == BICUBIC and input.ndim != 4:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    return _grid_sample(_up(input), _up(grid), interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default, wants_meta=True)
def grid_sampler_backward(grad_output: Any, input: Any, grid: Any, interpolation_mode: int, padding_mode: int,
                          align_corners: bool, output_mask: Sequence[bool], *,
                          out_meta: Sequence[Any] | None = None) -> tuple:
    grads = _vjp(lambda i, g: grid_sampler(i, g, interpolation_mode, padding_mode, align_corners), grad_output,
                 _up(input), _up(grid))
    return _masked(grads, output_mask, out_meta)


