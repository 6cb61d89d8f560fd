"""export_stablehlo: the StableHLO text of the program a model or function would run."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from torch_pjrt import storage
from torch_pjrt.ops import graph
from torch_pjrt.runtime import client


def _exported(module_or_fn: Any, example_args: tuple, example_kwargs: dict | None) -> torch.export.ExportedProgram:
    if isinstance(module_or_fn, torch.export.ExportedProgram):
        return module_or_fn
    if isinstance(module_or_fn, torch.nn.Module):
        module = module_or_fn
    else:

        class Wrapper(torch.nn.Module):
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return module_or_fn(*args, **kwargs)

        module = Wrapper()
    return torch.export.export(module, tuple(example_args), example_kwargs)


def _abstract(node: torch.fx.Node) -> Any:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        shape = tuple(int(s) for s in value.shape)
        return client.jax_module().ShapeDtypeStruct(shape, storage.numpy_dtype(value.dtype))
    return value


def export_stablehlo(module_or_fn: Any, example_args: tuple = (), example_kwargs: dict | None = None) -> str:
    """StableHLO (MLIR text) of a model or function: parameters, buffers and inputs are its arguments.

    Accepts an nn.Module, a function or a torch.export.ExportedProgram; example tensors may live
    on any device (only their shapes and dtypes matter).
    """
    exported = _exported(module_or_fn, example_args, example_kwargs).run_decompositions({})
    gm = exported.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    random = any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in n.target.tags
        for n in gm.graph.nodes
    )
    jax = client.jax_module()

    def program(arrays: list[Any], key: Any) -> Any:
        keys = graph.KeySource(jax.random.wrap_key_data(key, impl="threefry2x32")) if random else None
        return graph.run_graph(gm, arrays, keys)

    key = jax.ShapeDtypeStruct((2,), "uint32") if random else None
    return jax.jit(program).lower([_abstract(n) for n in placeholders], key).as_text()
