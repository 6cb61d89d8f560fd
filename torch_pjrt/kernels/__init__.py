"""Custom kernels: JAX and Pallas functions as PyTorch ops on pjrt tensors (docs/kernels.md).

`jax_op` wraps a function; `flash_attention` is a shipped op built on jax's Pallas attention
kernels; `use_flash_attention` routes `scaled_dot_product_attention` to it where it applies;
`paged_attention` is a Pallas kernel over a paged KV cache (the vLLM plugin's, kernels/paged.py);
`opcheck` is torch.library.opcheck for ops called with pjrt tensors.
"""

from __future__ import annotations

from typing import Any

from torch_pjrt.kernels.jax_ops import interpret_mode, jax_op
from torch_pjrt.kernels.op_checks import opcheck


def __getattr__(name: str) -> Any:
    if name in ("flash_attention", "use_flash_attention"):
        from torch_pjrt.kernels import attention

        return getattr(attention, name)
    if name == "paged_attention":
        from torch_pjrt.kernels import paged

        return paged.paged_attention
    raise AttributeError(f"module 'torch_pjrt.kernels' has no attribute {name!r}")


__all__ = ["flash_attention", "interpret_mode", "jax_op", "opcheck", "paged_attention", "use_flash_attention"]
