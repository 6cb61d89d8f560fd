"""The two ops behind torch.amp.GradScaler: unscale with an inf/NaN check, and the scale update."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt.ops.registry import register

aten = torch.ops.aten


@register(aten._amp_foreach_non_finite_check_and_unscale.default)
def _amp_foreach_non_finite_check_and_unscale(self: list[Any], found_inf: Any, inv_scale: Any) -> Any:
    """Every gradient is multiplied by inv_scale; found_inf becomes 1 if any holds an inf or NaN.

    The product is taken in the gradient's opmath type, as CPU and CUDA do: float32 for the half
    types, float64 for float64 gradients (a float32 detour would round them).
    """
    found = found_inf
    unscaled = []
    for grad in self:
        found = jnp.where(jnp.all(jnp.isfinite(grad)), found, jnp.ones_like(found))
        opmath = jnp.promote_types(grad.dtype, jnp.float32)
        product = grad.astype(opmath) * inv_scale.reshape(()).astype(opmath)
        unscaled.append(product.astype(grad.dtype))
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
