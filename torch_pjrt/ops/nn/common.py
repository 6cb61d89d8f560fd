"""Helpers the neural-network families share: compute dtypes, vjp-derived backwards, loss reduction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

aten = torch.ops.aten

MEAN, SUM = 1, 2


# --- shared helpers ------------------------------------------------------------------------------


def _compute_dtype(x: Any) -> Any:
    """Half types compute in float32, as PyTorch's CPU kernels do."""
    return jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype


def _up(x: Any) -> Any:
    return x.astype(_compute_dtype(x))


def _vjp(fn: Callable, grad: Any, *primals: Any) -> tuple:
    """Gradients of fn at primals for the cotangent grad (cast to fn's output dtype)."""
    out, pullback = jax.vjp(fn, *primals)
    return pullback(jnp.broadcast_to(grad, out.shape).astype(out.dtype))


def _reduce(loss: Any, reduction: int) -> Any:
    if reduction == MEAN:
        return jnp.mean(loss)
    if reduction == SUM:
        return jnp.sum(loss)
    return loss


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against (N, C, ...) input."""
    return (1, -1) + (1,) * (x.ndim - 2)


def _masked(values: Sequence[Any], output_mask: Sequence[bool], out_meta: Sequence[Any] | None) -> tuple:
    """Outputs the caller expects: PyTorch's meta kernel decides (some ignore output_mask), else the mask."""
    wanted = output_mask if out_meta is None else [m is not None for m in out_meta]
    return tuple(v if w else None for v, w in zip(values, wanted))


def _transpose_of(forward: Callable, grad_output: Any, input_size: Sequence[int]) -> Any:
    """Backward of a linear resampling: the vjp of its forward, for an input of input_size."""
    return _vjp(forward, grad_output, jnp.zeros(tuple(input_size), _compute_dtype(grad_output)))[0]
