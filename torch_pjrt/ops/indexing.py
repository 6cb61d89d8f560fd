"""Advanced indexing, gather/scatter and masked ops.

Index tensors that are boolean masks need their true count (a shape) and are turned into
integer indices by the eager kernels in torch_pjrt/eager/data_dependent.py before they
reach these lowerings; the one mask case handled here is a mask write whose value does
not depend on the count (`x[mask] = 0`), which needs no sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_pjrt import storage
from torch_pjrt.ops import casts
from torch_pjrt.ops.factories import dtype_of, scalar_type_name
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten


# --- shared helpers ----------------------------------------------------------------------------

# CPU's messages for an index out of range (IndexError or RuntimeError, as each CPU kernel raises)
OUT_OF_BOUNDS = "index {{value}} is out of bounds for dimension {dim} with size {size}"
OUT_OF_RANGE = "index out of range in self"
TAKE_OUT_OF_RANGE = "out of range: tried to access index {{value}} on a tensor of {size} elements."


def check_index(index: Any, size: int, op: str, message: str, error: type[Exception] = IndexError,
                negative: bool = False, dim: int = 0) -> None:
    """A device-side check that `index` is in [0, size) (or [-size, size) with `negative`)."""
    index = jnp.asarray(index)
    low = -size if negative else 0
    message = message.format(dim=dim, size=size)
    checks.fail_if((index < low) | (index >= size), op, message, error, index if "{value}" in message else None)


def _check_indices(self: Any, indices: Sequence[Any], op: str) -> None:
    """index/index_put's integer indices against the dims they index (negatives count from the end); CPU
    checks none when no element is selected."""
    if not _selects_any(self.shape, indices):
        return
    for dim, index in enumerate(indices):
        if index is not None and not _is_mask(index):
            check_index(index, self.shape[dim], op, OUT_OF_BOUNDS, negative=True, dim=dim)

def _selects_any(shape: Sequence[int], indices: Sequence[Any]) -> bool:
    """Whether indexing an array of `shape` with these integer indices selects any element."""
    if any(_is_mask(i) for i in indices):
        return True
    given = [jnp.shape(i) for i in indices if i is not None]
    rest = [n for n, index in zip(shape, list(indices) + [None] * len(shape)) if index is None]
    return math.prod(np.broadcast_shapes(*given) if given else ()) * math.prod(rest) > 0


def _dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _is_mask(index: Any) -> bool:
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _index_tuple(indices: Sequence[Any]) -> tuple:
    """ATen's index list (None = whole dim) as a numpy-style index; the placement rule of the
    result dims (in place when the indices are adjacent, else first) is numpy's too."""
    if any(_is_mask(i) for i in indices):
        raise NotImplementedError("torch_pjrt: boolean mask indices must be converted before lowering.")
    return tuple(slice(None) if i is None else jnp.asarray(i) for i in indices)


def mask_write_ok(self_shape: Sequence[int], position: int, mask_shape: Sequence[int],
                  values_shape: Sequence[int]) -> bool:
    """True when `self[(:,) * position + (mask,)] = values` can be a `where` (no sync): the mask
    fits self there and the values do not vary along the selected elements."""
    mask_shape = tuple(mask_shape)
    if tuple(self_shape[position:position + len(mask_shape)]) != mask_shape:
        return False
    target = tuple(self_shape[:position]) + (1,) + tuple(self_shape[position + len(mask_shape):])
    try:
        return np.broadcast_shapes(tuple(values_shape), target) == target
    except ValueError:
        return False


def _single_mask(indices: Sequence[Any]) -> int | None:
    """Position of the only index when it is a boolean mask."""
    given = [i for i, index in enumerate(indices) if index is not None]
    return given[0] if len(given) == 1 and _is_mask(indices[given[0]]) else None


def _masked_write(self: Any, indices: Sequence[Any], values: Any, accumulate: bool) -> Any:
    position = next(i for i, index in enumerate(indices) if index is not None)
    mask = indices[position].astype(jnp.bool_)
    rest = self.ndim - position - mask.ndim
    target = self.shape[:position] + (1,) + self.shape[position + mask.ndim:]
    values = jnp.broadcast_to(values, target).reshape(self.shape[:position] + (1,) * mask.ndim
                                                      + self.shape[position + mask.ndim:])
    mask = mask.reshape(mask.shape + (1,) * rest)
    if accumulate:
        return jnp.where(mask, self + values.astype(self.dtype), self)
    return jnp.where(mask, values.astype(self.dtype), self)


def _source_shape(shape: tuple[int, ...], axis: int, index: Any) -> tuple[int, ...]:
    """index_add/copy/reduce's source: the data's shape with one slice per index along axis (an explicit size:
    a -1 cannot be solved when another dim is 0)."""
    return shape[:axis] + (int(np.size(index)),) + shape[axis + 1:]


def _along(dim: int, index: Any) -> tuple:
    """Index selecting `index` entries along `dim`, all of every other dim."""
    return (slice(None),) * dim + (index,)


def _full_index(index: Any, dim: int) -> tuple:
    """gather/scatter's index: `index` along dim, the element's own position elsewhere."""
    positions = [lax.broadcasted_iota(index.dtype, index.shape, d) for d in range(index.ndim)]
    positions[dim] = index
    return tuple(positions)


def _as_vector(a: Any) -> Any:
    return a.reshape(1) if a.ndim == 0 else a


def _fit(src: Any, shape: tuple[int, ...]) -> Any:
    """The leading box of src matching index's shape (PyTorch lets src be larger)."""
    return src[tuple(slice(0, n) for n in shape)]


_REDUCE_NAMES = {"add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod", "mean": "mean",
                 "amax": "amax", "amin": "amin"}


def _identity(reduce: str, dtype: Any) -> Any:
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        value = -jnp.inf if reduce == "amax" else jnp.inf
        return jnp.asarray(value, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce == "amin")
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


def _combine_at(array: Any, where: Any, values: Any, how: str = "add") -> Any:
    """array.at[where].add(values) (or "multiply"); bool arrays combine as a logical or (and), as
    PyTorch's bool sum (product) does, which XLA lacks."""
    if array.dtype == jnp.bool_:
        return getattr(array.astype(jnp.int32).at[where], how)(values.astype(jnp.int32)) != 0
    return getattr(array.at[where], how)(values)


class Scatter(NamedTuple):
    """An op as `self.reshape(shape).at[where].set(values)` (or `.add`, duplicates adding up): the form in
    which an in-place call on a view writes only the elements it changes (`scatter_through`)."""

    shape: tuple[int, ...]
    where: Any
    values: Any
    how: str  # "set" or "add"


def scatter_into(data: Any, scatter: Scatter) -> Any:
    """`data` (the op's self) with the scatter applied."""
    target = data.reshape(scatter.shape)
    values = jnp.asarray(scatter.values).astype(target.dtype)
    if scatter.how == "add":
        return _combine_at(target, scatter.where, values).reshape(data.shape)
    return target.at[scatter.where].set(values).reshape(data.shape)


def scatter_through(flat: Any, positions: Any, scatter: Scatter, view_dtype: np.dtype) -> Any | None:
    """A storage's 1-D array after the scatter through a view of `view_dtype`, `positions` holding the
    address of each of the view's elements (in view elements), or None when it cannot be written so.

    A view of a wider dtype than its storage's (a float KV cache inside a byte buffer) writes its values'
    bytes at the bytes' positions: reinterpreting the whole storage instead makes XLA copy all of it. An
    add through such a view, or a view narrower than its storage's elements, is left to the caller."""
    written = positions.reshape(scatter.shape)[scatter.where]
    values = jnp.asarray(scatter.values).astype(view_dtype)
    if view_dtype != flat.dtype:
        ratio, remainder = divmod(np.dtype(view_dtype).itemsize, flat.dtype.itemsize)
        odd = any(d == jnp.bool_ or jnp.issubdtype(d, jnp.complexfloating) for d in (view_dtype, flat.dtype))
        if scatter.how == "add" or remainder or not ratio or odd:
            return None
        values = lax.bitcast_convert_type(values, flat.dtype)
        if ratio > 1:
            written = written[..., None] * ratio + jnp.arange(ratio)
    return _combine_at(flat, written, values) if scatter.how == "add" else flat.at[written].set(values)


def _reduce_into(self: Any, where: tuple, src: Any, reduce: str, include_self: bool) -> Any:
    """self with src reduced into the positions `where` names (duplicates combine)."""
    reduce = _REDUCE_NAMES[reduce]
    src = src.astype(self.dtype)
    start = self if include_self else self.at[where].set(_identity(reduce, self.dtype))
    slot = start.at[where]
    if reduce == "sum":
        return _combine_at(start, where, src)
    if reduce == "prod":
        return _combine_at(start, where, src, "multiply")
    if reduce == "amax":
        return slot.max(src)
    if reduce == "amin":
        return slot.min(src)
    total = _combine_at(start, where, src)
    ones = jnp.ones(self.shape, jnp.int64)
    counts = (ones if include_self else ones.at[where].set(0)).at[where].add(jnp.ones(src.shape, jnp.int64))
    counts = jnp.maximum(counts, 1)
    if jnp.issubdtype(self.dtype, jnp.integer):
        return jnp.floor_divide(total, counts.astype(self.dtype))
    return (total / counts).astype(self.dtype)


# --- advanced indexing -------------------------------------------------------------------------


@register(aten._unsafe_index.Tensor)
def unsafe_index(self: Any, indices: list[Any]) -> Any:
    """Unchecked: PyTorch's decompositions make these indices in range by construction."""
    return self[_index_tuple(indices)]


@register(aten.index.Tensor)
def index(self: Any, indices: list[Any]) -> Any:
    _check_indices(self, indices, "aten::index")
    return self[_index_tuple(indices)]


def _index_put_scatter(self: Any, indices: list[Any], values: Any, accumulate: bool = False,
                       unsafe: bool = False) -> Scatter | None:
    _check_indices(self, indices, "aten::index_put")
    return _put_scatter(self, indices, values, accumulate)


def _put_scatter(self: Any, indices: list[Any], values: Any, accumulate: bool = False) -> Scatter | None:
    """None for a mask write that needs no count (a `where`, not a scatter). Duplicates: accumulate adds every
    one; otherwise one of them wins (as on CUDA)."""
    values = jnp.asarray(values)
    position = _single_mask(indices)
    if position is not None and mask_write_ok(self.shape, position, indices[position].shape, values.shape):
        return None
    return Scatter(self.shape, _index_tuple(indices), values, "add" if accumulate else "set")


@register(aten._unsafe_index_put.default, scatter=_put_scatter)
def unsafe_index_put(self: Any, indices: list[Any], values: Any, accumulate: bool = False) -> Any:
    return _index_put(self, _put_scatter(self, indices, values, accumulate), indices, values, accumulate)


@register(aten.index_put.default, aten._index_put_impl.default, scatter=_index_put_scatter)
def index_put(self: Any, indices: list[Any], values: Any, accumulate: bool = False, unsafe: bool = False) -> Any:
    return _index_put(self, _index_put_scatter(self, indices, values, accumulate), indices, values, accumulate)


def _index_put(self: Any, scatter: Scatter | None, indices: list[Any], values: Any, accumulate: bool) -> Any:
    if scatter is None:
        return _masked_write(self, indices, jnp.asarray(values), accumulate)
    return scatter_into(self, scatter)


@register(aten._unsafe_masked_index.default)
def _unsafe_masked_index(self: Any, mask: Any, indices: list[Any], fill: Any) -> Any:
    """Masked-off positions may hold out-of-range indices: they are clamped, then replaced."""
    clamped = [None if i is None else jnp.clip(i, -n, n - 1) for i, n in zip(indices, self.shape)]
    return jnp.where(mask, self[_index_tuple(clamped)], jnp.asarray(fill).astype(self.dtype))


@register(aten._unsafe_masked_index_put_accumulate.default)
def _unsafe_masked_index_put_accumulate(self: Any, mask: Any, indices: list[Any], values: Any) -> Any:
    clamped = [None if i is None else jnp.clip(i, -n, n - 1) for i, n in zip(indices, self.shape)]
    values = jnp.where(mask, values, jnp.zeros((), values.dtype)).astype(self.dtype)
    return _combine_at(self, _index_tuple(clamped), values)


@register(aten.index_select_backward.default)
def index_select_backward(grad: Any, self_sizes: list[int], dim: int, index: Any) -> Any:
    size = self_sizes[_dim(dim, len(self_sizes))] if self_sizes else 1
    check_index(index, size, "aten::index_select_backward", OUT_OF_RANGE)
    zeros = jnp.zeros(tuple(self_sizes), grad.dtype)
    return scatter_into(zeros, _along_scatter(zeros, dim, index, grad, "add"))


@register(aten.index_select.default)
def index_select(self: Any, dim: int, index: Any) -> Any:
    """The index's rank and dtype are checked before (ops/arguments.py)."""
    check_index(index, _as_vector(self).shape[_dim(dim, self.ndim)], "aten::index_select", OUT_OF_RANGE)
    return jnp.take(_as_vector(self), _as_vector(index), axis=_dim(dim, self.ndim))


@register(aten.take.default)
def take(self: Any, index: Any) -> Any:
    check_index(index, self.size, "aten::take", TAKE_OUT_OF_RANGE, negative=True)
    return self.reshape(-1)[index]


def _put_flat_scatter(self: Any, index: Any, source: Any, accumulate: bool = False) -> Scatter:
    """CPU's checks of the index's dtype and of one source element per index (PyTorch's meta kernel makes neither)."""
    if index.dtype != jnp.int64:
        raise RuntimeError(f"put_(): Expected a long tensor for index, but got {scalar_type_name(dtype_of(index))}")
    if index.size != source.size:
        raise IndexError("put_(): Expected source and index to have the same number of elements, but got "
                         f"source.numel() = {source.size}, index.numel() = {index.size}")
    check_index(index, self.size, "aten::put", TAKE_OUT_OF_RANGE, negative=True)
    return Scatter((self.size,), index.reshape(-1), source.reshape(-1), "add" if accumulate else "set")


@register(aten.put.default, scatter=_put_flat_scatter)
def put(self: Any, index: Any, source: Any, accumulate: bool = False) -> Any:
    return scatter_into(self, _put_flat_scatter(self, index, source, accumulate))


@register(aten.nonzero_static.default)
def nonzero_static(self: Any, *, size: int, fill_value: int = -1) -> Any:
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self, size=size, fill_value=fill_value), axis=1)


# --- gather / scatter --------------------------------------------------------------------------


@register(aten.gather.default)
def gather(self: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    data, index = _as_vector(self), _as_vector(index)
    axis = _dim(dim, data.ndim)
    check_index(index, data.shape[axis], "aten::gather", OUT_OF_BOUNDS, RuntimeError, dim=axis)
    data = data[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(index.shape))]
    return jnp.take_along_axis(data, index, axis=axis)


def _check_scatter(data: Any, axis: int, index: Any, op: str) -> None:
    check_index(index, data.shape[axis], op, OUT_OF_BOUNDS, RuntimeError, dim=axis)


def _scatter(self: Any, dim: int, index: Any, src: Any, reduce: str | None, op: str) -> Any:
    if index.size == 0:
        return self
    data, index = _as_vector(self), _as_vector(index)
    _check_scatter(data, _dim(dim, data.ndim), index, op)
    where = _full_index(index, _dim(dim, data.ndim))
    src = jnp.broadcast_to(src, ()) if jnp.ndim(src) == 0 else _fit(_as_vector(src), index.shape)
    src = jnp.broadcast_to(src, index.shape)
    if reduce is None:
        result = data.at[where].set(src.astype(data.dtype))
    else:
        result = _reduce_into(data, where, src, reduce, True)
    return result.reshape(self.shape)


@register(aten.scatter.src, aten.scatter.value)
def scatter(self: Any, dim: int, index: Any, src: Any) -> Any:
    return _scatter(self, dim, index, src, None, "aten::scatter")


@register(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(self: Any, dim: int, index: Any, src: Any, *, reduce: str) -> Any:
    return _scatter(self, dim, index, src, reduce, "aten::scatter")


@register(aten.scatter_add.default)
def scatter_add(self: Any, dim: int, index: Any, src: Any) -> Any:
    return _scatter(self, dim, index, src, "add", "aten::scatter_add")


@register(aten.scatter_reduce.two)
def scatter_reduce(self: Any, dim: int, index: Any, src: Any, reduce: str, *, include_self: bool = True) -> Any:
    if index.size == 0:
        return self
    data, index = _as_vector(self), _as_vector(index)
    _check_scatter(data, _dim(dim, data.ndim), index, "aten::scatter_reduce")
    where = _full_index(index, _dim(dim, data.ndim))
    src = _fit(_as_vector(src), index.shape)
    return _reduce_into(data, where, src, reduce, include_self).reshape(self.shape)


# --- index_* along one dim ---------------------------------------------------------------------


def _along_scatter(self: Any, dim: int, index: Any, source: Any, how: str) -> Scatter:
    """index_add/copy/fill: `source` at `index` along `dim` (a 0-d self is a vector of one)."""
    shape = tuple(self.shape) or (1,)
    axis = _dim(dim, len(shape))
    source = jnp.asarray(source)
    if source.ndim:
        source = source.reshape(_source_shape(shape, axis, index))
    return Scatter(shape, _along(axis, _as_vector(index)), source, how)


def _index_add_scatter(self: Any, dim: int, index: Any, source: Any, *, alpha: Any = 1) -> Scatter:
    """CPU checks no index when self is empty (also index_fill)."""
    axis = _dim(dim, self.ndim)
    if self.size and self.ndim <= 1:
        check_index(index, _as_vector(self).shape[0], "aten::index_add", OUT_OF_RANGE)
    elif self.size:
        check_index(index, self.shape[axis], "aten::index_add", OUT_OF_BOUNDS, RuntimeError, dim=axis)
    return _along_scatter(self, dim, index, jnp.asarray(source) * alpha, "add")


@register(aten.index_add.default, scatter=_index_add_scatter)
def index_add(self: Any, dim: int, index: Any, source: Any, *, alpha: Any = 1) -> Any:
    return scatter_into(self, _index_add_scatter(self, dim, index, source, alpha=alpha))


def _index_copy_scatter(self: Any, dim: int, index: Any, source: Any) -> Scatter:
    axis = _dim(dim, self.ndim)
    if jnp.size(source):  # CPU checks no index when nothing is copied
        check_index(index, _as_vector(self).shape[axis], "aten::index_copy", "index_copy_(): " + OUT_OF_BOUNDS,
                    dim=axis)
    return _along_scatter(self, dim, index, source, "set")


@register(aten.index_copy.default, scatter=_index_copy_scatter)
def index_copy(self: Any, dim: int, index: Any, source: Any) -> Any:
    return scatter_into(self, _index_copy_scatter(self, dim, index, source))


def _index_fill_scatter(self: Any, dim: int, index: Any, value: Any) -> Scatter:
    axis = _dim(dim, self.ndim)
    if self.size:
        check_index(index, _as_vector(self).shape[axis], "aten::index_fill", OUT_OF_BOUNDS, negative=True, dim=axis)
    return _along_scatter(self, dim, index, value, "set")


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, scatter=_index_fill_scatter)
def index_fill(self: Any, dim: int, index: Any, value: Any) -> Any:
    return scatter_into(self, _index_fill_scatter(self, dim, index, value))


@register(aten.index_reduce.default)
def index_reduce(self: Any, dim: int, index: Any, source: Any, reduce: str, *, include_self: bool = True) -> Any:
    data = _as_vector(self)
    axis = _dim(dim, data.ndim)
    check_index(index, data.shape[axis], "aten::index_reduce", OUT_OF_RANGE)
    source = _as_vector(source).reshape(_source_shape(data.shape, axis, index))
    return _reduce_into(data, _along(axis, _as_vector(index)), source, reduce, include_self).reshape(self.shape)


# --- masks -------------------------------------------------------------------------------------


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self: Any, mask: Any, value: Any) -> Any:
    return jnp.where(mask, casts.fitted(value, storage.torch_dtype(self.dtype), "aten::masked_fill"), self)


@register(aten.masked_scatter.default)
def masked_scatter(self: Any, mask: Any, source: Any) -> Any:
    """The k-th selected position (row-major) takes source's k-th element."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    mask = jnp.broadcast_to(mask, shape)
    position = jnp.cumsum(mask.reshape(-1).astype(jnp.int64)) - 1
    flat = source.reshape(-1)
    checks.fail_if(position[-1:] >= flat.shape[0], "aten::masked_scatter",
                   "Number of elements of source < number of ones in mask")
    picked = flat[jnp.clip(position, 0, max(flat.shape[0] - 1, 0))] if flat.shape[0] else jnp.zeros_like(position)
    return jnp.where(mask, picked.reshape(shape).astype(self.dtype), jnp.broadcast_to(self, shape))


# --- class indices and asserts -------------------------------------------------------------------


@register(aten.one_hot.default, static_scalars=True)
def one_hot(self: Any, num_classes: int = -1) -> Any:
    """num_classes is known here (the eager kernel reads it from the values when it is -1)."""
    checks.fail_if(self < 0, "aten::one_hot", "Class values must be non-negative.")
    checks.fail_if(self >= num_classes, "aten::one_hot", "Class values must be smaller than num_classes.")
    return (self[..., None] == jnp.arange(num_classes, dtype=self.dtype)).astype(jnp.int64)


@register(aten._assert_async.default, aten._assert_async.msg)
def assert_async(self: Any, assert_msg: str = "Expected Tensor with single nonzero value, but got zero") -> tuple:
    """PyTorch's own device-side assert (decompositions emit it): a check, raised as CPU raises it."""
    checks.fail_if(jnp.asarray(self) == 0, "aten::_assert_async", assert_msg)
    return ()


@register(aten._functional_assert_async.msg)
def functional_assert_async(self: Any, assert_msg: str, dep_token: Any) -> Any:
    checks.fail_if(jnp.asarray(self) == 0, "aten::_assert_async", assert_msg)
    return dep_token


@register(aten._assert_scalar.default)
def assert_scalar(self: Any, assert_msg: str) -> None:
    """A compiled graph's runtime assert (torch._check on sizes or scalars): raised while tracing where the
    condition is known then, as on CPU, else checked on the device."""
    if isinstance(self, (bool, int, float, np.bool_)):
        if not self:
            raise RuntimeError(assert_msg)
    else:
        checks.fail_if(jnp.logical_not(jnp.asarray(self)), "aten::_assert_scalar", assert_msg)


@register(aten.sym_constrain_range_for_size.default, aten._assert_tensor_metadata.default)
def checked_when_traced(*args: Any, **kwargs: Any) -> None:
    """Facts Dynamo and AOTAutograd already checked on the traced values: nothing to compute."""
