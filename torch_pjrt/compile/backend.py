"""The "pjrt" torch.compile backend.

Dynamo hands over an FX graph; AOTAutograd turns it into functional ATen graphs for the
forward and the backward; each graph is interpreted with the eager lowering table inside
one `jax.jit`, so XLA sees one program per graph. In-place updates of graph inputs
(batch-norm buffers, optimizer state) come back as `copy_` nodes and are written back
into the input tensors after the program runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_pjrt import _registration, _torch_private, storage
from torch_pjrt.eager import kernels
from torch_pjrt.ops import graph
from torch_pjrt.runtime import client, programs, rng

aten = torch.ops.aten
# Compiles of one graph for distinct input shapes before a warning names what keeps changing.
RECOMPILE_BUDGET = int(os.environ.get("TORCH_PJRT_RECOMPILE_BUDGET", "8"))


def _input_mutations(gm: torch.fx.GraphModule) -> list[tuple[int, torch.fx.Node]]:
    """(placeholder index, copy_ node) for every in-place write into a graph input."""
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in placeholders:
            found.append((placeholders[node.args[0]], node))
    return found


class Output:
    """How one graph output comes back: a tensor (with the dim order of its dense layout), or a constant."""

    def __init__(self, value: Any) -> None:
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        self.is_tensor = isinstance(meta, torch.Tensor)
        self.constant = None if self.is_tensor else meta
        self.order = None
        if self.is_tensor and all(isinstance(s, int) for s in (*meta.shape, *meta.stride())):
            self.order = storage.physical_order(tuple(meta.shape), tuple(meta.stride()))


def _outputs(gm: torch.fx.GraphModule) -> list[Output]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    return [Output(v) for v in (values if isinstance(values, (list, tuple)) else [values])]


class CompiledGraph:
    """A graph compiled per input signature; called with the graph's real inputs."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.mutations = _input_mutations(gm)
        self.outputs = _outputs(gm)
        self.random = any(
            n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags
            for n in gm.graph.nodes
        )
        self.programs: dict[Any, programs.Program] = {}

    def _program(self, signature: tuple) -> tuple[programs.Program, list[Any]]:
        """The program for one input signature, and the layouts of its outputs (known once traced).

        The program takes the flat storages of the pjrt inputs (each once) and reads every input
        through its view inside the jit, so no eager reshape or gather runs per call; outputs come
        back as flat storages, and mutated inputs as their storages' new flat arrays.
        """
        found = self.programs.get(signature)
        if found is None:
            gm, extra = self.gm, tuple(node for _, node in self.mutations)
            described = self.outputs
            mutated = [index for index, _ in self.mutations]
            layouts: list[Any] = []

            def run(flats: list[Any], hosts: list[Any], key: Any) -> Any:
                host_values = iter(hosts)
                inputs = []
                for entry in signature:
                    if entry[0] == "pjrt":
                        _, slot, view, storage_dtype = entry
                        inputs.append(storage.read_view(flats[slot], storage_dtype, view))
                    elif entry[0] == "host":
                        inputs.append(next(host_values))
                    else:
                        inputs.append(entry[1])
                keys = None
                if key is not None:
                    keys = graph.KeySource(client.jax_module().random.wrap_key_data(key, impl="threefry2x32"))
                outputs, updates = graph.evaluate(gm, inputs, keys, extra)
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
                for value, out in zip(outputs, described):
                    if not out.is_tensor or value is None:
                        layouts.append(None)
                        continue
                    sizes = tuple(value.shape)
                    strides = storage.strides_in_order(sizes, out.order) if out.order else None
                    strides = strides or storage.contiguous_strides(sizes)
                    layouts.append((storage.torch_dtype(value.dtype), sizes, strides))
                    tensors.append(storage.pack(value, sizes, strides))
                written = sorted({signature[index][1] for index in mutated if signature[index][0] == "pjrt"})
                return tensors, [new_flats[slot] for slot in written], host_updates

            found = self.programs[signature] = (programs.Program(run, "compiled_graph"), layouts)
            if len(self.programs) == RECOMPILE_BUDGET + 1:
                warnings.warn(self._recompile_message(), stacklevel=2)
        return found

    def _recompile_message(self) -> str:
        """Which input and dimension kept changing, and the user's line, for the budget warning."""
        names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        shapes: dict[tuple[int, int], set[int]] = {}
        for signature in self.programs:
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
            f"(budget {RECOMPILE_BUDGET}, TORCH_PJRT_RECOMPILE_BUDGET); changing: {', '.join(changing) or 'none'}; "
            f"at {line}. Pad such inputs to a few fixed sizes to bound the compiles."
        )

    def __call__(self, *args: Any) -> Any:
        flats: list[Any] = []
        stores: list[storage.DeviceStorage] = []
        slots: dict[int, int] = {}
        hosts: list[Any] = []
        signature: list[Any] = []
        device = None
        for value in args:
            if isinstance(value, torch.Tensor) and value.device.type == "pjrt":
                device = device or value.device
                st = storage.storage_of(value)
                slot = slots.get(id(st))
                if slot is None:
                    slot = slots[id(st)] = len(stores)
                    stores.append(st)
                    flats.append(st.materialize())
                signature.append(("pjrt", slot, storage.view_of(value), st.dtype))
            elif isinstance(value, torch.Tensor):
                hosts.append(kernels.host_array(value))
                signature.append(("host", tuple(value.shape), value.dtype))
            else:
                signature.append(("static", value))
        device = device or torch.device("pjrt", 0)
        key = rng.state(device.index).next_key() if self.random else None
        program, layouts = self._program(tuple(signature))
        tensors, written, host_updates = program.call(flats, hosts, key)
        pjrt_mutations = [index for index, _ in self.mutations if signature[index][0] == "pjrt"]
        for slot, flat in zip(sorted({signature[index][1] for index in pjrt_mutations}), written):
            stores[slot].array = flat
        host_mutations = [index for index, _ in self.mutations if signature[index][0] != "pjrt"]
        for index, value in zip(host_mutations, host_updates):
            args[index].copy_(kernels.host_tensor(client.to_host(value)))
        produced = iter(tensors)
        return [
            out.constant if layout is None else storage.new_tensor(next(produced), layout[0], device, *layout[1:])
            for out, layout in zip(self.outputs, layouts)
        ]


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from functorch.compile import make_boxed_func

    return make_boxed_func(CompiledGraph(gm))


def pjrt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The torch.compile backend (registered as "pjrt" through the torch_dynamo_backends entry point)."""
    from torch._dynamo.backends.common import aot_autograd

    _torch_private.dynamo_skip_packages(*_registration.DYNAMO_SKIPPED)
    backend = aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph, keep_inference_input_mutations=True)
    return backend(gm, example_inputs)

