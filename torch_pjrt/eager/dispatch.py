"""Strict eager execution: every ATen call on pjrt tensors runs as one cached jitted program.

A kernel is classified from its schema (functional, mutating: in-place or out=, view).
Its program takes the flat arrays of the storages its tensors live in plus the traced
scalars, reads each tensor through its view, applies the lowering, and returns new
storages for the outputs and the updated flat arrays of every mutated storage.
Programs are cached by (op, views, static arguments); a Python scalar that changes
(a learning rate) is a traced argument, never part of the key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import math
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch._ops import OpOverload

from torch_pjrt import _torch_private, storage
from torch_pjrt.eager import dynamic, fusion, modes
from torch_pjrt.ops import arguments, casts, graph, indexing, linalg, padding, registry
from torch_pjrt.runtime import checks, client, disk_store, metrics, programs, rng, startup
from torch_pjrt.storage import View

PJRT = "pjrt"
_CONSTANT_PAD = torch.ops.aten.constant_pad_nd.default


class Arg(enum.Enum):
    TENSOR = 1
    TENSOR_LIST = 2
    SCALAR = 3
    SCALAR_LIST = 4
    GENERATOR = 5
    DEVICE = 6
    STATIC = 7


def _arg_kind(type_: Any) -> Arg:
    text = str(type_)
    if "Tensor" in text:
        return Arg.TENSOR_LIST if ("List" in text or "[]" in text) else Arg.TENSOR
    if "Generator" in text:
        return Arg.GENERATOR
    if text in ("Device", "Optional[Device]"):
        return Arg.DEVICE
    if text in ("number", "Optional[number]", "Scalar", "Optional[Scalar]"):
        return Arg.SCALAR
    if text in ("List[number]", "List[Scalar]", "Optional[List[number]]"):
        return Arg.SCALAR_LIST
    return Arg.STATIC


@dataclasses.dataclass
class SchemaFacts:
    """What a plan reads from its overload's schema: the same in every process of the same torch, so the
    device's start keeps them in the cache folder (`schema_facts_known`) instead of reading 2,400 schemas."""

    names: list[str]
    kinds: list[Arg]
    kwarg_only: list[bool]
    defaults: list[Any]
    mutated: list[int]
    # for each schema return: the index of the argument it aliases, or None for a new tensor
    return_aliases: list[int | None]
    # every return is a tensor, an optional tensor or a tensor list (what the native cache can wrap)
    native_returns: bool


@dataclasses.dataclass
class OpPlan(SchemaFacts):
    """What the dispatcher needs to know about one overload, computed once."""

    op: OpOverload
    lowering: registry.Lowering
    factory: bool
    static_scalars: bool
    has_device_arg: bool
    # str(op): hashed per call as part of the cache key (an OpOverload's hash is computed in Python)
    name: str
    allow_cpu: bool
    # a factory's sizes that are padded when they equal a length marked lately (`Scan.sizes`): its `size`,
    # arange's `end`; none for random factories, whose draws would change with the padding
    length_args: tuple[int, ...]

    def normalize(self, args: tuple, kwargs: dict) -> list[Any]:
        values = list(args)
        for i in range(len(values), len(self.names)):
            name = self.names[i]
            values.append(kwargs[name] if name in kwargs else self.defaults[i])
        return values


class _NoDefault(enum.Enum):
    """An argument without a schema default (an enum member: the same object after a stored plan is read)."""

    NO_DEFAULT = 0


_NO_DEFAULT = _NoDefault.NO_DEFAULT


def _default(argument: Any) -> Any:
    """A schema default as Python sees it (ScalarType defaults come as enum numbers)."""
    if not argument.has_default_value():
        return _NO_DEFAULT
    value = argument.default_value
    if isinstance(value, int) and "ScalarType" in str(argument.type):
        return _torch_private.scalar_type(value)
    return value


# by overload name (`op.name()`): those read so far, and those an earlier process read (`schema_facts_known`)
_known_facts: dict[str, SchemaFacts] = {}


def schema_facts_known(facts: dict[str, SchemaFacts] | None = None) -> dict[str, SchemaFacts]:
    """Add the facts an earlier process of the same code and torch read; all those known now."""
    _known_facts.update(facts or {})
    return dict(_known_facts)


def schema_facts(op: OpOverload) -> SchemaFacts:
    known = _known_facts.get(op.name())
    if known is None:
        known = _known_facts[op.name()] = _read_schema_facts(op)
    return known


def _read_schema_facts(op: OpOverload) -> SchemaFacts:
    schema = op._schema
    arguments = schema.arguments
    mutated = registry.mutated_arguments(op)
    aliases: list[int | None] = []
    for ret in schema.returns:
        index = None
        if ret.alias_info is not None:
            for i in mutated:
                if arguments[i].alias_info.before_set == ret.alias_info.before_set:
                    index = i
        aliases.append(index)
    return SchemaFacts(
        names=[a.name for a in arguments],
        kinds=[_arg_kind(a.type) for a in arguments],
        kwarg_only=[a.kwarg_only for a in arguments],
        defaults=[_default(a) for a in arguments],
        mutated=mutated,
        return_aliases=aliases,
        native_returns=all(str(r.type) in ("Tensor", "Optional[Tensor]", "List[Tensor]") for r in schema.returns),
    )


# Factories whose one number argument is the value they fill with: traced like any op's number (one program for
# every value; generate()'s stop check makes `full((batch,), is_done)` each token). Other factories keep their
# numbers static (arange's ends decide its length).
FILL_FACTORIES = frozenset({torch.ops.aten.full.default, torch.ops.aten.scalar_tensor.default})


@functools.cache
def plan_for(op: OpOverload) -> OpPlan | None:
    lowering = graph.lookup(op)
    if lowering is None:
        return None
    facts = schema_facts(op)
    if lowering.traced_floats:
        floats = [str(a.type) == "float" for a in op._schema.arguments]
        facts = dataclasses.replace(facts, kinds=[Arg.SCALAR if f else k for k, f in zip(facts.kinds, floats)])
    factory = not any(k in (Arg.TENSOR, Arg.TENSOR_LIST) for k in facts.kinds)
    return OpPlan(
        **vars(facts),
        op=op,
        lowering=lowering,
        factory=factory,
        static_scalars=lowering.static_scalars or (factory and op not in FILL_FACTORIES),
        has_device_arg=Arg.DEVICE in facts.kinds,
        name=str(op),
        allow_cpu=op in CPU_TENSORS_ALLOWED,
        length_args=() if not factory or lowering.random else tuple(
            i for i, name in enumerate(facts.names)
            if name == "size" or (name == "end" and op is torch.ops.aten.arange.default)),
    )


# --- the per-call argument scan ------------------------------------------------------------

# Ops whose CPU tensor arguments PyTorch accepts alongside device tensors (indices, per-tensor scalars).
CPU_TENSORS_ALLOWED = frozenset(
    {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
     torch.ops.aten._index_put_impl_.default, torch.ops.aten._foreach_addcmul.Tensor,
     torch.ops.aten._foreach_addcmul_.Tensor, torch.ops.aten._foreach_addcdiv.Tensor,
     torch.ops.aten._foreach_addcdiv_.Tensor}
)


class Leaf(NamedTuple):
    """A pjrt tensor argument as the program sees it: which storage, which view of it."""

    slot: int
    view: View
    numel: int
    storage_dtype: torch.dtype
    uninitialised: bool


class Scan:
    """Storages, key and traced values gathered from one call's arguments."""

    __slots__ = ("storages", "slots", "dynamic", "device", "plan", "allow_cpu", "symbols", "plain", "live_reads",
                 "donating")

    def __init__(self, plan: OpPlan, plain: bool = False) -> None:
        self.storages: list[storage.DeviceStorage] = []
        self.slots: dict[int, int] = {}
        self.dynamic: list[Any] = []
        self.device: torch.device | None = None
        self.plan = plan
        self.allow_cpu = plan.allow_cpu
        # the true sizes of padded (dynamic) arguments, once one is seen; plain: read them compacted
        self.symbols: dynamic.Symbols | None = None
        self.plain = plain
        # a plain storage read padded because its length was marked lately: the call depends on
        # more than its arguments, so the native cache must not replay it
        self.live_reads = False
        # the call gives its program the storages of its donated arguments (lowering.donated)
        self.donating = False

    def tensor(self, t: torch.Tensor) -> Any:
        if t.is_cpu:
            return self.host_tensor(t)
        device = t.device
        if device != self.device:
            # (reading device.type costs more than comparing devices: only the first tensor pays it)
            if self.device is not None or device.type != PJRT:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{self.device or 'pjrt:0'} and {device}!"
                )
            self.device = device
        st = t.untyped_storage()._pjrt
        slot = self.slots.get(id(st))
        if slot is None:
            slot = self.slots[id(st)] = len(self.storages)
            self.storages.append(st)
        if type(st.array) is storage.Padded and not self.plain:
            return self.padded(t, st, slot)
        if type(st.array) is storage.Consumed:
            st.array.resolve()  # raises: another op took this buffer
        view = storage.view_of(t) if t.is_complex() else View(t.dtype, tuple(t.shape), t.stride(),
                                                                     t.storage_offset())
        if st.array is not None and not self.plain and dynamic.has_live_lengths() and not self.plan.mutated:
            symbols = self.symbols or dynamic.Symbols()
            leaf = dynamic.read_padded(st, slot, view, symbols)
            if leaf is not None:
                self.symbols = symbols
                self.live_reads = True
                return leaf
        return Leaf(slot, view, st.numel, st.dtype, st.array is None)

    def padded(self, t: torch.Tensor, st: storage.DeviceStorage, slot: int) -> dynamic.PaddedLeaf:
        if self.symbols is None:
            self.symbols = dynamic.Symbols()
        leaf = dynamic.describe(t, st, slot, self.symbols)
        if leaf is None:
            raise dynamic.CannotPad("a view of a padded tensor that splits or strides along its dynamic dim")
        return leaf

    def sizes(self, described: list[Any]) -> None:
        """A factory's sizes that equal a length marked dynamic lately become symbols: its result is
        padded, like the tensors it will meet (their length reached it as a plain int)."""
        for index in self.plan.length_args:
            value = described[index]
            if not isinstance(value, tuple):
                continue
            if self.plan.names[index] == "size":
                described[index] = tuple(self.size(v) for v in value)
            else:  # arange's end
                size = self.size(value[1])
                described[index] = size if isinstance(size, dynamic.SizeSymbol) else value

    def size(self, value: Any) -> Any:
        upper = dynamic.live_bound(value) if type(value) is int else None
        if upper is None:
            return value
        if self.symbols is None:
            self.symbols = dynamic.Symbols()
        return dynamic.SizeSymbol(self.symbols.of(value, upper))

    def pads_to_buckets(self, described: list[Any]) -> None:
        """constant_pad_nd padding a dynamic dim up to one of its bucket sizes (a static KV cache's
        length, say): that size is fixed and the pad amount follows the true length, so every length
        in the bucket shares one program, where a fixed amount would make one per amount."""
        source, pads = described[0], described[1]
        if not isinstance(source, dynamic.PaddedLeaf) or not isinstance(pads, tuple):
            return
        rank = len(source.view.sizes)
        found = list(pads)
        for pair in range(min(len(pads) // 2, rank)):
            factors = source.dims[rank - 1 - pair]
            before, after = pads[2 * pair], pads[2 * pair + 1]
            if factors is None or len(factors) != 1 or isinstance(factors[0], int) or factors[0][1] or min(
                    before, after) < 0:
                continue
            symbol = factors[0][0]
            total = before + self.symbols.values[symbol] + after
            if dynamic.is_bucket_size(total, self.symbols.uppers[symbol]):
                found[2 * pair + 1] = dynamic.SizeSymbol(symbol, total - before, -1)
        described[1] = tuple(found)

    def host_tensor(self, t: torch.Tensor) -> Any:
        """A CPU tensor argument: a traced value where PyTorch accepts one (scalars, indices)."""
        if t.dim() == 0 or self.allow_cpu:
            self.dynamic.append(storage.host_array(t))
            return ("host", t.dtype, tuple(t.shape))
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{self.device or 'pjrt:0'} and cpu!"
        )

    def number(self, value: Any) -> Any:
        """A Python number: traced (its type in the key), unless the op wants it static or it is 0 or 1."""
        if (value is None or self.plan.static_scalars or isinstance(value, torch.SymInt) or _is_unit(value)
                or casts.beyond_int64(value)):
            # (1 and 1.0 are equal keys, and their programs differ; a uint64 Scalar is compiled in, where the
            # lowering converts it as CPU does)
            return ("static", value, type(value))
        self.dynamic.append(value)
        return type(value)

    def value(self, kind: Arg, value: Any) -> Any:
        if kind is Arg.TENSOR or kind is Arg.SCALAR:
            if value is None:
                return None if kind is Arg.TENSOR else ("static", None)
            if isinstance(value, torch.Tensor):
                return self.tensor(value)
            return self.number(value)
        if kind is Arg.TENSOR_LIST:
            return tuple(None if v is None else self.tensor(v) for v in value)
        if kind is Arg.SCALAR_LIST:
            if value is None or self.plan.static_scalars:
                return ("static", None if value is None else tuple(value))
            self.dynamic.extend(value)
            return tuple(type(v) for v in value)
        if kind is Arg.GENERATOR:
            return None
        if kind is Arg.DEVICE:
            return None if value is None else torch.device(value)
        return _static(value)


def _is_unit(value: Any) -> bool:
    """0 and 1 (int or float, not -0.0) are compiled in rather than traced: `alpha=1` and `beta=1` are
    in most calls, and a traced number is one more program input per call; a value that merely passes
    through 0 or 1 (a learning rate schedule) makes at most two more programs."""
    kind = type(value)
    if kind is int:
        return value == 0 or value == 1
    return kind is float and (value == 1.0 or (value == 0.0 and math.copysign(1.0, value) > 0))


def _static(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_static(v) for v in value)
    return value


# --- building a program --------------------------------------------------------------------


@dataclasses.dataclass
class Entry:
    program: programs.Program
    fn: Callable[..., Any]
    # per new output: (dtype, sizes, strides, storage numel) or None
    outputs: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int] | None]
    mutated_slots: list[int]
    resized: list[tuple[tuple[int, int], tuple[int, ...], tuple[int, ...]]]
    passed_slots: list[int]
    random: bool
    output_count: int
    # padded (dynamic) execution: the op's symbolic form, the positions of passed_slots read in the
    # padded layout, the slots written in it, and each output factor's padded size
    form: Any = None
    padded_positions: tuple[int, ...] = ()
    padded_slots: frozenset[int] = frozenset()
    out_padded: tuple[int, ...] = ()
    # the device-side checks its lowering made (known once traced); when any, the program's last
    # output is their code (runtime/checks.py), not counted in output_count
    checks: tuple[checks.Check, ...] = ()
    # storages donated to the program (a custom op's donate_argnums): their tensors are consumed
    consumed_slots: tuple[int, ...] = ()
    # its cache key as text that means the same in every process (None: a part of it is known only in this
    # one); a fused program made of such entries is stored for later processes under a key built from these
    structure: str | None = None
    # the positions of passed_slots the program donates (written in place or consumed)
    donate: tuple[int, ...] = ()


def _structure(key: Any, plan: OpPlan | None) -> str | None:
    """A cache key as process-independent text: its repr (dtypes, views, static values, types of traced
    numbers), with the custom kernel's fingerprint; None where an object is known only by its address."""
    text = repr(key)
    if " at 0x" in text:
        return None
    return text if plan is None else f"{text} {plan.lowering.fingerprint}"


def _meta_tensor(view: View) -> torch.Tensor:
    return torch.empty_strided(view.sizes, view.strides, dtype=view.dtype, device="meta")


def _meta_value(kind: Arg, value: Any, described: Any, symbols: Any = None) -> Any:
    if kind is Arg.TENSOR or kind is Arg.SCALAR:
        if isinstance(described, dynamic.SizeSymbol):
            return described.at(symbols[described.symbol])
        return _meta_from(value, described, symbols) if isinstance(value, torch.Tensor) else value
    if kind is Arg.TENSOR_LIST:
        return [None if v is None else _meta_from(v, d, symbols) for v, d in zip(value, described)]
    if kind is Arg.GENERATOR:
        return None
    if kind is Arg.DEVICE and value is not None:
        return torch.device("meta")
    if isinstance(described, tuple) and any(isinstance(d, dynamic.SizeSymbol) for d in described):
        return [d.at(symbols[d.symbol]) if isinstance(d, dynamic.SizeSymbol) else d for d in described]
    return value


def _meta_from(tensor: torch.Tensor, described: Any, symbols: Any = None) -> torch.Tensor:
    """A meta tensor for a pjrt argument or a 0-dim CPU scalar; a CPU one for CPU indices and scalar lists.
    A padded argument's dynamic dims get symbolic sizes (inside a fake-tensor mode)."""
    if isinstance(described, Leaf):
        return _meta_tensor(described.view)
    if isinstance(described, dynamic.PaddedLeaf):
        sizes = [n if factors is None else math.prod(
            [f if isinstance(f, int) else symbols[f[0]] + f[1] for f in factors])
            for n, factors in zip(described.view.sizes, described.dims)]
        # the view's dim order in memory, so results keep PyTorch's layout (a transposed input's)
        order = storage.physical_order(described.view.sizes, described.view.strides) or range(len(sizes))
        strides = [0] * len(sizes)
        running: Any = 1
        for d in reversed(list(order)):
            strides[d] = running
            running = running * sizes[d]
        return torch.empty_strided(sizes, strides, dtype=described.view.dtype, device="meta")
    return torch.empty(described[2], dtype=described[1], device="meta" if not described[2] else "cpu")


def _run_meta(plan: OpPlan, values: list[Any], described: list[Any], symbols: Any = None) -> tuple[Any, list[Any]]:
    metas = [_meta_value(k, v, d, symbols) for k, v, d in zip(plan.kinds, values, described)]
    # a kernel that would specialise symbolic sizes is replaced by a size function of padding.py's
    meta_kernel = arguments.META_KERNELS.get(plan.op, plan.op)
    if symbols is not None:
        meta_kernel = padding.SYMBOLIC_META.get(plan.op, meta_kernel)
    if plan.factory and "device" in plan.names:
        metas[plan.names.index("device")] = torch.device("meta")
    if symbols is None:
        arguments.check(plan.op, dict(zip(plan.names, metas)))
    positional = [m for m, kw in zip(metas, plan.kwarg_only) if not kw]
    keywords = {n: m for n, m, kw in zip(plan.names, metas, plan.kwarg_only) if kw and m is not _NO_DEFAULT}
    return meta_kernel(*positional, **keywords), metas


def _new_output_specs(plan: OpPlan, meta_result: Any, metas: list[Any]) -> list[Any]:
    """Meta of each functional output: non-aliasing returns, then mutated arguments."""
    count = len(plan.return_aliases)
    returns = [] if count == 0 else [meta_result] if count == 1 else list(meta_result)
    fresh = [r for r, alias in zip(returns, plan.return_aliases) if alias is None]
    return fresh + [metas[i] for i in plan.mutated]


def _spec(meta: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]:
    sizes = tuple(meta.shape)
    strides = tuple(meta.stride())
    if not storage.is_dense(sizes, strides):
        strides = storage.contiguous_strides(sizes)
    return meta.dtype, sizes, strides, math.prod(sizes)


def _spec_bytes(specs: list[Any]) -> int:
    """Bytes of an op's new outputs: checked against the device once, when its program is built."""
    flat = [s for spec in specs if spec is not None for s in (spec if isinstance(spec, list) else [spec])]
    return sum(numel * dtype.itemsize for dtype, _, _, numel in flat)


# out= ops whose CPU kernels refuse an out= overlapping an input at all (at::assert_no_overlap); pointwise ones
# (TensorIterator's) refuse only a partial overlap (an out= that is an input works as an in-place op); the others
# (mm, sum, flip, ...) check nothing.
OVERLAP_REFUSED = frozenset({"cat", "take", "gather", "index_select", "masked_select", "index", "kthvalue"})
INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                    "memory location. Please clone() the tensor before performing the operation.")
OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a single "
           "memory location. Please clone() the tensor before performing the operation.")


def _check_out_overlap(plan: OpPlan, described: list[Any], slot: int, out: View, result: tuple[int, ...]) -> None:
    """CPU's check of an out= argument against the inputs in the same storage (see OVERLAP_REFUSED); an out= to be
    resized to the `result` shape is checked both as it is and as it will be (CPU's kernels differ in which)."""
    refused = plan.op._schema.name.split("::")[-1] in OVERLAP_REFUSED
    resized = result != out.sizes
    if not refused and (resized or not plan.lowering.fn.__module__.endswith(".pointwise")):
        return
    if resized and out.has_internal_overlap():
        raise RuntimeError(INTERNAL_OVERLAP)
    outs = [out, View(out.dtype, result, storage.contiguous_strides(result), out.offset)] if resized else [out]
    for index, desc in enumerate(described):
        if index in plan.mutated or plan.kinds[index] not in (Arg.TENSOR, Arg.TENSOR_LIST):
            continue
        for leaf in desc if plan.kinds[index] is Arg.TENSOR_LIST else (desc,):
            if not isinstance(leaf, Leaf) or leaf.slot != slot:
                continue
            for written in outs:
                status = _overlap(written, leaf.view)
                if status == "partial" or (status == "full" and refused):
                    raise RuntimeError(OVERLAP)


def _check_xla_sizes(plan: OpPlan, described: list[Any], specs: list[Any]) -> None:
    """Refuse a program XLA would abort the process on (an array with a dimension of 2**61 or more)."""
    sizes = [leaf.view.sizes for leaf in _leaves(described) if isinstance(leaf, Leaf)]
    sizes += [s[1] for spec in specs if spec is not None for s in (spec if isinstance(spec, list) else [spec])]
    for found in sizes:
        if storage.beyond_xla(found):
            raise RuntimeError(f"{plan.op}: a tensor of shape {list(found)} has a dimension of 2**61 or more, which "
                               "XLA cannot hold: use smaller dimensions.")


def _overlap(a: View, b: View) -> str | None:
    """'full', 'partial' or None, as PyTorch decides it; views that are not dense are too hard (None)."""
    if a == b:
        return "full"
    numel_a, numel_b = math.prod(a.sizes), math.prod(b.sizes)
    if not numel_a or not numel_b or not all(storage.is_dense(v.sizes, v.strides) for v in (a, b)):
        return None
    begin_a, begin_b = a.offset * a.dtype.itemsize, b.offset * b.dtype.itemsize
    end_a, end_b = begin_a + numel_a * a.dtype.itemsize, begin_b + numel_b * b.dtype.itemsize
    if (begin_a, end_a) == (begin_b, end_b):
        return "full" if a.strides == b.strides else "partial"
    return "partial" if begin_a < end_b and begin_b < end_a else None


def _build(plan: OpPlan, scan: Scan, values: list[Any], described: list[Any], form: Any = None,
           out_padded: tuple[int, ...] = ()) -> Entry:
    """The program of one call signature. With `form` (padded arguments), it reads and writes
    them in their padded layout and runs the op through the padding rules, the true sizes traced."""
    if form is None:
        meta_result, metas = _run_meta(plan, values, described)
        functional_metas = _new_output_specs(plan, meta_result, metas)
        n_functional = len(functional_metas)
        sizes_after = {index: [None if m is None else tuple(m.shape) for m in (
            metas[index] if plan.kinds[index] is Arg.TENSOR_LIST else [metas[index]])] for index in plan.mutated}
    else:
        functional_metas, n_functional, sizes_after = None, len(form.shape.nesting), dict(form.shape.mutated_sizes)
    n_fresh = n_functional - len(plan.mutated)
    fresh_specs: list[Any] = []
    for meta in functional_metas[:n_fresh] if form is None else ():
        if isinstance(meta, (list, tuple)):
            fresh_specs.append([_spec(m) for m in meta])
        else:
            fresh_specs.append(None if meta is None else _spec(meta))
    client.check_fits(scan.device.index, _spec_bytes(fresh_specs))
    _check_xla_sizes(plan, described, fresh_specs)

    # mutated arguments: their views, their storages, and out= resizes
    mutated_views: list[list[tuple[int, Any, Any] | None]] = []
    resized: list[tuple[tuple[int, int], tuple[int, ...], tuple[int, ...]]] = []
    for index in plan.mutated:
        entries = described[index] if plan.kinds[index] is Arg.TENSOR_LIST else (described[index],)
        views: list[tuple[int, Any, Any] | None] = []
        for position, (desc, after) in enumerate(zip(entries, sizes_after[index])):
            if desc is None:
                views.append(None)
                continue
            if isinstance(desc, dynamic.PaddedLeaf):
                views.append((desc.slot, desc, "padded"))
                continue
            if -1 in after:  # (a form's sizes: -1 is a dynamic one)
                raise padding.CannotPad("it resizes an argument to a dynamic size")
            slot, view = desc.slot, desc.view
            if plan.kwarg_only[index]:
                _check_out_overlap(plan, described, slot, view, after)
            elif after != view.sizes and plan.lowering.fn.__module__.endswith(".pointwise"):
                # an in-place pointwise op never resizes self (PyTorch's refs for some, lt_ and fmod_, do)
                raise RuntimeError(f"output with shape {list(view.sizes)} doesn't match the broadcast shape "
                                   f"{list(after)}")
            if after != view.sizes:
                sizes = after
                strides = storage.contiguous_strides(sizes)
                resized.append(((index, position), sizes, strides))
                view = View(view.dtype, sizes, strides, 0)
                views.append((slot, view, "resized"))
            else:
                if view.has_internal_overlap():
                    raise RuntimeError(INTERNAL_OVERLAP)
                views.append((slot, view, None))
        mutated_views.append(views)

    mutated_slots = sorted({v[0] for views in mutated_views for v in views if v is not None and v[2] != "resized"})
    slot_info = {leaf.slot: (leaf.numel if isinstance(leaf, Leaf) else math.prod(leaf.padded), leaf.storage_dtype,
                             isinstance(leaf, Leaf) and leaf.uninitialised) for leaf in _leaves(described)}
    through = _written_through(plan, mutated_views, slot_info, n_fresh)
    padded_slots = frozenset(leaf.slot for leaf in _leaves(described) if isinstance(leaf, dynamic.PaddedLeaf)
                             and type(scan.storages[leaf.slot].array) is storage.Padded)
    passed_slots = [s for s in range(len(scan.storages)) if not slot_info[s][2]]
    consumed = sorted({described[i].slot for i in plan.lowering.donated
                       if scan.donating and isinstance(described[i], Leaf)} - set(mutated_slots))
    donate = tuple(i for i, s in enumerate(passed_slots) if s in mutated_slots or s in consumed)
    n_passed = len(passed_slots)
    kinds = plan.kinds
    lowering = plan.lowering
    random = lowering.random
    kwarg_only = plan.kwarg_only
    names = plan.names
    wants_meta = lowering.wants_meta
    dropped = {names[i] for i in plan.mutated if kwarg_only[i]} if lowering.drops_out_arguments else set()
    buckets = scan.symbols.buckets() if form is not None else ()
    n_symbols = len(buckets)
    out_factors = _output_factors(form, out_padded) if form is not None else []

    precision = linalg.global_float32_matmul_precision()  # part of the cache key

    def program(*inputs: Any) -> Any:
        """The op's outputs, then its device-side checks' code when its lowering made any."""
        with checks.collecting() as found, linalg.pinned_float32_matmul_precision(precision):
            outputs = body(*inputs)
        entry.checks = tuple(found.checks)
        return (*outputs, found.code()) if found.checks else outputs

    def body(*inputs: Any) -> Any:
        jnp = client.jax_module().numpy
        flats: dict[int, Any] = {}
        for position, slot in enumerate(passed_slots):
            flats[slot] = inputs[position]
        for slot, (numel, dtype, uninitialised) in slot_info.items():
            if uninitialised:
                flats[slot] = jnp.zeros((numel,), storage.numpy_dtype(dtype))
        rest = inputs[n_passed:len(inputs) - n_symbols]
        true = inputs[len(inputs) - n_symbols:]
        traced = iter(rest)
        key = next(traced) if random else None

        def arg(kind: Arg, desc: Any) -> Any:
            if kind is Arg.TENSOR or kind is Arg.SCALAR:
                if desc is None:
                    return None
                if isinstance(desc, type):
                    return next(traced)
                if isinstance(desc, dynamic.SizeSymbol):
                    return desc.at(buckets[desc.symbol])
                if desc[0] == "static":
                    return desc[1]
                return leaf(desc)
            if kind is Arg.TENSOR_LIST:
                return [None if d is None else leaf(d) for d in desc]
            if kind is Arg.SCALAR_LIST:
                if isinstance(desc, tuple) and desc and desc[0] == "static":
                    return None if desc[1] is None else list(desc[1])
                return [next(traced) for _ in desc]
            if isinstance(desc, tuple) and form is not None:
                return tuple(d.at(buckets[d.symbol]) if isinstance(d, dynamic.SizeSymbol) else d for d in desc)
            return desc

        def leaf(desc: Any) -> Any:
            if isinstance(desc, dynamic.PaddedLeaf):
                return dynamic.read_leaf(flats[desc.slot], desc, true, buckets)
            if not isinstance(desc, Leaf):
                return jnp.asarray(next(traced))
            return storage.read_view(flats[desc.slot], desc.storage_dtype, desc.view)

        resolved = [arg(k, d) for k, d in zip(kinds, described)]
        if random:
            key = client.jax_module().random.wrap_key_data(key, impl="threefry2x32")
        positional = [v for v, kw in zip(resolved, kwarg_only) if not kw]
        keywords = {n: v for n, v, kw in zip(names, resolved, kwarg_only) if kw and n not in dropped}
        if through is not None:
            scatter = lowering.scatter(*positional, **keywords)
            slot, view = through
            written = None if scatter is None else indexing.scatter_through(
                storage.flat_array(flats[slot]), storage.positions(view), scatter, storage.numpy_dtype(view.dtype))
            if written is not None:  # self's whole view is never read: XLA drops that read
                flats[slot] = written.reshape(flats[slot].shape)
                return tuple(flats[s] for s in mutated_slots)
        results_meta = functional_metas
        if form is not None:
            op_graph = form.graph()
            results_meta = op_graph.metas
            sizes = padding.Sizes(dict(zip(form.symbols, buckets)), dict(zip(form.symbols, true)))
            fed = [dynamic.pick(path, positional, keywords) for path in op_graph.feeds]
            result = graph.evaluate(op_graph.module, fed, graph.KeySource(key) if random else None,
                                    interpret=padding.PaddedInterpreter(sizes))[0]
        else:
            extra: dict[str, Any] = {}
            if random:
                extra["rng"] = key
            if wants_meta:
                extra["out_meta"] = functional_metas
            result = lowering.fn(*positional, **keywords, **extra)
            if result is NotImplemented:
                raise registry.MissingLowering(plan.op)
        outputs = [result] if len(results_meta) == 1 else list(result)
        outputs = [graph.conform(o, m) for o, m in zip(outputs, results_meta)]

        flat_outputs = []
        if form is not None:
            values_out = [v for value in outputs[:n_fresh] for v in (value if isinstance(value, (list, tuple))
                                                                      else [value]) if v is not None]
            for value, (padded_dims, factor_exprs, order) in zip(values_out, out_factors):
                true_dims = [[f if isinstance(f, int) else sizes.value(f) for f in dim]
                             for dim in factor_exprs]
                flat_outputs.append(dynamic.finish(value, padded_dims, true_dims, order))
        for value, spec in zip(outputs[:n_fresh], fresh_specs):
            if isinstance(spec, list):
                flat_outputs.extend(storage.pack(v, s[1], s[2]) for v, s in zip(value, spec))
            elif spec is not None:
                flat_outputs.append(storage.pack(value, spec[1], spec[2]))
        resized = []
        for views, value in zip(mutated_views, outputs[n_fresh:]):
            values_list = value if isinstance(value, (list, tuple)) else [value]
            for entry, item in zip(views, values_list):
                if entry is None:
                    continue
                slot, view, how = entry
                if how == "resized":
                    resized.append(storage.pack(item, view.sizes, view.strides))
                elif how == "padded":
                    flats[slot] = dynamic.write_leaf(flats[slot], view, item, true)
                else:
                    numel, storage_dtype, _ = slot_info[slot]
                    flats[slot] = storage.write_view(flats[slot], storage_dtype, view, item)
        return (*flat_outputs, *resized, *(flats[s] for s in mutated_slots))

    # Results go on the op's device even when no input decides it: a program whose passed storages go
    # unused (uniform_ overwrites its input whole, so jit drops it) would otherwise run on jax's default device.
    device_index = scan.device.index
    compiled = programs.Program(program, str(plan.op), donate=donate, device_index=device_index)
    if form is not None:
        output_count = len(out_factors)
    else:
        output_count = sum(len(s) if isinstance(s, list) else int(s is not None) for s in fresh_specs)
    output_count += len(resized) + len(mutated_slots)
    padded_positions = tuple(i for i, s in enumerate(passed_slots) if s in padded_slots)
    # named: `program` fills in its checks when traced
    entry = Entry(compiled, program, fresh_specs, mutated_slots, resized, passed_slots, random, output_count,
                  form, padded_positions, padded_slots, out_padded, consumed_slots=tuple(consumed), donate=donate)
    return entry


def _written_through(plan: OpPlan, mutated_views: list[list[Any]], slot_info: dict[int, Any],
                     n_fresh: int) -> tuple[int, View] | None:
    """(slot, view) when the op writes into a view of part of its self's storage and has a scatter form:
    its program then scatters into the storage in place (copying only what it writes), a view of another
    dtype included where `indexing.scatter_through` can write its values' bytes."""
    if plan.lowering.scatter is None or plan.mutated != [0] or n_fresh or len(mutated_views[0]) != 1:
        return None
    found = mutated_views[0][0]
    if found is None or found[2] is not None:
        return None
    slot, view, _ = found
    numel, storage_dtype, _ = slot_info[slot]
    if view.covers(numel) and view.dtype == storage_dtype or view.conj or view.neg or not math.prod(view.sizes):
        return None
    return slot, view


def _output_factors(form: Any, out_padded: tuple[int, ...]) -> list[tuple[list[list[int]], list[list[Any]], Any]]:
    """Per fresh tensor result: each dim's padded factor sizes, its factors (ints or sympy), and
    the order of its dims in memory."""
    padded = iter(out_padded)
    found = []
    for layout in form.flat_layouts:
        dims = [[f if isinstance(f, int) else next(padded) for f in factors] for factors in layout.dims]
        found.append((dims, [list(factors) for factors in layout.dims], layout.order))
    return found


def _leaves(described: Any) -> list[Any]:
    if isinstance(described, (Leaf, dynamic.PaddedLeaf)):
        return [described]
    if isinstance(described, (list, tuple)):
        return [leaf for d in described for leaf in _leaves(d)]
    return []


# --- executing ----------------------------------------------------------------------------

_cache = programs.ProgramCache()


class ElsewhereDevice(Exception):
    """An op on pjrt tensors asked for its result on another device (`zeros_like(x, device="cpu")`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _target_device(values: list[Any], plan: OpPlan, found: torch.device | None) -> torch.device:
    """Where results go: an explicit pjrt device argument, else the inputs' device."""
    for kind, value in zip(plan.kinds, values):
        if kind is Arg.DEVICE and value is not None:
            device = torch.device(value)
            if device.type != PJRT:
                raise ElsewhereDevice(device)
            return torch.device(PJRT, startup.current_device() if device.index is None else device.index)
    if found is None:
        return torch.device(PJRT, startup.current_device())
    return found


def _random_key(plan: OpPlan, values: list[Any], device: torch.device) -> np.ndarray:
    for kind, value in zip(plan.kinds, values):
        if kind is Arg.GENERATOR and value is not None:
            return generator_key(value)
    return rng.state(device.index).next_key()


def generator_key(generator: torch.Generator) -> np.ndarray:
    """A key drawn from a user's torch.Generator (advancing it), so it is honoured."""
    if generator.device.type == PJRT:
        return startup.generator_key(generator)
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    return rng.raw_key(seed, 0)


def _inputs(entry: Entry, scan: Scan, plan: OpPlan, values: list[Any]) -> list[Any]:
    inputs = [scan.storages[s].array for s in entry.passed_slots]
    for position in entry.padded_positions:
        inputs[position] = inputs[position].array
    if any(isinstance(a, storage.PendingArray) for a in inputs):
        inputs = [_ready(a, scan.device.index) for a in inputs]
    if entry.random:
        inputs.append(_random_key(plan, values, scan.device))
    if modes.state.fusing:
        inputs.extend(scan.dynamic)  # the pending graph wires numbers as its own traced inputs
    else:
        inputs.extend(client.traced_number(value, scan.device.index) for value in scan.dynamic)
    if entry.form is not None:
        inputs.extend(scan.symbols.values)
    return inputs


def _ready(array: Any, device_index: int) -> Any:
    """An input as a plain-layout program takes it: a padded storage compacted (recorded when
    fusing), a fused result resolved unless it is being recorded into the same graph."""
    if isinstance(array, storage.Padded):
        return _compacted(array, device_index)
    if not modes.state.fusing and isinstance(array, storage.PendingArray):
        return array.resolve()
    return array


_compactions: dict[tuple, Entry] = {}


def _compacted(layout: storage.Padded, device_index: int) -> Any:
    key = (layout.shape, layout.padded)
    entry = _compactions.get(key)
    if entry is None:
        compact = storage.compactor(layout.shape, layout.padded)[0]

        def fn(array: Any) -> tuple[Any]:
            return (compact(array),)

        entry = _compactions[key] = Entry(programs.Program(fn, "compact_padded"), fn, [], [], [], [0], False, 1,
                                          structure=_structure(("compact_padded", *key), None))
    metrics.bump("dynamic_compactions")
    inner = layout.array
    if not modes.state.fusing and isinstance(inner, storage.PendingArray):
        inner = inner.resolve()
    return _run(entry, [inner], device_index)[0]


def _prepare(entry: Entry, scan: Scan, inputs: list[Any]) -> None:
    """Make a new entry ready to run: its device-side checks known and, in strict eager, its program compiled.

    With a cache folder, what an earlier process found is reused: the checks its tracing made (so a
    fused op or a padded one is not traced again only to learn them) and, in strict eager, the op's
    executable (loaded, not traced, lowered and looked up in XLA's cache). Without one, a fused or
    padded op is traced at once, so a lowering error surfaces at the op, not at the flush."""
    key = _stored_op_key(entry.structure) if entry.structure is not None and disk_store.enabled() else None
    if key is None:
        if modes.state.fusing:
            _trace_now(entry, scan, inputs)
        else:
            _load_stored_op(entry, None, scan, inputs)
        return
    with disk_store.counted_as("op_store"):
        recorded = disk_store.read("op_checks", key)
        entry.checks = None  # set again by the program's function whenever it is traced
        if not modes.state.fusing:
            _load_stored_op(entry, key, scan, inputs)
        elif recorded is None:
            _trace_now(entry, scan, inputs)
        if entry.checks is None:
            if recorded is None:  # an executable stored without its checks (a folder emptied in part)
                _trace_now(entry, scan, inputs)
            else:
                entry.checks = pickle.loads(recorded)
        if recorded is None:
            disk_store.write("op_checks", key, pickle.dumps(entry.checks))


def _load_stored_op(entry: Entry, key: str | None, scan: Scan, inputs: list[Any]) -> None:
    """Make a strict op's program a `StoredOp` with the executable for these inputs, so every one-op program
    compiles in one place (with its XLA options), with a cache folder or without."""
    stored = StoredOp(entry, key, scan.device.index)
    stored.load(inputs)
    entry.program = programs.Program.of_executable(stored, entry.program.name, device_index=scan.device.index)


class StoredOp:
    """A strict op's program as executables by the shapes and dtypes of the arrays it is called with (a
    storage's array has the shape its producer gave it, so one signature meets several, as jit would
    retrace), each loaded from the cache folder or compiled (and stored there when `key` is not None).

    While it has met one set of shapes, callers run that executable directly (`target`); once it meets a
    second, they call this object, which picks the executable by the arguments' shapes (the native hit
    path keeps each pick, `call_for`, and picks by the same key itself): an executable
    refusing other shapes does so through jax's slow path (a TypeError, about 0.5 ms), and a strict
    generate's one (1, 128) @ (128, 128) mm alternates between producers of (1, 4, 1, 32) and (1, 1, 128)."""

    __slots__ = ("entry", "key", "device_index", "by_avals", "only", "program")

    def __init__(self, entry: Entry, key: str | None, device_index: int) -> None:
        self.entry, self.key, self.device_index = entry, key, device_index
        # the op's own Program (the entry's is this object once stored): it compiles the op where nothing is
        # stored, its jax.jit made only then
        self.program = entry.program
        self.by_avals: dict[tuple, Any] = {}
        self.only: Any = None  # the executable while only one set of shapes has been met

    def __call__(self, *args: Any) -> Any:
        if self.only is not None:
            try:
                return self.only(*args)
            except TypeError:  # arrays of other shapes: the executable refused them unrun
                metrics.bump("stored_op_refusals")
        return self.load(args)(*args)

    @property
    def target(self) -> Any:
        """What a caller should call: the one executable, or this object once there are several. The executable
        as jax's C++ call where it has made one (at its first call): `Compiled.__call__` is a Python frame in
        front of it, which a compiled generate() entered ~40 times a token."""
        if self.only is None:
            return self
        return _direct_call(self.only)

    def call_for(self, args: Sequence[Any]) -> Any:
        """The executable these arguments run, as `target` hands it over, once it has run: what the native
        hit path calls for arguments of these shapes and dtypes from then on."""
        return _direct_call(self.load(args))

    def reload(self, args: Sequence[Any]) -> Any:
        """What to call instead, once `target` refused these arguments (the native hit path)."""
        metrics.bump("stored_op_refusals")
        self.load(args)
        return self.target

    def load(self, args: Sequence[Any]) -> Any:
        """The executable for these arguments' shapes and dtypes, loaded or compiled when new."""
        # dtypes as objects: str(dtype) took 14 us each
        avals = tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) if hasattr(a, "shape") else type(a)
                      for a in args)
        executable = self.by_avals.get(avals)
        if executable is None:
            with client.one_op_compiles():
                executable = self.by_avals[avals] = self._compiled(tuple(args), avals)
            self.only = executable if len(self.by_avals) == 1 else None
        return executable

    def _compiled(self, args: tuple, avals: tuple) -> Any:
        if self.key is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                return self.program.jitted.lower(*args).compile()
        key = hashlib.sha256(f"{self.key}{avals!r}".encode()).hexdigest()
        entry = self.entry
        return programs.stored_executable(entry.fn, args, key, entry.program.name, donate=entry.donate,
                                          device_index=self.device_index).jitted


def _direct_call(executable: Any) -> Any:
    """A compiled executable as jax's C++ call where its first call has made one: `Compiled.__call__` is a
    Python frame in front of it."""
    return getattr(executable, "_call", None) or executable


def _stored_op_key(structure: str) -> str:
    """An op's program as later processes find it: its structure, our code, the XLA options it is compiled
    with and what else it depends on."""
    digest = disk_store.entry_digest()
    digest.update(f"{structure}\0{sorted(client.one_op_options().items())}{client.ONE_OP_MAX_CHARACTERS}".encode())
    return digest.hexdigest()


def _trace_now(entry: Entry, scan: Scan, inputs: list[Any]) -> None:
    """Trace a new op's function at once, so a lowering error surfaces at the op, not at the flush."""
    jax = client.jax_module()
    abstract = []
    for position, slot in enumerate(entry.passed_slots):
        st = scan.storages[slot]
        shape = st.array.padded if position in entry.padded_positions else (st.numel,)
        abstract.append(jax.ShapeDtypeStruct(shape, storage.numpy_dtype(st.dtype)))
    jax.eval_shape(entry.fn, *abstract, *inputs[len(abstract):])


def _run(entry: Entry, inputs: list[Any], device_index: int) -> tuple[Any, ...]:
    if modes.state.fusing:
        return fusion.graph(device_index).record(entry, inputs, entry.output_count)
    outputs = entry.program.call(*inputs)
    if entry.checks:
        checks.issued(outputs[-1], entry.checks, (checks.caller(),) * len(entry.checks), modes.state.blocking)
        return outputs[:-1]
    return outputs


def cache_key(scan: Scan, described: list[Any]) -> tuple:
    """Everything a program depends on: op, views, static arguments, device, default dtype, matmul precision."""
    return (scan.plan.name, tuple(described), scan.device, torch.get_default_dtype(),
            linalg.global_float32_matmul_precision(), scan.donating)


def _donating(values: list[Any]) -> bool:
    """Whether a call of an op with donated arguments gives their buffers away: in strict eager, and
    not where autograd may keep its inputs for the backward (a derived backward reruns the forward;
    an autograd.Function's forward runs without grad mode, so an input requiring grad decides)."""
    if modes.state.fusing:
        return False  # the fused program reuses buffers itself; the tensors stay readable
    return not any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _describe(plan: OpPlan, values: list[Any], plain: bool) -> tuple[Scan, list[Any]]:
    scan = Scan(plan, plain)
    scan.donating = bool(plan.lowering.donated) and _donating(values)
    described = [scan.value(k, v) for k, v in zip(plan.kinds, values)]
    if plan.length_args and not plain and dynamic.has_live_lengths():
        scan.sizes(described)
    elif plan.op is _CONSTANT_PAD and scan.symbols is not None:
        scan.pads_to_buckets(described)
    return scan, described


def execute(plan: OpPlan, args: tuple, kwargs: dict) -> Any:
    return _execute(plan, args, kwargs)[0]


class Replay(NamedTuple):
    """What the native cache needs to run a call's signature again: the program's entry, the specs
    of its results, and the values passed after its traced scalars (a padded call's true lengths)."""

    entry: Entry
    specs: list[Any]
    lengths: tuple[int, ...]


def _execute(plan: OpPlan, args: tuple, kwargs: dict) -> tuple[Any, Replay | None]:
    """Run one call; also how to replay it (None where it went a way that its arguments alone do not
    decide: a fallback, a factory placed elsewhere, a storage read padded for a live length)."""
    values = plan.normalize(args, kwargs)
    try:
        scan, described = _describe(plan, values, False)
    except padding.CannotPad as reason:
        dynamic.warn_unmaskable(plan.name, str(reason), fusion._user_line())
        scan, described = _describe(plan, values, True)
    if plan.has_device_arg or scan.device is None:
        try:
            scan.device = _target_device(values, plan, scan.device)
        except ElsewhereDevice as elsewhere:
            return _factory_elsewhere(plan, args, kwargs, elsewhere.device), None
    if scan.symbols is not None:
        try:
            entry, inputs, specs = _padded_entry(plan, scan, values, described)
        except padding.CannotPad as reason:
            dynamic.warn_unmaskable(plan.name, str(reason), fusion._user_line())
            scan, described = _describe(plan, values, True)
            scan.device = _target_device(values, plan, scan.device)
        else:
            result = _complete(plan, values, scan, entry, _run(entry, inputs, scan.device.index), specs)
            return result, None if scan.live_reads else Replay(entry, specs, tuple(scan.symbols.values))
    key = cache_key(scan, described)
    try:
        entry = _cache.get(key)
    except TypeError:
        raise TypeError(f"torch_pjrt: unhashable argument to {plan.op}: {values!r}") from None
    if entry is None:
        try:
            entry = _build(plan, scan, values, described)
            inputs = _inputs(entry, scan, plan, values)
            entry.structure = _structure(key, plan)
            _prepare(entry, scan, inputs)
            outputs = _run(entry, inputs, scan.device.index)
        except registry.MissingLowering as missing:
            from torch_pjrt.eager import fallback

            if fallback.cpu_fallback_enabled():
                return fallback.run_on_cpu(plan.op, args, kwargs), None
            detail = "" if missing.op == plan.op else f" (its decomposition reaches {missing.op})"
            raise NotImplementedError(fallback.missing_message(plan.op) + detail) from None
        _cache.put(key, entry)
    else:
        outputs = _run(entry, _inputs(entry, scan, plan, values), scan.device.index)
    result = _complete(plan, values, scan, entry, outputs, entry.outputs)
    if scan.plain:
        dynamic.repad(result)
        return result, None
    return result, Replay(entry, entry.outputs, ())


def native_miss(plan: OpPlan, args: tuple, kwargs: dict) -> tuple[Any, tuple | None]:
    """A call the native hit path (csrc/dispatch.cpp) did not have: run it here, and hand back what
    the native cache needs to run the same signature itself next time (None: it cannot)."""
    special = _UNLESS_PLAIN.get(plan.op)
    if special is not None and not special[0](*args, **kwargs):
        return special[1](*args, **kwargs), None
    result, replay = _execute(plan, args, kwargs)
    if replay is None:
        return result, None
    entry = replay.entry
    if entry.resized or not plan.native_returns or (plan.factory and replay.lengths):
        return result, None  # (a factory padded for a live length: the native key cannot tell that apart)
    program = entry.program
    specs = iter(replay.specs)
    returns = []
    for alias in plan.return_aliases:
        if alias is not None:
            returns.append((0, alias, ()))
            continue
        spec = next(specs)
        if spec is None:
            returns.append((1, -1, ()))
        elif isinstance(spec, list):
            returns.append((3, -1, tuple(spec)))
        else:
            returns.append((2, -1, (spec,)))
    fresh = entry.output_count - len(entry.mutated_slots)
    mutated_padded = [slot in entry.padded_slots for slot in entry.mutated_slots]
    # a stored op hands the native path its current executable, and itself to load another when the
    # arrays' shapes change, so a hit calls XLA's executable with no frame of ours between
    stored = program.jitted if program.compiled and isinstance(program.jitted, StoredOp) else None
    # a signature first met while fusing is recorded natively at once, and runs natively in strict
    # mode once a Python call has compiled its program (csrc/dispatch.cpp checks `compiled`)
    # (an entry first met while fusing is not compiled: the native side reads its `jitted` once it is, so a
    # fused entry never makes a jax.jit it does not run)
    jitted = stored.target if stored else program.jitted if program.compiled else None
    return result, (jitted, program, entry.passed_slots, entry.random,
                    returns, entry.mutated_slots, fresh, replay.lengths, mutated_padded, entry.checks or None, entry,
                    program.compiled, stored)


def native_checks_issued(code: Any, issued_checks: tuple[checks.Check, ...]) -> None:
    """A native hit ran a program with device-side checks (its last output, `code`): pending, as here."""
    checks.issued(code, issued_checks, (checks.caller(),) * len(issued_checks))


def _complete(plan: OpPlan, values: list[Any], scan: Scan, entry: Entry, outputs: Any, specs: list[Any]) -> Any:
    """Point the mutated storages at their new arrays and wrap the fresh results as tensors."""
    n_updated = len(entry.mutated_slots)
    n_resized = len(entry.resized)
    n_fresh = len(outputs) - n_updated - n_resized
    metrics.bump("ops_executed")
    metrics.op_counts[plan.name] += 1
    if modes.state.blocking:
        client.synchronize(outputs)
    startup.note_output(scan.device.index, outputs)
    for slot, array in zip(entry.mutated_slots, outputs[n_fresh + n_resized:]):
        st = scan.storages[slot]
        st.array = st.array.holding(array) if slot in entry.padded_slots else array
    for slot in entry.consumed_slots:
        scan.storages[slot].array = storage.Consumed(plan.op._schema.name)
    if n_resized:
        _apply_resizes(plan, values, entry, outputs[n_fresh:n_fresh + n_resized])
    return _returns(plan, values, iter(outputs[:n_fresh]), specs, scan.device)


# --- padded (dynamic) execution ------------------------------------------------------------------

_forms: dict[Any, Any] = {}


def _padded_entry(plan: OpPlan, scan: Scan, values: list[Any], described: list[Any]) -> tuple[Entry, list, list]:
    """The program for a call with padded arguments (built once per bucket pattern), its inputs,
    and this call's result specs; raises CannotPad when the op cannot run padded."""
    key = (cache_key(scan, described), scan.symbols.signature())
    form = _forms.get(key)
    if form is None:
        form = _forms[key] = _padded_form(key, plan, scan, values, described)
    if isinstance(form, padding.CannotPad):
        raise form
    padded, specs = form.call_layout(scan.symbols.values, len(form.shape.nesting) - len(plan.mutated))
    entry = form.entries.get(padded)
    if entry is None:
        entry = _build(plan, scan, values, described, form, padded)
        entry.structure = _structure((key, padded), plan)
        inputs = _inputs(entry, scan, plan, values)
        try:
            _prepare(entry, scan, inputs)
        except padding.CannotPad as reason:
            _forms[key] = reason
            raise
        form.entries[padded] = entry
        metrics.bump("dynamic_new_buckets")
    else:
        inputs = _inputs(entry, scan, plan, values)
    metrics.bump("dynamic_padded_ops")
    return entry, inputs, specs


def _padded_form(key: tuple, plan: OpPlan, scan: Scan, values: list[Any],
                 described: list[Any]) -> dynamic.Form | padding.CannotPad:
    """The op's padded form for an argument pattern, or why it has none: its shape read from the cache folder
    where an earlier process stored it (the meta kernels then run only if the op is traced), else made
    by the meta kernels now (and stored)."""
    uppers = list(scan.symbols.uppers)
    # (the stand-ins keep no tensor of this call alive in a form whose graph is made later)
    make = functools.partial(_symbolic_form, plan, list(scan.symbols.values), bool(scan.dynamic),
                             _meta_stand_ins(values), described, _traced_numbers(plan, described))
    structure = _structure(key, plan) if disk_store.enabled() else None
    stored_key = None if structure is None else _stored_form_key(structure)
    if stored_key is not None:
        with disk_store.counted_as("form_store"):
            payload = disk_store.read("forms", stored_key)
        if payload is not None:
            found = pickle.loads(payload)
            return padding.CannotPad(found) if isinstance(found, str) else dynamic.Form(found, uppers, make)
    try:
        shape, op_graph = make()
    except padding.CannotPad as reason:
        result, stored = reason, str(reason)
    except Exception as error:  # a meta kernel that cannot take symbolic sizes
        result = padding.CannotPad(f"{type(error).__name__}: {error}".splitlines()[0])
        stored = str(result)
    else:
        result, stored = dynamic.Form(shape, uppers, op_graph), shape
    if stored_key is not None:
        with disk_store.counted_as("form_store"):
            disk_store.write("forms", stored_key, pickle.dumps(stored))
    return result


def _stored_form_key(structure: str) -> str:
    """A padded form as later processes find it: its argument pattern, our code and what else it depends on."""
    digest = disk_store.entry_digest()
    digest.update(f"form\0{structure}".encode())
    return digest.hexdigest()


def _meta_stand_ins(values: list[Any]) -> list[Any]:
    """A call's arguments with every tensor a meta stand-in: the meta run reads tensors only through
    their descriptions."""
    stand_in = torch.empty(0, device="meta")

    def replaced(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return stand_in
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(stand_in if isinstance(v, torch.Tensor) else v for v in value)
        return value

    return [replaced(v) for v in values]


def _traced_numbers(plan: OpPlan, described: list[Any]) -> frozenset[int]:
    """The arguments that are traced numbers (a scalar's type, or a list of them, in the key)."""
    return frozenset(i for i, (kind, desc) in enumerate(zip(plan.kinds, described)) if isinstance(desc, type) or (
        kind is Arg.SCALAR_LIST and isinstance(desc, tuple) and desc and isinstance(desc[0], type)))


def _symbolic_form(plan: OpPlan, symbol_values: list[int], has_dynamic: bool, values: list[Any],
                   described: list[Any], traced: frozenset[int]) -> tuple[dynamic.FormShape, dynamic.FormGraph]:
    """Run the op's meta kernel on fake tensors whose dynamic dims are symbols."""
    env, mode, symbols, sizes = _torch_private.symbolic_fake_mode(symbol_values)
    with mode:
        result, metas = _run_meta(plan, values, described, sizes)
    functional = _new_output_specs(plan, result, metas)
    n_fresh = len(functional) - len(plan.mutated)
    target = plan.op if not plan.mutated else registry.functional_counterpart(plan.op)
    dropped = {plan.names[i] for i in plan.mutated if plan.kwarg_only[i]}
    positional = [i for i, kw in enumerate(plan.kwarg_only) if not kw]
    keywords = {plan.names[i]: i for i, kw in enumerate(plan.kwarg_only)
                if kw and metas[i] is not _NO_DEFAULT and plan.names[i] not in dropped}
    decomposition = None
    if not has_dynamic and not plan.mutated:
        decomposition = registry.decomposition(plan.op)
    return dynamic.form(target, metas, functional, n_fresh, env.guards, symbols, plan.mutated, positional, keywords,
                        mode, decomposition, traced)


def _factory_elsewhere(plan: OpPlan, args: tuple, kwargs: dict, device: torch.device) -> Any:
    """A `*_like` or `new_*` factory whose result belongs on another device: it reads only its
    inputs' layout, so it runs there on meta stand-ins of the same sizes, strides and dtype."""
    name = plan.op.name().split("::")[-1]
    if not (name.endswith("_like") or name.startswith("new_")):
        raise RuntimeError(f"torch_pjrt cannot place the result of {plan.op} on {device}; move its inputs there first.")

    def stand_in(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == PJRT:
            return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
        return value

    return plan.op(*[stand_in(a) for a in args], **{k: stand_in(v) for k, v in kwargs.items()})


def _apply_resizes(plan: OpPlan, values: list[Any], entry: Entry, resized_values: list[Any]) -> None:
    for ((index, position), sizes, strides), array in zip(entry.resized, resized_values):
        target = values[index] if plan.kinds[index] is Arg.TENSOR else values[index][position]
        st = storage.replace_storage(target, math.prod(sizes), sizes, strides)
        st.array = array


def _wrap(array: Any, spec: Any, device: torch.device) -> torch.Tensor:
    """A result as a tensor; a padded result's spec carries its layout (eager/dynamic.py)."""
    if len(spec) == 5:
        dtype, sizes, strides, numel, layout = spec
        if layout is not None:
            tensor = storage.new_tensor(layout.holding(array), dtype, device, sizes, strides, numel)
            dynamic.note_padded(storage.storage_of(tensor))
            return tensor
    else:
        dtype, sizes, strides, numel = spec
    return storage.new_tensor(array, dtype, device, sizes, strides, numel)


def _returns(plan: OpPlan, values: list[Any], arrays: Any, specs: list[Any], device: torch.device) -> Any:
    results = []
    spec_iter = iter(specs)
    for alias in plan.return_aliases:
        if alias is not None:
            results.append(values[alias])
            continue
        spec = next(spec_iter)
        if spec is None:
            results.append(None)
        elif isinstance(spec, list):
            results.append([_wrap(next(arrays), s, device) for s in spec])
        else:
            results.append(_wrap(next(arrays), spec, device))
    if not plan.return_aliases:
        return None
    return results[0] if len(results) == 1 else tuple(results)


# Natively registered ops whose Python kernel is more than `execute` for some calls: (whether a call is plain
# execution, the kernel for the others).
_UNLESS_PLAIN: dict[OpOverload, tuple[Callable[..., bool], Callable[..., Any]]] = {}


def register_native(module: Any, op: OpOverload, plan: OpPlan,
                    unless_plain: tuple[Callable[..., bool], Callable[..., Any]] | None = None) -> None:
    """Give `op` the native kernel (csrc/dispatch.cpp): cache hits run there, misses come to `native_miss`.
    A factory's sizes (`Scan.sizes`: its `size`, arange's `end`) that equal a live length send the call
    here, where it is padded. With `unless_plain`, a miss that is not plain execution runs that kernel
    and is not installed."""
    if unless_plain is not None:
        _UNLESS_PLAIN[op] = unless_plain
    schema = op._schema  # (an aten op by its bare name, one of ours qualified: torch_pjrt::fused_attention)
    module.register_kernel(schema.name.removeprefix("aten::"), schema.overload_name, plan,
                           [k.value for k in plan.kinds], plan.static_scalars, plan.allow_cpu, list(plan.length_args))


def configure_native(module: Any) -> None:
    """Hand the native dispatch what its hit path reads: the storage class, jax's array type, the mode's
    flags, the op counts it bumps (its other counters it keeps: metrics adds them), the device's newest
    outputs, the default random key source, the padded storages' layout class, where a program's
    device-check code goes, for DEFER_AND_FUSE the fusion module (its pending graph, its size cap and debug
    switch), the fused result type and the source of a checked op's user line, the table of live lengths
    with how many it keeps and metrics' own counters (a factory of a live size is padded here, and a new
    padded result's lengths become live natively, as dynamic.note_padded does in Python), and the device
    arrays of traced numbers."""
    module.configure_dispatch(native_miss, storage.DeviceStorage, client.array_type(), metrics.op_counts,
                              startup.newest_outputs(), lambda index: rng.state(index).next_key(), storage.Padded,
                              native_checks_issued, fusion, fusion.Deferred, checks.caller,
                              dynamic.live_lengths(), dynamic.live_limit(), metrics.own_counts(),
                              client.scalar_array)
    modes.on_change(module.set_eager_mode_flags)
    metrics.count_elsewhere(
        metrics.KeptElsewhere(module.native_counts, module.native_count, module.reset_native_counts))


def make_kernel(plan: OpPlan) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return execute(plan, args, kwargs)

    kernel.__name__ = f"pjrt_{plan.op.name()}"
    return kernel


@functools.cache
def _reader(view: View, storage_dtype: torch.dtype, numel: int) -> programs.Program:
    return programs.Program(lambda flat: storage.read_view(flat, storage_dtype, view), "read_view")


def read(tensor: torch.Tensor) -> Any:
    """The logical jax array of a pjrt tensor (zero-copy when it is its whole storage)."""
    flat, view, reader = _flat_and_reader(tensor)
    return flat.reshape(view.sizes) if reader is None else reader.call(flat)


def read_to_host(tensor: torch.Tensor) -> np.ndarray:
    """A pjrt tensor's logical contents on the host; a whole storage is moved as it is and shaped on the
    host (a device reshape would be a program dispatch per read, e.g. per `.item()`)."""
    flat, view, reader = _flat_and_reader(tensor)
    return client.to_host(flat).reshape(view.sizes) if reader is None else client.to_host(reader.call(flat))


def _flat_and_reader(tensor: torch.Tensor) -> tuple[Any, View, programs.Program | None]:
    """A tensor's flat storage array, its view, and the program that reads the view (None: it is the whole)."""
    st = storage.storage_of(tensor)
    view = storage.view_of(tensor)
    flat = st.materialize()
    if view.covers(st.numel) and view.dtype == st.dtype:
        return flat, view, None
    return flat, view, _reader(view, st.dtype, st.numel)
