"""What happens to an op with no pjrt kernel: a clear error, or (opted in) CPU execution."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_pjrt import envvars
from torch_pjrt.runtime import metrics, startup

_switch = envvars.Switch("TORCH_PJRT_CPU_FALLBACK")
_warned: set[str] = set()


def cpu_fallback_enabled() -> bool:
    return _switch.enabled()


@contextlib.contextmanager
def cpu_fallback(enabled: bool = True) -> Iterator[None]:
    """Within this block, ops with no pjrt lowering run on CPU (counted, warned once per op)."""
    with _switch.scoped(enabled):
        yield


def missing_message(op: torch._ops.OpOverload, compiled: bool = False) -> str:
    """What a user reads for an op with no lowering; in a torch.compile graph the CPU fallback does not apply
    (the whole graph is one program), so the remedy names running that code eagerly."""
    name = f"{op._schema.name}.{op._overloadname or 'default'}"
    if compiled:
        return (
            f"torch_pjrt has no lowering for {name} on pjrt tensors, inside a torch.compile graph; run that code "
            "outside torch.compile, where TORCH_PJRT_CPU_FALLBACK=1 or `with torch_pjrt.cpu_fallback():` runs "
            "the op on CPU, and please report the op."
        )
    return (
        f"torch_pjrt has no lowering for {name} on pjrt tensors; set TORCH_PJRT_CPU_FALLBACK=1 or wrap the "
        "code in `with torch_pjrt.cpu_fallback():` to run it on CPU, and please report the op."
    )


def catch_all(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    if not startup.started():
        startup.ensure_started()
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "PrivateUse1"):
            return op(*args, **kwargs)
    if not cpu_fallback_enabled():
        raise NotImplementedError(missing_message(op))
    return run_on_cpu(op, args, kwargs)


def run_on_cpu(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Copy pjrt arguments to CPU, run the op there, copy mutations and results back."""
    name = str(op)
    metrics.bump("cpu_fallbacks")
    metrics.fallback_ops[name] += 1
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"torch_pjrt: {name} has no pjrt lowering and runs on CPU (copies both ways).", stacklevel=3)
    leaves = pytree.tree_leaves((args, kwargs))
    devices = [v.device if isinstance(v, torch.Tensor) else v for v in leaves
               if isinstance(v, (torch.Tensor, torch.device))]
    device = next((d for d in devices if d.type == "pjrt"), None)

    def to_cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "pjrt":
            return value.cpu()
        if isinstance(value, torch.device) and value.type == "pjrt":
            return torch.device("cpu")
        return value

    cpu_args, cpu_kwargs = pytree.tree_map(to_cpu, (args, kwargs))
    result = op(*cpu_args, **cpu_kwargs)
    originals = pytree.tree_leaves((args, kwargs))
    copies = pytree.tree_leaves((cpu_args, cpu_kwargs))
    schema_args = op._schema.arguments
    mutated = {a.name for a in schema_args if a.alias_info is not None and a.alias_info.is_write}
    if mutated:
        for original, copy in zip(originals, copies):
            if isinstance(original, torch.Tensor) and original.device.type == "pjrt" and copy is not original:
                if _is_mutated(original, args, kwargs, schema_args, mutated):
                    original.copy_(copy)
    by_identity = {id(c): o for o, c in zip(originals, copies) if isinstance(c, torch.Tensor)}

    def back(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in by_identity:
                return by_identity[id(value)]
            return value.to(device) if device is not None else value
        return value

    return pytree.tree_map(back, result)


def _is_mutated(tensor: torch.Tensor, args: tuple, kwargs: dict, schema_args: Any, mutated: set[str]) -> bool:
    for i, argument in enumerate(schema_args):
        if argument.name not in mutated:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(v is tensor for v in values):
            return True
    return False
