"""Moving a module to or from pjrt keeps its Parameter objects and their ties, as a move to CUDA does.

PyTorch's `Module._apply` (behind `.to()`) assigns `param.data` only between its built-in dense
backends; for any other device it makes a new Parameter in each module. Weights tied across modules
(an embedding and the output layer) then come back as separate tensors that train apart, silently,
and an optimizer built before the move steps tensors the model no longer holds. After the move,
each original Parameter takes its new contents (`torch.utils.swap_tensors`) and every module that
held it holds it again; a tensor that cannot be swapped (one with weak references) is tied anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_pjrt import _torch_private

_moving = threading.local()

Slot = tuple[torch.nn.Module, str, str]  # (module, "_parameters" or "_buffers", name)


def _held(module: torch.nn.Module) -> dict[int, tuple[torch.Tensor, list[Slot]]]:
    """Every parameter and buffer of the module tree, with every place that holds it."""
    found: dict[int, tuple[torch.Tensor, list[Slot]]] = {}
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is not None:
                    found.setdefault(id(tensor), (tensor, []))[1].append((owner, kind, name))
    return found


def _restore(held: dict[int, tuple[torch.Tensor, list[Slot]]]) -> None:
    for old, slots in held.values():
        new = [getattr(owner, kind).get(name) for owner, kind, name in slots]
        if all(t is old for t in new) or not any(isinstance(t, torch.Tensor) and t.device.type == "pjrt"
                                                 for t in [old, *new]):
            continue  # PyTorch kept them (its own backends), or the move did not involve pjrt
        kept = new[0]
        if isinstance(old, torch.nn.Parameter) and type(kept) is type(old):
            try:
                torch.utils.swap_tensors(old, kept)
                kept = old
            except RuntimeError:
                pass
        for owner, kind, name in slots:
            getattr(owner, kind)[name] = kept


def _keeping_identities(original: Callable[..., Any]) -> Callable[..., Any]:
    def _apply(self: torch.nn.Module, fn: Callable[..., Any], recurse: bool = True) -> Any:
        if getattr(_moving, "active", False):
            return original(self, fn, recurse)
        held = _held(self)
        _moving.active = True
        try:
            result = original(self, fn, recurse)
        finally:
            _moving.active = False
        _restore(held)
        return result

    return _apply


def install() -> None:
    _torch_private.wrap_module_apply(_keeping_identities)
