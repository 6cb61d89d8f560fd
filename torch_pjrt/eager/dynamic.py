"""Bounded dynamism for eager tensors: a size that varies between calls compiles once per bucket.

`mark_dynamic(t, dim, max=...)` stores the tensor padded to a bucket of that dim (a
`storage.Padded` storage) while PyTorch keeps seeing its true sizes: `t.shape`, strides,
views, `.cpu()` and printing are the logical tensor. An op whose inputs live in padded storages
runs the program built for their buckets, with the true sizes as traced scalars, through the same
masking rules torch.compile's padded graphs use (ops/padding.py); its results are padded again,
so the marks flow through a model (broadcasts, matmuls, softmax, attention, a KV cache growing by
one) and a new size inside a seen bucket compiles nothing.

How an op sees a padded tensor: the tensor's view (sizes, strides, offset over its storage's true
row-major shape) is translated into the padded layout. Each dim of the view that runs along a
dynamic storage dim gets a symbolic size (the true size of that storage dim, or a fixed offset
from it, or a product when a view merges dims); symbols are shared by value within a call, and
the program is keyed by that pattern, never by the values. PyTorch's meta kernels run on fake
tensors of those symbolic sizes, so output sizes (and their buckets) come from PyTorch. A view the
translation cannot express, or an op with no padding rule, runs at its true sizes on a compacted
copy: one program per size, counted (`dynamic_unmaskable`) and warned once per op.

Factories (`torch.arange(n)`, `torch.ones(n, n)`, ...) whose size equals a length marked
dynamic recently make padded results too, since a length computed from `t.shape` reaches them
as a plain int: padding never changes values, only which programs run.
"""

from __future__ import annotations

import bisect
import builtins
import collections
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import sympy
import torch
import torch.fx

from torch_pjrt import _torch_private, envvars, storage
from torch_pjrt.ops import padding
from torch_pjrt.ops.padding import CannotPad
from torch_pjrt.runtime import client, metrics, programs
from torch_pjrt.storage import Padded, View

# --- marks -----------------------------------------------------------------------------------

# Lengths marked dynamic lately (true size -> (upper bound, ops executed when last seen, the storage
# seen with it)), newest last: factories with such a size pad. A length counts while that storage (a
# padded tensor of that length, or the CPU tensor marked) is alive and for _LIVE_OPS ops after it
# was last seen, so code that never met it (a later training loop, another test) is left alone.
_LIVE_LENGTHS: collections.OrderedDict[int, tuple[Bound, float, weakref.ref]] = collections.OrderedDict()
_LIVE_LIMIT = 16
_LIVE_OPS = 512


Bound = Any  # how a dynamic dim is bucketed: an upper bound (0: powers of two, unbounded) or a ladder of sizes


def bucket(size: int, upper: Bound) -> int | None:
    """The padded size of a dynamic dim, or None when it is exact: past its bound, or below 2.
    `upper` is an int bound (powers of two up to it, or the ladder mark_dynamic registered for it;
    0: powers of two, unbounded) or a tuple of bucket sizes."""
    if size < 2:
        return None
    if isinstance(upper, tuple):
        return None if size > upper[-1] else upper[bisect.bisect_left(upper, size)]
    if upper and size > upper:
        return None
    if not upper:
        return 1 << (size - 1).bit_length()
    return padding.bucket(size, upper)


def ladder(smallest: int, upper: int) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `upper`, and `upper` (a floor keeps short sizes in one bucket)."""
    sizes = [smallest]
    while sizes[-1] < upper:
        sizes.append(min(sizes[-1] * 2, upper))
    return tuple(sizes)


def note_length(size: int, upper: Bound, owner: Any) -> None:
    """`size` is a dynamic length of `owner` (a padded storage, or a marked CPU tensor)."""
    if size < 2:
        return
    _LIVE_LENGTHS.pop(size, None)
    _LIVE_LENGTHS[size] = (upper, metrics.counters_now("ops_executed"), weakref.ref(owner))
    while len(_LIVE_LENGTHS) > _LIVE_LIMIT:
        _LIVE_LENGTHS.popitem(last=False)


def note_padded(st: storage.DeviceStorage) -> None:
    """The dynamic lengths of a storage just made padded (an op's result, a marked or moved tensor)."""
    layout = st.array
    for size, upper in zip(layout.shape, layout.bounds):
        if upper is not None:
            note_length(size, upper, st)


def live_bound(size: int) -> Bound | None:
    """The bound of `size` when it is a length marked dynamic lately, else None."""
    found = _LIVE_LENGTHS.get(size)
    if found is None:
        return None
    upper, seen_at, owner = found
    if metrics.counters_now("ops_executed") - seen_at > _LIVE_OPS:
        del _LIVE_LENGTHS[size]
        return None
    # (a dead owner's entry stays until its window ends: has_live_lengths() keeps a call's plain reads
    # looking at the lengths of its own padded arguments, read_padded's fallback)
    return None if owner() is None else upper


def mark_dynamic(
    tensor: torch.Tensor, dim: int, *, min: int | None = None, max: int | None = None,  # noqa: A002
    buckets: Sequence[int] | None = None,
) -> None:
    """Mark `tensor.shape[dim]` dynamic within [min, max], padded to `buckets` (default: powers of two
    up to max, and max; without max, powers of two): eager ops on the tensor, and graphs compiled
    with it as input, then compile once per bucket instead of once per size.

    Sizes 0 and 1 stay unmarked: Dynamo specialises them, so each gets a graph of its own."""
    if max is None and buckets is not None:
        raise ValueError("torch_pjrt.mark_dynamic: buckets need a max; pass max= as well.")
    dim = dim % builtins.max(tensor.dim(), 1)
    if tensor.shape[dim] < 2:
        return
    sizes = None
    if buckets is not None:
        sizes = tuple(sorted({int(b) for b in buckets}))
        if sizes[-1] < max:
            raise ValueError(f"torch_pjrt.mark_dynamic: the largest bucket {sizes[-1]} is below max={max}.")
        padding.LADDERS[max] = sizes
    # (Dynamo's range needs a lower end once it has an upper one; 2 is where its dynamic sizes start)
    lower = builtins.max(min, 2) if min is not None else (2 if max is not None else None)
    torch._dynamo.mark_dynamic(tensor, dim, min=lower, max=max)
    mark_eager(tensor, dim, sizes or max or 0)


def mark_eager(tensor: torch.Tensor, dim: int, upper: Bound) -> None:
    """Hold a tensor's storage padded along `dim` (a CPU tensor is padded when it moves to pjrt);
    `upper` says how the size is bucketed (see `bucket`)."""
    size = tensor.shape[dim]
    if bucket(size, upper) is None:
        return
    if tensor.device.type == "cpu":
        tensor._pjrt_dynamic = {**getattr(tensor, "_pjrt_dynamic", {}), dim: upper}
        note_length(size, upper, tensor)
        return
    if tensor.device.type != "pjrt":
        return
    st = storage.storage_of(tensor)
    view = storage.view_of(tensor)
    current = st.array if isinstance(st.array, Padded) else None
    if current is None:
        if not (view.covers(st.numel) and view.dtype == st.dtype):
            raise ValueError(
                "torch_pjrt.mark_dynamic marks a tensor together with its storage: call it on a contiguous "
                "tensor that owns its storage (t.contiguous() or t.clone() first)."
            )
        shape, bounds, storage_dim = tuple(tensor.shape), [None] * tensor.dim(), dim
    else:
        found = translate(view, current, st.dtype)
        factors = None if found is None else found.dims[dim]
        if factors is not None and len(factors) == 1 and factors[0][1] == 0:
            return  # already dynamic
        if found is None or found.view.sizes[dim] != size or found.starts:
            raise ValueError("torch_pjrt.mark_dynamic: this view of a padded tensor cannot be marked; mark the "
                             "tensor it was made from.")
        storage_dim = _storage_dim(view, current.shape, dim)
        if storage_dim is None:
            raise ValueError("torch_pjrt.mark_dynamic: this view of a padded tensor cannot be marked; mark the "
                             "tensor it was made from.")
        shape, bounds = current.shape, list(current.bounds)
    bounds[storage_dim] = upper
    padded_shape = tuple(n if b is None else bucket(n, b) for n, b in zip(shape, bounds))
    source = current.resolve() if current is not None else st.materialize()
    st.array = Padded(_pad_device_array(source, shape, padded_shape, st), shape, padded_shape, tuple(bounds))
    note_padded(st)


# A device tensor up to this size is padded through the host: one round trip (it waits for the tensor)
# and no program, where a padding program would compile for every true length (its input's shape).
HOST_PAD_BYTES = 16 << 20


def _pad_device_array(source: Any, shape: tuple[int, ...], padded_shape: tuple[int, ...],
                      st: storage.DeviceStorage) -> Any:
    if st.numel * st.dtype.itemsize <= HOST_PAD_BYTES:
        widths = [(0, p - n) for n, p in zip(shape, padded_shape)]
        host = np.asarray(client.to_host(source)).reshape(shape)
        return client.to_device(np.pad(host, widths), st.device.index)
    return _padder(shape, padded_shape, st.dtype).call(source)


def _storage_dim(view: View, shape: tuple[int, ...], dim: int) -> int | None:
    """The storage dim a view dim runs along whole (stride of that storage dim, full size)."""
    strides = storage.contiguous_strides(shape)
    for k, (n, st) in enumerate(zip(shape, strides)):
        if view.strides[dim] == st and view.sizes[dim] == n:
            return k
    return None


_padders: dict[tuple, programs.Program] = {}


def _padder(shape: tuple[int, ...], padded_shape: tuple[int, ...], dtype: torch.dtype) -> programs.Program:
    key = (shape, padded_shape, dtype)
    if key not in _padders:
        jnp = client.jax_module().numpy
        widths = [(0, p - n) for n, p in zip(shape, padded_shape)]
        _padders[key] = programs.Program(lambda flat: jnp.pad(flat.reshape(shape), widths), "pad_to_bucket")
    return _padders[key]


def pad_host(array: np.ndarray, sizes: Sequence[int], marks: dict[int, Bound]) -> tuple[np.ndarray, Padded]:
    """A marked CPU tensor's elements padded on the host (free: it is copied anyway), and its layout."""
    shape = tuple(sizes)
    bounds: list[Bound | None] = [None] * len(shape)
    for dim, upper in marks.items():
        if bucket(shape[dim], upper) is not None:
            bounds[dim] = upper
    padded_shape = tuple(n if b is None else bucket(n, b) for n, b in zip(shape, bounds))
    widths = [(0, p - n) for n, p in zip(shape, padded_shape)]
    return np.pad(array.reshape(shape), widths), Padded(None, shape, padded_shape, tuple(bounds))


def host_marks(tensor: torch.Tensor) -> dict[int, Bound] | None:
    return getattr(tensor, "_pjrt_dynamic", None)


def get_dynamism_info(tensor: torch.Tensor) -> dict[str, Any]:
    """What is marked dynamic on a tensor: per dynamic dim its true size and bucket, and the
    storage's true and padded shapes (None when it is not padded)."""
    if tensor.device.type == "cpu":
        marks = host_marks(tensor) or {}
        return {"dims": {d: {"size": tensor.shape[d], "bucket": bucket(tensor.shape[d], u)}
                         for d, u in marks.items()}, "storage": None}
    st = storage.storage_of(tensor)
    layout = st.array
    if not isinstance(layout, Padded):
        return {"dims": {}, "storage": None}
    found = translate(storage.view_of(tensor), layout, st.dtype)
    dims = {}
    for d, factors in enumerate(found.dims if found is not None else ()):
        if factors is not None:
            dims[d] = {"size": tensor.shape[d], "bucket": found.view.sizes[d]}
    return {"dims": dims, "storage": {"shape": layout.shape, "padded": layout.padded,
                                      "readable_padded": found is not None}}


# --- a view of a padded storage, in the padded layout -----------------------------------------


Factor = Any  # int (a static size) or (storage dim or class, offset): that dim's true size + offset


class Translation(NamedTuple):
    """A view of a padded storage expressed in its padded layout."""

    view: View  # over the padded storage's flat array; dynamic dims at their padded sizes
    # per view dim: None (exact) or its true size as a product of factors over storage dims
    dims: tuple[tuple[Factor, ...] | None, ...]
    # view dims that merge a dynamic storage dim with others: block layout, to be read into prefix order
    relayouts: tuple[int, ...]
    # (storage dim, length): a window of that length ending at the true end, read from there
    starts: tuple[tuple[int, int], ...]


def _digits(value: int, shape: Sequence[int], strides: Sequence[int]) -> list[int]:
    return [value // st if i == 0 else (value // st) % n for i, (n, st) in enumerate(zip(shape, strides))]


def translate(view: View, layout: Padded, storage_dtype: torch.dtype) -> Translation | None:
    """The view in the padded layout, or None when a padded array cannot show it (a dynamic dim
    split, strided along or mixed with another in one stride, a dtype reinterpretation)."""
    if view.dtype != storage_dtype or view.conj or view.neg:
        return None
    return _translate(view, layout.shape, layout.padded, layout.bounds)


@functools.lru_cache(maxsize=8192)
def _translate(view: View, shape: tuple[int, ...], padded: tuple[int, ...],
               bounds: tuple[int | None, ...]) -> Translation | None:
    rank = len(shape)
    if 0 in shape or 0 in view.sizes:
        return None
    cs, cp = storage.contiguous_strides(shape), storage.contiguous_strides(padded)
    od = _digits(view.offset, shape, cs)
    if sum(d * c for d, c in zip(od, cs)) != view.offset:
        return None
    reach = list(od)
    touched: list[list[int]] = [[] for _ in range(rank)]
    kinds: list[Any] = []
    covered: set[int] = set()
    for j, (n, st) in enumerate(zip(view.sizes, view.strides)):
        if n == 1 or st == 0:
            kinds.append(None)
            continue
        d = _digits(st, shape, cs)
        if sum(a * c for a, c in zip(d, cs)) != st:
            return None
        nonzero = [i for i in range(rank) if d[i]]
        if len(nonzero) == 1 and d[nonzero[0]] == 1 and od[nonzero[0]] + n > shape[nonzero[0]]:
            inner = outer = nonzero[0]
            total = shape[inner]
            while total < n and outer > 0:
                outer -= 1
                total *= shape[outer]
            run = tuple(range(outer, inner + 1))
            if total != n or any(od[i] for i in run) or covered & set(run):
                return None
            covered |= set(run)
            kinds.append(("run", run))
            for i in run:
                touched[i].append(j)
        else:
            kinds.append(("lin", d))
            for i in nonzero:
                reach[i] += (n - 1) * d[i]
                touched[i].append(j)
    if any(i not in covered and reach[i] >= shape[i] for i in range(rank)):
        return None
    if any(i in covered and len(touched[i]) != 1 for i in range(rank)):
        return None

    sizes = [1 if kind is None and n == 1 else n for kind, n in zip(kinds, view.sizes)]
    strides = [0] * len(kinds)
    dims: list[Any] = [None] * len(kinds)
    relayouts = []
    for j, kind in enumerate(kinds):
        if kind is None:
            continue
        if kind[0] == "run":
            run = kind[1]
            sizes[j] = math.prod(padded[i] for i in run)
            strides[j] = cp[run[-1]]
            dynamic = [i for i in run if bounds[i] is not None]
            if dynamic:
                dims[j] = tuple((i, 0) if bounds[i] is not None else shape[i] for i in run)
                if dynamic != [run[0]]:
                    relayouts.append(j)
        else:
            strides[j] = sum(a * c for a, c in zip(kind[1], cp))
    digits = list(od)
    starts = []
    for k in range(rank):
        if bounds[k] is None or k in covered:
            continue
        if len(touched[k]) > 1:
            return None
        j = touched[k][0] if touched[k] else None
        if j is not None and any(a for i, a in enumerate(kinds[j][1]) if i != k) or (
                j is not None and kinds[j][1][k] != 1):
            return None
        a, n = od[k], (view.sizes[j] if j is not None else 1)
        true, pad = shape[k], padded[k]
        window, start = None, a
        if a + n == true and a == 0:
            window, size = ((k, 0),), pad
        elif a + n == true and 2 * n > true:
            window, size = ((k, -a),), pad - a
        elif a + n == true:
            starts.append((k, n))
            start, size = 0, n
        elif a == 0 and 2 * n > true:
            window, size = ((k, n - true),), pad + n - true
        else:
            size = n
        digits[k] = start
        if j is not None:
            sizes[j] = size
            dims[j] = window
    offset = sum(d * c for d, c in zip(digits, cp))
    return Translation(View(view.dtype, tuple(sizes), tuple(strides), offset), tuple(dims), tuple(relayouts),
                       tuple(starts))


# --- one call's padded arguments -----------------------------------------------------------


class PaddedLeaf(NamedTuple):
    """A tensor argument in a padded storage, as the program reads it (part of the cache key)."""

    slot: int
    storage_dtype: torch.dtype
    padded: tuple[int, ...]  # the storage array's shape
    view: View  # in the padded layout
    # per view dim: None, or its true size as factors: int, or (symbol class, offset)
    dims: tuple[tuple[Factor, ...] | None, ...]
    relayouts: tuple[int, ...]
    # (storage axis, symbol class, length, scale): read from (true size - length) * scale along the axis:
    # a window of fixed length at the true end, or one that starts at a length (scale: its stride)
    starts: tuple[tuple[int, int, int, int], ...]


class Symbols:
    """The true sizes of one call's dynamic dims, one symbol per distinct (size, bound)."""

    __slots__ = ("index", "values", "uppers")

    def __init__(self) -> None:
        self.index: dict[tuple[int, Bound], int] = {}
        self.values: list[int] = []
        self.uppers: list[Bound] = []

    def of(self, value: int, upper: Bound) -> int:
        key = (value, upper)
        found = self.index.get(key)
        if found is None:
            found = self.index[key] = len(self.values)
            self.values.append(value)
            self.uppers.append(upper)
        return found

    def bound_of(self, value: int) -> Bound | None:
        """The bound of a dynamic dim of this call whose true size is `value`, or None."""
        for found, upper in zip(self.values, self.uppers):
            if found == value:
                return upper
        return None

    def buckets(self) -> tuple[int, ...]:
        return tuple(bucket(v, u) for v, u in zip(self.values, self.uppers))

    def signature(self) -> tuple:
        """What a program depends on: each symbol's bucket and bound, never its value."""
        return tuple(zip(self.buckets(), self.uppers))


def describe(tensor: torch.Tensor, st: storage.DeviceStorage, slot: int, symbols: Symbols) -> PaddedLeaf | None:
    """A padded tensor argument, or None when its view cannot be read padded."""
    layout = st.array
    found = translate(storage.view_of(tensor), layout, st.dtype)
    if found is None:
        return None

    def factor(f: Any) -> Any:
        return f if isinstance(f, int) else (symbols.of(layout.shape[f[0]], layout.bounds[f[0]]), f[1])

    dims = tuple(None if d is None else tuple(factor(f) for f in d) for d in found.dims)
    starts = tuple((k, symbols.of(layout.shape[k], layout.bounds[k]), n, 1) for k, n in found.starts)
    return PaddedLeaf(slot, st.dtype, layout.padded, found.view, dims, found.relayouts, starts)


def read_padded(st: storage.DeviceStorage, slot: int, view: View, symbols: Symbols) -> PaddedLeaf | None:
    """A view of a plain storage along which a length marked lately bounds a dim, read padded so that
    the ops on it run their bucket's program. Per dim: a size that is such a length is read at its
    bucket where the storage extends that far (`cache[:, :, :T]` of a static KV cache); a window that
    starts at such a length and runs to the end of its row (`mask[:, T:]` of a mask padded to a fixed
    length E) is read from the traced start, its size E - T a symbol of its own bucketed at E. None
    when no dim qualifies."""
    if view.dtype != st.dtype or view.conj or view.neg or 0 in view.sizes:
        return None
    sizes, offset = list(view.sizes), view.offset
    bounds: list[Bound | None] = [None] * len(view.sizes)  # of each dim read padded
    start = None  # (dim, length, its bound) of the window read from a traced start
    for d, size in enumerate(view.sizes):
        if not view.strides[d]:
            continue
        window = None if start else _window_from_length(view, d, st.numel)
        if window is not None:
            length, upper, end = window
            offset -= length * view.strides[d]
            start, sizes[d], bounds[d] = (d, length, upper), end, (end,)
            continue
        # (or a dynamic length of this call's padded arguments: a static cache's `[:, :, :T]` beside the query
        # of length T, when the storage last seen with T has died)
        upper = live_bound(size)
        if upper is None:
            upper = symbols.bound_of(size)
        padded_size = None if upper is None else bucket(size, upper)
        if padded_size is not None and padded_size > size:
            sizes[d], bounds[d] = padded_size, upper
    if all(b is None for b in bounds):
        return None
    if offset + sum((n - 1) * stride for n, stride in zip(sizes, view.strides)) >= st.numel:
        return None
    starts = () if start is None else ((0, symbols.of(start[1], start[2]), 0, view.strides[start[0]]),)
    dims = tuple(None if b is None else ((symbols.of(n, b), 0),) for n, b in zip(view.sizes, bounds))
    return PaddedLeaf(slot, st.dtype, (st.numel,), view._replace(sizes=tuple(sizes), offset=offset), dims, (),
                      starts)


def _window_from_length(view: View, dim: int, numel: int) -> tuple[int, Bound, int] | None:
    """(start, its bound, row end) when the view's dim starts at a length marked lately and runs to the
    end of its row: the next larger stride of the view (or the storage's end) over this dim's stride."""
    stride = view.strides[dim]
    larger = [s for s in view.strides if s > stride]
    outer = min(larger) if larger else numel
    if outer % stride:
        return None
    start, end = view.offset % outer // stride, outer // stride
    upper = live_bound(start)
    if upper is None or start + view.sizes[dim] != end or bucket(view.sizes[dim], (end,)) is None:
        return None
    return start, upper, end


def padded_factor(f: Factor, buckets: Sequence[int]) -> int:
    return f if isinstance(f, int) else buckets[f[0]] + f[1]


def true_factor(f: Factor, true: Sequence[Any]) -> Any:
    return f if isinstance(f, int) else true[f[0]] + f[1]


# --- reading and writing padded arguments inside a program -------------------------------------


def _shifted(x: Any, leaf: PaddedLeaf, true: Sequence[Any], sign: int) -> Any:
    """Roll each window that starts at a traced offset to the front (sign -1) or back (+1)."""
    jnp = client.jax_module().numpy
    for k, symbol, length, scale in leaf.starts:
        x = jnp.roll(x, sign * (true[symbol] - length) * scale, axis=k)
    return x


def read_leaf(array: Any, leaf: PaddedLeaf, true: Sequence[Any], buckets: Sequence[int]) -> Any:
    """The argument's padded logical array: true values first along each dynamic dim."""
    x = _shifted(array.reshape(leaf.padded), leaf, true, -1)
    value = storage.read_view(x.reshape(-1), leaf.storage_dtype, leaf.view)
    for axis in leaf.relayouts:
        factors = leaf.dims[axis]
        value = _block_to_prefix(value, axis, [padded_factor(f, buckets) for f in factors],
                                 [true_factor(f, true) for f in factors])
    return value


def write_leaf(array: Any, leaf: PaddedLeaf, value: Any, true: Sequence[Any]) -> Any:
    """The padded storage array after writing `value` through the argument's view: only the
    true elements are written, so garbage in the value's padding never reaches true data."""
    jnp = client.jax_module().numpy
    x = _shifted(array.reshape(leaf.padded), leaf, true, -1)
    flat = x.reshape(-1)
    current = storage.read_view(flat, leaf.storage_dtype, leaf.view)
    value = jnp.broadcast_to(value.astype(current.dtype), current.shape)
    mask = _valid(leaf.dims, current.shape, true)
    if mask is not None:
        value = jnp.where(mask, value, current)
    flat = storage.write_view(flat, leaf.storage_dtype, leaf.view, value)
    return _shifted(flat.reshape(leaf.padded), leaf, true, 1)


def _valid(dims: Sequence[Any], shape: Sequence[int], true: Sequence[Any]) -> Any:
    jnp = client.jax_module().numpy
    mask = None
    for axis, factors in enumerate(dims):
        if factors is None:
            continue
        size = math.prod([true_factor(f, true) for f in factors])
        axis_mask = (jnp.arange(shape[axis]) < size).reshape([-1 if d == axis else 1 for d in range(len(shape))])
        mask = axis_mask if mask is None else mask & axis_mask
    return mask


def _block_to_prefix(value: Any, axis: int, padded: Sequence[int], true: Sequence[Any]) -> Any:
    """A merged dim laid out in padded blocks, re-read with its true elements first."""
    jnp = client.jax_module().numpy
    position = jnp.arange(value.shape[axis])
    index = 0
    strides = zip(padding.row_major_strides(true), padding.row_major_strides(padded))
    for size, (true_stride, padded_stride) in zip(true, strides):
        index = index + (position // true_stride) % jnp.maximum(size, 1) * padded_stride
    return jnp.take(value, index, axis=axis, mode="clip")


def _prefix_to_block(value: Any, axis: int, padded: Sequence[int], true: Sequence[Any]) -> Any:
    """A dim holding its true elements first, laid out in padded blocks of its factors."""
    jnp = client.jax_module().numpy
    position = jnp.arange(math.prod(padded))
    index = 0
    strides = zip(padding.row_major_strides(true), padding.row_major_strides(padded))
    for size, (true_stride, padded_stride) in zip(padded, strides):
        index = index + (position // padded_stride) % size * true_stride
    return jnp.take(value, index, axis=axis, mode="clip")


# --- what an op does to dynamic sizes: PyTorch's meta kernels on symbolic sizes ----------------


class OutputLayout(NamedTuple):
    """How one fresh result is stored: per dim its factors (ints, or sympy expressions), and the
    order its dims take in memory (PyTorch's strides for the result: a permuted input's layout)."""

    dims: tuple[tuple[Any, ...], ...]
    order: tuple[int, ...]


def _layout(meta: torch.Tensor) -> OutputLayout:
    sizes = [_torch_private.hint(s) for s in meta.shape]
    order = storage.physical_order(sizes, [_torch_private.hint(s) for s in meta.stride()])
    return OutputLayout(tuple(factors_of(s) for s in meta.shape), order or tuple(range(meta.dim())))


_CALL_LAYOUTS = 256  # per form: the true sizes remembered (a server sees every length up to its bound)


class FormShape(NamedTuple):
    """What an op's padded form says about its results, all a call needs unless the op is traced: plain
    values and sympy expressions, so the cache folder keeps it and a later process skips the meta kernels."""

    symbols: tuple[Any, ...]
    layouts: tuple[OutputLayout | None, ...]  # per fresh tensor result (None: a None result)
    dtypes: tuple[torch.dtype | None, ...]
    nesting: tuple[int | None, ...]  # per functional result: its list's length, None for a single value
    # per mutated argument's index: its tensors' sizes after the op (None: no tensor; -1: a dynamic size)
    mutated_sizes: tuple[tuple[int, tuple[tuple[int, ...] | None, ...]], ...]


class FormGraph(NamedTuple):
    """The op as a graph over fake tensors of symbolic sizes (one node, or its decomposition), where each
    graph input sits in the call's arguments, and its functional results' fake values: what tracing needs."""

    module: torch.fx.GraphModule
    feeds: list[tuple]
    metas: list[Any]


class Form:
    """An op's padded form, shared by every call with the same argument pattern: its shape (how its results
    are laid out), its graph (made when first traced, where the shape came from the cache folder), and the
    programs built for each combination of result buckets."""

    def __init__(self, shape: FormShape, uppers: Sequence[Bound],
                 graph: FormGraph | Callable[[], tuple[FormShape, FormGraph]]) -> None:
        self.shape = shape
        self.symbols = shape.symbols
        self._graph = graph
        self.flat_layouts = [layout for layout in shape.layouts if layout is not None]
        position = {symbol: i for i, symbol in enumerate(self.symbols)}
        factors = [f for layout in self.flat_layouts for dim in layout.dims for f in dim if not isinstance(f, int)]
        self._evaluators = [_evaluator(f, position) for f in factors]
        self.factor_bounds = tuple(bound_of(f, self.symbols, uppers) for f in factors)
        self.entries: dict[tuple[int, ...], Any] = {}
        self._calls: dict[tuple[int, ...], tuple[tuple[int, ...], list[Any]]] = {}

    def graph(self) -> FormGraph:
        """The form's graph, made now by the meta kernels when its shape was read from the cache folder."""
        if not isinstance(self._graph, FormGraph):
            shape, self._graph = self._graph()
            if shape != self.shape:
                raise RuntimeError("torch_pjrt: an op's padded form stored in the cache folder differs from the one "
                                   "PyTorch's meta kernels give now; clear the folder (torch-pjrt cache clear).")
        return self._graph

    def call_layout(self, values: Sequence[int], n_results: int) -> tuple[tuple[int, ...], list[Any]]:
        """A call's result buckets and its first `n_results` results' specs (nested like the op's
        results), for these symbol values; remembered, as the same lengths recur call after call."""
        key = tuple(values)
        found = self._calls.get(key)
        if found is None:
            true, padded = self.factor_sizes(values)
            flat = iter(self.specs(true, padded))
            specs = [next(flat) if count is None else [next(flat) for _ in range(count)]
                     for count in self.shape.nesting[:n_results]]
            if len(self._calls) >= _CALL_LAYOUTS:
                self._calls.clear()
            found = self._calls[key] = (padded, specs)
        return found

    def factor_sizes(self, values: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each dynamic result factor's true size and padded size (its bucket; itself when exact)."""
        true = tuple(e(values) for e in self._evaluators)
        padded = tuple(bucket(v, b) or v for v, b in zip(true, self.factor_bounds))
        return true, padded

    def specs(self, true: Sequence[int], padded: Sequence[int]) -> list[Any]:
        """Per fresh result: (dtype, sizes, strides, numel, layout or None) of this call."""
        true_it, padded_it = iter(true), iter(padded)
        bounds_it = iter(self.factor_bounds)
        found = []
        for layout, dtype in zip(self.shape.layouts, self.shape.dtypes):
            if layout is None:
                found.append(None)
                continue
            per_dim = []  # (true, padded, bound) of each factor, per logical dim
            sizes = []
            for factors in layout.dims:
                parts = []
                for f in factors:
                    if isinstance(f, int):
                        parts.append((f, f, None))
                        continue
                    t, p, b = next(true_it), next(padded_it), next(bounds_it)
                    parts.append((t, p, b if bucket(t, b) is not None else None))
                per_dim.append(parts)
                sizes.append(math.prod(part[0] for part in parts))
            in_memory = [part for d in layout.order for part in per_dim[d]]
            shape, padded_shape, bounds = (tuple(column) for column in zip(*in_memory)) if in_memory else ((), (), ())
            sizes_t = tuple(sizes)
            pad = None if shape == padded_shape and all(b is None for b in bounds) else Padded(
                None, shape, padded_shape, bounds)
            strides = storage.strides_in_order(sizes_t, layout.order)
            found.append((dtype, sizes_t, strides, math.prod(sizes_t), pad))
        return found


def _form_shape(symbols: Sequence[Any], metas: list[Any], arg_metas: Sequence[Any], n_fresh: int,
                mutated: Sequence[int]) -> FormShape:
    fresh = [m for meta in metas[:n_fresh] for m in (meta if isinstance(meta, (list, tuple)) else [meta])]

    def sizes(meta: Any) -> tuple[int, ...] | None:
        if not isinstance(meta, torch.Tensor):
            return None
        return tuple(-1 if isinstance(s, torch.SymInt) else int(s) for s in meta.shape)

    mutated_sizes = tuple((index, tuple(sizes(m) for m in (arg_metas[index] if isinstance(arg_metas[index], list)
                                                            else [arg_metas[index]]))) for index in mutated)
    return FormShape(tuple(symbols), tuple(None if m is None else _layout(m) for m in fresh),
                     tuple(None if m is None else m.dtype for m in fresh),
                     tuple(len(m) if isinstance(m, (list, tuple)) else None for m in metas), mutated_sizes)


def form(target: Any, fakes: Sequence[Any], metas: list[Any], n_fresh: int, guards: Sequence[Any],
         symbols: Sequence[Any], mutated: Sequence[int], positional: Sequence[int], keywords: dict[str, int],
         mode: Any, decomposition: Any = None, traced: frozenset[int] = frozenset()) -> tuple[FormShape, FormGraph]:
    """The padded form of one op call from its fake run: `fakes` are the arguments in schema order
    (fake tensors, SymInts, plain values, after the op: the `mutated` ones hold its writes),
    `positional`/`keywords` say how they are passed, `traced` which of them are traced numbers (graph inputs,
    not constants: the form serves every value). An op with no padding rule runs as its PyTorch
    decomposition (traced on the same fake tensors) when it has one."""
    if guards:
        raise CannotPad(f"its sizes must equal fixed ones ({guards[0].expr})")
    if target is None:
        raise CannotPad("no functional form")
    for meta in metas[n_fresh:]:
        if isinstance(meta, torch.Tensor) and meta.dim() and any(len(factors_of(s)) > 1 for s in meta.shape):
            raise CannotPad("it writes a merged dynamic dim")
    args = [fakes[i] for i in positional]
    kwargs = {name: fakes[i] for name, i in keywords.items()}
    numbers: list[tuple] = []
    places = [*(("p", j, i) for j, i in enumerate(positional)), *(("k", name, i) for name, i in keywords.items())]
    for where, key, i in places:
        if i in traced:
            fake = fakes[i]
            listed = isinstance(fake, (list, tuple))
            numbers += [(where, key, k) for k in range(len(fake))] if listed else [(where, key)]
    module, feeds = _one_node(target, args, kwargs, metas, numbers)
    try:
        padding.PaddedInterpreter.check(next(n for n in module.graph.nodes if n.op == "call_function"))
    except CannotPad:
        if decomposition is None:
            raise
        module, feeds = _decomposed(decomposition, args, kwargs, mode)
    return _form_shape(symbols, metas, fakes, n_fresh, mutated), FormGraph(module, feeds, metas)


def _paths(args: Sequence[Any], kwargs: dict[str, Any], wanted: Any) -> list[tuple]:
    """Where each value that `wanted` picks sits in (args, kwargs), in order."""
    found = []
    for where, items in (("p", list(enumerate(args))), ("k", list(kwargs.items()))):
        for key, value in items:
            if isinstance(value, (list, tuple)):
                found.extend((where, key, j) for j, v in enumerate(value) if wanted(v))
            elif wanted(value):
                found.append((where, key))
    return found


def pick(path: tuple, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    value = args[path[1]] if path[0] == "p" else kwargs[path[1]]
    return value[path[2]] if len(path) == 3 else value


def _one_node(target: Any, args: list[Any], kwargs: dict[str, Any], metas: list[Any],
              numbers: list[tuple]) -> tuple[Any, list[tuple]]:
    """The op as one graph node; its inputs the tensors, SymInts and traced numbers (each a scalar or a list,
    at `numbers`) of the call."""
    graph = torch.fx.Graph()
    feeds = _paths(args, kwargs, lambda v: isinstance(v, (torch.Tensor, torch.SymInt)))
    feeds += numbers
    nodes: dict[tuple, Any] = {}
    for position, path in enumerate(feeds):
        placeholder = nodes[path] = graph.placeholder(f"arg{position}")
        placeholder.meta["val"] = pick(path, args, kwargs)

    def node_args(items: Any, where: str) -> Any:
        out = {}
        for key, value in items:
            if isinstance(value, (list, tuple)):
                out[key] = [nodes.get((where, key, j), v) for j, v in enumerate(value)]
            else:
                out[key] = nodes.get((where, key), value)
        return out

    positional = node_args(enumerate(args), "p")
    node = graph.call_function(target, tuple(positional[i] for i in range(len(args))), node_args(kwargs.items(), "k"))
    node.meta["val"] = metas[0] if len(metas) == 1 else tuple(metas)
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph), feeds


def _decomposed(decomposition: Any, args: list[Any], kwargs: dict[str, Any], mode: Any) -> tuple[Any, list[tuple]]:
    """The decomposition as a graph of ops over the call's tensors (traced on its fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if any(isinstance(v, torch.SymInt) for v in [*args, *kwargs.values()]):
        raise CannotPad("a decomposition of a factory of dynamic size")
    feeds = _paths(args, kwargs, lambda v: isinstance(v, torch.Tensor))

    def traced(*tensors: torch.Tensor) -> Any:
        a, k = list(args), dict(kwargs)
        for path, tensor in zip(feeds, tensors):
            holder = a if path[0] == "p" else k
            if len(path) == 3:
                holder[path[1]] = list(holder[path[1]])
                holder[path[1]][path[2]] = tensor
            else:
                holder[path[1]] = tensor
        return decomposition(*a, **k)

    with mode:
        module = make_fx(traced, tracing_mode="real")(*[pick(p, args, kwargs) for p in feeds])
    return module, feeds


def _evaluator(expr: Any, position: dict[Any, int]) -> Any:
    """A closure computing a sympy size expression from the symbols' values (sympy is too slow per call)."""
    functions = _torch_private.size_functions()
    if expr.is_Integer:
        constant = int(expr)
        return lambda values: constant
    if expr.is_Symbol:
        index = position[expr]
        return lambda values: values[index]
    parts = [_evaluator(a, position) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return lambda values: sum(p(values) for p in parts)
    if isinstance(expr, sympy.Mul):
        return lambda values: math.prod(p(values) for p in parts)
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        exponent = int(expr.exp)
        return lambda values: parts[0](values) ** exponent
    operators = {"FloorDiv": lambda a, b: a // b, "CeilDiv": lambda a, b: -(-a // b), "Mod": lambda a, b: a % b,
                 "Max": max, "Min": min}
    for name, apply in operators.items():
        if isinstance(expr, functions[name]):
            return lambda values: apply(*(p(values) for p in parts))
    raise CannotPad(f"size expression {expr}")


def factors_of(size: Any) -> tuple[Any, ...]:
    """How a result dim is stored: an int, one dynamic dim, or a product laid out as several
    (2*s -> (2, s): a batch merged with a length is split back into blocks of the length)."""
    if not isinstance(size, torch.SymInt):
        return (int(size),)
    expr = size.node.expr
    if isinstance(expr, sympy.Mul):
        parts = [int(a) if a.is_Integer else a for a in expr.as_ordered_factors()]
        return tuple(parts)
    return (expr,)


def bound_of(expr: Any, symbols: Sequence[Any], uppers: Sequence[Bound]) -> Bound:
    """The bound a result factor is bucketed by: that of the first symbol in it."""
    for symbol, upper in zip(symbols, uppers):
        if symbol in expr.free_symbols:
            return upper
    return 0


def finish(value: Any, padded: Sequence[Sequence[int]], true: Sequence[Sequence[Any]],
           order: Sequence[int] | None = None) -> Any:
    """A rule's result (true values first along each dim) laid out as its storage: each dim cut or
    padded to its bucket, products split into blocks of their factors, dims in memory `order`."""
    jnp = client.jax_module().numpy
    lax = client.jax_module().lax
    for axis, (pf, tf) in enumerate(zip(padded, true)):
        target = math.prod(pf)
        if len(pf) > 1 and any(not isinstance(f, int) for f in tf):
            value = _prefix_to_block(value, axis, pf, tf)
        elif value.shape[axis] > target:
            value = lax.slice_in_dim(value, 0, target, axis=axis)
        elif value.shape[axis] < target:
            value = jnp.pad(value, [(0, target - value.shape[axis]) if d == axis else (0, 0)
                                    for d in range(value.ndim)])
    if order is not None and tuple(order) != tuple(range(value.ndim)):
        value = jnp.transpose(value, order)
        padded = [padded[d] for d in order]
    return value.reshape([f for pf in padded for f in pf])


def repad(result: Any) -> None:
    """After an op ran at true sizes on padded inputs, pad its results again where a dim has a length
    marked lately, so the ops after it run padded instead of at true sizes too (one small program)."""
    for tensor in storage.iter_tensors(result if isinstance(result, (list, tuple)) else [result]):
        if tensor.device.type != "pjrt":
            continue
        for dim, size in enumerate(tensor.shape):
            upper = live_bound(size)
            if upper is not None:
                try:
                    mark_eager(tensor, dim, upper)
                except ValueError:
                    return  # a view of another storage: left at true sizes


def has_live_lengths() -> bool:
    return bool(_LIVE_LENGTHS)


def live_lengths() -> collections.OrderedDict[int, tuple[Bound, float, weakref.ref]]:
    """The table of lengths marked dynamic lately, by length (the native dispatch sends a factory whose
    size is one of them here, to be padded, and notes a new padded result's lengths there as note_padded does)."""
    return _LIVE_LENGTHS


def live_limit() -> int:
    """How many live lengths the table keeps, the newest."""
    return _LIVE_LIMIT


def warn_unmaskable(name: str, reason: str, where: str) -> None:
    """Count an op that ran at true sizes on padded tensors; warn once per op (each time under
    TORCH_PJRT_DEBUG_RECOMPILE)."""
    metrics.bump("dynamic_unmaskable")
    metrics.unmaskable_ops[name] += 1
    if metrics.unmaskable_ops[name] == 1 or envvars.flag("TORCH_PJRT_DEBUG_RECOMPILE"):
        warnings.warn(
            f"torch_pjrt: {name} cannot run on padded (dynamic) tensors ({reason}); it runs at their true "
            f"sizes, compiling once per size. User line: {where}",
            stacklevel=2,
        )


class SizeSymbol(NamedTuple):
    """A size argument that follows a dynamic length: `sign * length + offset` (a factory's size is the
    length itself; a pad up to a fixed size is that size minus it). Part of the cache key, not its value."""

    symbol: int
    offset: int = 0
    sign: int = 1

    def at(self, length: Any) -> Any:
        return length if self.sign == 1 and not self.offset else self.sign * length + self.offset


def is_bucket_size(size: int, upper: Bound) -> bool:
    """Whether `size` is one of the bucket sizes of a dynamic dim bucketed by `upper`."""
    return bucket(size, upper) == size
