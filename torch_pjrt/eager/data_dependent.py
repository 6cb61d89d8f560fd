"""Ops whose output shape depends on values (nonzero, masked_select, unique, ...).

Each waits for its input, reads the size it needs to the host, then runs a program of
static shape. The cost: one device-to-host sync per call.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_pjrt import storage
from torch_pjrt.eager import dispatch, modes
from torch_pjrt.ops import arguments, indexing
from torch_pjrt.ops.factories import scalar_type_name
from torch_pjrt.runtime import checks, client

aten = torch.ops.aten

KERNELS: dict[Any, Any] = {}


def kernel(*ops: Any) -> Callable:
    def decorate(fn: Callable) -> Callable:
        for op in ops:
            KERNELS[op] = _refusing_float8_like_cpu(op, fn)
        return fn

    return decorate


def _refusing_float8_like_cpu(op: Any, fn: Callable) -> Callable:
    """These kernels skip the dispatcher's argument checks: CPU's float8 refusals are made here."""
    names = [argument.name for argument in op._schema.arguments]

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        arguments.refuse_float8_like_cpu(op, {**dict(zip(names, args)), **kwargs})
        return fn(*args, **kwargs)

    return checked


# --- shared helpers ----------------------------------------------------------------------------


def _wrap(array: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return storage.new_tensor(array.reshape(-1).astype(storage.numpy_dtype(dtype)), dtype, device,
                              tuple(array.shape))


def _empty(device: torch.device) -> torch.Tensor:
    return _wrap(jnp.zeros((0,), jnp.int64), torch.int64, device)


def _host_int(value: Any) -> int:
    """The one sync of a kernel: a device scalar read to the host."""
    return int(client.to_host(value))


def _host_ints(values: Any) -> list[int]:
    """Several device scalars in one read (still the kernel's one sync)."""
    return [int(v) for v in client.to_host(values)]


@jax.jit
def _count_nonzero(x: Any) -> Any:
    return jnp.count_nonzero(x)


@functools.partial(jax.jit, static_argnums=1)
def _nonzero_coords(x: Any, count: int) -> Any:
    if x.ndim == 0:
        return jnp.zeros((count, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(x, size=count), axis=1).astype(jnp.int64)


def _coords(x: Any) -> Any:
    """(count, ndim) int64 coordinates of the non-zero elements (one sync for the count)."""
    return _nonzero_coords(x, _host_int(_count_nonzero(x)))


# --- nonzero, masked_select ----------------------------------------------------------------


@kernel(aten.nonzero.default)
def nonzero(self: torch.Tensor) -> torch.Tensor:
    """One sync: the number of non-zero elements."""
    return _wrap(_coords(dispatch.read(self)), torch.int64, self.device)


@functools.partial(jax.jit, static_argnums=2)
def _select(x: Any, mask: Any, count: int) -> Any:
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    (where,) = jnp.nonzero(flat_mask, size=count)
    return jnp.broadcast_to(x, shape).reshape(-1)[where]


@kernel(aten.masked_select.default)
def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One sync: the number of selected elements (of the broadcast mask)."""
    x, m = dispatch.read(self), dispatch.read(mask)
    shape = jnp.broadcast_shapes(x.shape, m.shape)
    count = _host_int(_count_nonzero(jnp.broadcast_to(m, shape)))
    return _wrap(_select(x, m, count), self.dtype, self.device)


# --- unique ------------------------------------------------------------------------------------


def _rows(x: Any, dim: int | None) -> Any:
    """x as a (n, m) stack of the slices compared for equality."""
    if dim is None:
        return x.reshape(-1, 1)
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(x.shape[dim], math.prod(moved.shape[1:]))


@functools.partial(jax.jit, static_argnums=1)
def _order(rows: Any, sort: bool) -> tuple[Any, Any]:
    """Rows sorted lexicographically (stable) and the permutation; identity when not sorting."""
    iota = jnp.arange(rows.shape[0])
    if not sort or rows.shape[0] == 0:
        return rows, iota
    columns = [rows[:, j] for j in range(rows.shape[1])]
    *sorted_columns, order = lax.sort((*columns, iota), num_keys=max(len(columns), 1), is_stable=True)
    return jnp.stack(sorted_columns, axis=1) if sorted_columns else rows, order


@jax.jit
def _starts(sorted_rows: Any) -> Any:
    """True where a row differs from the one before (NaN never equals, as in PyTorch)."""
    if sorted_rows.shape[0] == 0:
        return jnp.zeros((0,), jnp.bool_)
    differs = jnp.any(sorted_rows[1:] != sorted_rows[:-1], axis=1)
    return jnp.concatenate([jnp.ones((1,), jnp.bool_), differs])


@functools.partial(jax.jit, static_argnums=3)
def _groups(sorted_rows: Any, order: Any, starts: Any, count: int) -> tuple[Any, Any, Any]:
    group = jnp.cumsum(starts) - 1
    values = jnp.zeros((count,) + sorted_rows.shape[1:], sorted_rows.dtype).at[group].set(sorted_rows)
    inverse = jnp.zeros(order.shape, jnp.int64).at[order].set(group)
    counts = jnp.zeros((count,), jnp.int64).at[group].add(1)
    return values, inverse, counts


def _unique(self: torch.Tensor, dim: int | None, sort: bool) -> tuple[Any, Any, Any]:
    """(values as rows, inverse, counts); one sync: the number of distinct slices."""
    x = dispatch.read(self)
    sorted_rows, order = _order(_rows(x, dim), sort)
    starts = _starts(sorted_rows)
    values, inverse, counts = _groups(sorted_rows, order, starts, _host_int(jnp.sum(starts)))
    if dim is None:
        return values.reshape(-1), inverse.reshape(x.shape), counts
    moved = jnp.moveaxis(x, dim, 0).shape[1:]
    return jnp.moveaxis(values.reshape((values.shape[0],) + moved), 0, dim), inverse, counts


def _unique_results(self: torch.Tensor, found: tuple[Any, Any, Any], return_inverse: bool,
                    return_counts: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, inverse, counts = found
    device = self.device
    return (_wrap(values, self.dtype, device),
            _wrap(inverse, torch.int64, device) if return_inverse else _empty(device),
            _wrap(counts, torch.int64, device) if return_counts else _empty(device))


@kernel(aten._unique2.default)
def _unique2(self: torch.Tensor, sorted: bool = True, return_inverse: bool = False,
             return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Always sorted (allowed for sorted=False). One sync: the number of distinct values."""
    return _unique_results(self, _unique(self, None, True), return_inverse, return_counts)


@kernel(aten.unique_dim.default)
def unique_dim(self: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False,
               return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch returns inverse and counts here whatever the flags. One sync."""
    return _unique_results(self, _unique(self, dim % max(self.dim(), 1), True), True, True)


@kernel(aten.unique_consecutive.default)
def unique_consecutive(self: torch.Tensor, return_inverse: bool = False, return_counts: bool = False,
                       dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sync: the number of runs."""
    axis = None if dim is None else dim % max(self.dim(), 1)
    return _unique_results(self, _unique(self, axis, False), return_inverse, return_counts)


# --- repeat_interleave, bincount ---------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _repeat_positions(repeats: Any, total: int) -> Any:
    """Positions in the repeats' own dtype (CPU's result dtype)."""
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=total)


@kernel(aten.repeat_interleave.Tensor)
def repeat_interleave(repeats: torch.Tensor, *, output_size: int | None = None) -> torch.Tensor:
    """One sync (the total, and the smallest repeat: CPU's check) unless output_size is given; then the
    check is a device-side one."""
    if repeats.dtype not in (torch.int64, torch.int32):  # CPU checks the dtype first
        raise NotImplementedError(f'"repeat_interleave_cpu" not implemented for \'{scalar_type_name(repeats.dtype)}\'')
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    r = dispatch.read(repeats).reshape(-1)
    if output_size is None:
        total, smallest = _host_ints(_sum_and_min(r))
        if smallest < 0:
            raise RuntimeError("repeats can not be negative")
    else:
        total = int(output_size)
        if checks.ENABLED:
            checks.issued(_negative_code(r), (_NEGATIVE_REPEATS,), (checks.caller(),), modes.state.blocking)
    return _wrap(_repeat_positions(r, total), repeats.dtype, repeats.device)


_NEGATIVE_REPEATS = checks.Check("aten::repeat_interleave", "repeats can not be negative")


@jax.jit
def _sum_and_min(r: Any) -> Any:
    return jnp.stack([jnp.sum(r), jnp.min(r, initial=0)])


@jax.jit
def _negative_code(r: Any) -> Any:
    """A device-side check's code (runtime/checks.py) for a negative repeat, when no sync is made."""
    return jnp.stack([jnp.any(r < 0).astype(jnp.int64), jnp.min(r, initial=0).astype(jnp.int64), jnp.argmin(r)])


@functools.partial(jax.jit, static_argnums=2)
def _bincount(x: Any, weights: Any, length: int) -> Any:
    if weights is None:
        return jnp.zeros((length,), jnp.int64).at[x].add(1)
    accumulator = jnp.float64 if weights.dtype != jnp.float32 else jnp.float32
    return jnp.zeros((length,), accumulator).at[x].add(weights.astype(accumulator))


@jax.jit
def _min_and_max(x: Any) -> Any:
    return jnp.stack([jnp.min(x), jnp.max(x)])


@kernel(aten.bincount.default)
def bincount(self: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """One sync: the smallest value (CPU's check) and the largest. Float32 weights give float32 counts,
    others float64 (PyTorch)."""
    if self.is_floating_point() or self.is_complex():
        raise NotImplementedError(f'"bincount" not implemented for \'{scalar_type_name(self.dtype)}\': it counts '
                                  "integers only")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if self.dim() == 1 and self.numel() == 0:  # CPU's early return: int64 zeros, whatever the weights
        return _wrap(jnp.zeros((int(minlength),), jnp.int64), torch.int64, self.device)
    if self.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    x = dispatch.read(self).reshape(-1)
    largest = 0
    if x.shape[0]:
        smallest, largest = _host_ints(_min_and_max(x))
        if smallest < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        largest += 1
    w = None if weights is None else dispatch.read(weights).reshape(-1)
    dtype = torch.int64 if w is None else (torch.float32 if weights.dtype == torch.float32 else torch.float64)
    length = max(largest, int(minlength))
    client.check_fits(self.device.index, length * dtype.itemsize)
    return _wrap(_bincount(x, w, length), dtype, self.device)


@jax.jit
def _min_and_max_or_zero(x: Any) -> Any:
    return jnp.stack([jnp.min(x, initial=0), jnp.max(x, initial=0)])


@kernel(aten.one_hot.default)
def one_hot(self: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """CPU's checks: with num_classes=-1 one sync reads the values' range (raised at once, as on CPU),
    otherwise they are device-side checks."""
    if self.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0 and num_classes <= 0:
        raise RuntimeError("Can not infer total number of classes from empty tensor.")
    if num_classes == -1:
        smallest, largest = _host_ints(_min_and_max_or_zero(dispatch.read(self)))
        if smallest < 0:
            raise RuntimeError("Class values must be non-negative.")
        num_classes = largest + 1
    return dispatch.execute(dispatch.plan_for(aten.one_hot.default), (self, num_classes), {})


# --- linalg error checks ----------------------------------------------------------------------


@kernel(aten._linalg_check_errors.default)
def _linalg_check_errors(info: torch.Tensor, api_name: str, *, is_matrix: bool) -> None:
    """One sync: `info` is read to the host and PyTorch's CPU check raises its LinAlgError."""
    aten._linalg_check_errors(info.cpu(), api_name, is_matrix=is_matrix)


# --- boolean mask indices ----------------------------------------------------------------------


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _mask_indices(mask: torch.Tensor, self_shape: Sequence[int], position: int) -> list[torch.Tensor]:
    """A mask as one integer index per dim it covers (one sync for a pjrt mask)."""
    covered = tuple(self_shape[position:position + mask.dim()])
    if tuple(mask.shape) != covered:
        raise IndexError(
            f"The shape of the mask {list(mask.shape)} at index {position} does not match the shape of the "
            f"indexed tensor {list(self_shape)} at index {position}"
        )
    if mask.device.type != "pjrt":
        return list(torch.nonzero(mask.bool()).unbind(1))
    coords = _coords(dispatch.read(mask).astype(jnp.bool_))
    return [_wrap(coords[:, d], torch.int64, mask.device) for d in range(mask.dim())]


def _integer_indices(self: torch.Tensor, indices: Sequence[Any]) -> list[Any]:
    converted: list[Any] = []
    position = 0
    for index in indices:
        if _is_mask(index):
            converted.extend(_mask_indices(index, tuple(self.shape), position))
            position += index.dim()
        else:
            converted.append(index)
            position += 1
    return converted


def _needs_conversion(self: torch.Tensor, indices: Sequence[Any], values: torch.Tensor | None) -> bool:
    if not any(_is_mask(i) for i in indices):
        return False
    given = [i for i, index in enumerate(indices) if index is not None]
    if values is not None and len(given) == 1:
        mask = indices[given[0]]
        return not indexing.mask_write_ok(tuple(self.shape), given[0], tuple(mask.shape), tuple(values.shape))
    return True


INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)


def _check_index_dtypes(indices: Sequence[Any]) -> None:
    """CPU's IndexError for a float index (PyTorch's meta kernel raises it as a RuntimeError)."""
    if any(isinstance(i, torch.Tensor) and i.dtype not in INDEX_DTYPES for i in indices):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")


@kernel(aten.index.Tensor)
def index(self: torch.Tensor, indices: list[Any]) -> torch.Tensor:
    """Boolean masks become integer indices first (one sync per pjrt mask)."""
    _check_index_dtypes(indices)
    if _needs_conversion(self, indices, None):
        indices = _integer_indices(self, indices)
    return dispatch.execute(dispatch.plan_for(aten.index.Tensor), (self, indices), {})


EXPANDED_INDEX_PUT = ("Use of index_put_ on expanded tensors is deprecated. Please clone() the tensor before "
                      "performing this operation. This also applies to advanced indexing e.g. tensor[indices] = tensor")


def _index_put_kernel(op: Any) -> Callable:
    def put(self: torch.Tensor, indices: list[Any], values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Masks are converted (one sync) unless the write is a `where` (`x[mask] = 0`)."""
        _check_index_dtypes(indices)
        if _needs_conversion(self, indices, values):
            indices = _integer_indices(self, indices)
        if op is not aten.index_put.default and storage.view_of(self).has_internal_overlap():
            _put_into_expanded(op, self, indices, values, args, kwargs)
            return self
        return dispatch.execute(dispatch.plan_for(op), (self, indices, values, *args), kwargs)

    put.__name__ = f"pjrt_{op.name()}"
    return put


def _put_into_expanded(op: Any, self: torch.Tensor, indices: list[Any], values: torch.Tensor, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> None:
    """CPU writes each selected element through its address (warning that this is deprecated), so elements that
    share one see every write: the write goes to the view without the expanded dims, at the selected elements'
    places in it (checked against self's sizes, as CPU checks them)."""
    warnings.warn(EXPANDED_INDEX_PUT, UserWarning, stacklevel=3)
    unexpanded_sizes = [1 if stride == 0 else size for size, stride in zip(self.shape, self.stride())]
    unexpanded = self.as_strided(unexpanded_sizes, self.stride(), self.storage_offset())
    places = torch.arange(unexpanded.numel(), device=self.device).view(unexpanded_sizes).expand(self.shape)
    selected = aten.index.Tensor(places, indices)
    coordinates = list(torch.unravel_index(selected, unexpanded_sizes))
    dispatch.execute(dispatch.plan_for(op), (unexpanded, coordinates, values, *args), kwargs)


for _op in (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
    KERNELS[_op] = _index_put_kernel(_op)


def _plain_index(self: torch.Tensor, indices: list[Any]) -> bool:
    return all(not isinstance(i, torch.Tensor) or i.dtype in INDEX_DTYPES for i in indices) and not _needs_conversion(
        self, indices, None)


def _plain_index_put(op: Any) -> Callable[..., bool]:
    def plain(self: torch.Tensor, indices: list[Any], values: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        return (all(not isinstance(i, torch.Tensor) or i.dtype in INDEX_DTYPES for i in indices)
                and not _needs_conversion(self, indices, values)
                and (op is aten.index_put.default or not storage.view_of(self).has_internal_overlap()))

    return plain


# Calls for which the kernels above only run `dispatch.execute`: these ops take the native hit path, and a
# native miss that is not such a call runs the kernel (csrc/dispatch.cpp keys each call by its dtypes,
# shapes and strides, which decide it).
PLAIN_CALLS: dict[Any, Callable[..., bool]] = {
    aten.index.Tensor: _plain_index,
    **{op: _plain_index_put(op) for op in (aten.index_put.default, aten.index_put_.default,
                                           aten._index_put_impl_.default)},
}
