"""The lowering table, one module per op family; importing this package fills it."""

from torch_pjrt.ops import core  # noqa: F401
from torch_pjrt.ops.registry import LOWERINGS, lookup, register

__all__ = ["LOWERINGS", "lookup", "register"]
