"""The _foreach_* family (optimizers' multi-tensor ops), one program per call.

Each foreach op maps the ATen pointwise/reduction lowering over its lists: list
arguments (tensors or scalars) are taken item by item, everything else is shared.
The in-place forms (_foreach_add_, ...) reuse these through their functional twins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt.ops import core, pointwise, reductions
from torch_pjrt.ops.registry import LOWERINGS, register

aten = torch.ops.aten


def map_lists(fn: Callable, *columns: Any, **shared: Any) -> list[Any]:
    """fn applied item by item across the list columns, with non-list columns shared."""
    length = next((len(c) for c in columns if isinstance(c, list)), 0)
    return [fn(*(c[i] if isinstance(c, list) else c for c in columns), **shared) for i in range(length)]


def _mapped(fn: Callable, name: str) -> Callable:
    def lowering(*args: Any, **kwargs: Any) -> list[Any]:
        return map_lists(fn, *args, **kwargs)

    lowering.__name__ = name
    return lowering


# foreach packet -> the ATen overload whose lowering each item goes through
ITEMWISE: dict[Any, Any] = {
    aten._foreach_add: aten.add.Tensor, aten._foreach_sub: aten.sub.Tensor, aten._foreach_mul: aten.mul.Tensor,
    aten._foreach_div: aten.div.Tensor, aten._foreach_pow: aten.pow.Tensor_Tensor,
    aten._foreach_maximum: aten.maximum.default, aten._foreach_minimum: aten.minimum.default,
    aten._foreach_clamp_min: aten.clamp_min.Tensor, aten._foreach_clamp_max: aten.clamp_max.Tensor,
    aten._foreach_lerp: aten.lerp.Tensor, aten._foreach_max: aten.max.default,
}
ITEMWISE.update({
    getattr(aten, f"_foreach_{name}"): getattr(aten, name).default
    for name in (
        "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
        "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
        "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "zero", "clone",
    )
})

for _packet, _aten in ITEMWISE.items():
    register(_packet)(_mapped(LOWERINGS[_aten].fn, _packet.__name__))


def _per_item(values: Any, count: int) -> Any:
    """A 1-D `scalars` tensor holds one value per list item."""
    if isinstance(values, list) or getattr(values, "ndim", 0) != 1:
        return values
    return [values[i] for i in range(count)]


@register(aten._foreach_addcmul.Scalar, aten._foreach_addcmul.ScalarList, aten._foreach_addcmul.Tensor)
def _foreach_addcmul(self: list[Any], tensor1: list[Any], tensor2: list[Any], scalars: Any = 1) -> list[Any]:
    values = _per_item(scalars, len(self))
    return map_lists(lambda x, a, b, v: pointwise.addcmul(x, a, b, value=v), self, tensor1, tensor2, values)


@register(aten._foreach_addcdiv.Scalar, aten._foreach_addcdiv.ScalarList, aten._foreach_addcdiv.Tensor)
def _foreach_addcdiv(self: list[Any], tensor1: list[Any], tensor2: list[Any], scalars: Any = 1) -> list[Any]:
    values = _per_item(scalars, len(self))
    return map_lists(lambda x, a, b, v: pointwise.addcdiv(x, a, b, value=v), self, tensor1, tensor2, values)


@register(aten._foreach_copy.default)
def _foreach_copy(self: list[Any], src: list[Any], non_blocking: bool = False) -> list[Any]:
    return map_lists(core.copy, self, src)


@register(aten._foreach_norm.Scalar, static_scalars=True)
def _foreach_norm(self: list[Any], ord: float = 2, dtype: torch.dtype | None = None) -> list[Any]:  # noqa: A002
    return map_lists(lambda x: reductions.linalg_vector_norm(x, ord, dtype=dtype), self)


@register(aten._foreach_powsum.Scalar, static_scalars=True)
def _foreach_powsum(self: list[Any], ord: float = 2, dtype: torch.dtype | None = None) -> list[Any]:  # noqa: A002
    """Sum of |x|**ord per tensor (a norm without the final root), accumulated like sum."""
    return map_lists(lambda x: jnp.sum(jnp.abs(reductions.accumulate(x, dtype)) ** ord), self)


@register(aten._foreach_mm.default)
def _foreach_mm(self: list[Any], mat2: list[Any]) -> list[Any]:
    return map_lists(jnp.matmul, self, mat2)
