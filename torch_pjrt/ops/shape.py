"""Shape ops that copy: cat, stack, flip, roll, tril/triu, repeat, and the `*_copy` twins of views.

Decompositions are traced with views removed, so every view op reaches a lowered graph as
its `*_copy` form; those work on the logical array (a view of a contiguous tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import torch
from jax import lax

from torch_pjrt import storage
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


# --- shared helpers ----------------------------------------------------------------------------


def _dim(dim: int, ndim: int) -> int:
    """A possibly negative dim as an axis; 0-dim tensors accept 0 and -1 like PyTorch."""
    return dim % max(ndim, 1)


def _promoted(arrays: Sequence[Any]) -> Any:
    """PyTorch's result dtype of tensors of equal standing (cat, stack)."""
    dtypes = [storage.torch_dtype(a.dtype) for a in arrays]
    return storage.numpy_dtype(functools.reduce(torch.promote_types, dtypes))


def _sizes(size: Sequence[int], shape: tuple[int, ...]) -> tuple[int, ...]:
    """A view size with one -1 inferred from the element count."""
    size = tuple(int(s) for s in size)
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        total = 1
        for s in shape:
            total *= s
        size = tuple(total // max(known, 1) if s == -1 else s for s in size)
    return size


def _strided_index(size: Sequence[int], stride: Sequence[int], offset: int | None) -> Any:
    """Flat positions of an as_strided view, strides counting elements of the tensor laid out
    contiguously (the functional base a graph's as_strided ops refer to)."""
    shape = tuple(size)
    index = jnp.full(shape, offset or 0, jnp.int64)
    for axis, st in enumerate(stride):
        index = index + lax.broadcasted_iota(jnp.int64, shape, axis) * st
    return index


def _slice_index(ndim: int, dim: int, start: int | None, end: int | None, step: int) -> tuple:
    return (slice(None),) * _dim(dim, ndim) + (slice(start, end, step),)


def _diagonal_positions(shape: tuple[int, ...], offset: int, axes: tuple[int, int]) -> tuple[Any, Any]:
    n = max(0, min(shape[axes[0]] + min(offset, 0), shape[axes[1]] - max(offset, 0)))
    index = jnp.arange(n)
    return index + max(-offset, 0), index + max(offset, 0)


# --- copies that build new layouts -------------------------------------------------------------


@register(aten.cat.default)
def cat(tensors: list[Any], dim: int = 0) -> Any:
    """Legacy rule kept by PyTorch: 1-D empty tensors are skipped whatever the other shapes."""
    dtype = _promoted(tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype)
    axis = _dim(dim, kept[0].ndim)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=axis)


@register(aten.stack.default)
def stack(tensors: list[Any], dim: int = 0) -> Any:
    dtype = _promoted(tensors)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


@register(aten.flip.default)
def flip(self: Any, dims: list[int]) -> Any:
    if self.ndim == 0 or not dims:
        return self
    return jnp.flip(self, tuple(_dim(d, self.ndim) for d in dims))


@register(aten.roll.default)
def roll(self: Any, shifts: list[int], dims: list[int] = ()) -> Any:
    """No dims: roll the flattened tensor."""
    if not dims:
        return jnp.roll(self.reshape(-1), tuple(shifts)).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(_dim(d, self.ndim) for d in dims))


@register(aten.tril.default)
def tril(self: Any, diagonal: int = 0) -> Any:
    return jnp.tril(self, diagonal)


@register(aten.triu.default)
def triu(self: Any, diagonal: int = 0) -> Any:
    return jnp.triu(self, diagonal)


@register(aten.repeat.default)
def repeat(self: Any, repeats: list[int]) -> Any:
    return jnp.tile(self, tuple(repeats))


@register(aten.diag_embed.default)
def diag_embed(self: Any, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Any:
    n = self.shape[-1] + abs(offset)
    index = jnp.arange(self.shape[-1])
    rows, cols = index + max(-offset, 0), index + max(offset, 0)
    square = jnp.zeros(self.shape[:-1] + (n, n), self.dtype).at[..., rows, cols].set(self)
    ndim = self.ndim + 1
    return jnp.moveaxis(square, (-2, -1), (_dim(dim1, ndim), _dim(dim2, ndim)))


# --- copies of views ---------------------------------------------------------------------------


@register(aten.view_copy.default, aten._reshape_copy.default, aten._unsafe_view.default)
def view_copy(self: Any, size: list[int]) -> Any:
    return self.reshape(_sizes(size, self.shape))


@register(aten._reshape_alias_copy.default)
def _reshape_alias_copy(self: Any, size: list[int], stride: list[int]) -> Any:
    return self.reshape(_sizes(size, self.shape))


@register(aten.view_copy.dtype)
def view_copy_dtype(self: Any, dtype: torch.dtype) -> Any:
    """Reinterpret the bytes; the last dim grows or shrinks by the itemsize ratio."""
    source = storage.torch_dtype(self.dtype)
    flat = storage.reinterpret(self.reshape(-1), source, dtype)
    last = self.shape[-1] * source.itemsize // dtype.itemsize if self.ndim else ()
    return flat.reshape(self.shape[:-1] + ((last,) if self.ndim else ()))


@register(aten.alias_copy.default, aten.detach_copy.default, aten.lift_fresh_copy.default)
def alias_copy(self: Any) -> Any:
    return self


@register(aten._conj_copy.default)
def _conj_copy(self: Any) -> Any:
    return jnp.conj(self)


@register(aten._neg_view_copy.default)
def _neg_view_copy(self: Any) -> Any:
    return -self


@register(aten.expand_copy.default)
def expand_copy(self: Any, size: list[int], *, implicit: bool = False) -> Any:
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@register(aten.permute_copy.default)
def permute_copy(self: Any, dims: list[int]) -> Any:
    return jnp.transpose(self, tuple(_dim(d, self.ndim) for d in dims))


@register(aten.t_copy.default)
def t_copy(self: Any) -> Any:
    return self.T if self.ndim == 2 else self


@register(aten.transpose_copy.int)
def transpose_copy(self: Any, dim0: int, dim1: int) -> Any:
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@register(aten.unsqueeze_copy.default)
def unsqueeze_copy(self: Any, dim: int) -> Any:
    return jnp.expand_dims(self, dim % (self.ndim + 1))


def _squeezed(self: Any, dims: Sequence[int]) -> Any:
    if self.ndim == 0:
        return self
    axes = tuple(a for a in {_dim(d, self.ndim) for d in dims} if self.shape[a] == 1)
    return jnp.squeeze(self, axes) if axes else self


@register(aten.squeeze_copy.default)
def squeeze_copy(self: Any) -> Any:
    return _squeezed(self, range(self.ndim))


@register(aten.squeeze_copy.dim)
def squeeze_copy_dim(self: Any, dim: int) -> Any:
    return _squeezed(self, [dim])


@register(aten.squeeze_copy.dims)
def squeeze_copy_dims(self: Any, dim: list[int]) -> Any:
    return _squeezed(self, dim)


@register(aten.select_copy.int)
def select_copy(self: Any, dim: int, index: int) -> Any:
    axis = _dim(dim, self.ndim)
    return lax.index_in_dim(self, index % self.shape[axis], axis, keepdims=False)


@register(aten.slice_copy.Tensor)
def slice_copy(self: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> Any:
    """Python's slice clamping is PyTorch's (out-of-range bounds clamp, negatives wrap)."""
    return self[_slice_index(self.ndim, dim, start, end, step)]


@register(aten.narrow_copy.default)
def narrow_copy(self: Any, dim: int, start: int, length: int) -> Any:
    axis = _dim(dim, self.ndim)
    start = start % self.shape[axis] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, axis=axis)


@register(aten.diagonal_copy.default)
def diagonal_copy(self: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    return jnp.diagonal(self, offset, _dim(dim1, self.ndim), _dim(dim2, self.ndim))


@register(aten.as_strided_copy.default)
def as_strided_copy(self: Any, size: list[int], stride: list[int], storage_offset: int | None = None) -> Any:
    return self.reshape(-1)[_strided_index(size, stride, storage_offset)]


@register(aten.unfold_copy.default)
def unfold_copy(self: Any, dimension: int, size: int, step: int) -> Any:
    if self.ndim == 0:
        return self.reshape(1)
    axis = _dim(dimension, self.ndim)
    windows = (self.shape[axis] - size) // step + 1
    index = jnp.arange(windows)[:, None] * step + jnp.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(self, index, axis=axis), axis + 1, -1)


@register(aten.split_copy.Tensor)
def split_copy(self: Any, split_size: int, dim: int = 0) -> list[Any]:
    axis = _dim(dim, self.ndim)
    length = self.shape[axis]
    sizes = [min(split_size, length - start) for start in range(0, length, max(split_size, 1))] or [0]
    return split_with_sizes_copy(self, sizes, dim)


@register(aten.split_with_sizes_copy.default)
def split_with_sizes_copy(self: Any, split_sizes: list[int], dim: int = 0) -> list[Any]:
    axis = _dim(dim, self.ndim)
    starts = [sum(split_sizes[:i]) for i in range(len(split_sizes))]
    return [lax.slice_in_dim(self, s, s + n, axis=axis) for s, n in zip(starts, split_sizes)]


@register(aten.unbind_copy.int)
def unbind_copy(self: Any, dim: int = 0) -> list[Any]:
    axis = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis, keepdims=False) for i in range(self.shape[axis])]


@register(aten.view_as_real_copy.default)
def view_as_real_copy(self: Any) -> Any:
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@register(aten.view_as_complex_copy.default)
def view_as_complex_copy(self: Any) -> Any:
    return lax.complex(self[..., 0], self[..., 1])


# --- scatters: the functional form of writes through views -------------------------------------


@register(aten.slice_scatter.default)
def slice_scatter(self: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None,
                  step: int = 1) -> Any:
    return self.at[_slice_index(self.ndim, dim, start, end, step)].set(src.astype(self.dtype))


@register(aten.select_scatter.default)
def select_scatter(self: Any, src: Any, dim: int, index: int) -> Any:
    axis = _dim(dim, self.ndim)
    return self.at[(slice(None),) * axis + (index % self.shape[axis],)].set(src.astype(self.dtype))


@register(aten.diagonal_scatter.default)
def diagonal_scatter(self: Any, src: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    axes = (_dim(dim1, self.ndim), _dim(dim2, self.ndim))
    rows, cols = _diagonal_positions(self.shape, offset, axes)
    moved = jnp.moveaxis(self, axes, (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), axes)


@register(aten.as_strided_scatter.default)
def as_strided_scatter(self: Any, src: Any, size: list[int], stride: list[int],
                       storage_offset: int | None = None) -> Any:
    flat = self.reshape(-1).at[_strided_index(size, stride, storage_offset)].set(src.astype(self.dtype))
    return flat.reshape(self.shape)


@register(aten.slice_backward.default)
def slice_backward(grad_output: Any, input_sizes: list[int], dim: int, start: int, end: int, step: int) -> Any:
    return slice_scatter(jnp.zeros(tuple(input_sizes), grad_output.dtype), grad_output, dim, start, end, step)


@register(aten.select_backward.default)
def select_backward(grad_output: Any, input_sizes: list[int], dim: int, index: int) -> Any:
    return select_scatter(jnp.zeros(tuple(input_sizes), grad_output.dtype), grad_output, dim, index)


@register(aten.diagonal_backward.default)
def diagonal_backward(grad_output: Any, input_sizes: list[int], offset: int, dim1: int, dim2: int) -> Any:
    return diagonal_scatter(jnp.zeros(tuple(input_sizes), grad_output.dtype), grad_output, offset, dim1, dim2)


@register(aten.unfold_backward.default)
def unfold_backward(grad_in: Any, input_sizes: list[int], dim: int, size: int, step: int) -> Any:
    """Overlapping windows add up."""
    if not input_sizes:
        return grad_in.reshape(())
    axis = _dim(dim, len(input_sizes))
    windows = grad_in.shape[axis]
    index = (jnp.arange(windows)[:, None] * step + jnp.arange(size)[None, :]).reshape(-1)
    grad = jnp.moveaxis(grad_in, -1, axis + 1)
    grad = grad.reshape(grad.shape[:axis] + (windows * size,) + grad.shape[axis + 2:])
    zeros = jnp.zeros(tuple(input_sizes), grad_in.dtype)
    return zeros.at[(slice(None),) * axis + (index,)].add(grad)
