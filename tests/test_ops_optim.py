"""The fused optimizer steps (Adam/AdamW/SGD/Adagrad with fused=True) on pjrt against the same on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_pjrt

SHAPES = [(4, 3), (7,), (2, 3, 2), ()]
MODES = ["strict", "fuse", "compile"]
EAGER = {"strict": "defer_never", "fuse": "defer_and_fuse", "compile": "defer_never"}

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
    "adamw amsgrad maximize": lambda p: torch.optim.AdamW(p, lr=0.05, betas=(0.8, 0.95), eps=1e-6,
                                                          weight_decay=0.1, amsgrad=True, maximize=True, fused=True),
    "adam weight decay": lambda p: torch.optim.Adam(p, lr=0.02, weight_decay=0.3, fused=True),
    "adam amsgrad": lambda p: torch.optim.Adam(p, lr=0.02, amsgrad=True, fused=True),
    "adamw tensor lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.03), weight_decay=0.05, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "sgd momentum dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01,
                                                        fused=True),
    "sgd nesterov maximize": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True, maximize=True,
                                                       fused=True),
    "sgd tensor lr": lambda p: torch.optim.SGD(p, lr=torch.tensor(0.05), momentum=0.5, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.02, fused=True),
    "adagrad tensor lr maximize": lambda p: torch.optim.Adagrad(p, lr=torch.tensor(0.1), maximize=True, fused=True),
}


def random_lists(count: int) -> list[list[torch.Tensor]]:
    return [[torch.randn(shape) for shape in SHAPES] for _ in range(count)]


def train(device: str, mode: str, make: Callable, start: list[torch.Tensor], grads: list[list[torch.Tensor]],
          schedule: Callable[[int], float] | None = None) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Steps of the optimizer on copies of `start` with the given gradients; the parameters and state, on CPU."""
    params = [p.clone().to(device).requires_grad_() for p in start]
    optimizer = make(params)

    def step() -> None:
        optimizer.step()

    if mode == "compile" and device == "pjrt":
        # Dynamo caches frames by code object: the optimizers' step frames compiled by earlier cases count against
        # their recompile limit, past which they would run eagerly (here and in later test files of this process).
        torch._dynamo.reset()
        step = torch.compile(step, backend="pjrt")
    with torch.pjrt.set_eager_mode(EAGER[mode] if device == "pjrt" else torch.pjrt.eager_mode):
        for index, step_grads in enumerate(grads):
            if schedule is not None:
                for group in optimizer.param_groups:
                    group["lr"] = schedule(index)
            for param, grad in zip(params, step_grads):
                param.grad = grad.to(device)
            step()
            if device == "pjrt":
                torch.pjrt.synchronize()  # one step per fused program, the same program each step
    state = [{name: value.cpu() if isinstance(value, torch.Tensor) else value
              for name, value in optimizer.state[p].items()} for p in params]
    return [p.detach().cpu() for p in params], state


def assert_same(expected: tuple, found: tuple) -> None:
    (expected_params, expected_state), (found_params, found_state) = expected, found
    for want, got in zip(expected_params, found_params):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for want, got in zip(expected_state, found_state):
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_optimizer_steps_match_cpu(name: str, mode: str) -> None:
    start, grads = random_lists(1)[0], random_lists(4)
    make = OPTIMIZERS[name]
    assert_same(train("cpu", mode, make, start, grads), train("pjrt", mode, make, start, grads))


@pytest.mark.parametrize("name", ["adamw amsgrad maximize", "adam weight decay"])
def test_bfloat16_steps_compute_in_float32_like_cpu(name: str) -> None:
    start = [p.bfloat16() for p in random_lists(1)[0]]
    grads = [[g.bfloat16() for g in step] for step in random_lists(3)]
    expected, found = (train(device, "strict", OPTIMIZERS[name], start, grads) for device in ("cpu", "pjrt"))
    assert_same(expected, found)


@pytest.mark.parametrize("mode", ["strict", "fuse"])
def test_a_scheduled_lr_compiles_no_program_per_value(mode: str) -> None:
    """The lr is traced, not baked in: a scheduler changing it every step reuses the step's program."""
    start, grads = random_lists(1)[0], random_lists(6)
    make = OPTIMIZERS["adamw amsgrad maximize"]
    schedule = lambda index: 0.05 / (index + 1)  # noqa: E731
    train("pjrt", mode, make, start, grads[:2], schedule)  # the programs a step needs, compiled
    before = torch_pjrt.metrics.counters()["compiles"]
    found = train("pjrt", mode, make, start, grads, schedule)
    assert torch_pjrt.metrics.counters()["compiles"] == before
    assert_same(train("cpu", mode, make, start, grads, schedule), found)


FUSED_OPS = [torch._fused_adam_, torch._fused_adamw_]


def adam_lists(amsgrad: bool) -> list[list[torch.Tensor]]:
    params, grads = random_lists(1)[0], random_lists(1)[0]
    exp_avgs = [torch.randn(s) for s in SHAPES]
    exp_avg_sqs = [torch.rand(s) for s in SHAPES]
    max_exp_avg_sqs = [torch.rand(s) + 0.5 for s in SHAPES] if amsgrad else []
    steps = [torch.tensor(3.0) for _ in SHAPES]
    return [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps]


@pytest.mark.parametrize("mode", ["strict", "fuse"])
@pytest.mark.parametrize("found_inf", [None, 0.0, 1.0])
@pytest.mark.parametrize("op", FUSED_OPS, ids=["adam", "adamw"])
def test_grad_scale_unscales_and_found_inf_skips_adam(op: Callable, found_inf: float | None, mode: str) -> None:
    """The gradients are divided by grad_scale and written back; found_inf 1 leaves every list as it was."""
    lists = adam_lists(amsgrad=True)
    options = dict(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=True, maximize=False,
                   grad_scale=torch.tensor(64.0))
    results = {}
    for device in ("cpu", "pjrt"):
        moved = [[t.clone().to(device) for t in column] for column in lists]
        extra = {} if found_inf is None else {"found_inf": torch.tensor(found_inf, device=device)}
        with torch.pjrt.set_eager_mode(EAGER[mode]):
            op(*moved, **{**options, "grad_scale": options["grad_scale"].to(device)}, **extra)
            results[device] = [[t.cpu() for t in column] for column in moved]
    for want, got in zip(results["cpu"], results["pjrt"]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    if found_inf == 1.0:
        torch.testing.assert_close(results["pjrt"], lists, atol=0, rtol=0)
    else:
        torch.testing.assert_close(results["pjrt"][1], [g / 64 for g in lists[1]])


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grad_scale_and_found_inf_sgd(found_inf: float) -> None:
    params, grads, buffers = random_lists(3)
    options = dict(weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=True, maximize=False,
                   is_first_step=False)
    results = {}
    for device in ("cpu", "pjrt"):
        moved = [[t.clone().to(device) for t in column] for column in (params, grads, buffers)]
        torch._fused_sgd_(*moved, **options, grad_scale=torch.tensor(8.0, device=device),
                          found_inf=torch.tensor(found_inf, device=device))
        results[device] = [[t.cpu() for t in column] for column in moved]
    torch.testing.assert_close(results["pjrt"], results["cpu"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["strict", "fuse"])
def test_grad_scaler_steps_and_skips_like_cpu(mode: str) -> None:
    """torch.amp.GradScaler with a fused AdamW: scaled gradients are unscaled by the fused op, and the step
    whose gradient holds an inf is skipped (parameters, state and step count kept) and the scale backs off."""
    start, grads = random_lists(1)[0], random_lists(4)
    grads[2][1][3] = float("inf")
    results = {}
    for device in ("cpu", "pjrt"):
        params = [p.clone().to(device).requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=2)
        with torch.pjrt.set_eager_mode(EAGER[mode] if device == "pjrt" else torch.pjrt.eager_mode):
            for step_grads in grads:
                loss = sum((p * g.to(device)).sum() for p, g in zip(params, step_grads))
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        state = [{k: v.cpu() for k, v in optimizer.state[p].items()} for p in params]
        results[device] = ([p.detach().cpu() for p in params], state, scaler.get_scale())
    assert results["pjrt"][2] == results["cpu"][2]
    assert_same(results["cpu"][:2], results["pjrt"][:2])
    assert results["pjrt"][1][0]["step"].item() == 3  # four steps, one skipped
