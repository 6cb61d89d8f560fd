"""The "pjrt" torch.compile backend.

Dynamo hands over an FX graph; AOTAutograd turns it into functional ATen graphs for the
forward and the backward; each graph is interpreted with the eager lowering table inside
one `jax.jit`, so XLA sees one program per graph. In-place updates of graph inputs
(batch-norm buffers, optimizer state) come back as `copy_` nodes and are written back
into the input tensors after the program runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import operator
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from torch_pjrt import _torch_private, storage
from torch_pjrt.compile import native_call, padding, warm_start
from torch_pjrt.eager import dynamic, fallback, modes
from torch_pjrt.ops import arguments, graph, linalg, registry
from torch_pjrt.runtime import checks, client, disk_store, metrics, programs, rng, spmd, startup

aten = torch.ops.aten
# Imported when torch.compile looks this backend up, before Dynamo traces a user's optimizer step.
_torch_private.dynamo_optimizer_without_cudagraph_import()
# An optimizer on pjrt is made capturable when Dynamo traces its step, as on CUDA: its step counts (AdamW: one a
# parameter) are updated inside the step's program, not by torch on the CPU and sent to the device each step.
_torch_private.dynamo_optimizer_capturable_on("pjrt")
# Compiles of one graph for distinct input shapes before a warning names what keeps changing.
RECOMPILE_BUDGET = int(os.environ.get("TORCH_PJRT_RECOMPILE_BUDGET", "8"))
# torch.compile(backend="pjrt", options={...}): what each option means.
OPTIONS = {
    "recompile_budget": "compiles of one graph for distinct input shapes before the warning naming the changing "
                        "dimension (default TORCH_PJRT_RECOMPILE_BUDGET, 8)",
}


def _input_mutations(gm: torch.fx.GraphModule) -> list[tuple[int, torch.fx.Node]]:
    """(placeholder index, copy_ node) for every in-place write into a graph input."""
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in placeholders:
            found.append((placeholders[node.args[0]], node))
    return found


def _on_host(value: Any) -> bool:
    """A CPU tensor, or a non-empty list of them (a foreach op's result)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_on_host(v) for v in value)
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _eager_nodes(gm: torch.fx.GraphModule, written: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes torch runs itself, outside the program.

    CPU values computed only from CPU values (no random ops) run on the host, as on CUDA, so
    updating them never waits for the device program. Views of device inputs the graph does not
    write (a transposed weight saved for the backward) alias their input, as eager views and
    inductor's outputs do, instead of being copied out of the program.
    """
    host: set[torch.fx.Node] = set()
    views: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder":
            if _on_host(value):
                host.add(node)
            elif isinstance(value, torch.Tensor) and node not in written:
                views.add(node)
        elif node.op != "call_function":
            continue
        elif _on_host(value) and not _is_seeded(node.target) and all(n in host for n in node.all_input_nodes):
            host.add(node)
        elif (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
              and isinstance(value, torch.Tensor) and node.all_input_nodes == [node.args[0]]
              and node.args[0] in views):
            views.add(node)
    return host | views


def _is_seeded(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _eager_part(
    gm: torch.fx.GraphModule, writes: list[torch.fx.Node], outputs: list[torch.fx.Node]
) -> torch.fx.GraphModule:
    """A graph with the same inputs that makes the `writes` into its inputs and returns `outputs`."""
    needed: set[torch.fx.Node] = set()
    pending = [*writes, *outputs]
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    graph = torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            copied[node] = graph.node_copy(node, copied.__getitem__)
    graph.output(tuple(copied[node] for node in outputs))
    for node in list(graph.nodes):
        _foreach_in_place(graph, node)
    return torch.fx.GraphModule(gm, graph)


def _foreach_in_place(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """A functional foreach op whose every result is copied back into its own input, which nothing else reads
    (AOTAutograd's form of an optimizer's `_foreach_add_(state_steps, 1)`), made its in-place overload again:
    one op on the host instead of the op and a copy per tensor (AdamW's 29 step counts)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return
    name = target._schema.name
    if not name.startswith("aten::_foreach_") or name.endswith("_") or not node.args:
        return
    packet = getattr(aten, name.removeprefix("aten::") + "_", None)
    in_place = getattr(packet, target._overloadname, None) if packet is not None else None
    inputs = node.args[0]
    if in_place is None or not isinstance(inputs, (list, tuple)) or len(set(inputs)) != len(inputs):
        return
    copies: dict[int, torch.fx.Node] = {}
    for item in node.users:
        index = item.args[1] if item.target is operator.getitem else None
        [copy] = item.users if len(item.users) == 1 else [None]
        if (index is None or copy is None or copy.target is not aten.copy_.default or copy.users
                or copy.args != (inputs[index], item) or copy.kwargs):
            return
        copies[index] = copy
    if sorted(copies) != list(range(len(inputs))):
        return
    if any(set(x.users) != {node, copies[i]} for i, x in enumerate(inputs) if isinstance(x, torch.fx.Node)):
        return
    with graph.inserting_before(node):
        graph.call_function(in_place, node.args, node.kwargs)
    for copy in copies.values():
        item = copy.args[1]
        graph.erase_node(copy)
        graph.erase_node(item)
    graph.erase_node(node)


class Output:
    """How one graph output comes back: from the program as a device tensor (with the dim order of
    its dense layout) or a host copy, from torch's own run outside it, or as a constant."""

    def __init__(self, value: Any, eager: set[torch.fx.Node]) -> None:
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        self.meta = meta
        self.node = value if isinstance(value, torch.fx.Node) else None
        self.computed_eagerly = value in eager if self.node is not None else False
        self.transferred = _on_host(meta) and not self.computed_eagerly
        self.is_tensor = isinstance(meta, torch.Tensor) and not self.computed_eagerly
        self.constant = None if isinstance(meta, torch.Tensor) else meta
        self.order = None
        if self.is_tensor and all(isinstance(s, int) for s in (*meta.shape, *meta.stride())):
            self.order = storage.physical_order(tuple(meta.shape), tuple(meta.stride()))


def _outputs(gm: torch.fx.GraphModule, eager: set[torch.fx.Node]) -> list[Output]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    return [Output(v, eager) for v in (values if isinstance(values, (list, tuple)) else [values])]


@dataclasses.dataclass(slots=True)
class SignatureProgram:
    """A graph's program for one input signature, and what a call needs besides it."""

    program: programs.Program
    layouts: list[Any]  # how each output comes back; filled in when the program is traced
    written: list[int]  # storage slots of the mutated pjrt inputs, in the program's output order
    host_mutations: list[int]  # CPU inputs the program's host updates are copied into
    checks: list[checks.Check]  # the device-side checks its lowerings made (filled in when traced)
    precision: str  # the float32 matmul precision it was traced under (part of its signature)
    # Its native replay (native_call.py); None: only Python runs it, or `planned` is still False (not run yet).
    native: Any = None
    planned: bool = False


class CompiledGraph:
    """A graph compiled per input signature; called with the graph's real inputs.

    Graphs whose dynamic sizes are bounded (see padding.py) are compiled per bucket of those
    sizes; others per distinct input shape, with a warning past `recompile_budget` compiles.
    """

    def __init__(self, gm: torch.fx.GraphModule, recompile_budget: int = RECOMPILE_BUDGET) -> None:
        self.gm = gm
        self.recompile_budget = recompile_budget
        self.metas = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        mutations = _input_mutations(gm)
        eager = _eager_nodes(gm, {node.args[0] for _, node in mutations})
        # Writes into CPU inputs computed from CPU values run on the host; the program makes the rest.
        self.mutations = [(index, node) for index, node in mutations if node not in eager]
        self.outputs = _outputs(gm, eager)
        eager_writes = [node for _, node in mutations if node in eager]
        eager_outputs = [out.node for out in self.outputs if out.computed_eagerly]
        self.eager_part = _eager_part(gm, eager_writes, eager_outputs) if eager_writes or eager_outputs else None
        self.random = any(n.op == "call_function" and _is_seeded(n.target) for n in gm.graph.nodes)
        # A graph of views and host values only (a detached loss) runs no program at all.
        self.needs_program = self.random or bool(self.mutations) or any(out.is_tensor for out in self.outputs)
        self.programs: dict[Any, SignatureProgram] = {}
        self.bounds = padding.bounds(gm)
        if self.bounds and any(padding.is_symbolic(self.metas[index]) for index, _ in self.mutations):
            self.bounds = None
        self.symbolic_constants = any(isinstance(out.constant, torch.SymInt) for out in self.outputs)
        # Collectives of one process group make the graph one SPMD program over that group's mesh.
        self.collective_groups = {node.args[spmd.COLLECTIVES[node.target]] for node in gm.graph.nodes
                                  if node.op == "call_function" and node.target in spmd.COLLECTIVES}
        self.mesh: Any = None
        self.mesh_resolved = not self.collective_groups
        # The replayable signature that ran last (natively or not): its native replay is tried first.
        self.native_last: SignatureProgram | None = None
        # The signatures with a native replay by (matmul precision, the plan's signature_key): a call the last one
        # does not replay tries only those of its own key (native_call.call_key), not every plan.
        self.native_plans: dict[tuple[str, int], list[SignatureProgram]] = {}

    def _refuse_like_cpu(self) -> None:
        """CPU's NotImplementedError for an op on float8 or fp4 tensors that CPU has no kernel for, as eager pjrt
        raises it (ops/arguments.py): the meta kernels Dynamo traced the graph with refuse nothing."""
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
            bound = dict(zip((argument.name for argument in node.target._schema.arguments), args))
            arguments.refuse_float8_like_cpu(node.target, {**bound, **kwargs})

    def _program(self, signature: tuple, padded: dict[Any, int] | None, example: tuple,
                 out_buckets: tuple[int, ...] = ()) -> SignatureProgram:
        """The program for one input signature, and the layouts of its outputs (known once traced).

        The program takes the flat storages of the pjrt inputs (each once) and reads every input
        through its view inside the jit, so no eager reshape or gather runs per call; outputs come
        back as flat storages, and mutated inputs as their storages' new flat arrays, written into the
        buffers of the old ones (donated: a KV cache updated in place is not copied each call). With padded
        sizes, inputs and outputs of symbolic shape are flat buffers with their true elements first.
        """
        precision = linalg.global_float32_matmul_precision()
        # A storage's array keeps the shape its last writer gave it (not always flat): the traced reads
        # depend on it, and a program stored for one shape refuses another.
        array_shapes = tuple(tuple(flat.shape) for flat in (*example[0], *example[1]) if flat is not None)
        key = (signature, array_shapes, None if padded is None else tuple(padded.values()), out_buckets, precision)
        found = self.programs.get(key)
        if found is not None:
            return found
        self._refuse_like_cpu()
        gm, extra = self.gm, tuple(node for _, node in self.mutations)
        metas, described = self.metas, self.outputs
        mutated = [index for index, _ in self.mutations]
        written = sorted({signature[index][1] for index in mutated if signature[index][0] == "pjrt"})
        layouts: list[Any] = []
        made: list[checks.Check] = []

        def run(flats: list[Any], donated: list[Any], hosts: list[Any], key: Any, true: list[Any]) -> Any:
            flats = list(flats)
            for slot, flat in zip(written, donated):
                flats[slot] = flat
            sizes = None if padded is None else padding.Sizes(padded, dict(zip(padded, true)))
            groups, taken = _host_groups(signature), [0] * len(hosts)
            inputs = []
            for entry, meta in zip(signature, metas):
                if entry[0] == "pjrt":
                    _, slot, view, storage_dtype = entry
                    inputs.append(storage.read_view(flats[slot], storage_dtype, view))
                elif entry[0] == "padded":
                    inputs.append(padding.expand(flats[entry[1]], meta, sizes))
                elif entry[0] == "block":
                    _, slot, leaf, symbols = entry
                    inputs.append(dynamic.read_leaf(flats[slot], leaf, [sizes.true[s] for s in symbols],
                                                    [padded[s] for s in symbols]))
                elif entry[0] == "size":
                    inputs.append(sizes.real(meta))
                elif entry[0] == "host":
                    _, shape, dtype = entry
                    group, start = groups[dtype], taken[groups[dtype]]
                    taken[group] = start + math.prod(shape)
                    inputs.append(hosts[group][start:taken[group]].reshape(shape))
                else:
                    inputs.append(entry[1])
            keys = None
            if key is not None:
                keys = graph.KeySource(client.jax_module().random.wrap_key_data(key, impl="threefry2x32"))
            interpret = None if sizes is None else padding.PaddedInterpreter(sizes)
            with checks.collecting() as found, linalg.pinned_float32_matmul_precision(precision):
                outputs, updates = graph.evaluate(gm, inputs, keys, extra, interpret)
            made[:] = found.checks
            new_flats = list(flats)
            host_updates = []
            for index, value in zip(mutated, updates):
                if signature[index][0] != "pjrt":
                    host_updates.append(value)
                    continue
                _, slot, view, storage_dtype = signature[index]
                new_flats[slot] = storage.write_view(new_flats[slot], storage_dtype, view, value)
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            tensors = []
            layouts.clear()
            buckets = iter(out_buckets)
            for value, out in zip(outputs, described):
                if not out.is_tensor or value is None:
                    layouts.append(None)
                elif out.transferred:
                    layouts.append(("host",))
                    tensors.append(value)
                elif sizes is not None and padding.is_symbolic(out.meta):
                    factors = [dynamic.factors_of(size) for size in out.meta.shape]
                    padded_factors = [[f if isinstance(f, int) else next(buckets) for f in dim] for dim in factors]
                    true_factors = [[f if isinstance(f, int) else sizes.value(f) for f in dim] for dim in factors]
                    layouts.append(("block", storage.torch_dtype(value.dtype), factors))
                    tensors.append(dynamic.finish(value, padded_factors, true_factors))
                else:
                    shape = tuple(value.shape)
                    strides = storage.strides_in_order(shape, out.order) if out.order else None
                    strides = strides or storage.contiguous_strides(shape)
                    numel = storage.storage_numel(shape, strides, 0)
                    layouts.append((storage.torch_dtype(value.dtype), shape, strides, numel))
                    tensors.append(storage.pack(value, shape, strides))
            code = found.code() if found.checks else None
            return tensors, [new_flats[slot] for slot in written], host_updates, code

        found = None
        if self.mesh is not None:
            found = (spmd.MeshProgram(run, self.mesh, "compiled_graph", counter="graph_compiles", donate=(1,)),
                     layouts, made)
        elif padded is None and _can_store():
            stored = self._stored_key(signature, array_shapes)
            found = _load_stored(stored, example) or _export_stored(run, example, layouts, made, stored)
        program, layouts, made = found or (_graph_program(run), layouts, made)
        host_mutations = [index for index in mutated if signature[index][0] != "pjrt"]
        found = self.programs[key] = SignatureProgram(program, layouts, written, host_mutations, made, precision)
        if padded is None and len(self.programs) == self.recompile_budget + 1:
            warnings.warn(self._recompile_message(), stacklevel=3)
        return found

    def _stored_key(self, signature: tuple, array_shapes: tuple) -> str:
        """What the traced program depends on: our code, the versions, the graph, its inputs' layouts,
        the matmul precision, and the kernels of the custom ops in it (torch_pjrt.kernels)."""
        digest = disk_store.entry_digest()
        metas = [(m.dtype, tuple(m.shape), m.stride(), m.device.type) if isinstance(m, torch.Tensor) else m
                 for m in self.metas]
        for part in (self.gm.code, repr(metas), repr(signature), repr(array_shapes),
                     linalg.global_float32_matmul_precision()):
            digest.update(str(part).encode())
        for node in self.gm.graph.nodes:
            lowering = registry.LOWERINGS.get(node.target) if node.op == "call_function" else None
            if lowering is not None and lowering.fingerprint:
                digest.update(lowering.fingerprint.encode())
            if node.op == "get_attr":
                constant = getattr(self.gm, node.target)
                if isinstance(constant, torch.Tensor):
                    constant = storage.host_array(constant.cpu()).tobytes()
                digest.update(repr((node.target, constant)).encode())
        return digest.hexdigest()

    def _recompile_message(self) -> str:
        """Which input and dimension kept changing, and the user's line, for the budget warning."""
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        shapes: dict[tuple[int, int], set[int]] = {}
        for signature, *_ in self.programs:
            for position, entry in enumerate(signature):
                sizes = entry[2].sizes if entry[0] == "pjrt" else entry[1] if entry[0] == "host" else ()
                for dim, size in enumerate(sizes):
                    shapes.setdefault((position, dim), set()).add(size)
        changing = [f"{names[p]} dim {d} ({len(v)} sizes)" for (p, d), v in shapes.items() if len(v) > 1]
        trace = next((n.meta["stack_trace"] for n in self.gm.graph.nodes if n.meta.get("stack_trace")), "")
        frames = [line.strip() for line in trace.splitlines()]
        files = [i for i, line in enumerate(frames) if line.startswith("File ")]
        line = " ".join(frames[files[-1]:files[-1] + 2]) if files else "an unknown line"
        return (
            f"torch_pjrt: a compiled graph has been compiled for {len(self.programs)} input shapes "
            f"(budget {self.recompile_budget}: TORCH_PJRT_RECOMPILE_BUDGET, or torch.compile's "
            f"options={{'recompile_budget': N}}); changing: {', '.join(changing) or 'none'}; "
            f"at {line}. Bound them with torch_pjrt.mark_dynamic(tensor, dim, min=, max=) so they are padded "
            f"to a few bucket sizes."
        )

    def __call__(self, *args: Any) -> Any:
        if self.native_last is not None:
            results = self._replayed(args)
            if results is not None:
                return results
        values = padding.true_sizes(self.gm, args) if self.bounds or self.symbolic_constants else {}
        if self.bounds and all(symbol in values for symbol in self.bounds):
            padded = {s: padding.bucket(values[s], upper) for s, upper in self.bounds.items()}
            try:
                return self._run(args, values, padded)
            except padding.CannotPad as reason:
                warnings.warn(
                    f"torch_pjrt: a graph with bounded dynamic sizes cannot run padded ({reason}); it compiles "
                    f"once per distinct size instead.", stacklevel=2,
                )
                self.bounds = None
        return self._run(args, values, None)

    def _replayed(self, args: tuple) -> list[Any] | None:
        """The call replayed by the native plan of its signature (the last one tried first), or None."""
        precision = linalg.global_float32_matmul_precision()
        last = self.native_last
        if last.native is not None and last.precision == precision:
            results = last.native(args)
            if results is not None:
                return results
        if not self.native_plans:
            return None
        for found in self.native_plans.get((precision, native_call.call_key(args)), ()):
            results = found.native(args) if found is not last else None
            if results is not None:
                self.native_last = found
                return results
        return None

    def _run(self, args: Sequence[Any], values: dict[Any, int], padded: dict[Any, int] | None) -> list[Any]:
        """One call; `values` binds the size symbols the inputs carry, `padded` their buckets (or None)."""
        if not self.needs_program:
            return self._results(self._run_eager_part(args), values, [None] * len(self.outputs), (), None)
        flats: list[Any] = []
        stores: list[storage.DeviceStorage | None] = []
        slots: dict[int, int] = {}
        host_inputs: list[torch.Tensor] = []
        signature: list[Any] = []
        device = None
        for value, meta in zip(args, self.metas):
            if isinstance(value, torch.Tensor) and not value.is_cpu:
                if device is None:
                    device = value.device
                if padded is not None and padding.is_symbolic(meta):
                    block = _block_input(value, meta, padded, values)
                    if block is not None:
                        signature.append(("block", len(stores), *block))
                        stores.append(None)
                        flats.append(storage.storage_of(value).array.bucket_array())
                    else:
                        signature.append(("padded", len(stores)))
                        stores.append(None)
                        flats.append(_boundary_flat(value, math.prod(padding.concrete(s, padded) for s in meta.shape)))
                    continue
                st = storage.storage_of(value)
                slot = slots.get(id(st))
                if slot is None:
                    slot = slots[id(st)] = len(stores)
                    stores.append(st)
                    flats.append(st.materialize())
                signature.append(("pjrt", slot, storage.view_of(value), st.dtype))
            elif isinstance(value, torch.Tensor):
                if padded is not None and padding.is_symbolic(meta):
                    raise padding.CannotPad("a host tensor of dynamic size")
                host_inputs.append(value)
                signature.append(("host", tuple(value.shape), value.dtype))
            elif padded is not None and isinstance(meta, torch.SymInt):
                signature.append(("size",))
            else:
                signature.append(("static", value))
        hosts = _host_batches(host_inputs)
        device = device or torch.device("pjrt", 0)
        if not self.mesh_resolved:  # once: the group's engine and mesh do not change
            if len(self.collective_groups) == 1:
                self.mesh = spmd.mesh_of(next(iter(self.collective_groups)), device.index)
            self.mesh_resolved = True
        key = _next_key(device.index) if self.random else None
        # True sizes are traced program arguments: a new size in the same bucket must not recompile.
        true = [] if padded is None else [np.asarray(values[s], np.int64) for s in padded]
        out_buckets = () if padded is None else self._out_buckets(values)
        donated = _donated(flats, sorted({signature[index][1] for index, _ in self.mutations
                                          if signature[index][0] == "pjrt"}))
        try:  # a new signature's program is traced here, by its export or by its first call
            found = self._program(tuple(signature), padded, (flats, donated, hosts, key, true), out_buckets)
            replayable = padded is None and self.mesh is None and not self.bounds and not self.symbolic_constants
            slot_shapes = None
            if replayable and not found.planned:
                arrays = list(flats)
                for slot, flat in zip(found.written, donated):
                    arrays[slot] = flat
                slot_shapes = [tuple(array.shape) for array in arrays]
            tensors, written, host_updates, code = _call_program(found.program, device.index, flats, donated, hosts,
                                                                 key, true)
        except registry.MissingLowering as missing:
            raise NotImplementedError(fallback.missing_message(missing.op, compiled=True)) from None
        if code is not None:
            _issue_checks(tuple(found.checks), code)
        # After the inputs were read: the eager part writes into CPU inputs the program reads as they were.
        computed = self._run_eager_part(args)
        for slot, flat in zip(found.written, written):
            stores[slot].array = flat
        for index, value in zip(found.host_mutations, client.to_host_many(host_updates) if host_updates else []):
            args[index].copy_(storage.host_tensor(value))
        results = self._results(computed, values, found.layouts, tensors, device)
        if slot_shapes is not None:
            found.native, found.planned = self._native_plan(signature, found, slot_shapes, stores, device), True
            if found.native is not None:
                self.native_plans.setdefault((found.precision, found.native.signature_key), []).append(found)
        self.native_last = found if replayable else None
        return results

    def _native_plan(self, signature: list[Any], found: SignatureProgram, slot_shapes: list[tuple[int, ...]],
                     stores: list[storage.DeviceStorage | None], device: torch.device) -> Any:
        """The native replay of this signature's call (native_call.py), or None where only Python runs it."""
        if found.host_mutations:
            return None
        return native_call.plan(
            signature, slot_shapes, [st.dtype for st in stores], found.written, self.outputs, found.layouts, device,
            functools.partial(_call_program, found.program, device.index),
            functools.partial(_next_key, device.index) if self.random else None,
            self.eager_part.forward if self.eager_part is not None else None,
            functools.partial(_issue_checks, tuple(found.checks)))

    def _out_buckets(self, values: dict[Any, int]) -> tuple[int, ...]:
        """The bucket of every dynamic factor of the outputs' sizes in this call (part of the key)."""
        found = []
        for out in self.outputs:
            if out.is_tensor and not out.transferred and padding.is_symbolic(out.meta):
                for size in out.meta.shape:
                    for factor in dynamic.factors_of(size):
                        if not isinstance(factor, int):
                            true = padding.concrete_expr(factor, values)
                            found.append(dynamic.bucket(true, self._bound_of(factor)) or true)
        return tuple(found)

    def _bound_of(self, expr: Any) -> int:
        return dynamic.bound_of(expr, list(self.bounds), list(self.bounds.values()))

    def _block_output(self, array: Any, dtype: torch.dtype, factors: list[tuple[Any, ...]], values: dict[Any, int],
                      device: torch.device) -> torch.Tensor:
        """A padded graph output as an eager tensor held padded (eager/dynamic.py)."""
        shape, padded, bounds, sizes = [], [], [], []
        for dim in factors:
            size = 1
            for factor in dim:
                true = factor if isinstance(factor, int) else padding.concrete_expr(factor, values)
                bound = None if isinstance(factor, int) else self._bound_of(factor)
                bucket = None if bound is None else dynamic.bucket(true, bound)
                shape.append(true)
                padded.append(bucket or true)
                bounds.append(bound if bucket is not None else None)
                size *= true
            sizes.append(size)
        layout = storage.Padded(array, tuple(shape), tuple(padded), tuple(bounds))
        return storage.new_tensor(layout, dtype, device, sizes, storage.contiguous_strides(sizes), math.prod(sizes))

    def _run_eager_part(self, args: Sequence[Any]) -> list[Any]:
        return self.eager_part.forward(*args) if self.eager_part is not None else []

    def _results(self, computed: Sequence[Any], values: dict[Any, int], layouts: list[Any], tensors: Sequence[Any],
                 device: torch.device | None) -> list[Any]:
        """The graph's outputs: from the eager part, as constants, or wrapped from the program's arrays."""
        computed, produced = iter(computed), iter(tensors)
        results = []
        for out, layout in zip(self.outputs, layouts):
            if out.computed_eagerly:
                results.append(next(computed))
            elif layout is None:
                results.append(_constant(out.constant, values))
            elif layout[0] == "host":
                results.append(storage.host_tensor(client.to_host(next(produced))))
            elif layout[0] == "block":
                results.append(self._block_output(next(produced), layout[1], layout[2], values, device))
            else:
                dtype, shape, strides, numel = layout
                results.append(storage.new_tensor(next(produced), dtype, device, shape, strides, numel))
        return results


def _call_program(program: programs.Program, device_index: int, *args: Any) -> Any:
    """A graph's program call, from the Python path and from its native plan: Program.call looked up at each
    call (benchmarks and tools that wrap it see native calls too), and the results noted as the device's
    newest, held weakly (what a torch.pjrt.Event recorded after the call waits for)."""
    results = program.call(*args)
    tensors, written = results[0], results[1]
    startup.note_output(device_index, startup.WeakResults([*tensors[:1], *written[:1]]))
    return results


def _next_key(index: int) -> Any:
    """A random graph's key: the device's next default one."""
    return rng.state(index).next_key()


def _issue_checks(made: tuple[checks.Check, ...], code: Any) -> None:
    """A graph program with device-side checks ran: its code joins the pending checks."""
    checks.issued(code, made, (None,) * len(made), modes.state.blocking)


def _block_input(tensor: torch.Tensor, meta: torch.Tensor, padded: dict[Any, int],
                 values: dict[Any, int]) -> tuple[Any, tuple[Any, ...]] | None:
    """An input held padded (eager/dynamic.py) whose dynamic dims are the graph's symbols at the
    graph's buckets: the program reads its padded array as it is, so no program pads it per size.
    Returns its padded view and the graph symbol of each of its size classes."""
    st = storage.storage_of(tensor)
    if not isinstance(st.array, storage.Padded):
        return None
    symbols = dynamic.Symbols()
    leaf = dynamic.describe(tensor, st, 0, symbols)
    if leaf is None or leaf.relayouts or leaf.starts:
        return None
    classes: list[Any] = [None] * len(symbols.values)
    for size, factors in zip(meta.shape, leaf.dims):
        if not isinstance(size, torch.SymInt):
            if factors is not None:
                return None
            continue
        expr = size.node.expr
        if factors is None or len(factors) != 1 or factors[0][1] != 0 or not expr.is_Symbol:
            return None
        cls = factors[0][0]
        if classes[cls] not in (None, expr) or symbols.values[cls] != values.get(expr) or (
                symbols.buckets()[cls] != padded[expr]):
            return None
        classes[cls] = expr
    if any(c is None for c in classes):
        return None
    return leaf, tuple(classes)


def _host_batches(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """A call's CPU inputs as one flat array per dtype, in order of first use (see `_host_groups`): the program
    takes one host transfer per dtype, not one per tensor (AdamW's CPU step counts: one per parameter)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        # Tensors of one shape (AdamW's 0-dim step counts) stacked: one op, not a reshape per tensor and a cat
        # (29 step counts: 135 -> 35 us). Conjugate and negative bits are resolved by the op itself.
        return [storage.host_array(torch.stack(group).reshape(-1) if _one_shape(group)
                                   else torch.cat([tensor.reshape(-1) for tensor in group]))
                for group in groups.values()]


def _one_shape(tensors: list[torch.Tensor]) -> bool:
    shape = tensors[0].shape
    return all(tensor.shape == shape for tensor in tensors)


def _host_groups(signature: Sequence[Any]) -> dict[torch.dtype, int]:
    """Which of `_host_batches`' arrays holds the CPU inputs of each dtype."""
    groups: dict[torch.dtype, int] = {}
    for entry in signature:
        if entry[0] == "host":
            groups.setdefault(entry[2], len(groups))
    return groups


def _can_store() -> bool:
    """Traced graphs are stored when the cache is on and jax can serialize them."""
    return disk_store.enabled() and _has_serializer()


@functools.cache
def _has_serializer() -> bool:
    return importlib.util.find_spec("flatbuffers") is not None


def _load_stored(key: str, example: tuple) -> tuple[programs.Program, list[Any], list[checks.Check]] | None:
    """A graph's program as an earlier process traced it (its StableHLO, output layouts and checks), run by
    the executable that process stored for it where there is one: the StableHLO is deserialized only where there
    is none (the GPT step's 4 graphs: 13 ms of a warm first step's main thread)."""
    payload = disk_store.read("graphs", key)
    if payload is None:
        return None
    header, _, module = payload.partition(b"\n")
    described = json.loads(header)
    layouts = [_layout_from_json(item) for item in described["layouts"]]
    made = [checks.Check(op, message, _ERRORS[error], where) for op, message, error, where in described["checks"]]

    def run_stored_module(*args: Any) -> Any:
        return client.jax_module().export.deserialize(bytearray(module)).call(*args)

    return _stored_graph_program(run_stored_module, example, key), layouts, made


# the exception classes a stored check may name
_ERRORS = {error.__name__: error for error in (RuntimeError, IndexError, ValueError)}


def _export_stored(
    run: Callable, example: tuple, layouts: list[Any], made: list[checks.Check], key: str
) -> tuple[programs.Program, list[Any], list[checks.Check]] | None:
    """Trace a graph's program once, store it and its executable for later processes, and run it from
    the stored form."""
    jax = client.jax_module()
    start = time.perf_counter()
    try:
        allowed = [jax.export.DisabledSafetyCheck.custom_call(target) for target in disk_store.STORABLE_CUSTOM_CALLS]
        exported = jax.export.export(jax.jit(run), disabled_checks=allowed)(*example)
    except ValueError:
        # Custom calls without a stability guarantee (some CPU linear algebra) cannot be stored.
        return None
    metrics.bump("graph_compiles_seconds", time.perf_counter() - start)
    header = {"layouts": [_layout_to_json(layout) for layout in layouts],
              "checks": [[c.op, c.message, c.error.__name__, c.where] for c in made]}
    disk_store.write("graphs", key, json.dumps(header).encode() + b"\n" + exported.serialize())
    return _stored_graph_program(exported.call, example, key), layouts, made


def _graph_program(fn: Callable) -> programs.Program:
    return programs.Program(fn, "compiled_graph", donate=(1,), counter="graph_compiles")


def _stored_graph_program(fn: Callable, example: tuple, key: str) -> programs.Program:
    return programs.stored_executable(fn, example, key, "compiled_graph", "graph_compiles", donate=(1,))


def _donated(flats: list[Any], written: list[int]) -> list[Any]:
    """The arrays of the storages a graph writes, taken out of `flats` for the program to write its results
    into: each one only its storage holds (any other holder, or a pending copy to the host, gets a copy).
    The same rule, by reference count, is csrc/graph_call.cpp's GraphPlan (its native replay): change both."""
    # Counted here, not in a shared helper: one more Python call frame under Dynamo's frame hook holds one more
    # reference to its arguments (measured: 5 where 4 was due), and every array would be copied.
    held_by_storage_list_and_call = 3
    # A copy is a put to the array's own sharding, not Array.copy(), which traces, lowers and compiles a jax copy
    # program per shape (25-45 ms each; a warm first training step lowered one: the optimizer state's newest
    # zeros, which the device's newest outputs still held).
    put = client.jax_module().device_put
    donated = []
    for slot in written:
        flat, flats[slot] = flats[slot], None
        donated.append(flat if sys.getrefcount(flat) == held_by_storage_list_and_call else put(flat, may_alias=False))
    return donated


def _layout_to_json(layout: tuple | None) -> list | None:
    """An output layout for the stored header: its torch dtype by name."""
    if layout is None or layout[0] == "host":
        return None if layout is None else list(layout)
    return [str(layout[0]).removeprefix("torch."), *layout[1:]]


def _layout_from_json(item: list | None) -> tuple | None:
    if item is None or item[0] == "host":
        return None if item is None else tuple(item)
    return (getattr(torch, item[0]), *item[1:])


def _boundary_flat(tensor: torch.Tensor, padded_numel: int) -> Any:
    """The tensor's elements in row-major order at the front of a flat array of the padded count.

    A graph's own padded outputs already are such arrays; a whole storage held padded by eager
    (a saved tensor AOTAutograd hands the backward graph as a reshape, `(4 * s, 64)` of `(4, s, 64)`)
    is repacked by one program per bucket, its true shape traced; any other tensor is copied into one
    by a small program compiled per true shape.
    """
    st = storage.storage_of(tensor)
    view = storage.view_of(tensor)
    if view.covers(math.prod(view.sizes)) and st.numel == padded_numel:
        return st.materialize()
    if isinstance(st.array, storage.Padded) and view.covers(st.numel) and view.dtype == st.dtype:
        layout = st.array
        return _front_packer(layout.padded, padded_numel).call(layout.bucket_array(),
                                                                np.asarray(layout.shape, np.int64))
    key = (view, st.dtype, st.numel, padded_numel)
    program = _PAD_PROGRAMS.get(key)
    if program is None:

        def pad(flat: Any) -> Any:
            values = storage.read_view(flat, st.dtype, view).reshape(-1)
            return client.jax_module().numpy.pad(values, (0, padded_numel - values.shape[0]))

        program = _PAD_PROGRAMS[key] = programs.Program(pad, "pad_input", counter="pad_compiles")
    return program.call(st.materialize())


_PAD_PROGRAMS: dict[Any, programs.Program] = {}


@functools.cache
def _front_packer(padded: tuple[int, ...], padded_numel: int) -> programs.Program:
    """The program that moves a padded array's true elements (true shape traced) to the front of a flat
    array of `padded_numel`, in row-major order, zeros after them."""
    jnp = client.jax_module().numpy

    def pack(array: Any, true_shape: Any) -> Any:
        position = jnp.arange(padded_numel)
        rest, source = position, jnp.zeros_like(position)
        scale = 1
        for dim in reversed(range(len(padded))):
            extent = jnp.maximum(true_shape[dim], 1)
            source = source + (rest % extent) * scale
            rest, scale = rest // extent, scale * padded[dim]
        valid = position < jnp.prod(true_shape)
        flat = array.reshape(-1)
        return jnp.where(valid, flat[jnp.where(valid, source, 0)], jnp.zeros((), flat.dtype))

    return programs.Program(pack, "pack_padded_input", counter="pad_compiles")


def _constant(value: Any, values: dict[Any, int]) -> Any:
    """A graph's non-tensor output; symbolic sizes (saved for the backward) become this call's ints."""
    return padding.concrete(value, values) if isinstance(value, torch.SymInt) else value


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile's `options` for this backend; an option it does not know is an error, never ignored."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        known = "; ".join(f"{name}: {meaning}" for name, meaning in OPTIONS.items())
        named = ", ".join(map(repr, unknown))
        raise ValueError(f"torch.compile(backend='pjrt') has no option {named}; it takes {known}.")
    budget = options.get("recompile_budget", RECOMPILE_BUDGET)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"torch.compile(backend='pjrt'): recompile_budget must be a positive int, not {budget!r}.")
    return {"recompile_budget": budget}


def pjrt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The torch.compile backend (registered as "pjrt" through the torch_dynamo_backends entry point);
    `options` are torch.compile's `options={...}` (see OPTIONS). Inductor's modes have no meaning here:
    one is named in a warning (CUDA scripts pass them), not silently dropped."""
    from torch._dynamo.backends.common import aot_autograd

    if mode is not None:
        warnings.warn(f"torch.compile(backend='pjrt') does not use mode={mode!r} (Inductor's); the graph compiles "
                      "to one XLA program either way.", stacklevel=2)
    _torch_private.dynamo_skip_our_packages()
    make = functools.partial(CompiledGraph, **_checked_options(options or {}))
    with warm_start.aot_cache(example_inputs, make) as compiler:
        # Min-cut: views of the inputs and cheap ops are recomputed inside the backward's program instead of saved
        # by the forward (the GPT step's forward: 9 weight transposes made by torch after each call, 190 -> 100 us).
        backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True,
                               partition_fn=_torch_private.min_cut_partition())
        return backend(gm, example_inputs)

