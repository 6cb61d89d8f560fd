"""The "pjrt" torch.compile backend.

Dynamo hands over an FX graph; AOTAutograd turns it into functional ATen graphs for the
forward and the backward; each graph is interpreted with the eager lowering table inside
one `jax.jit`, so XLA sees one program per graph. In-place updates of graph inputs
(batch-norm buffers, optimizer state) come back as `copy_` nodes and are written back
into the input tensors after the program runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch_pjrt import _registration, _torch_private, storage
from torch_pjrt.eager import dispatch, kernels
from torch_pjrt.ops import graph
from torch_pjrt.runtime import client, programs, rng

aten = torch.ops.aten


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
        """The program for one input signature, and the layouts of its outputs (known once traced)."""
        found = self.programs.get(signature)
        if found is None:
            gm, extra = self.gm, tuple(node for _, node in self.mutations)
            described = self.outputs
            statics = {i: entry[1] for i, entry in enumerate(signature) if entry[0] == "static"}
            layouts: list[Any] = []

            def run(arrays: list[Any], key: Any) -> Any:
                inputs = list(arrays)
                for index, value in sorted(statics.items()):
                    inputs.insert(index, value)
                keys = None
                if key is not None:
                    keys = graph.KeySource(client.jax_module().random.wrap_key_data(key, impl="threefry2x32"))
                outputs, updates = graph.evaluate(gm, inputs, keys, extra)
                outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
                tensors = []
                layouts.clear()
                for value, out in zip(outputs, described):
                    if not out.is_tensor or value is None:
                        layouts.append(None)
                        continue
                    sizes = tuple(value.shape)
                    strides = storage.strides_in_order(sizes, out.order) if out.order else None
                    layouts.append((sizes, strides))
                    tensors.append(storage.pack(value, sizes, strides) if strides else value)
                return tensors, updates

            found = self.programs[signature] = (programs.Program(run, "compiled_graph"), layouts)
        return found

    def __call__(self, *args: Any) -> Any:
        arrays: list[Any] = []
        signature: list[Any] = []
        device = None
        for value in args:
            if isinstance(value, torch.Tensor):
                if value.device.type == "pjrt":
                    device = device or value.device
                    arrays.append(dispatch.read(value))
                else:
                    arrays.append(kernels.host_array(value))
                signature.append((tuple(value.shape), value.dtype, value.device.type))
            else:
                signature.append(("static", value))
        device = device or torch.device("pjrt", 0)
        key = rng.state(device.index).next_key() if self.random else None
        program, layouts = self._program(tuple(signature))
        tensors, updates = program.call(arrays, key)
        for (index, _), value in zip(self.mutations, updates):
            kernels.copy_(args[index], _as_tensor(value, device))
        produced = iter(tensors)
        results = []
        for out, layout in zip(self.outputs, layouts):
            if layout is None:
                results.append(out.constant)
            else:
                results.append(_as_tensor(next(produced), device, *layout))
        return results


def _as_tensor(value: Any, device: torch.device, shape: Any = None, strides: Any = None) -> Any:
    """A program output as a pjrt tensor: packed 1-D storage with known strides, or a logical array."""
    if not hasattr(value, "dtype"):
        return value
    dtype = storage.torch_dtype(value.dtype)
    if strides is not None:
        return storage.new_tensor(value, dtype, device, shape, strides)
    return storage.new_tensor(value.reshape(-1), dtype, device, tuple(value.shape))


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from functorch.compile import make_boxed_func

    return make_boxed_func(CompiledGraph(gm))


def pjrt_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The torch.compile backend (registered as "pjrt" through the torch_dynamo_backends entry point)."""
    from torch._dynamo.backends.common import aot_autograd

    _torch_private.dynamo_skip_packages(*_registration.DYNAMO_SKIPPED)
    backend = aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph, keep_inference_input_mutations=True)
    return backend(gm, example_inputs)

