"""Bounded dynamism in torch.compile graphs: a graph whose dynamic sizes have an upper bound runs
padded to a bucket.

A size marked dynamic with a maximum (`mark_dynamic(t, dim, min=, max=)`) reaches the backend
as a symbol with a finite range. Each call then runs the program compiled for the bucket the
true size falls in, so compiles stay bounded by the bucket count. The op rules inside the program
are ops/padding.py's. At the program boundary a tensor of symbolic shape is its true elements in
row-major order at the front of a flat buffer of the padded element count, so a returned tensor is
an ordinary view of a larger storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from torch_pjrt import _torch_private
from torch_pjrt.ops.padding import (  # noqa: F401 (the backend reaches the rules through this module)
    CannotPad,
    PaddedInterpreter,
    Sizes,
    bucket,
    concrete,
    concrete_expr,
    expand,
    is_symbolic,
)


def bounds(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int] | None:
    """Upper bound of each size symbol of the graph's inputs (in a fixed order), or None when one is
    unbounded."""
    symbols: dict[sympy.Symbol, int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        for size in symbolic_sizes(value):
            for symbol in size.node.expr.free_symbols:
                upper = _torch_private.symbol_upper_bound(size, symbol)
                if upper is None:
                    return None
                symbols[symbol] = upper
    return dict(sorted(symbols.items(), key=lambda item: str(item[0]))) or None


def symbolic_sizes(value: Any) -> list[torch.SymInt]:
    if isinstance(value, torch.SymInt):
        return [value]
    if isinstance(value, torch.Tensor):
        return [s for s in (*value.shape, *value.stride()) if isinstance(s, torch.SymInt)]
    return []

def true_sizes(gm: torch.fx.GraphModule, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """The value in this call of each size symbol that an input carries bare (a size, or a dim)."""
    found: dict[sympy.Symbol, int] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, arg in zip(placeholders, args):
        meta = node.meta.get("val")
        pairs = [(meta, arg)] if isinstance(meta, torch.SymInt) else []
        if isinstance(meta, torch.Tensor) and isinstance(arg, torch.Tensor):
            pairs = list(zip(meta.shape, arg.shape))
        for size, actual in pairs:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                found[size.node.expr] = int(actual)
    return found

