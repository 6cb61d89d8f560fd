"""Training end to end on pjrt against the same training on CPU: autograd, optimizers, AMP."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, loss_fn, train_step  # noqa: E402


def train_both(model: nn.Module, make_optimizer, data: list, loss_fn, ignore=None) -> None:  # noqa: ANN001
    """Train copies of a model on CPU and on pjrt with the same batches; compare every step.

    `ignore(name, tensor)` may drop parts whose exact-arithmetic gradient is zero: Adam turns the
    ~1e-9 rounding noise there into full-size steps of either sign on any device.
    """
    results = {}
    for device in ("cpu", "pjrt"):
        local = copy.deepcopy(model).to(device)
        optimizer = make_optimizer(local.parameters())
        losses = []
        for inputs, targets in data:
            optimizer.zero_grad()
            loss = loss_fn(local(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        results[device] = (losses, local)
    cpu_losses, cpu_model = results["cpu"]
    pjrt_losses, pjrt_model = results["pjrt"]
    torch.testing.assert_close(torch.tensor(pjrt_losses), torch.tensor(cpu_losses), atol=1e-4, rtol=1e-4)
    for (name, a), (_, b) in zip(cpu_model.state_dict().items(), pjrt_model.state_dict().items()):
        assert b.device.type == "pjrt", name
        b = b.cpu()
        if ignore is not None:
            a, b = ignore(name, a), ignore(name, b)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=name)


def without_key_bias(name: str, value: torch.Tensor) -> torch.Tensor:
    """A bias on the keys shifts every score of a query equally: softmax ignores it."""
    if name.endswith("qkv.bias"):
        width = value.shape[0] // 3
        return torch.cat([value[:width], value[2 * width:]])
    return value


def random_batches(shape: tuple[int, ...], classes: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(*shape), torch.randint(0, classes, (shape[0],))) for _ in range(steps)]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_trains_like_cpu(optimizer: str, foreach: bool) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    if optimizer == "sgd":
        def make(p):  # noqa: ANN001, ANN202
            return torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=foreach)
    else:
        def make(p):  # noqa: ANN001, ANN202
            return torch.optim.Adam(p, lr=1e-2, foreach=foreach)
    train_both(model, make, random_batches((16, 12), 5, 4), F.cross_entropy)


def test_cnn_with_batch_norm_trains_like_cpu() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )
    train_both(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), random_batches((4, 3, 16, 16), 4, 3),
               F.cross_entropy)


def test_transformer_with_adamw_trains_like_cpu() -> None:
    torch.manual_seed(3)
    model = GPT(width=32, layers=2, heads=4, context=16)
    data = batches(corpus_bytes(), 4, 16, 3)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), label_smoothing=0.1)

    train_both(model, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), data, loss, without_key_bias)


def test_gpt_train_step_with_clip_grad_norm() -> None:
    torch.manual_seed(4)
    model = GPT(width=32, layers=1, heads=2, context=16)
    tokens, targets = batches(corpus_bytes(), 2, 16, 1)[0]
    losses = {}
    for device in ("cpu", "pjrt"):
        local = copy.deepcopy(model).to(device)
        optimizer = torch.optim.AdamW(local.parameters(), lr=1e-3)
        losses[device] = [train_step(local, optimizer, tokens.to(device), targets.to(device)).item() for _ in range(2)]
    torch.testing.assert_close(torch.tensor(losses["pjrt"]), torch.tensor(losses["cpu"]), atol=1e-4, rtol=1e-4)


def clipped_gradients(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss's gradients, clipped, and the loss detached: the tensor holding the backward's graph ends here."""
    loss = loss_fn(model, tokens, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss.detach()


def train_step_detached_first(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """train_step with no tensor holding the backward's graph alive at the optimizer's step (its graph break), as
    Dynamo's trace_autograd_ops needs to trace loss.backward()."""
    optimizer.zero_grad(set_to_none=True)
    loss = clipped_gradients(model, tokens, targets)
    optimizer.step()
    return loss


@pytest.mark.parametrize(("backward", "programs"), [("autograd", 4), ("compiled autograd", 4), ("traced", 2)])
def test_the_compiled_gpt_step_runs_its_programs_with_strict_eagers_losses(
    backward: str, programs: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPT step (zero_grad, forward, backward, clip, AdamW) under torch.compile(backend="pjrt") runs four
    programs a step: the forward, the backward, the clip and AdamW, each ended by a break PyTorch makes (backward
    ends the forward's graph, the optimizer's step is its own frame). Compiled autograd (Dynamo tracing the
    backward) keeps that count: its backward graph is one program too. With Dynamo's trace_autograd_ops and the
    loss detached before the optimizer's step, loss.backward() and the clip join the forward's graph: two programs.
    (A graph returning the step's `loss.detach()` runs no program.) Losses and weights equal strict eager's, but
    for the keys' bias (see without_key_bias)."""
    from torch_pjrt.compile import backend

    torch.manual_seed(5)
    model = GPT(width=32, layers=1, heads=2, context=16)
    data = [(tokens.to("pjrt"), targets.to("pjrt")) for tokens, targets in batches(corpus_bytes(), 2, 16, 3)]
    graphs_called: list[backend.CompiledGraph] = []
    call = backend.CompiledGraph.__call__

    def counted(graph: backend.CompiledGraph, *args: object) -> object:
        graphs_called.append(graph)
        return call(graph, *args)

    runs = {}
    for compiled in (False, True):
        local = copy.deepcopy(model).to("pjrt")
        optimizer = torch.optim.AdamW(local.parameters(), lr=3e-3, weight_decay=0.01)
        step = functools.partial(train_step_detached_first if backward == "traced" else train_step, local, optimizer)
        # torch.compile reads compiled_autograd when it wraps the step, Dynamo trace_autograd_ops when it traces.
        with torch._dynamo.config.patch(compiled_autograd=compiled and backward == "compiled autograd",
                                        trace_autograd_ops=backward == "traced"):
            if compiled:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                step = torch.compile(step, backend="pjrt")
            losses = [step(tokens, targets).item() for tokens, targets in data[:-1]]
            graphs_called.clear()
            monkeypatch.setattr(backend.CompiledGraph, "__call__", counted)
            losses.append(step(*data[-1]).item())
            monkeypatch.undo()
        runs[compiled] = (losses, local, sum(graph.needs_program for graph in graphs_called))
    (eager_losses, eager_model, _), (losses, compiled_model, ran) = runs[False], runs[True]
    assert ran == programs
    assert bool(torch._dynamo.utils.counters["compiled_autograd"]["captures"]) == (backward == "compiled autograd")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), atol=1e-5, rtol=1e-5)
    for (name, a), (_, b) in zip(eager_model.state_dict().items(), compiled_model.state_dict().items()):
        a, b = without_key_bias(name, a.cpu()), without_key_bias(name, b.cpu())
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)


def test_readme_example() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 30 * 30, 10)).to("pjrt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, 32, 32, device="pjrt")
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert isinstance(loss.item(), float) and x.cpu().shape == (8, 3, 32, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_cuda(dtype: torch.dtype) -> None:
    linear = nn.Linear(8, 4).to("pjrt")
    x = torch.randn(2, 8, device="pjrt")
    with torch.autocast("pjrt", dtype=dtype):
        y = linear(x)
        z = torch.softmax(y, -1)
        w = torch.log(y.float().abs() + 1)
        s = y.sum()
    assert y.dtype == dtype  # linear: lower precision
    assert z.dtype == torch.float32  # softmax: float32 unless a dtype is given, as on CUDA
    assert w.dtype == torch.float32  # log: float32
    assert s.dtype == torch.float32  # sum: float32 unless a dtype is given
    cpu = nn.Linear(8, 4)
    cpu.load_state_dict({k: v.cpu() for k, v in linear.state_dict().items()})
    torch.testing.assert_close(y.float().cpu(), cpu(x.cpu()), atol=5e-2, rtol=5e-2)


def test_grad_scaler_steps_and_skips_overflow() -> None:
    torch.manual_seed(5)
    model = nn.Linear(4, 2).to("pjrt")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("pjrt", init_scale=1024.0, growth_interval=1)
    x = torch.randn(3, 4, device="pjrt")
    before = model.weight.detach().cpu().clone()
    with torch.autocast("pjrt", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(model.weight.detach().cpu(), before)
    assert scaler.get_scale() == 2048.0
    optimizer.zero_grad()
    loss = model(x).sum() * float("inf")
    scaler.scale(loss).backward()
    after_step = model.weight.detach().cpu().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(model.weight.detach().cpu(), after_step)
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_grad_scaler_unscale_op_matches_cpu(poison: float | None) -> None:
    """aten::_amp_foreach_non_finite_check_and_unscale_ on pjrt: CPU's unscaled values and found_inf."""
    generator = torch.Generator().manual_seed(11)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) * 1000
             for shape, dtype in (((5, 3), torch.float32), ((7,), torch.float16), ((2, 2), torch.bfloat16),
                                  ((), torch.float64))]
    if poison is not None:
        grads[1][3] = poison
    inv_scale = torch.rand(1, generator=generator) / 100
    results = {}
    for device in ("cpu", "pjrt"):
        local = [g.to(device, copy=True) for g in grads]
        found_inf = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(local, found_inf, inv_scale.to(device))
        results[device] = ([g.cpu() for g in local], found_inf.cpu())
    assert results["pjrt"][1].item() == (0.0 if poison is None else 1.0)
    torch.testing.assert_close(results["pjrt"], results["cpu"], rtol=0, atol=0, equal_nan=True)


def test_grad_scaler_update_op_matches_cpu() -> None:
    """aten::_amp_update_scale_ on pjrt follows CPU's scale and growth tracker through clean and overflowed steps."""
    generator = torch.Generator().manual_seed(12)
    overflows = (torch.rand(12, generator=generator) < 0.3).tolist()
    states = {}
    for device in ("cpu", "pjrt"):
        scale = torch.full((1,), 2.0 ** 16, device=device)
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        history = []
        for overflow in overflows:
            found_inf = torch.full((1,), float(overflow), device=device)
            torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 3)
            history.append((scale.item(), tracker.item()))
        states[device] = history
    assert states["pjrt"] == states["cpu"]


def test_backward_on_second_device() -> None:
    code = """
        import torch
        a = torch.randn(4, 3)
        x = a.to("pjrt:1").requires_grad_()
        (x * x).sum().backward()
        assert x.grad.device == torch.device("pjrt", 1)
        torch.testing.assert_close(x.grad.cpu(), 2 * a)
        y = a.to("pjrt:0").requires_grad_()
        (y.to("pjrt:1") * 3).sum().backward()
        assert y.grad.device.index == 0
        torch.testing.assert_close(y.grad.cpu(), torch.full((4, 3), 3.0))
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={**os.environ, "TORCH_PJRT_CPU_DEVICES": "2"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight, as GPT-2, BERT and T5 do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight


def test_moving_a_module_keeps_its_parameters_and_their_ties() -> None:
    torch.manual_seed(21)
    model = TiedLM()
    moved = copy.deepcopy(model)
    weight = moved.embed.weight
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, moved)]  # built before the move
    moved.to("pjrt")
    assert moved.embed.weight is weight and moved.head.weight is weight and weight.device.type == "pjrt"
    tokens = torch.randint(0, 20, (2, 6))
    for m, optimizer, device in ((model, optimizers[0], "cpu"), (moved, optimizers[1], "pjrt")):
        for _ in range(2):
            optimizer.zero_grad()
            F.cross_entropy(m.head(m.embed(tokens.to(device))).flatten(0, 1), tokens.flatten().to(device)).backward()
            optimizer.step()
    torch.testing.assert_close(weight.detach().cpu(), model.embed.weight.detach())
    moved.to("cpu")
    assert moved.head.weight is weight and weight.device.type == "cpu"
