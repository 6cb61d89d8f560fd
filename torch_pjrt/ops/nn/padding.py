"""Constant, reflection and replication padding, and their backward ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt.ops.nn.common import _up, _vjp
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


def _pad_widths(ndim: int, pad: Sequence[int]) -> list[tuple[int, int]]:
    """PyTorch's pad list (last dim first, (before, after) pairs) as per-dim widths."""
    pairs = [(int(pad[i]), int(pad[i + 1])) for i in range(0, len(pad), 2)]
    return [(0, 0)] * (ndim - len(pairs)) + pairs[::-1]


@register(aten.constant_pad_nd.default)
def constant_pad_nd(self: Any, pad: Sequence[int], value: Any = 0) -> Any:
    """Negative widths crop, as in PyTorch."""
    widths = _pad_widths(self.ndim, pad)
    return jax.lax.pad(self, jnp.asarray(value, self.dtype), [(lo, hi, 0) for lo, hi in widths])


def _mode_pad(self: Any, padding: Sequence[int], mode: str) -> Any:
    widths = _pad_widths(self.ndim, padding)
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        cropped = jax.lax.pad(self, jnp.zeros((), self.dtype),
                              [(min(lo, 0), min(hi, 0), 0) for lo, hi in widths])
        return jnp.pad(cropped, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode=mode)
    return jnp.pad(self, widths, mode=mode)


@register(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(self: Any, padding: Sequence[int]) -> Any:
    return _mode_pad(self, padding, "reflect")


@register(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(self: Any, padding: Sequence[int]) -> Any:
    """Output j reads input clamp(j - before, 0, size - 1), as PyTorch's kernel: a negative width crops first,
    and a dim cropped away entirely still repeats the input's edge (not an empty axis)."""
    for axis, (lo, hi) in enumerate(_pad_widths(self.ndim, padding)):
        if lo or hi:
            size = self.shape[axis]
            self = jnp.take(self, np.clip(np.arange(size + lo + hi) - lo, 0, size - 1), axis=axis)
    return self


@register(aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
          aten.reflection_pad3d_backward.default)
def reflection_pad_backward(grad_output: Any, self: Any, padding: Sequence[int]) -> Any:
    return _vjp(lambda x: reflection_pad(x, padding), grad_output, _up(self))[0]


@register(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
          aten.replication_pad3d_backward.default)
def replication_pad_backward(grad_output: Any, self: Any, padding: Sequence[int]) -> Any:
    return _vjp(lambda x: replication_pad(x, padding), grad_output, _up(self))[0]


