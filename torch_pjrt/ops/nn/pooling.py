"""Max, average, adaptive and fractional pooling, im2col and col2im.

Max pooling keeps a running maximum over kernel offsets (memory O(output)), so its indices (flat
positions in each input plane) follow PyTorch's tie and NaN rules; adaptive pools and im2col gather
their (variable-size) windows explicitly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt.ops.nn.common import _transpose_of, _up, _vjp
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


def _expand(values: Sequence[int], rank: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    values = tuple(int(v) for v in values) if values else tuple(default or ())
    return values * rank if len(values) == 1 else values


def _pool_positions(size: int, kernel: int, stride: int, padding: int, dilation: int,
                    ceil_mode: bool) -> np.ndarray:
    """Input positions (out, kernel) each output window reads, PyTorch's output-size rule included."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * dilation - padding


def _adaptive_positions(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (out, widest window) and validity of PyTorch's adaptive windows [floor(o*in/out), ceil(...))."""
    starts = (np.arange(out) * size) // out
    ends = -((-(np.arange(out) + 1) * size) // out)
    widest = int((ends - starts).max())
    positions = starts[:, None] + np.arange(widest)[None, :]
    return positions, positions < ends[:, None]


def _outer(masks: Sequence[np.ndarray]) -> np.ndarray:
    """Combine per-dimension (out, k) arrays into one (o1, k1, o2, k2, ...) boolean array."""
    combined = np.array(True)
    for mask in masks:
        combined = np.logical_and(combined[..., None, None], mask)
    return combined


def _window_layout(array: Any, lead: int, rank: int) -> Any:
    """(..., o1, k1, ..., or, kr) -> (..., o1, ..., or, k1*...*kr)."""
    perm = list(range(lead)) + [lead + 2 * d for d in range(rank)] + [lead + 2 * d + 1 for d in range(rank)]
    array = array.transpose(perm)
    return array.reshape(array.shape[: lead + rank] + (math.prod(array.shape[lead + rank:]),))


def _windows(x: Any, positions: Sequence[np.ndarray], valid: Sequence[np.ndarray], fill: Any) -> Any:
    """Windows over x's trailing dims as (..., *out, K); positions outside valid read fill."""
    rank = len(positions)
    lead = x.ndim - rank
    for d, pos in enumerate(positions):
        axis = lead + 2 * d
        gathered = jnp.take(x, np.clip(pos, 0, x.shape[axis] - 1).reshape(-1), axis=axis)
        x = gathered.reshape(x.shape[:axis] + pos.shape + x.shape[axis + 1:])
    x = jnp.where(_outer(valid), x, jnp.asarray(fill, x.dtype))
    return _window_layout(x, lead, rank)


def _in_bounds(positions: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    return [(p >= 0) & (p < s) for p, s in zip(positions, sizes)]


def _lowest(dtype: Any) -> Any:
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_windows(x: Any, positions: Sequence[np.ndarray], valid: Sequence[np.ndarray]) -> tuple[Any, Any]:
    """Max of each (padded) window and its flat index in the input plane: the first maximum, or the last NaN,
    as PyTorch's kernels choose. One argmax over the window axis, for windows of any size."""
    rank = len(positions)
    sizes = x.shape[-rank:]
    windows = _windows(x, positions, valid, _lowest(x.dtype))
    plane = np.array(0)
    for pos, stride in zip(positions, np.cumprod((1,) + sizes[::-1])[-2::-1]):
        plane = plane[..., None, None] + pos * stride
    return _pick_max(windows, jnp.asarray(_window_layout(plane, 0, rank)))


def _pick_max(windows: Any, flat: Any) -> tuple[Any, Any]:
    """Over the last axis: the first maximum, or the last NaN, as PyTorch's kernels choose; with its flat index."""
    if jnp.issubdtype(windows.dtype, jnp.floating):
        nan = jnp.isnan(windows)
        last_nan = windows.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        choice = jnp.where(jnp.any(nan, -1), last_nan, jnp.argmax(windows, axis=-1))
    else:
        choice = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(flat, windows.shape), choice[..., None], axis=-1)[..., 0]
    return values, indices


def _pool_taps(x: Any, positions: Sequence[np.ndarray], strides: Sequence[int],
               fill: Any) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """For each kernel offset: the strided slice of x it reads (one value per output), which outputs read
    inside the input there, and the flat in-plane index read. Memory stays O(output) per offset."""
    rank = len(positions)
    lead = x.ndim - rank
    sizes = x.shape[lead:]
    before = [max(0, -int(pos.min())) for pos in positions]
    after = [max(0, int(pos.max()) + 1 - size) for pos, size in zip(positions, sizes)]
    padded = jax.lax.pad(x, jnp.asarray(fill, x.dtype), [(0, 0, 0)] * lead + [(b, a, 0) for b, a in zip(before, after)])
    plane_strides = np.cumprod((1,) + tuple(sizes[::-1]))[-2::-1]
    for offset in itertools.product(*(range(pos.shape[1]) for pos in positions)):
        columns = [pos[:, j] for pos, j in zip(positions, offset)]
        start = [0] * lead + [int(c[0]) + b for c, b in zip(columns, before)]
        limit = list(x.shape[:lead]) + [int(c[-1]) + b + 1 for c, b in zip(columns, before)]
        taken = jax.lax.slice(padded, start, limit, [1] * lead + list(strides))
        valid, flat = np.array(True), np.array(0)
        for column, size, plane_stride in zip(columns, sizes, plane_strides):
            valid = valid[..., None] & (column >= 0) & (column < size)
            flat = flat[..., None] + column * plane_stride
        yield taken, valid, flat


def _max_pool(self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
              dilation: Sequence[int], ceil_mode: bool, rank: int) -> tuple:
    """Running max over kernel offsets; ties keep the first, a NaN always wins (as PyTorch's kernels)."""
    kernel = _expand(kernel_size, rank)
    strides = _expand(stride, rank, kernel)
    pads, dilations = _expand(padding, rank), _expand(dilation, rank)
    sizes = self.shape[-rank:]
    positions = [_pool_positions(*args, ceil_mode) for args in zip(sizes, kernel, strides, pads, dilations)]
    out_shape = self.shape[:-rank] + tuple(pos.shape[0] for pos in positions)
    best = jnp.full(out_shape, _lowest(self.dtype), self.dtype)
    index = jnp.full(out_shape, -1, jnp.int64)
    floating = jnp.issubdtype(self.dtype, jnp.floating)
    for value, valid, flat in _pool_taps(self, positions, strides, _lowest(self.dtype)):
        better = (value > best) | (index < 0)
        if floating:
            better = better | jnp.isnan(value)
        better = better & valid
        best = jnp.where(better, value, best)
        index = jnp.where(better, flat, index)
    return best, index


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                            ceil_mode: bool = False) -> tuple:
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                            ceil_mode: bool = False) -> tuple:
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _scatter_to_plane(grad_output: Any, self: Any, indices: Any, rank: int) -> Any:
    """Add each output gradient into the input position its index names (the max-pool backward)."""
    lead = self.shape[:-rank]
    rows = math.prod(lead)
    outputs = math.prod(grad_output.shape[len(lead):])
    g = _up(grad_output).reshape(rows, outputs)
    idx = indices.reshape(rows, outputs)
    grad = jnp.zeros((rows, math.prod(self.shape[-rank:])), g.dtype)
    grad = grad.at[jnp.arange(rows)[:, None], idx].add(g)
    return grad.reshape(self.shape)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


def _window_sums(x: Any, positions: Sequence[np.ndarray], kernel: Sequence[int], strides: Sequence[int]) -> Any:
    """Sum of each (zero-padded) window: one reduce_window, whatever the kernel size."""
    rank = len(positions)
    lead = x.ndim - rank
    before = [max(0, -int(pos.min())) for pos in positions]
    after = [max(0, int(pos.max()) + 1 - size) for pos, size in zip(positions, x.shape[lead:])]
    padded = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * lead + [(b, a, 0) for b, a in zip(before, after)])
    first = [int(pos[0, 0]) + b for pos, b in zip(positions, before)]
    padded = padded[(Ellipsis, *(slice(f, None) for f in first))]
    sums = jax.lax.reduce_window(padded, np.zeros((), x.dtype), jax.lax.add, (1,) * lead + tuple(kernel),
                                 (1,) * lead + tuple(strides), "VALID")
    return sums[(Ellipsis, *(slice(0, pos.shape[0]) for pos in positions))]


def _avg_pool(self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
              ceil_mode: bool, count_include_pad: bool, divisor_override: int | None, rank: int) -> Any:
    kernel = _expand(kernel_size, rank)
    strides = _expand(stride, rank, kernel)
    pads = _expand(padding, rank)
    sizes = self.shape[-rank:]
    positions = [_pool_positions(s, k, st, p, 1, ceil_mode) for s, k, st, p in zip(sizes, kernel, strides, pads)]
    total = _window_sums(_up(self), positions, kernel, strides)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:
        counts = [np.minimum(pos[:, 0] + k, s + p) - pos[:, 0] for pos, k, s, p in zip(positions, kernel, sizes, pads)]
    else:
        counts = [v.sum(axis=1) for v in _in_bounds(positions, sizes)]
    divisor = np.array(1)
    for count in counts:
        divisor = divisor[..., None] * count
    return total / jnp.asarray(divisor, total.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@register(aten.avg_pool3d.default)
def avg_pool3d(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int],
                        padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> Any:
    return _vjp(lambda x: avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override), grad_output, _up(self))[0]


@register(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int],
                        padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> Any:
    return _vjp(lambda x: avg_pool3d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override), grad_output, _up(self))[0]


def _adaptive(self: Any, output_size: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rank = len(output_size)
    pairs = [_adaptive_positions(s, int(o)) for s, o in zip(self.shape[-rank:], output_size)]
    return [p for p, _ in pairs], [v for _, v in pairs]


def _adaptive_avg_pool_nd(self: Any, output_size: Sequence[int]) -> Any:
    positions, valid = _adaptive(self, output_size)
    total = jnp.sum(_windows(_up(self), positions, valid, 0), axis=-1)
    divisor = np.array(1)
    for v in valid:
        divisor = divisor[..., None] * v.sum(axis=1)
    return total / jnp.asarray(divisor, total.dtype)


@register(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool(self: Any, output_size: Sequence[int]) -> Any:
    return _adaptive_avg_pool_nd(self, output_size)


@register(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad_output: Any, self: Any) -> Any:
    return _vjp(lambda x: _adaptive_avg_pool_nd(x, grad_output.shape[-2:]), grad_output, _up(self))[0]


@register(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad_output: Any, self: Any) -> Any:
    return _vjp(lambda x: _adaptive_avg_pool_nd(x, grad_output.shape[-3:]), grad_output, _up(self))[0]


@register(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(self: Any, output_size: Sequence[int]) -> tuple:
    return _max_windows(self, *_adaptive(self, output_size))


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


def _fractional_starts(sample: Any, size: int, out: int, kernel: int) -> Any:
    """PyTorch's pseudo-random window starts per plane: int((i + u) a) - int(u a) with a = (size - k) / (out - 1),
    in the samples' dtype; the last window ends at the input's end."""
    i = jnp.arange(out).astype(sample.dtype)
    u = sample[..., None]
    alpha = jnp.asarray(size - kernel, sample.dtype) / (out - 1) if out > 1 else jnp.zeros((), sample.dtype)
    starts = ((i + u) * alpha).astype(jnp.int64) - (u * alpha).astype(jnp.int64)
    return starts.at[..., -1].set(size - kernel)


def _fractional_max_pool(self: Any, kernel_size: Sequence[int], output_size: Sequence[int], random_samples: Any,
                         rank: int) -> tuple:
    """Max over windows at random_samples' starts. A plane's samples name the dims (T, H, W) in 3-D but (W, H)
    in 2-D, as PyTorch's kernels read them."""
    unbatched = self.ndim == rank + 1
    x = self[None] if unbatched else self
    sizes = x.shape[2:]
    if 0 in output_size:
        shape = x.shape[:2] + tuple(int(o) for o in output_size)
        values, indices = jnp.zeros(shape, x.dtype), jnp.zeros(shape, jnp.int64)
    else:
        flat = jnp.zeros(x.shape[:2], jnp.int64)
        for d, (size, out, kernel) in enumerate(zip(sizes, output_size, kernel_size)):
            sample = random_samples[..., rank - 1 - d if rank == 2 else d]
            starts = _fractional_starts(sample, size, int(out), int(kernel))
            positions = starts[..., None] + jnp.arange(int(kernel))
            lead = positions.shape[:2] + (1, 1) * d
            flat = flat[..., None, None] * size + positions.reshape(lead + positions.shape[2:])
        planes = x.reshape(x.shape[:2] + (math.prod(sizes),))
        windows = jnp.take_along_axis(planes, flat.reshape(flat.shape[:2] + (math.prod(flat.shape[2:]),)), axis=2)
        layout = lambda a: _window_layout(a.reshape(flat.shape), 2, rank)
        values, indices = _pick_max(layout(windows), layout(flat))
    return (values[0], indices[0]) if unbatched else (values, indices)


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self: Any, kernel_size: Sequence[int], output_size: Sequence[int],
                          random_samples: Any) -> tuple:
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 2)


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self: Any, kernel_size: Sequence[int], output_size: Sequence[int],
                          random_samples: Any) -> tuple:
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 3)


@register(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                   output_size: Sequence[int], indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@torch.library.register_fake("aten::fractional_max_pool3d_backward")
def _fractional_max_pool3d_backward_meta(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                         output_size: Sequence[int], indices: Any) -> Any:
    """PyTorch ships no meta kernel for this backward; its result is shaped like the input."""
    return self.new_empty(self.shape)


@register(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                   output_size: Sequence[int], indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


@register(aten.im2col.default)
def im2col(self: Any, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
           stride: Sequence[int]) -> Any:
    """(N, C, H, W) -> (N, C*kh*kw, L): each column one window, channel-major like F.unfold."""
    sizes = self.shape[-2:]
    positions = [_pool_positions(s, k, st, p, d, False)
                 for s, k, d, p, st in zip(sizes, _expand(kernel_size, 2), _expand(dilation, 2),
                                           _expand(padding, 2), _expand(stride, 2))]
    windows = _windows(self, positions, _in_bounds(positions, sizes), 0)
    lead = self.ndim - 2
    columns = jnp.moveaxis(windows, -1, lead)
    rows = self.shape[lead - 1] * columns.shape[lead]
    return columns.reshape(self.shape[:lead - 1] + (rows, math.prod(columns.shape[-2:])))


@register(aten.col2im.default)
def col2im(self: Any, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
           padding: Sequence[int], stride: Sequence[int]) -> Any:
    """The transpose of im2col: overlapping window entries are summed into the image (F.fold)."""
    kernel = math.prod(_expand(kernel_size, 2))
    shape = self.shape[:-2] + (self.shape[-2] // kernel,) + tuple(int(o) for o in output_size)
    return _transpose_of(lambda x: im2col(x, kernel_size, dilation, padding, stride), self, shape)


