"""The two ops behind torch.amp.GradScaler: unscale with an inf/NaN check, and the scale update."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt.ops.registry import register

aten = torch.ops.aten


@register(aten._amp_foreach_non_finite_check_and_unscale.default)
def _amp_foreach_non_finite_check_and_unscale(self: list[Any], found_inf: Any, inv_scale: Any) -> Any:
    """Every gradient is multiplied by inv_scale; found_inf becomes 1 if any holds an inf or NaN."""
    found = found_inf
    unscaled = []
    for grad in self:
        found = jnp.where(jnp.all(jnp.isfinite(grad)), found, jnp.ones_like(found))
        unscaled.append((grad.astype(jnp.float32) * inv_scale).astype(grad.dtype))
    return unscaled, found


@register(aten._amp_update_scale.default)
def _amp_update_scale(
    self: Any, growth_tracker: Any, found_inf: Any, scale_growth_factor: float, scale_backoff_factor: float,
    growth_interval: int,
) -> Any:
    """Back off after an overflow; grow after growth_interval clean steps in a row."""
    overflow = found_inf.reshape(()) > 0
    successful = growth_tracker + 1
    grow = successful >= growth_interval
    grown = jnp.where(jnp.isfinite(self * scale_growth_factor), self * scale_growth_factor, self)
    scale = jnp.where(overflow, self * scale_backoff_factor, jnp.where(grow, grown, self))
    tracker = jnp.where(overflow | grow, jnp.zeros_like(growth_tracker), successful)
    return scale, tracker
