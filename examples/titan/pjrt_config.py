"""TorchTitan's llama3 debug config, runnable on the pjrt device (docs/torchtitan.md).

Select it with `--module pjrt_config --config llama3_debugmodel` and this folder on PYTHONPATH.

The config is TorchTitan's own `llama3_debugmodel`. The one shim: TorchTitan's language models
attend with FlexAttention (its `sdpa` backend is refused: "sdpa is no longer supported for language
models"), and PyTorch's eager FlexAttention refuses every device but CUDA, CPU, XPU, HPU and MPS
(the pjrt device adds itself to that set at its start) and any backward on CPU ("FlexAttention does not
support backward on CPU"), which the CPU reference runs need. Its eager implementation is plain ATen ops
(a dense masked softmax, forward and backward), which any device runs, so importing this module drops
that device check. TorchTitan also wraps flex_attention in its own `torch.compile` with Inductor's
FlexAttention kernels, which run on no pjrt device, so the shim calls flex_attention itself (eagerly, or
inside the block's graph when the block is compiled with the pjrt backend, below).

TorchTitan 0.3.0 is built against a newer PyTorch than this project's 2.13.0: it shortens the process
groups' timeouts after the first step with `torch.distributed.set_timeout`, which 2.13.0 names
`torch.distributed.distributed_c10d._set_pg_timeout`; the shim gives it that name (on any device).
Its pipeline-parallel step hands the schedule microbatches already split (`step(arg_mbs=, kwarg_mbs=,
target_mbs=)`), which 2.13.0's `step` takes for model keyword arguments (then fails: "Expecting 2 arg_mbs
but got 1"); 2.13.0 runs such lists through the schedule's `_step_microbatches`, so the shim sends them
there (single-stage schedules: GPipe, 1F1B). Both shims are needed on the CPU as well.

With `--compile.enable --compile.backend pjrt` TorchTitan compiles each transformer block; for models
with FlexAttention it accepts only "inductor" and "aot_eager" ("the flex region would decompose to
eager aten ops (no Triton kernel)"). The pjrt backend lowers that region itself (flex_attention's dense
kernels inside the block's one XLA program), so the shim lets "pjrt" through unchanged.
"""

from typing import Any

import torch.distributed
import torch.nn.attention.flex_attention as _flex_attention
import torchtitan.distributed.compile as _titan_compile
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

__all__ = ["llama3_debugmodel"]


def _validate_device(query, key, value) -> None:
    """FlexAttention's eager math path runs on any device whose ops cover it."""


_flex_attention._validate_device = _validate_device
FlexAttention._compiled_flex_attn = _flex_attention.flex_attention
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout


_whole_batch_step = PipelineScheduleSingle.step


def _step(self: PipelineScheduleSingle, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
          target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
          loss_kwargs: dict | None = None, **kwargs: Any) -> Any:
    """One schedule step of a whole batch, or of microbatches already split (what TorchTitan passes)."""
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        return _whole_batch_step(self, *args, losses=losses, return_outputs=return_outputs,
                                 loss_kwargs=loss_kwargs, **kwargs)
    self._stage.has_backward = self._has_backward
    self._stage.clear_runtime_states()
    self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
    return self._merge_outputs(self._stage.output_chunks) if self._stage.is_last and return_outputs else None


if "arg_mbs" not in PipelineScheduleSingle.step.__code__.co_varnames:
    PipelineScheduleSingle.step = _step


_regional_backend = _titan_compile._maybe_regional_inductor_backend


def _backend(model: torch.nn.Module, backend: Any) -> Any:
    """The per-block compile backend: "pjrt" as named (it lowers FlexAttention), the others as TorchTitan picks."""
    return backend if backend == "pjrt" else _regional_backend(model, backend)


_titan_compile._maybe_regional_inductor_backend = _backend
