"""_foreach_* lowerings and the torch.optim foreach paths against PyTorch on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import check


def tensors(low: float = -2.0, high: float = 2.0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shapes = [(3, 4), (5,), (2, 2, 2), ()]
    return [(torch.rand(s, dtype=torch.float64) * (high - low) + low).to(dtype) for s in shapes]


def in_place(op: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Apply a _foreach_*_ op to clones of the first list and return them."""

    def run(first: list[torch.Tensor], *rest: Any) -> list[torch.Tensor]:
        targets = [t.clone() for t in first]
        op(targets, *rest, *args, **kwargs)
        return targets

    return run


UNARY = ["abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
         "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
         "sin", "sinh", "sqrt", "tan", "tanh", "trunc"]


@pytest.mark.parametrize("name", UNARY)
def test_unary(name: str) -> None:
    xs = tensors(0.1, 0.9)
    check(getattr(torch, f"_foreach_{name}"), xs, atol=1e-5, rtol=1e-5)
    check(in_place(getattr(torch, f"_foreach_{name}_")), xs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max",
                                  "pow"])
def test_binary_variants(name: str) -> None:
    fn, fn_ = getattr(torch, f"_foreach_{name}"), getattr(torch, f"_foreach_{name}_")
    xs, ys = tensors(0.5, 2), tensors(0.5, 2)
    check(fn, xs, ys)
    check(lambda a: fn(a, 1.5), xs)
    check(lambda a: fn(a, [0.5, 1.0, 1.5, 2.0]), xs)
    check(in_place(fn_, 0.75), xs)
    check(in_place(fn_), xs, ys)


def test_tensor_and_alpha_variants() -> None:
    xs, ys = tensors(), tensors()
    check(lambda a, b: torch._foreach_add(a, b, alpha=-0.5), xs, ys)
    check(lambda a, b: torch._foreach_sub(a, b, alpha=2), xs, ys)
    check(lambda a, s: torch._foreach_add(a, s, alpha=3), xs, torch.tensor(0.25))
    check(lambda a, s: torch._foreach_mul(a, s), xs, torch.tensor(1.5))
    check(lambda a, s: torch._foreach_div(a, s), xs, torch.tensor(4.0))
    check(in_place(torch._foreach_add_, alpha=0.1), xs, ys)
    check(lambda a: torch._foreach_pow(2.0, a), xs)


def test_addcmul_addcdiv_lerp() -> None:
    xs, ys, zs = tensors(), tensors(), tensors(0.5, 2)
    for fn in (torch._foreach_addcmul, torch._foreach_addcdiv):
        check(lambda a, b, c, f=fn: f(a, b, c), xs, ys, zs)
        check(lambda a, b, c, f=fn: f(a, b, c, 0.3), xs, ys, zs)
        check(lambda a, b, c, f=fn: f(a, b, c, [0.1, 0.2, 0.3, 0.4]), xs, ys, zs)
    check(in_place(torch._foreach_addcdiv_, value=-0.5), xs, ys, zs)
    check(lambda a, b: torch._foreach_lerp(a, b, 0.3), xs, ys)
    check(lambda a, b, w: torch._foreach_lerp(a, b, w), xs, ys, tensors(0, 1))
    check(lambda a, b: torch._foreach_lerp(a, b, [0.1, 0.6, 0.9, 0.2]), xs, ys)
    check(in_place(torch._foreach_lerp_, weight=0.9), xs, ys)


@pytest.mark.xfail(reason="core: a 1-D CPU `scalars` tensor is refused by dispatch (CPU_TENSORS_ALLOWED)",
                   raises=RuntimeError, strict=False)
def test_addcdiv_tensor_scalars() -> None:
    xs, ys, zs = tensors(), tensors(), tensors(0.5, 2)
    scalars = torch.tensor([0.1, -0.2, 0.3, 0.4])
    for fn in (torch._foreach_addcmul, torch._foreach_addcdiv):
        expected = fn(xs, ys, zs, scalars)
        actual = fn([x.to("pjrt") for x in xs], [y.to("pjrt") for y in ys], [z.to("pjrt") for z in zs], scalars)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.cpu(), e)


def test_reductions_and_copies() -> None:
    xs, ys = tensors(), tensors()
    check(torch._foreach_norm, xs, atol=1e-5, rtol=1e-5)
    check(lambda a: torch._foreach_norm(a, 1), xs, atol=1e-5, rtol=1e-5)
    check(lambda a: torch._foreach_norm(a, float("inf")), xs)
    check(lambda a: torch._foreach_norm(a, 2, dtype=torch.float64), xs)
    check(torch._foreach_max, xs)
    check(in_place(torch._foreach_zero_), xs)
    check(in_place(torch._foreach_copy_), xs, ys)
    check(in_place(torch._foreach_copy_), xs, [y.double() for y in ys])


def test_other_dtypes() -> None:
    xs, ys = tensors(dtype=torch.bfloat16), tensors(dtype=torch.bfloat16)
    check(lambda a, b: torch._foreach_addcmul(a, a, b, 0.5), xs, ys, atol=2e-2, rtol=2e-2)
    check(torch._foreach_norm, xs, atol=2e-2, rtol=2e-2)
    ints = [torch.randint(-5, 6, (3, 4)), torch.randint(-5, 6, (5,))]
    check(lambda a: (torch._foreach_add(a, 2), torch._foreach_mul(a, a), torch._foreach_abs(a)), ints)


def test_non_contiguous() -> None:
    base = torch.randn(6, 8)
    check(lambda b: torch._foreach_mul([b.t(), b[::2, 1::3]], 2.0), base)
    check(lambda b: in_place(torch._foreach_add_, 1.0)([b.t(), b[1:3]]), base)


def _train(device: str, optimizer: type[torch.optim.Optimizer], **options: Any) -> list[torch.Tensor]:
    """Three steps from a fixed init with fixed gradients; the final parameters on CPU."""
    init = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=init).to(device).requires_grad_() for s in [(4, 3), (5,), (2, 3, 2)]]
    opt = optimizer(params, foreach=True, **options)
    grads = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads).to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize("optimizer,options", [
    (torch.optim.Adam, dict(lr=0.1)),
    (torch.optim.Adam, dict(lr=0.05, amsgrad=True, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
], ids=["adam", "adam-amsgrad", "adamw", "sgd-momentum", "sgd-nesterov"])
def test_optimizers_foreach(optimizer: type[torch.optim.Optimizer], options: dict) -> None:
    expected = _train("cpu", optimizer, **options)
    actual = _train("pjrt", optimizer, **options)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_optimizer_runs_foreach_ops() -> None:
    from torch_pjrt.runtime import metrics

    metrics.reset()
    _train("pjrt", torch.optim.Adam, lr=0.1)
    names = {str(op) for op in metrics.op_counts}
    assert any(name.startswith("aten._foreach_") for name in names), names
