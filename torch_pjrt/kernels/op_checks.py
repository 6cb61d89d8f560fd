"""`opcheck` for ops called with pjrt tensors: torch.library.opcheck, with its autograd registration
check done for PrivateUse1 (torch's own takes CPU, CUDA and XPU tensors only and raises otherwise)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from torch_pjrt import _torch_private

AUTOGRAD_REGISTRATION = "test_autograd_registration"
DEFAULT_TEST_UTILS = ("test_schema", AUTOGRAD_REGISTRATION, "test_faketensor", "test_aot_dispatch_dynamic")
# where an autograd formula for a pjrt call may live; a kernel at another key bypasses autograd
AUTOGRAD_KEYS = ("AutogradPrivateUse1", "Autograd", "CompositeImplicitAutograd")


def opcheck(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *,
            test_utils: str | Sequence[str] = DEFAULT_TEST_UTILS, raise_exception: bool = True,
            atol: float | None = None, rtol: float | None = None) -> dict[str, str]:
    """torch.library.opcheck(op, args, kwargs, ...) for pjrt arguments; the same tests, results and errors."""
    wanted = [test_utils] if isinstance(test_utils, str) else list(test_utils)
    rest = [name for name in wanted if name != AUTOGRAD_REGISTRATION]
    results = torch.library.opcheck(op, args, kwargs, test_utils=rest, raise_exception=raise_exception,
                                    atol=atol, rtol=rtol) if rest else {}
    if AUTOGRAD_REGISTRATION in wanted:
        try:
            check_autograd_registration(op, args, kwargs or {})
            results[AUTOGRAD_REGISTRATION] = "SUCCESS"
        except Exception as error:
            if raise_exception:
                raise
            results[AUTOGRAD_REGISTRATION] = error
    return {name: results[name] for name in wanted}


def check_autograd_registration(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An op whose outputs can require grad must have its autograd formula at an autograd key.

    An op with a kernel at one of AUTOGRAD_KEYS passes; otherwise it runs with PyTorch's autograd
    fallback off, and an output (not an input) that still requires grad means the formula sits at a
    backend key, where autograd silently misses it.
    """
    overload = getattr(op, "_opoverload", op)
    if isinstance(overload, torch._ops.OpOverloadPacket):
        overload = overload.default
    tensors = [leaf for leaf in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(leaf, torch.Tensor)]
    if not any(tensor.requires_grad for tensor in tensors):
        raise RuntimeError(f"{overload.name()}: the autograd registration check needs an input that requires grad; "
                           f"pass one with requires_grad=True.")
    if any(_torch_private.has_kernel(overload.name(), key) for key in AUTOGRAD_KEYS):
        return
    inputs = {id(tensor) for tensor in tensors}
    with _torch_private.autograd_fallback_mode("nothing"):
        outputs = overload(*args, **kwargs)
    if pytree.tree_any_only(torch.Tensor, lambda t: t.requires_grad and id(t) not in inputs, outputs):
        raise AssertionError(f"{overload.name()}: an output requires grad but the op has no kernel at an autograd "
                             f"key ({', '.join(AUTOGRAD_KEYS)}); register its backward with register_autograd "
                             f"(or jax_op(..., vjp='auto')), not as a PrivateUse1 kernel.")
