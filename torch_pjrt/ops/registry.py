"""The lowering table: ATen overload -> pure function of jax arrays.

One table serves strict eager, fused execution and torch.compile graphs.

Contract of a lowering: it takes the op's arguments in schema order, with every tensor
replaced by a jax array (None stays None) and everything else as given. It returns
what the *functional* form of the op returns: for an op that mutates arguments, first
its non-aliasing returns, then the new value of each mutated argument in argument order
(PyTorch's own functionalization rule). Result dtypes and shapes need not be exact:
the caller casts to what PyTorch's meta kernel says.

Where no lowering is written, PyTorch's decomposition of the op (torch._decomp) is
traced to an ATen graph and that graph is lowered with this same table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

from torch_pjrt import _torch_private

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Lowering:
    fn: Callable[..., Any]
    # A random op receives `rng=` (a jax PRNG key) as a keyword argument.
    random: bool = False
    # Scalars are normally traced (a changing learning rate must not recompile); ops whose
    # result shape or structure depends on a Scalar's value mark them static.
    static_scalars: bool = False
    # The lowering needs the meta outputs (shapes/dtypes) as `out_meta=`.
    wants_meta: bool = False
    # Borrowed from the functional twin of an out= op: the out= arguments are not passed to it.
    drops_out_arguments: bool = False
    # What the traced program depends on beyond this package's source (a custom op's kernel code):
    # part of the persistent cache key of a compiled graph that contains the op.
    fingerprint: str = ""
    # The op as a scatter into its first argument (`(*args) -> Scatter | None`, ops/indexing.py): an
    # in-place call on a view then writes only the scattered elements of the storage, in place,
    # instead of reading the whole view and writing it back (a KV-cache write into a view of one
    # large buffer would copy the view on every step).
    scatter: Callable[..., Any] | None = None
    # Argument positions whose storages a strict call may donate to its program (a custom op's
    # donate_argnums): their buffers become the results' where XLA can alias them, and the tensors
    # are consumed (reading one again raises).
    donated: tuple[int, ...] = ()
    # The op's `float` arguments are traced like Scalars instead of static: an optimizer's lr and betas, which a
    # scheduler changes every step, must not compile a program per value.
    traced_floats: bool = False


LOWERINGS: dict[OpOverload, Lowering] = {}


def _overloads(target: OpOverload | OpOverloadPacket) -> list[OpOverload]:
    if isinstance(target, OpOverload):
        return [target]
    found = []
    for name in target.overloads():
        overload = getattr(target, name)
        schema = overload._schema
        if schema.is_mutable or any(a.alias_info is not None for a in schema.returns):
            continue
        if any(str(a.type) in ("int", "float", "complex", "bool") for a in schema.arguments) and not any(
            "Tensor" in str(a.type) for a in schema.arguments
        ):
            continue
        found.append(overload)
    return found


def register(*targets: OpOverload | OpOverloadPacket, random: bool = False,
             static_scalars: bool = False, wants_meta: bool = False, fingerprint: str = "",
             scatter: Callable[..., Any] | None = None, donated: tuple[int, ...] = (),
             traced_floats: bool = False) -> Callable:
    """Decorator: register a lowering for overloads (a packet means its functional overloads)."""

    def decorate(fn: Callable) -> Callable:
        entry = Lowering(fn, random, static_scalars, wants_meta, fingerprint=fingerprint, scatter=scatter,
                         donated=donated, traced_floats=traced_floats)
        for target in targets:
            for overload in _overloads(target):
                LOWERINGS[overload] = entry
        return fn

    return decorate


# --- mutating ops and their functional counterparts ------------------------------------------


def mutated_arguments(op: OpOverload) -> list[int]:
    return list(_mutated_arguments(op))


@functools.cache
def _mutated_arguments(op: OpOverload) -> tuple[int, ...]:
    """Once per overload: the device's start asks it about 2 times for each of 2,400 overloads, and each reading
    of a schema's arguments copies them."""
    return tuple(i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _argument_signature(arguments: list[torch.Argument], skip: set[int]) -> list[tuple[str, torch._C.Type]]:
    """The arguments' names and types, compared as types (an argument's `Tensor?` is not `Tensor`; its alias
    annotation is no part of its type): formatting every type as text cost more than the rest of the search."""
    return [(a.name, a.type) for i, a in enumerate(arguments) if i not in skip]


def _packet(namespace: Any, qualified: str) -> OpOverloadPacket | None:
    """`getattr(namespace, name, None)`, where a name that is no operator costs a schema query instead of the
    exception torch raises and catches inside (most names a counterpart search tries are no operator)."""
    name = qualified.split("::")[1]
    packet = vars(namespace).get(name)
    if packet is None and _torch_private.operator_schemas(qualified):
        packet = getattr(namespace, name, None)
    return packet


# Each mutating op's functional counterpart by name (None: it has none), as found or as given by `counterparts_known`.
_counterpart_names: dict[str, str | None] = {}
_counterparts: dict[OpOverload, OpOverload | None] = {}


def counterparts_known(names: dict[str, str | None]) -> None:
    """Counterparts an earlier process of the same code and torch found (the device's start keeps them in the
    cache folder): each is looked up by name instead of searched for again."""
    _counterpart_names.update(names)


def counterparts_found() -> dict[str, str | None]:
    """Every counterpart this process found or was given, by name: what the device's start stores."""
    return dict(_counterpart_names)


def functional_counterpart(op: OpOverload) -> OpOverload | None:
    """The functional overload computing what a mutating op writes (add_.Tensor -> add.Tensor): the first
    non-mutating overload whose arguments are the op's less its keyword-only mutated ones (out=), the op's
    overload name first, in the op's own packet (add.out's), the packet without the trailing underscore
    (add_'s add), then the `_functional` packets (normal_ -> normal_functional). Once per op and process."""
    if op in _counterparts:
        return _counterparts[op]
    name = op.name()
    if name in _counterpart_names:
        known = _counterpart_names[name]
        found = None if known is None else _overload_named(known)
    else:
        found = _searched_counterpart(op)
        _counterpart_names[name] = None if found is None else found.name()
    _counterparts[op] = found
    return found


def _overload_named(name: str) -> OpOverload:
    """`aten::add.Tensor` -> torch.ops.aten.add.Tensor (`aten::add` -> its `default`)."""
    qualified, _, overload = name.partition(".")
    namespace, packet = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _searched_counterpart(op: OpOverload) -> OpOverload | None:
    schema = op._schema
    namespace_name, name = schema.name.split("::")
    namespace = getattr(torch.ops, namespace_name)
    base = name[:-1] if name.endswith("_") else name
    packet_names = [] if name.endswith("_") else [name]
    packet_names += [packet_name for packet_name in (base, base + "_functional", name + "_functional",
                                                     base.lstrip("_") + "_functional") if packet_name != name]
    arguments = schema.arguments
    wanted = _argument_signature(arguments, {i for i in _mutated_arguments(op) if arguments[i].kwarg_only})
    for packet_name in packet_names:
        packet = _packet(namespace, f"{namespace_name}::{packet_name}")
        if packet is None:
            continue
        overload_names = packet.overloads()
        preferred = [schema.overload_name] if schema.overload_name in overload_names else []
        for overload_name in preferred + [o for o in overload_names if o not in preferred]:
            overload = getattr(packet, overload_name)
            if overload is op or overload._schema.is_mutable:
                continue
            if _argument_signature(overload._schema.arguments, set()) == wanted:
                return overload
    return None


# --- lookup, with decompositions --------------------------------------------------------------


@functools.cache
def _decompositions() -> dict[OpOverload, Callable]:
    from torch._decomp import decomposition_table

    return dict(decomposition_table)


def view_copy(op: OpOverload) -> OpOverload | None:
    """The `*_copy` twin of a view op (select.int -> select_copy.int): what the view computes, in a
    graph where values never alias (torch.compile's functional graphs, traced decompositions)."""
    if not op.is_view:
        return None
    namespace, name = op._schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name + "_copy", None)
    return None if packet is None else getattr(packet, op._overloadname, None)


def decomposition(op: OpOverload) -> Callable | None:
    """PyTorch's decomposition of an op (torch._decomp's table, else its composite kernel), if any."""
    found = _decompositions().get(op)
    if found is None and _torch_private.has_kernel(op.name(), "CompositeImplicitAutograd"):
        found = op.decompose
    return found


class MissingLowering(NotImplementedError):
    """An ATen op that the table cannot lower (raised at trace time)."""

    def __init__(self, op: Any) -> None:
        super().__init__(f"{op}")
        self.op = op


def is_random(op: OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags
