"""torch's symbolic sizes as jax symbolic dimensions, and jax's result dimensions back as torch SymInts.

A jax_op's fake kernel traces the function with `jax.eval_shape`. Under `torch.compile` with dynamic
shapes its inputs' sizes are SymInts; each distinct one becomes a jax symbolic dimension (jax.export's
shape polymorphism), the function is traced once for all sizes, and every result dimension jax derives
(a polynomial with floordiv, mod, max and min) is rebuilt from those SymInts with torch's own arithmetic,
so Dynamo and AOTAutograd see the same relations jax computed. jax prints a dimension in its documented
expression syntax; that text is read here with `ast`, never evaluated as code.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

import torch

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "floordiv": operator.floordiv, "mod": operator.mod, "max": torch.sym_max, "min": torch.sym_min,
    "non_negative": lambda size: torch.sym_max(size, 0),
}


class SymbolicSizes:
    """One trace's mapping: each distinct torch SymInt (by its expression) is one jax symbol; with
    `specialize`, each is its current value instead (guarded, so a new value traces again)."""

    def __init__(self, jax: Any, specialize: bool = False) -> None:
        self.jax = jax
        self.specialize = specialize
        self.scope = jax.export.SymbolicScope()
        self.names: dict[str, str] = {}
        self.sizes: dict[str, torch.SymInt] = {}

    def shape(self, sizes: tuple[Any, ...]) -> tuple[Any, ...]:
        """A jax shape for torch sizes: ints stay ints, SymInts become this trace's symbols."""
        if self.specialize or all(isinstance(size, int) for size in sizes):
            return tuple(int(size) for size in sizes)  # int() of a SymInt guards it to this value
        text = ", ".join(str(size) if isinstance(size, int) else self._name(size) for size in sizes)
        return tuple(self.jax.export.symbolic_shape(text, scope=self.scope))

    def _name(self, size: torch.SymInt) -> str:
        key = str(size)
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"size{len(self.names)}"
            self.sizes[name] = size
        return name

    def torch_size(self, dim: Any) -> Any:
        """A result dimension as an int or a SymInt built from the inputs' SymInts."""
        if isinstance(dim, int):
            return dim
        return self._evaluate(ast.parse(str(dim), mode="eval").body, str(dim))

    def _evaluate(self, node: ast.AST, text: str) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.sizes:
            return self.sizes[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._evaluate(node.operand, text)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](self._evaluate(node.left, text), self._evaluate(node.right, text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            return _FUNCTIONS[node.func.id](*(self._evaluate(arg, text) for arg in node.args))
        raise NotImplementedError(f"torch_pjrt.kernels: jax gave a result dimension {text!r} that has no torch "
                                  f"equivalent here; give the op a fake of its own (op.register_fake).")
