"""vLLM's compile path on pjrt: each piece of vLLM's split model graph compiled by torch_pjrt's backend.

With `enforce_eager=False`, vLLM traces the model once with Dynamo (guards dropped), attention included
(the paged KV cache of attention.py, its index tensors' token and context lengths symbolic), splits the
graph only at its mixture-of-experts ops, which run eagerly, and hands each piece to the platform's
compiler: the `pjrt` torch.compile backend (AOTAutograd, then one program per piece, the KV cache buffer
written in place). A dense model is one program a step. The model runner pads the token count and the
attention metadata the context length to powers of two, so a piece compiles once per (token, context)
bucket, never per prompt length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.compilation.compiler_interface import CompilerInterface

from torch_pjrt.compile import backend


class PjrtCompiler(CompilerInterface):
    """vLLM's `CompilerInterface` over `torch.compile(backend="pjrt")`; compiled pieces are not stored by vLLM
    (torch_pjrt's own persistent cache keeps their programs)."""

    name = "pjrt"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        compile_range: Any,
        key: str | None = None,
    ) -> tuple[Callable[..., Any] | None, Any | None]:
        return backend.pjrt_backend(graph, example_inputs), None
