"""flash_attention: jax's Pallas attention kernels as a PyTorch op, and the switch that routes
`scaled_dot_product_attention` on pjrt tensors to it.

On CPU and GPU the op runs jax's GPU kernel (`pallas.ops.gpu.attention.mha`, interpreted on CPU);
on TPU jax's TPU flash attention (the GPU kernel's layout is (batch, seq, heads, dim), the TPU
one's SDPA's). Both cut sequences into blocks of a fixed size: shorter or uneven sequences are
padded to whole blocks and the padded keys masked with segment ids, so every length runs. The
backward is `jax.vjp` of the forward (the kernels' own custom backward), recomputing the forward
inside the backward program.

The SDPA switch is a PrivateUse1 autograd kernel for `aten::scaled_dot_product_attention`,
installed the first time the switch is on: where the kernel applies (no mask, no dropout, equal
heads and head dims, a float32/bfloat16/float16 dtype) it calls the op, otherwise PyTorch's own
composite decomposition, which is what runs without the switch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import torch

from torch_pjrt import envvars
from torch_pjrt.kernels import jax_ops
from torch_pjrt.runtime import client

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# sequence positions per kernel block at most (jax's GPU and TPU kernels' default)
MAX_BLOCK = 128


def block_size(length: int) -> int:
    """Positions per block for a sequence: the next power of two, from 16 up to MAX_BLOCK."""
    return min(MAX_BLOCK, max(16, 1 << max(0, length - 1).bit_length()))


def _padded(length: int, block: int) -> int:
    return -(-length // block) * block


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """Why the kernel cannot take these inputs, or None when it can."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k and v must be 4-D (batch, heads, seq, head_dim), got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return f"q, k and v must share one of float32, bfloat16, float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[1] == k.shape[1] == v.shape[1]):
        return f"q, k and v must have equal batch and head counts, got {tuple(q.shape)}, {tuple(k.shape)}, " \
               f"{tuple(v.shape)}"
    if not (q.shape[3] == k.shape[3] == v.shape[3]) or k.shape[2] != v.shape[2]:
        return f"q, k and v must have one head_dim and k, v one length, got {tuple(q.shape)}, {tuple(k.shape)}, " \
               f"{tuple(v.shape)}"
    q_length, k_length = q.shape[2], k.shape[2]
    if q_length > k_length and causal:
        return f"causal attention needs at least as many keys as queries, got {k_length} keys, {q_length} queries"
    if q_length > k_length and k_length % block_size(k_length):
        return f"padding {k_length} keys to whole blocks needs at least as many keys as queries ({q_length})"
    return None


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
               scale: float | None = None) -> jax.Array:
    """softmax(q @ k^T * scale) @ v of (batch, heads, seq, head_dim) tensors, as
    `scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`, with a Pallas kernel;
    differentiable. `scale` defaults to 1/sqrt(head_dim); causal masks keys after each query."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if client.platform() == "tpu":
        return _tpu_attention(q, k, v, causal, scale)
    return _gpu_attention(q, k, v, causal, scale)


def _gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention

    jnp = jax.numpy
    q_length, k_length = q.shape[2], k.shape[2]
    q_block, k_block = block_size(q_length), block_size(k_length)
    q_target, k_target = _padded(q_length, q_block), _padded(k_length, k_block)
    segment_ids = None
    if k_target != k_length:
        # padded keys are masked: one segment id per position (0 for padding) shared by queries and
        # keys, so both get one length; a power of two up to MAX_BLOCK, or a multiple of it: whole blocks
        q_target = k_target = max(q_target, k_target)
        segment_ids = jnp.broadcast_to((jnp.arange(k_target) < k_length).astype(jnp.int32), (q.shape[0], k_target))
    # the kernel's layout is (batch, seq, heads, head_dim)
    q_in, k_in, v_in = (jnp.pad(jnp.swapaxes(t, 1, 2), ((0, 0), (0, target - t.shape[2]), (0, 0), (0, 0)))
                        for t, target in ((q, q_target), (k, k_target), (v, k_target)))
    interpret = jax_ops.interpret_mode()
    blocks = attention.BlockSizes(q_block, k_block, *_backward_blocks(q_target, k_target, interpret))
    out = attention.mha(q_in, k_in, v_in, segment_ids, sm_scale=scale, causal=causal, block_sizes=blocks,
                        interpret=interpret)
    return jnp.swapaxes(out[:, :q_length], 1, 2)


def _backward_blocks(q_length: int, k_length: int, interpret: bool) -> tuple[int, int, int, int]:
    """(block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq) of the GPU kernel's backward: at most 128
    positions interpreted (fewer, larger blocks run faster), 32 compiled (the kernel's own choice); its
    fused pass splits queries and keys into one number of blocks."""
    cap = MAX_BLOCK if interpret else 32
    common = math.gcd(q_length, k_length)
    count = common // min(cap, common)
    return min(cap, q_length), k_length // count, q_length // count, min(cap, k_length)


def _tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu

    jnp = jax.numpy
    q_length, k_length = q.shape[2], k.shape[2]
    q_target, k_target = _padded(q_length, MAX_BLOCK), _padded(k_length, MAX_BLOCK)
    segment_ids = None
    if k_target != k_length:
        segment_ids = tpu.SegmentIds(q=jnp.ones((q.shape[0], q_target), jnp.int32),
                                     kv=jnp.broadcast_to((jnp.arange(k_target) < k_length).astype(jnp.int32),
                                                         (q.shape[0], k_target)))
    q_in, k_in, v_in = (jnp.pad(t, ((0, 0), (0, 0), (0, target - t.shape[2]), (0, 0)))
                        for t, target in ((q, q_target), (k, k_target), (v, k_target)))
    out = tpu.flash_attention(q_in, k_in, v_in, segment_ids=segment_ids, causal=causal, sm_scale=scale)
    return out[:, :, :q_length]


def _checked_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """The op's fake: refuses what the kernel cannot take, else a result of q's shape (symbolic
    sizes included; those are checked when the graph runs)."""
    if all(isinstance(size, int) for size in (*q.shape, *k.shape, *v.shape)):
        reason = unsupported(q, k, v, causal)
        if reason is not None:
            raise ValueError(f"torch_pjrt.kernels.flash_attention: {reason}; use "
                             f"torch.nn.functional.scaled_dot_product_attention for these inputs.")
    return q.new_empty(q.shape)


# called as flash_attention(q, k, v, causal=..., scale=...): a custom op, so torch.compile traces it
flash_attention = jax_ops.define("torch_pjrt::flash_attention", _attention, vjp="auto", fake=_checked_result)


# --- the scaled_dot_product_attention switch ---------------------------------------------------------

# the innermost use_flash_attention block, else TORCH_PJRT_FLASH_ATTENTION
switch = envvars.Switch("TORCH_PJRT_FLASH_ATTENTION")
_installed: list[torch.library.Library] = []


@contextlib.contextmanager
def use_flash_attention(enabled: bool = True) -> Iterator[None]:
    """Within the block, `scaled_dot_product_attention` on pjrt tensors runs flash_attention where it
    applies (or, with enabled=False, never). torch.compile reads it when it traces a graph."""
    install()
    with switch.scoped(enabled):
        yield


def _applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
             is_causal: bool) -> bool:
    static = all(isinstance(size, int) for size in (*query.shape, *key.shape))
    return (switch.enabled() and attn_mask is None and dropout_p == 0.0 and static
            and unsupported(query, key, value, is_causal) is None)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, *,
          enable_gqa: bool = False) -> torch.Tensor:
    if _applies(query, key, value, attn_mask, dropout_p, is_causal):
        return flash_attention(query, key, value, causal=is_causal, scale=scale)
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def install() -> None:
    """Route SDPA on pjrt tensors through the switch (once; a no-op while the switch is off)."""
    if not _installed:
        library = torch.library.Library("aten", "IMPL")
        library.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
        _installed.append(library)
