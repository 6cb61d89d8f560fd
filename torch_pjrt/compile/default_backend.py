"""torch.compile's default backend on pjrt graphs: the pjrt backend compiles what Inductor cannot.

Inductor generates Triton or C++ for CUDA and CPU and has no code generator for pjrt, so a graph on pjrt
tensors, a user's `torch.compile(model)` after "cuda" became "pjrt" or a library's own compiled helper
(vLLM's logprob ranks, xgrammar's bitmask), failed with Inductor's `KeyError: 'pjrt'`. Such a graph now
goes to `backend="pjrt"`; graphs on CPU or CUDA tensors stay with Inductor. Installed at registration;
cheap: nothing is imported until a graph is compiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_pjrt import _torch_private


def install() -> None:
    _torch_private.wrap_inductor_compile(_routed)


def _routed(inductor: Callable[..., Any]) -> Callable[..., Any]:
    def compile_graph(self: Any, model: torch.fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
                      **kwargs: Any) -> Any:
        if not _on_pjrt(model, example_inputs):
            return inductor(self, model, example_inputs, *args, **kwargs)
        settings = _torch_private.inductor_settings(self)
        if settings:
            warnings.warn(
                f"torch.compile's mode/options set Inductor's {sorted(settings)}; this graph is on pjrt, where the "
                "pjrt backend compiles it and Inductor's settings do not apply: pass backend=\"pjrt\" to say so",
                stacklevel=2,
            )
        from torch_pjrt.compile.backend import pjrt_backend

        return pjrt_backend(model, example_inputs)

    return compile_graph


def _on_pjrt(model: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph takes or makes a pjrt tensor (a graph of factories has no tensor inputs)."""
    if any(isinstance(t, torch.Tensor) and t.device.type == "pjrt" for t in example_inputs):
        return True
    for node in model.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.device.type == "pjrt":
            return True
    return False
