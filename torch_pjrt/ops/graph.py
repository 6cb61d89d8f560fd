"""Lower ATen FX graphs with the lowering table (decompositions here, torch.compile later)."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from torch_pjrt import _torch_private, storage
from torch_pjrt.ops import casts, registry
from torch_pjrt.runtime import checks, client


def is_array(value: Any) -> bool:
    return isinstance(value, client.jax_module().Array)


def meta_like(array: Any) -> torch.Tensor:
    return torch.empty(tuple(array.shape), dtype=storage.torch_dtype(array.dtype), device="meta")


def conform(value: Any, meta: Any) -> Any:
    """Cast a lowering's result to the dtype PyTorch's meta kernel gives, checking the shape."""
    if isinstance(meta, torch.Tensor):
        if value is None:
            return None
        jnp = client.jax_module().numpy
        value = jnp.asarray(value)
        value = casts.convert(value, meta.dtype)
        expected = tuple(meta.shape)
        if any(isinstance(size, torch.SymInt) for size in expected):
            return value  # a dynamic graph: the traced array has the concrete size
        if tuple(value.shape) != expected:
            if value.size == meta.numel():
                return value.reshape(tuple(meta.shape))
            raise RuntimeError(
                f"torch_pjrt lowering bug: result shape {tuple(value.shape)} but PyTorch expects "
                f"{tuple(meta.shape)}; please report it."
            )
        return value
    if isinstance(meta, (list, tuple)):
        return type(meta)(conform(v, m) for v, m in zip(value, meta))
    return value


class KeySource:
    """Hands out fresh PRNG keys split from one traced key, for the random ops of a graph."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def next(self) -> Any:
        if self.key is None:
            raise RuntimeError("torch_pjrt: a random op was traced without a random key.")
        self.key, sub = client.jax_module().random.split(self.key)
        return sub


def call_lowering(op: Any, args: tuple, kwargs: dict, rng: KeySource | None, meta: Any = None) -> Any:
    entry = lookup(op)
    if entry is None:
        raise registry.MissingLowering(op)
    extra = {}
    if entry.random:
        extra["rng"] = rng.next() if rng is not None else KeySource(None).next()
    if entry.wants_meta:
        extra["out_meta"] = meta
    result = entry.fn(*args, **kwargs, **extra)
    if result is NotImplemented:
        raise registry.MissingLowering(op)
    return result if meta is None else conform(result, meta)


def run_graph(gm: torch.fx.GraphModule, inputs: list[Any], rng: KeySource | None = None) -> Any:
    """Evaluate an ATen graph on jax values (traced inside the caller's jax.jit)."""
    return evaluate(gm, inputs, rng)[0]


def evaluate(
    gm: torch.fx.GraphModule, inputs: list[Any], rng: KeySource | None = None, extra: tuple = (),
    interpret: Callable[[torch.fx.Node, tuple, dict, KeySource | None], Any] | None = None,
) -> tuple[Any, list[Any]]:
    """The graph's output, and the values of the `extra` nodes (e.g. inputs' in-place updates).

    `interpret`, when given, runs every call node instead (torch.compile's padded graphs)."""
    env: dict[torch.fx.Node, Any] = {}
    feed: Iterator[Any] = iter(inputs)
    jnp = client.jax_module().numpy

    def load(arg: Any) -> Any:
        """Node values in place of nodes, as plain mutable lists (decompositions may edit them)."""
        return _plain(torch.fx.node.map_arg(arg, lambda n: env[n]))

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed)
        elif node.op == "get_attr":
            constant = getattr(gm, node.target)
            is_tensor = isinstance(constant, torch.Tensor)
            env[node] = jnp.asarray(storage.host_array(constant.detach().cpu())) if is_tensor else constant
        elif node.op == "call_function":
            args, kwargs = load(node.args), load(node.kwargs)
            checks.at_source(node.meta.get("stack_trace"))
            if interpret is not None:
                env[node] = interpret(node, args, kwargs, rng)
            elif isinstance(node.target, torch._ops.OpOverload):
                env[node] = call_lowering(node.target, args, kwargs, rng, node.meta.get("val"))
            elif node.target is torch.ops.higher_order.with_effects:
                env[node] = _with_effects(args, kwargs, rng)
            elif isinstance(node.target, torch._ops.HigherOrderOperator):
                env[node] = conform(_higher_order(node.target, args, kwargs, rng), node.meta.get("val"))
            else:
                env[node] = node.target(*args, **kwargs)
        elif node.op == "output":
            return load(node.args[0]), [env[n] for n in extra]
        else:
            raise RuntimeError(f"torch_pjrt cannot lower graph node {node.op} {node.target}.")
    return None, []


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _with_effects(args: tuple, kwargs: dict, rng: KeySource | None) -> tuple:
    """An effectful op (ordered by a token): run it; the token passes through unchanged."""
    token, op, *rest = args
    result = call_lowering(op, tuple(rest), kwargs, rng)
    return (token, *result) if isinstance(result, tuple) else (token, result)


def _higher_order(op: torch._ops.HigherOrderOperator, args: tuple, kwargs: dict, rng: KeySource | None) -> Any:
    """A higher-order op (flex_attention and its backward) as its composite kernel traced to ATen ops;
    its subgraph arguments (score and mask functions) are traced inline. Traced on CPU tensors: the
    dense kernels make tensor constants (the -inf of masked scores)."""
    kernel = _torch_private.composite_kernel(op)
    if kernel is None:
        raise RuntimeError(f"torch_pjrt cannot lower the higher-order op {op.name()} in a compiled graph (it has no "
                           "composite ATen implementation); run that part of the model outside torch.compile.")
    return lower_callable(kernel, args, kwargs, rng, trace_device="cpu")


_traced: dict[Any, torch.fx.GraphModule] = {}


def trace_to_graph(fn: Callable, metas: list[torch.Tensor]) -> torch.fx.GraphModule:
    """An ATen graph of fn on meta tensors; functionalized unless it uses aliasing prims, which
    functionalization refuses (those refs decompositions are functional apart from views)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), tracing_mode="real")(*metas)
    except RuntimeError as error:
        if "alias annotations" not in str(error):
            raise
        return make_fx(fn, tracing_mode="real")(*metas)


def lower_callable(fn: Callable, args: tuple, kwargs: dict, rng: KeySource | None = None,
                   trace_device: str = "meta") -> Any:
    """Trace a torch function of these arguments to an ATen graph and lower it on jax values. It is traced
    on meta tensors, or on zero-filled CPU tensors with trace_device="cpu" where it makes tensor
    constants (`torch.tensor(-inf, device=x.device)`), whose values a meta trace would lose."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    leaves = [torch.device(trace_device) if isinstance(leaf, torch.device)
              else _subgraph_on(leaf, trace_device) if isinstance(leaf, torch.fx.GraphModule) else leaf
              for leaf in leaves]
    positions = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    metas = [meta_like(leaves[i]) for i in positions]
    if trace_device != "meta":
        metas = [torch.zeros(m.shape, dtype=m.dtype, device=trace_device) for m in metas]
    static = tuple(None if i in positions else leaves[i] for i in range(len(leaves)))
    key = (fn, spec, _hashable(static), tuple((m.shape, m.dtype, m.device) for m in metas))
    gm = _traced.get(key)
    if gm is None:

        def traced(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, tensor in zip(positions, tensors):
                filled[i] = tensor
            a, k = pytree.tree_unflatten(filled, spec)
            return fn(*a, **k)

        gm = trace_to_graph(traced, metas)
        _traced[key] = gm
    return run_graph(gm, [leaves[i] for i in positions], rng)


_subgraphs_on: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _subgraph_on(module: torch.fx.GraphModule, device: str) -> torch.fx.GraphModule:
    """A subgraph argument (a score or mask function) whose device constants name the trace device: Dynamo
    records the model's device in it (flex_attention's default mask is `new_ones(..., device=pjrt)`), which
    would meet the trace's own tensors on another device. Kept per subgraph, so its traces stay cached."""
    moved = _subgraphs_on.get(module, {}).get(device)
    if moved is not None:
        return moved
    graph = copy.deepcopy(module.graph)
    for node in graph.nodes:
        node.args, node.kwargs = pytree.tree_map_only(torch.device, lambda _: torch.device(device),
                                                      (node.args, node.kwargs))
    moved = torch.fx.GraphModule(module, graph)
    _subgraphs_on.setdefault(module, {})[device] = moved
    return moved


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


# --- resolution: the table, else a related op's lowering, else PyTorch's decomposition traced -----

_decomposing: set[Any] = set()


def lookup(op: Any) -> registry.Lowering | None:
    """The lowering for an op: written by hand, else its functional counterpart's or its `*_copy` twin's,
    else its decomposition traced into a graph of lowered ops (cached in the table)."""
    entry = registry.LOWERINGS.get(op)
    if entry is not None:
        return entry
    if registry.mutated_arguments(op):
        functional = registry.functional_counterpart(op)
        if functional is not None:
            entry = lookup(functional)
            if entry is not None:
                entry = registry.LOWERINGS[op] = dataclasses.replace(entry, drops_out_arguments=True)
                return entry
    copy = registry.view_copy(op)
    if copy is not None and lookup(copy) is not None:
        entry = registry.LOWERINGS[op] = lookup(copy)
        return entry
    found = registry.decomposition(op)
    if found is not None and not registry.mutated_arguments(op):
        entry = registry.Lowering(decomposed(op, found), random=registry.is_random(op), static_scalars=True)
        registry.LOWERINGS[op] = entry
        return entry
    return None


def decomposed(op: Any, decomposition: Callable) -> Callable:
    """A lowering that traces PyTorch's decomposition on meta tensors and lowers that graph."""

    def lower(*args: Any, rng: Any = None, **kwargs: Any) -> Any:
        if op in _decomposing:
            raise registry.MissingLowering(op)  # its decomposition leads back to itself
        _decomposing.add(op)
        try:
            keys = KeySource(rng) if rng is not None else None
            return lower_callable(decomposition, args, kwargs, keys)
        finally:
            _decomposing.discard(op)

    lower.__name__ = f"decomposed_{op.name()}"
    return lower
