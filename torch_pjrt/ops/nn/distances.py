"""Pairwise and cross distances."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt.ops import reductions
from torch_pjrt.ops.nn.common import _up
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


def _pairs(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs i < j in pdist's order (row-major upper triangle)."""
    return np.triu_indices(rows, 1)


def _p_norm(diff: Any, p: float) -> Any:
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(diff.dtype)
    if p == math.inf:
        return reductions.extreme(functools.partial(jnp.max, initial=0), jnp.abs(diff), -1)
    if p == 1:
        return jnp.sum(jnp.abs(diff), axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(jnp.abs(diff) ** p, axis=-1) ** (1 / p)


@register(aten._pdist_forward.default, static_scalars=True)
def _pdist_forward(self: Any, p: float = 2) -> Any:
    """The p-norm distance of every pair of rows i < j (F.pdist)."""
    first, second = _pairs(self.shape[0])
    x = _up(self)
    return _p_norm(x[first] - x[second], p)


@register(aten._pdist_backward.default, static_scalars=True)
def _pdist_backward(grad: Any, self: Any, p: float, pdist: Any) -> Any:
    """PyTorch's per-p formulas: a zero distance (and, for p < 1, a zero difference) passes no gradient; for
    p = inf every coordinate that attains the maximum gets the whole gradient."""
    first, second = _pairs(self.shape[0])
    x = _up(self)
    diff = x[first] - x[second]
    g, dist = _up(grad)[:, None], _up(pdist)[:, None]
    if p == 0:
        pair_grad = jnp.zeros_like(diff)
    elif p == 1:
        pair_grad = g * jnp.sign(diff)
    elif p == math.inf:
        pair_grad = g * jnp.sign(diff) * (jnp.abs(diff) == dist)
    else:
        safe = jnp.where(dist == 0, 1, dist)
        if p == 2:
            pair_grad = g * diff / safe
        elif p < 1:
            safe_diff = jnp.where(diff == 0, 1, jnp.abs(diff))
            pair_grad = jnp.where(diff == 0, 0, g * jnp.sign(diff) * safe_diff ** (p - 1) / safe ** (p - 1))
        else:
            pair_grad = g * diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1)
        pair_grad = jnp.where(dist == 0, 0, pair_grad)
    return jnp.zeros_like(x).at[first].add(pair_grad).at[second].add(-pair_grad)


