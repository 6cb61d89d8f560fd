"""Dropout and scaled dot-product attention."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt import storage
from torch_pjrt.ops.nn.common import _up
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


@register(aten.native_dropout.default, random=True)
def native_dropout(input: Any, p: float, train: bool | None, *, rng: Any) -> tuple:
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(rng, 1.0 - p, input.shape)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return jnp.where(keep, _up(input) * scale, 0), keep


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output: Any, mask: Any, scale: float) -> Any:
    return jnp.where(mask, _up(grad_output) * scale, 0)


@register(aten._safe_softmax.default)
def _safe_softmax(self: Any, dim: int, dtype: Any = None) -> Any:
    """Softmax whose fully masked rows (all -inf, as attention masks make) are zeros, not NaN."""
    x = _up(self if dtype is None else self.astype(storage.numpy_dtype(dtype)))
    out = jax.nn.softmax(x, axis=dim)
    return jnp.where(jnp.all(x == -jnp.inf, axis=dim, keepdims=True), 0, out)
