"""Padded execution: values whose dynamic sizes are held at a bucket size, and the op rules on them.

A size that varies between calls (a sequence length) is held padded to a bucket (powers of two
up to a bound, by default), so programs compile once per bucket instead of once per size. Every
value of symbolic shape is held at its padded shape, the true values in the prefix of each
symbolic dimension and garbage after it. Every op keeps that invariant: pointwise and row-local
ops need nothing; reductions and contractions first fill the padding with their identity (masks
come from the op's symbolic shape and the true sizes, which are traced scalars); reshapes that
would mix padding into the data go through the true element order; slices, selects and
concatenations along a symbolic dimension use true offsets. An op with no such rule raises
CannotPad and runs at its exact sizes instead.

One set of rules serves torch.compile graphs (compile/padding.py) and eager tensors marked
dynamic (eager/dynamic.py): both hand `PaddedInterpreter` one graph node at a time.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from torch_pjrt import _torch_private, storage
from torch_pjrt.ops import graph
from torch_pjrt.ops.nn import attention
from torch_pjrt.runtime import checks, client

aten = torch.ops.aten
prims = torch.ops.prims

# Bucket ladders given to mark_dynamic, by the upper bound they were given with.
LADDERS: dict[int, tuple[int, ...]] = {}


class CannotPad(Exception):
    """The graph has an op whose padded form is not known; it runs at exact sizes instead."""

def bucket(size: int, upper: int) -> int:
    """The padded size for a true size: the smallest bucket that holds it."""
    ladder = LADDERS.get(upper)
    if ladder is None:
        if size <= 1:
            return 1
        return min(1 << (size - 1).bit_length(), upper)
    return ladder[bisect.bisect_left(ladder, size)]

def is_symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two size lists are the same expressions, without asking the shape env (a guard)."""
    def expr(size: Any) -> Any:
        return size.node.expr if isinstance(size, torch.SymInt) else int(size)

    return len(a) == len(b) and all(expr(x) == expr(y) for x, y in zip(a, b))

def concrete_expr(expr: Any, values: dict[sympy.Symbol, int]) -> int:
    """A sympy size expression with its symbols bound to these values."""
    return int(sympy.sympify(expr).xreplace(values))


def concrete(size: Any, values: dict[sympy.Symbol, int]) -> int:
    """A size (int or SymInt) with its symbols bound to these values."""
    return int(sympy.sympify(size.node.expr).xreplace(values)) if isinstance(size, torch.SymInt) else int(size)

# --- symbolic sizes inside the program -------------------------------------------------------


class Sizes:
    """Bindings of the graph's size symbols: padded (static ints) and true (traced scalars)."""

    def __init__(self, padded: dict[sympy.Symbol, int], true: dict[sympy.Symbol, Any]) -> None:
        self.padded = padded
        self.true = true

    def pad(self, size: Any) -> int:
        return concrete(size, self.padded)

    def real(self, size: Any) -> Any:
        return _trace(size.node.expr, self.true) if isinstance(size, torch.SymInt) else int(size)

    def value(self, expr: Any) -> Any:
        """A sympy size expression's true value (traced)."""
        return _trace(expr, self.true)

    def shape(self, meta: torch.Tensor) -> tuple[int, ...]:
        return tuple(self.pad(s) for s in meta.shape)

    def valid(self, meta: torch.Tensor) -> Any:
        """A boolean mask, broadcastable to the padded shape, of the true elements (None: all)."""
        jnp = client.jax_module().numpy
        mask = None
        rank = meta.dim()
        for dim, size in enumerate(meta.shape):
            if not isinstance(size, torch.SymInt):
                continue
            shape = [1] * rank
            shape[dim] = self.pad(size)
            axis = (jnp.arange(self.pad(size)) < self.real(size)).reshape(shape)
            mask = axis if mask is None else mask & axis
        return mask


def _trace(expr: Any, values: dict[sympy.Symbol, Any]) -> Any:
    """A sympy size expression evaluated on traced scalars."""
    functions = _torch_private.size_functions()
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return values[expr]
    parts = [_trace(a, values) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return sum(parts[1:], parts[0])
    if isinstance(expr, sympy.Mul):
        return math.prod(parts[1:], start=parts[0])
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return parts[0] ** int(expr.exp)
    if isinstance(expr, functions["FloorDiv"]):
        return parts[0] // parts[1]
    if isinstance(expr, functions["CeilDiv"]):
        return -(-parts[0] // parts[1])
    if isinstance(expr, functions["Mod"]):
        return parts[0] % parts[1]
    jnp = client.jax_module().numpy
    if isinstance(expr, functions["Max"]):
        return jnp.maximum(*parts)
    if isinstance(expr, functions["Min"]):
        return jnp.minimum(*parts)
    raise CannotPad(f"size expression {expr}")


# --- the program boundary: true elements first in a flat buffer -------------------------------


def _leading_only(meta: torch.Tensor) -> bool:
    """Only dim 0 is symbolic: the true elements already are the prefix of the padded ones."""
    return all(not isinstance(s, torch.SymInt) for s in meta.shape[1:])


def row_major_strides(sizes: Sequence[Any]) -> list[Any]:
    """Row-major strides of sizes that may be traced values (no max(): a traced size cannot branch)."""
    strides, running = [], 1
    for size in reversed(sizes):
        strides.append(running)
        running = running * size
    return strides[::-1]


def expand(flat: Any, meta: torch.Tensor, sizes: Sizes) -> Any:
    """Padded array from a flat buffer holding the true elements first."""
    jnp = client.jax_module().numpy
    padded = sizes.shape(meta)
    flat = storage.flat_array(flat)
    if _leading_only(meta):
        return flat[: math.prod(padded)].reshape(padded)
    true_strides = row_major_strides([sizes.real(s) for s in meta.shape])
    index = sum(
        jnp.arange(n).reshape([-1 if d == i else 1 for d in range(len(padded))]) * stride
        for i, (n, stride) in enumerate(zip(padded, true_strides))
    )
    return jnp.take(flat, index, mode="clip")


def compact(value: Any, meta: torch.Tensor, sizes: Sizes) -> Any:
    """Flat buffer of the padded element count holding the padded array's true elements first."""
    jnp = client.jax_module().numpy
    if _leading_only(meta):
        return value.reshape(-1)
    padded = sizes.shape(meta)
    true = [sizes.real(s) for s in meta.shape]
    position = jnp.arange(math.prod(padded))
    index = 0
    for size, true_stride, padded_stride in zip(true, row_major_strides(true), row_major_strides(padded)):
        index = index + (position // true_stride) % jnp.maximum(size, 1) * padded_stride
    return jnp.take(value.reshape(-1), index, mode="clip")


# --- the padded interpreter ------------------------------------------------------------------


def _fill(value: Any, meta: Any, sizes: Sizes, fill: Any) -> Any:
    if not is_symbolic(meta):
        return value
    jnp = client.jax_module().numpy
    mask = sizes.valid(meta)
    if fill in (math.inf, -math.inf) and not jnp.issubdtype(value.dtype, jnp.inexact):
        info = jnp.iinfo(value.dtype) if value.dtype != jnp.bool_ else None
        fill = (True if fill > 0 else False) if info is None else (info.max if fill > 0 else info.min)
    return jnp.where(mask, value, jnp.asarray(fill, value.dtype))


def _grown(value: Any, axis: int, width: int) -> Any:
    """The value with zeros after its elements along the axis, up to `width` of them."""
    jnp = client.jax_module().numpy
    widths = [(0, 0)] * value.ndim
    widths[axis] = (0, width - value.shape[axis])
    return jnp.pad(value, widths)


def _metas(node: torch.fx.Node) -> list[Any]:
    return [arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args]


REDUCTION_IDENTITY = {
    aten.sum: 0, aten.any: 0, aten.cumsum: 0, aten.prod: 1, aten.all: 1, aten.cumprod: 1,
    aten.amax: -math.inf, aten.max: -math.inf, aten.argmax: -math.inf, aten.logsumexp: -math.inf,
    aten._softmax: -math.inf, aten._log_softmax: -math.inf, aten._safe_softmax: -math.inf,
    aten.amin: math.inf, aten.min: math.inf, aten.argmin: math.inf,
}
# Ops whose true outputs depend on padding only through sums: zero padding leaves them exact.
ZERO_FILLED = {
    aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addmv, aten.mv, aten.dot, aten.convolution,
    aten.convolution_backward, aten.index_add, aten.scatter_add, aten.embedding_dense_backward,
    aten._softmax_backward_data, aten._log_softmax_backward_data, aten.native_layer_norm_backward,
}
# Ops that act on each element (or each row along static dims) independently.
ROW_LOCAL = {
    aten.clone, aten._to_copy, aten.alias, aten.detach, aten.lift_fresh_copy, aten.copy, aten.permute,
    aten.transpose, aten.t, aten.unsqueeze, aten.squeeze, aten.expand, aten.embedding, aten.native_dropout,
    aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
    aten.full, aten.zeros, aten.ones, aten.empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty,
    aten.empty_strided, aten.scalar_tensor, aten.arange, aten.tril, aten.triu, aten.masked_fill, aten.where,
    aten.bernoulli, aten.rand, aten.randn, aten.native_layer_norm, prims.convert_element_type,
    aten.split_with_sizes, aten.split, aten.unbind, aten.index_select, aten.gather, aten.index, aten.repeat,
}
SIZE_OPS = {aten.arange}


def constant_pad_sizes(input: torch.Tensor, pad: Sequence[Any], value: Any = 0) -> torch.Tensor:  # noqa: A002
    """constant_pad_nd's result on symbolic sizes, where its C++ kernel would fix them to their values.
    Pad amounts may be symbolic too (a pad up to a fixed size: eager/dispatch.py)."""
    sizes = list(input.shape)
    for pair in range(len(pad) // 2):
        dim = len(sizes) - 1 - pair
        sizes[dim] = sizes[dim] + pad[2 * pair] + pad[2 * pair + 1]
    return torch.empty(sizes, dtype=input.dtype, device=input.device,
                       memory_format=_torch_private.suggest_memory_format(input))


# ops whose symbolic result comes from a size function here, not from their kernel
SYMBOLIC_META = {aten.constant_pad_nd.default: constant_pad_sizes}
SKIPPED = {aten._assert_scalar, aten.sym_constrain_range_for_size, aten._assert_tensor_metadata}


class PaddedInterpreter:
    """Runs graph nodes on padded values, keeping the true values in each prefix."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes

    def __call__(self, node: torch.fx.Node, args: tuple, kwargs: dict, rng: Any) -> Any:
        meta = node.meta.get("val")
        if isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.sizes.real(meta) if isinstance(meta, torch.SymInt) else _trace(meta.node.expr, self.sizes.true)
        op = node.target
        if not isinstance(op, torch._ops.OpOverload):
            if op is operator.getitem:
                return args[0][args[1]]
            raise CannotPad(f"graph call {op}")
        packet = op.overloadpacket
        if packet in SKIPPED:
            return None
        args, kwargs = self._sizes_as_arguments(op, node, args, kwargs)
        if not any(is_symbolic(n.meta.get("val")) for n in node.all_input_nodes):
            return graph.call_lowering(op, args, kwargs, rng, self._meta_padded(meta))
        metas = _metas(node)
        rule = self._rule(op, packet, node, metas)
        with checks.masked(lambda shape: self._true_elements(shape, node)):
            return rule(op, node, metas, args, kwargs, rng)

    def _true_elements(self, shape: tuple[int, ...], node: torch.fx.Node) -> Any:
        """For a device-side check on an array of this padded shape: the true elements of the node's
        dynamic inputs of that shape (None when none has it: the check is dropped, never misread)."""
        mask = None
        for value in (n.meta.get("val") for n in node.all_input_nodes):
            if is_symbolic(value) and self.sizes.shape(value) == shape:
                valid = self.sizes.valid(value)
                mask = valid if mask is None else mask & valid
        return mask

    @staticmethod
    def check(node: torch.fx.Node) -> None:
        """Raise CannotPad now if the node has dynamic inputs and no rule (the rule is chosen again at trace time)."""
        op = node.target
        if isinstance(op, torch._ops.OpOverload) and op.overloadpacket not in SKIPPED and any(
                is_symbolic(n.meta.get("val")) for n in node.all_input_nodes):
            PaddedInterpreter(Sizes({}, {}))._rule(op, op.overloadpacket, node, _metas(node))

    def _meta_padded(self, meta: Any) -> Any:
        """The node's meta value at padded sizes (what conform checks results against)."""
        if isinstance(meta, torch.Tensor):
            return torch.empty_strided(self.sizes.shape(meta), [1] * meta.dim(), dtype=meta.dtype, device="meta")
        if isinstance(meta, (list, tuple)):
            return type(meta)(self._meta_padded(m) for m in meta)
        return meta

    def _sizes_as_arguments(self, op: Any, node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A size argument takes the padded size; a Scalar argument (a value) takes the true one."""
        schema = op._schema.arguments
        padded_scalars = op.overloadpacket in SIZE_OPS

        def convert(value: Any, kind: str) -> Any:
            if isinstance(value, (list, tuple)):
                return type(value)(convert(v, kind) for v in value)
            if not isinstance(value, torch.fx.Node):
                return value
            size = value.meta.get("val")
            if not isinstance(size, torch.SymInt):
                return None
            if "int" in kind.lower() or padded_scalars:
                return self.sizes.pad(size)
            return self.sizes.real(size)

        new_args = list(args)
        for i, raw in enumerate(node.args):
            kind = str(schema[i].type) if i < len(schema) else ""
            if _holds_symint(raw):
                new_args[i] = _merge(args[i], convert(raw, kind))
        new_kwargs = dict(kwargs)
        types = {a.name: str(a.type) for a in schema}
        for name, raw in node.kwargs.items():
            if _holds_symint(raw):
                new_kwargs[name] = _merge(kwargs[name], convert(raw, types.get(name, "")))
        return tuple(new_args), new_kwargs

    def _rule(self, op: Any, packet: Any, node: torch.fx.Node, metas: list[Any]) -> Any:
        if packet in (aten.view, aten._unsafe_view, aten.reshape):
            return self._reshape
        if packet is aten.slice:
            return self._slice
        if packet is aten.select:
            return self._select
        if packet is aten.cat:
            return self._cat
        if packet is aten.mean:
            return self._mean
        if packet in (aten.var, aten.std, aten.var_mean, aten.std_mean):
            return self._variance
        if packet in (aten.index_copy, aten.index_fill) and is_symbolic(metas[2]):
            return self._index_write
        if packet is aten.embedding_dense_backward and not same_sizes(metas[0].shape[:-1], metas[1].shape):
            # its meta does not compare the two: a gradient padded where the indices are not is a mismatch
            raise CannotPad("embedding backward whose indices are not padded like its gradient")
        if packet in (aten.nll_loss_forward, aten.nll_loss_backward):
            return self._nll_loss
        if packet is aten.constant_pad_nd:
            return self._constant_pad
        if op in (attention.fused_attention_op, attention.fused_attention_backward_op):
            return self._attention
        if packet in REDUCTION_IDENTITY:
            return self._identity_filled
        if packet in ZERO_FILLED or (packet is aten.index_put and _accumulates(node)):
            return self._zero_filled
        if packet in (aten.split, aten.split_with_sizes, aten.unbind) and self._along_symbolic(node, metas):
            raise CannotPad(str(op))
        if packet is aten.native_layer_norm and is_symbolic(metas[0]):
            normalized = len(node.args[1])
            if any(isinstance(s, torch.SymInt) for s in metas[0].shape[-normalized:]):
                raise CannotPad("layer norm over a dynamic dimension")
        if packet in (aten.index_select, aten.gather, aten.index) and self._along_symbolic(node, metas):
            raise CannotPad(f"{op} along a dynamic dimension")
        if torch.Tag.pointwise in op.tags or packet in ROW_LOCAL:
            return self._plain
        raise CannotPad(str(op))

    def _along_symbolic(self, node: torch.fx.Node, metas: list[Any]) -> bool:
        source = metas[0]
        if not is_symbolic(source):
            return False
        if node.target.overloadpacket is aten.index:
            indexed = [d for d, idx in enumerate(node.args[1]) if idx is not None]
            return any(isinstance(source.shape[d], torch.SymInt) for d in indexed)
        dim = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else node.kwargs.get("dim", 0)
        if node.target.overloadpacket in (aten.split, aten.split_with_sizes):
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        return isinstance(source.shape[dim % source.dim()], torch.SymInt)

    def _plain(self, op, node, metas, args, kwargs, rng):
        return graph.call_lowering(op, args, kwargs, rng, self._meta_padded(node.meta.get("val")))

    def _identity_filled(self, op, node, metas, args, kwargs, rng):
        args = (_fill(args[0], metas[0], self.sizes, REDUCTION_IDENTITY[op.overloadpacket]), *args[1:])
        return self._plain(op, node, metas, args, kwargs, rng)

    def _zero_filled(self, op, node, metas, args, kwargs, rng):
        filled = [_fill(a, m, self.sizes, 0) if graph.is_array(a) else a for a, m in zip(args, metas)]
        if op.overloadpacket is aten.index_put:
            indices = [None if i is None else _fill(i, m, self.sizes, 0)
                       for i, m in zip(args[1], [i.meta.get("val") if i is not None else None for i in node.args[1]])]
            filled[1] = indices
        return self._plain(op, node, metas, tuple(filled), kwargs, rng)

    def _attention(self, op, node, metas, args, kwargs, rng):
        """One-op attention (or its backward) over padded sequences: padded keys, values and bias entries
        are zeros, the keys masked out of every query's softmax; padded queries give padded rows, and in
        the backward their gradient rows are zeros, so they add nothing to the keys' and values' gradients.
        Queries or keys of a fixed length under a mask padded along them (its true size is their length)
        are padded to the mask's size with zeros too, and the results cut back to that fixed length, so
        the mask is never unpadded and one program serves every size of its bucket."""
        jnp = client.jax_module().numpy
        first = 1 if op is attention.fused_attention_backward_op else 0  # (the backward's grad_output)
        query, key, value = metas[first:first + 3]
        if any(isinstance(size, torch.SymInt) for t in (query, key, value) for size in (*t.shape[:2], t.shape[-1])):
            raise CannotPad("attention over a dynamic batch, head or feature dimension")
        mask = metas[first + 3]
        # the width the queries (rows) and the keys (columns) are padded to here, None where they are not
        rows, columns = (self.sizes.pad(mask.shape[axis]) if mask is not None and isinstance(mask.shape[axis],
                         torch.SymInt) and not isinstance(length, torch.SymInt) else None
                         for axis, length in ((-2, query.shape[2]), (-1, key.shape[2])))
        if any(width is not None and width < length for width, length in ((rows, query.shape[2]),
                                                                           (columns, key.shape[2]))):
            raise CannotPad("attention whose mask is padded to fewer positions than its fixed queries or keys")
        zeroed = [_fill(a, m, self.sizes, 0) for a, m in zip(args[:first + 3], metas[:first + 3])]
        if not first:
            zeroed[0] = args[0]  # (a padded query row only makes a padded output row)
        for i in range(first + 3):  # grad_output and query along rows, key and value along columns
            width = rows if i <= first else columns
            if width is not None:
                zeroed[i] = _grown(zeroed[i], 2, width)
        bias = args[first + 3]
        if bias is not None:
            bias = _fill(bias, metas[first + 3], self.sizes, 0)
        if isinstance(key.shape[2], torch.SymInt) or columns is not None:
            true_keys = key.shape[2] if columns is not None else self.sizes.real(key.shape[2])
            valid = jnp.arange(zeroed[first + 1].shape[2]) < true_keys
            bias = valid if bias is None else (bias & valid if bias.dtype == jnp.bool_
                                               else jnp.where(valid, bias, -jnp.inf))
        args = (*zeroed, bias, *args[first + 4:])
        if rows is None and columns is None:
            return self._plain(op, node, metas, args, kwargs, rng)
        results = graph.call_lowering(op, args, kwargs, rng)
        # the forward's output and logsumexp go by query rows; the backward's query, key and value gradients
        cuts = (rows, rows) if not first else (rows, columns, columns)
        lengths = (query.shape[2], query.shape[2]) if not first else (query.shape[2], key.shape[2], key.shape[2])
        results = tuple(result if result is None or i >= len(cuts) or cuts[i] is None else result[:, :, :lengths[i]]
                        for i, result in enumerate(results))
        return graph.conform(results, self._meta_padded(node.meta.get("val")))

    def _constant_pad(self, op, node, metas, args, kwargs, rng):
        """Each dynamic dim: the true elements shifted by the pad before them, the fill everywhere else
        up to the result's padded size (pad amounts may be traced: a pad up to a fixed size)."""
        jnp = client.jax_module().numpy
        source, result = metas[0], node.meta["val"]
        value = args[2] if len(args) > 2 else kwargs.get("value", 0)
        pads = [self.sizes.real(p.meta["val"]) if isinstance(p, torch.fx.Node) else int(p) for p in node.args[1]]
        x = args[0]
        fill = jnp.asarray(value, dtype=x.dtype)
        for pair in range(len(pads) // 2):
            dim = source.dim() - 1 - pair
            before, after = pads[2 * pair], pads[2 * pair + 1]
            length = self.sizes.pad(result.shape[dim])
            if not isinstance(source.shape[dim], torch.SymInt):
                if not (isinstance(before, int) and isinstance(after, int)):
                    raise CannotPad("a traced pad amount on a fixed dimension")
                widths = [(0, 0, 0)] * x.ndim
                widths[dim] = (before, after, 0)
                x = client.jax_module().lax.pad(x, fill, widths)
                continue
            if not isinstance(before, int) or before < 0 or (isinstance(after, int) and after < 0):
                raise CannotPad("a negative or traced leading pad of a dynamic dimension")
            widths = [(0, 0)] * x.ndim
            widths[dim] = (before, max(0, length - before - x.shape[dim]))
            x = jnp.pad(x, widths, constant_values=fill)[(slice(None),) * dim + (slice(0, length),)]
            position = jnp.arange(length).reshape([length if d == dim else 1 for d in range(x.ndim)])
            true = self.sizes.real(source.shape[dim])
            x = jnp.where((position >= before) & (position < before + true), x, fill)
        return x

    def _mean(self, op, node, metas, args, kwargs, rng):
        """Mean of the true elements: the padded mean of zero-filled input, rescaled by the counts."""
        source = metas[0]
        dims = args[1] if op is aten.mean.dim and args[1:] and args[1] not in (None, []) else range(source.dim())
        dims = [d % max(source.dim(), 1) for d in dims]
        padded = math.prod(self.sizes.pad(source.shape[d]) for d in dims)
        true = math.prod((self.sizes.real(source.shape[d]) for d in dims), start=1)
        result = self._plain(op, node, metas, (_fill(args[0], source, self.sizes, 0), *args[1:]), kwargs, rng)
        return (result * (padded / true)).astype(result.dtype)

    def _variance(self, op, node, metas, args, kwargs, rng):
        """var/std (and their _mean forms) of the true elements: moments of the zero-filled input over
        the true count, deviations masked."""
        jnp = client.jax_module().numpy
        source = metas[0]
        overload = op._overloadname
        if overload == "correction":
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            correction = kwargs.get("correction")
            correction = 1 if correction is None else correction
            keepdim = kwargs.get("keepdim", False)
        elif overload == "dim":
            dims = args[1]
            unbiased = args[2] if len(args) > 2 else kwargs.get("unbiased", True)
            correction, keepdim = int(unbiased), (args[3] if len(args) > 3 else kwargs.get("keepdim", False))
        else:
            dims, correction, keepdim = None, int(args[1] if len(args) > 1 else kwargs.get("unbiased", True)), False
        rank = max(source.dim(), 1)
        dims = tuple(range(source.dim())) if dims in (None, []) else tuple(d % rank for d in dims)
        count = math.prod((self.sizes.real(source.shape[d]) for d in dims), start=1)
        x = _fill(args[0], source, self.sizes, 0)
        mean = x.sum(dims, keepdims=True) / count
        deviation = x - mean
        mask = self.sizes.valid(source)
        if mask is not None:
            deviation = jnp.where(mask, deviation, 0)
        squares = (deviation * jnp.conj(deviation)).real if jnp.iscomplexobj(deviation) else deviation * deviation
        variance = squares.sum(dims, keepdims=keepdim) / jnp.maximum(count - correction, 0)
        packet = op.overloadpacket
        spread = jnp.sqrt(variance) if packet in (aten.std, aten.std_mean) else variance
        if packet in (aten.var, aten.std):
            return spread
        return spread, (mean if keepdim else mean.squeeze(dims))

    def _index_write(self, op, node, metas, args, kwargs, rng):
        """Padded index entries point past the dim, so their writes are dropped."""
        dim = args[1] % max(metas[0].dim(), 1)
        past_end = args[0].shape[dim] if args[0].ndim else 1
        args = (args[0], args[1], _fill(args[2], metas[2], self.sizes, past_end), *args[3:])
        return self._plain(op, node, metas, args, kwargs, rng)

    def _nll_loss(self, op, node, metas, args, kwargs, rng):
        """Padded rows get the ignored class: they count neither in the sum nor the mean's weight."""
        position = 1 if op.overloadpacket is aten.nll_loss_forward else 2
        ignore_index = args[position + 3]
        args = list(args)
        args[position] = _fill(args[position], metas[position], self.sizes, ignore_index)
        args = [_fill(a, m, self.sizes, 0) if graph.is_array(a) and i != position else a
                for i, (a, m) in enumerate(zip(args, metas))]
        return self._plain(op, node, metas, tuple(args), kwargs, rng)

    def _reshape(self, op, node, metas, args, kwargs, rng):
        source, target = metas[0], node.meta["val"]
        if _prefix_preserving(source.shape, target.shape):
            return args[0].reshape(self.sizes.shape(target))
        return expand(compact(args[0], source, self.sizes), target, self.sizes)

    def _slice(self, op, node, metas, args, kwargs, rng):
        source = metas[0]
        dim = (args[1] if len(args) > 1 else 0) % source.dim()
        if not isinstance(source.shape[dim], torch.SymInt):
            return self._plain(op, node, metas, args, kwargs, rng)
        jax = client.jax_module()
        jnp = jax.numpy
        raw = list(node.args) + [None] * (5 - len(node.args))
        step = args[4] if len(args) > 4 else 1
        size = self.sizes.real(source.shape[dim])
        start = self._true_bound(raw[2], args[2] if len(args) > 2 else None, size, 0)
        length = self.sizes.pad(node.meta["val"].shape[dim])
        x = jnp.pad(args[0], [(0, length * step if d == dim else 0) for d in range(source.dim())])
        window = jax.lax.dynamic_slice_in_dim(x, start, max((length - 1) * step + 1, 0), axis=dim)
        return jax.lax.slice_in_dim(window, 0, window.shape[dim], step, axis=dim)

    def _true_bound(self, raw: Any, value: Any, size: Any, default: int) -> Any:
        jnp = client.jax_module().numpy
        if value is None:
            return default
        if isinstance(raw, torch.fx.Node):
            value = self.sizes.real(raw.meta["val"])
        value = jnp.where(value < 0, value + size, value)
        return jnp.clip(value, 0, size)

    def _select(self, op, node, metas, args, kwargs, rng):
        source = metas[0]
        dim = args[1] % source.dim()
        if not isinstance(source.shape[dim], torch.SymInt):
            return self._plain(op, node, metas, args, kwargs, rng)
        jax = client.jax_module()
        size = self.sizes.real(source.shape[dim])
        index = self.sizes.real(node.args[2].meta["val"]) if isinstance(node.args[2], torch.fx.Node) else args[2]
        index = jax.numpy.where(index < 0, index + size, index)
        return jax.lax.dynamic_index_in_dim(args[0], index, axis=dim, keepdims=False)

    def _cat(self, op, node, metas, args, kwargs, rng):
        target = node.meta["val"]
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % target.dim()
        if not isinstance(target.shape[dim], torch.SymInt):
            return self._plain(op, node, metas, args, kwargs, rng)
        jax = client.jax_module()
        pieces = [p for p, n in zip(args[0], node.args[0]) if n.meta["val"].shape != (0,)]
        piece_metas = [n.meta["val"] for n in node.args[0] if n.meta["val"].shape != (0,)]
        shape = list(self.sizes.shape(target))
        shape[dim] = sum(p.shape[dim] for p in pieces)
        result = jax.numpy.zeros(shape, pieces[0].dtype)
        offset = 0
        for piece, meta in zip(pieces, piece_metas):
            start = [0] * len(shape)
            start[dim] = offset
            result = jax.lax.dynamic_update_slice(result, piece.astype(result.dtype), start)
            offset = offset + self.sizes.real(meta.shape[dim])
        return jax.lax.slice_in_dim(result, 0, self.sizes.pad(target.shape[dim]), axis=dim)


def _holds_symint(raw: Any) -> bool:
    if isinstance(raw, (list, tuple)):
        return any(_holds_symint(r) for r in raw)
    return isinstance(raw, torch.fx.Node) and isinstance(raw.meta.get("val"), torch.SymInt)


def _merge(loaded: Any, converted: Any) -> Any:
    """Loaded argument values with the converted sizes in place of symbolic ones."""
    if isinstance(converted, (list, tuple)):
        return type(loaded)(_merge(a, c) for a, c in zip(loaded, converted))
    return loaded if converted is None else converted


def _accumulates(node: torch.fx.Node) -> bool:
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _prefix_preserving(source: Sequence[Any], target: Sequence[Any]) -> bool:
    """A plain reshape of padded arrays keeps the true elements in each prefix when, in every group
    of dims whose products match, a symbolic dim only ever leads its group (the rest static)."""
    shapes = [[s for s in shape if not (isinstance(s, int) and s == 1)] for shape in (source, target)]
    symbolic = [s for shape in shapes for s in shape if isinstance(s, torch.SymInt)]
    symbols = sorted({sym for s in symbolic for sym in s.node.expr.free_symbols}, key=str)
    generic = {sym: 1009 + 16 * k for k, sym in enumerate(symbols)}
    values = [[concrete(s, generic) for s in shape] for shape in shapes]
    (a, b), (va, vb) = shapes, values
    i = j = 0
    while i < len(a) and j < len(b):
        group_a, group_b, pa, pb = [a[i]], [b[j]], va[i], vb[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                group_a.append(a[i])
                pa, i = pa * va[i], i + 1
            elif pb < pa and j < len(b):
                group_b.append(b[j])
                pb, j = pb * vb[j], j + 1
            else:
                return False
        if any(isinstance(s, torch.SymInt) for s in group_a[1:] + group_b[1:]):
            return False
    return i == len(a) and j == len(b)
