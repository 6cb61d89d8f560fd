"""TorchTitan's llama3 debug config, runnable on the pjrt device (docs/torchtitan.md).

Select it with `--module pjrt_config --config llama3_debugmodel` and this folder on PYTHONPATH.

The config is TorchTitan's own `llama3_debugmodel`. The one shim: TorchTitan's language models
attend with FlexAttention (its `sdpa` backend is refused: "sdpa is no longer supported for language
models"), and PyTorch's eager FlexAttention refuses every device but CUDA, CPU, XPU, HPU and MPS
("FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices. Found input tensors on pjrt
device.") and any backward on CPU ("FlexAttention does not support backward on CPU"). Its eager
implementation is plain ATen ops (a dense masked softmax, forward and backward), which pjrt runs, so
importing this module drops that device check. TorchTitan also wraps flex_attention in its own
`torch.compile` (Inductor's FlexAttention kernels); on pjrt that graph holds the flex_attention
higher-order op, which the pjrt compile backend cannot lower yet, so the shim calls it eagerly.

TorchTitan 0.3.0 is built against a newer PyTorch than this project's 2.13.0: it shortens the process
groups' timeouts after the first step with `torch.distributed.set_timeout`, which 2.13.0 names
`torch.distributed.distributed_c10d._set_pg_timeout`; the shim gives it that name (on any device).
"""

import torch.distributed
import torch.nn.attention.flex_attention as _flex_attention
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

__all__ = ["llama3_debugmodel"]


def _validate_device(query, key, value) -> None:
    """FlexAttention's eager math path runs on any device whose ops cover it."""


_flex_attention._validate_device = _validate_device
FlexAttention._compiled_flex_attn = _flex_attention.flex_attention
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
