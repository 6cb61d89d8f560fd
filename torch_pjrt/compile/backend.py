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

from torch_pjrt import storage
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


def _output_layouts(gm: torch.fx.GraphModule) -> list[Any]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (list, tuple)) else [values]
    layouts = []
    for value in values:
        meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(meta, torch.Tensor):
            sizes = tuple(int(s) for s in meta.shape)
            strides = tuple(int(s) for s in meta.stride())
            layouts.append(strides if storage.is_dense(sizes, strides) else None)
        else:
            layouts.append(None)
    return layouts


class CompiledGraph:
    """A graph compiled per input signature; called with the graph's real inputs."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.mutations = _input_mutations(gm)
        self.layouts = _output_layouts(gm)
        self.random = any(
            n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags
            for n in gm.graph.nodes
        )
        self.programs: dict[Any, programs.Program] = {}

    def _program(self, signature: Any) -> programs.Program:
        program = self.programs.get(signature)
        if program is None:
            gm, extra = self.gm, tuple(node for _, node in self.mutations)
            layouts = self.layouts

            def run(arrays: list[Any], key: Any) -> Any:
                keys = None
                if key is not None:
                    keys = graph.KeySource(client.jax_module().random.wrap_key_data(key, impl="threefry2x32"))
                outputs, updates = graph.evaluate(gm, arrays, keys, extra)
                single = not isinstance(outputs, (list, tuple))
                outputs = [outputs] if single else list(outputs)
                packed = [
                    storage.pack(o, o.shape, layout) if layout is not None and hasattr(o, "shape") else o
                    for o, layout in zip(outputs, layouts)
                ]
                return packed, updates

            program = programs.Program(lambda arrays, key: run(arrays, key), "compiled_graph")
            self.programs[signature] = program
        return program

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
                arrays.append(value)
                signature.append(("static", value))
        device = device or torch.device("pjrt", 0)
        key = rng.state(device.index).next_key() if self.random else None
        outputs, updates = self._program(tuple(signature)).call(arrays, key)
        for (index, _), value in zip(self.mutations, updates):
            kernels.copy_(args[index], _as_tensor(value, device))
        results = [
            _as_tensor(o, device, shape=node_shape, strides=layout)
            for o, layout, node_shape in zip(outputs, self.layouts, self._output_shapes())
        ]
        return results

    def _output_shapes(self) -> list[Any]:
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        shapes = []
        for value in values:
            meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
            shapes.append(tuple(int(s) for s in meta.shape) if isinstance(meta, torch.Tensor) else None)
        return shapes


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

    backend = aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph, keep_inference_input_mutations=True)
    return backend(gm, example_inputs)

