"""Several pjrt devices in one process, driven like a multi-GPU host: everything on pjrt:1 only.

The scenarios need two CPU devices, fixed when jax starts, so each job runs this file as a script in
a fresh process with TORCH_PJRT_CPU_DEVICES=2; one job runs many scenarios to pay start-up once. The
script compares every result with PyTorch on CPU (fresh random inputs) and checks on which jax
device the result arrays live; each test reads its scenario's outcome.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

SCENARIOS: dict[str, Callable[[], None]] = {}
SECOND = "pjrt:1"


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def jax_devices(tensor: torch.Tensor) -> list[int]:
    """Ids of the jax devices that hold a pjrt tensor's array (running its pending program first)."""
    from torch_pjrt import storage

    return sorted(device.id for device in storage.storage_of(tensor).materialize().devices())


def assert_on_second(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.device == torch.device(SECOND), tensor.device
        assert jax_devices(tensor) == [1], f"a {SECOND} tensor's array is on jax device(s) {jax_devices(tensor)}"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 32)
        self.down = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class AttentionBlock(nn.Module):
    """Pre-norm self-attention and MLP with residuals, as in a transformer layer."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        # no bias: a key bias gets a zero gradient, whose rounding noise AdamW would blow up to lr-sized steps
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(x)


def train_alongside(model: nn.Module, inputs: Callable[[], torch.Tensor], steps: int = 3,
                    prepare: Callable[[nn.Module], nn.Module] = lambda m: m) -> None:
    """Train a copy on pjrt:1 and the model on CPU with the same fresh inputs; losses, gradients and
    parameters must agree, and everything of the pjrt copy must live on jax device 1."""
    on_device = copy.deepcopy(model).to(SECOND)
    run_on_device = prepare(on_device)
    cpu_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(on_device.parameters(), lr=1e-2)
    for _ in range(steps):
        x = inputs()
        target = torch.randn_like(model(x))
        cpu_loss = F.mse_loss(model(x), target)
        cpu_loss.backward()
        loss = F.mse_loss(run_on_device(x.to(SECOND)), target.to(SECOND))
        loss.backward()
        assert_on_second(loss)
        torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-5)
        for (name, param), cpu_param in zip(on_device.named_parameters(), model.parameters()):
            assert_on_second(param.grad)
            torch.testing.assert_close(param.grad.cpu(), cpu_param.grad, rtol=1e-4, atol=1e-5, msg=name)
        cpu_optimizer.step()
        optimizer.step()
        cpu_optimizer.zero_grad()
        optimizer.zero_grad()
    for param, cpu_param in zip(on_device.parameters(), model.parameters()):
        assert_on_second(param)
        torch.testing.assert_close(param.detach().cpu(), cpu_param.detach(), rtol=1e-4, atol=1e-5)
    assert torch.pjrt.current_device() == 0, "training on pjrt:1 changed the caller's current device"


@scenario
def mlp_training() -> None:
    train_alongside(MLP(), lambda: torch.randn(8, 12))


@scenario
def attention_training() -> None:
    train_alongside(AttentionBlock(), lambda: torch.randn(2, 6, 16))


class ScaleWithDeviceFactories(torch.autograd.Function):
    """y = x * w; its backward makes tensors with no device index and reads the current device, as a
    CUDA extension's backward does on autograd's device thread."""

    seen: dict[str, Any] = {}

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        seen = ScaleWithDeviceFactories.seen
        seen["current_device"] = torch.pjrt.current_device() if grad.device.type == "pjrt" else None
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        zeros = torch.zeros(grad.shape, device=grad.device.type)
        ones = torch.ones(w.shape, device=grad.device.type, dtype=w.dtype)
        seen["made"] = [zeros, ones]
        return grad * w + zeros, (grad * x).sum(0) * ones


@scenario
def factories_in_backward() -> None:
    x_cpu = torch.randn(4, 3, requires_grad=True)
    w_cpu = torch.randn(3, requires_grad=True)
    ScaleWithDeviceFactories.apply(x_cpu, w_cpu).sin().sum().backward()
    x = x_cpu.detach().to(SECOND).requires_grad_()
    w = w_cpu.detach().to(SECOND).requires_grad_()
    ScaleWithDeviceFactories.apply(x, w).sin().sum().backward()
    seen = ScaleWithDeviceFactories.seen
    assert seen["thread"], "backward of a pjrt tensor ran on the caller's thread, not a device thread"
    assert seen["current_device"] == 1, f"torch.pjrt.current_device() in backward: {seen['current_device']}"
    assert_on_second(*seen["made"], x.grad, w.grad)
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)


def _factory_device() -> str:
    return str(torch.randn(2, device="pjrt").device)


def _in_thread(fn: Callable[[], Any]) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


@scenario
def current_device_per_thread() -> None:
    host = torch.randn(3)
    with torch.pjrt.device(1):
        assert torch.pjrt.current_device() == 1
        assert _factory_device() == SECOND
        moved = host.to("pjrt")
        assert_on_second(moved)
        assert _in_thread(_factory_device) == "pjrt:0", "torch.pjrt.device(1) reached another thread"
    assert torch.pjrt.current_device() == 0 and _factory_device() == "pjrt:0"
    torch.testing.assert_close(moved.cpu(), host)

    def set_then_make() -> tuple[int, str]:
        torch.pjrt.set_device(1)
        return torch.pjrt.current_device(), _factory_device()

    assert _in_thread(set_then_make) == (1, SECOND)
    assert torch.pjrt.current_device() == 0 and _factory_device() == "pjrt:0", "set_device(1) reached the main thread"
    torch.pjrt.set_device(1)
    try:
        assert _factory_device() == SECOND and torch.accelerator.current_device_index() == 1
    finally:
        torch.pjrt.set_device(0)


@scenario
def copies_between_devices() -> None:
    a_cpu, b_cpu = torch.randn(4, 5), torch.randn(4, 5)
    a, b = a_cpu.to("pjrt:0"), b_cpu.to(SECOND)
    moved = a.to(SECOND)
    assert_on_second(moved)
    assert jax_devices(a) == [0]
    torch.testing.assert_close(moved.cpu(), a_cpu)
    back = (b * 2).to("pjrt:0")
    assert back.device == torch.device("pjrt:0") and jax_devices(back) == [0]
    torch.testing.assert_close(back.cpu(), b_cpu * 2)
    target = torch.empty(4, 5, device=SECOND)
    target.copy_(a)
    assert_on_second(target)
    torch.testing.assert_close(target.cpu(), a_cpu)
    b[1:3, ::2].copy_(a[:2, :3])
    b_cpu[1:3, ::2].copy_(a_cpu[:2, :3])
    assert_on_second(b)
    torch.testing.assert_close(b.cpu(), b_cpu)
    for mixed in (lambda: a + b, lambda: b.add_(a), lambda: a @ b.T, lambda: torch.cat([a, b])):
        try:
            mixed()
        except RuntimeError as error:
            assert "Expected all tensors to be on the same device" in str(error), str(error)
        else:
            raise AssertionError("an op mixing pjrt:0 and pjrt:1 tensors did not raise")
    torch.testing.assert_close(b.cpu(), b_cpu)


@scenario
def streams_events_synchronize() -> None:
    stream = torch.pjrt.Stream(1)
    assert stream.device == torch.device(SECOND) and torch.pjrt.current_stream(1).device == torch.device(SECOND)
    with torch.pjrt.device(1):
        assert torch.pjrt.current_stream().device == torch.device(SECOND)
    x_cpu = torch.randn(64, 64)
    start, end = torch.pjrt.Event(enable_timing=True), torch.pjrt.Event(enable_timing=True)
    x = x_cpu.to(SECOND)
    start.record(stream)
    y = x @ x + 1
    end.record(stream)
    end.synchronize()
    assert end.query() and stream.query() and start.elapsed_time(end) >= 0
    torch.pjrt.synchronize(1)
    assert_on_second(y)
    torch.testing.assert_close(y.cpu(), x_cpu @ x_cpu + 1, rtol=1e-4, atol=1e-4)
    assert torch.pjrt.current_device() == 0


@scenario
def fused_mode() -> None:
    previous = torch.pjrt.eager_mode
    torch.pjrt.set_eager_mode(torch.pjrt.EagerMode.DEFER_AND_FUSE)
    try:
        train_alongside(MLP(), lambda: torch.randn(8, 12))
        made = torch.full((3,), 2.5, device=SECOND) + torch.arange(3, device=SECOND)
        assert_on_second(made)
        torch.testing.assert_close(made.cpu(), torch.full((3,), 2.5) + torch.arange(3))
        a_cpu, b_cpu = torch.randn(5), torch.randn(5)
        on_first = a_cpu.to("pjrt:0") * 2 + 1
        on_second = b_cpu.to(SECOND) * 3 + torch.ones(5, device=SECOND)
        crossed = on_second.to("pjrt:0") + on_first
        assert jax_devices(on_first) == [0] and jax_devices(crossed) == [0]
        assert_on_second(on_second)
        torch.testing.assert_close(on_first.cpu(), a_cpu * 2 + 1)
        torch.testing.assert_close(on_second.cpu(), b_cpu * 3 + 1)
        torch.testing.assert_close(crossed.cpu(), b_cpu * 3 + 1 + a_cpu * 2 + 1)
    finally:
        torch.pjrt.set_eager_mode(previous)


@scenario
def in_place_random_init() -> None:
    """uniform_ overwrites its input whole (jit drops the unused input); nn.init's trunc_normal_ and
    kaiming_uniform_ run on it. Their results must stay on the tensor's device."""
    weight = torch.randn(64, 16).to(SECOND)
    with torch.no_grad():
        weight.uniform_(-0.5, 0.25)
    assert_on_second(weight)
    values = weight.cpu()
    assert values.min() >= -0.5 and values.max() < 0.25 and values.std() > 0.1, values
    # (init, the bound of its values): kaiming_uniform_'s is sqrt(6 / fan_in) = sqrt(6 / 16)
    for init, bound in ((lambda w: nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04), 0.04),
                        (nn.init.kaiming_uniform_, (6 / 16) ** 0.5)):
        weight = torch.empty(64, 16, device=SECOND)
        init(weight)
        assert_on_second(weight)
        values = weight.cpu()
        assert values.abs().max() <= bound and values.std() > bound / 4, (bound, values)


@scenario
def compiled() -> None:
    torch._dynamo.reset()
    train_alongside(AttentionBlock(), lambda: torch.randn(2, 6, 16),
                    prepare=lambda model: torch.compile(model, backend="pjrt", fullgraph=True))


def run_scenarios(out_path: str, names: list[str]) -> None:
    """The script side: run each scenario, record "ok" or its error and traceback."""
    outcomes = {}
    for name in names:
        torch.manual_seed(sum(map(ord, name)))
        try:
            SCENARIOS[name]()
            outcomes[name] = "ok"
        except BaseException:  # noqa: BLE001 (every failure is reported to the test)
            outcomes[name] = traceback.format_exc()
    with open(out_path, "w") as out:
        json.dump(outcomes, out)


# --- the tests ---------------------------------------------------------------------------------------

FUSED = ["mlp_training", "attention_training", "factories_in_backward", "copies_between_devices", "fused_mode",
         "in_place_random_init"]
# job: (scenarios, environment); "python" runs every op through the Python kernels
JOBS = {
    "native": (list(SCENARIOS), {}),
    "python": (list(SCENARIOS), {"TORCH_PJRT_NATIVE_DISPATCH": "0"}),
    "fused_from_environment": (FUSED, {"TORCH_PJRT_EAGER_MODE": "defer_and_fuse"}),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, str]]:
    """Each job's outcomes by scenario, the job run once, on first request."""
    done: dict[str, dict[str, str]] = {}

    def of(job: str) -> dict[str, str]:
        if job not in done:
            names, env = JOBS[job]
            out_path = str(tmp_path_factory.mktemp(job) / "outcomes.json")
            environment = {**os.environ, "TORCH_PJRT_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1", **env}
            ran = subprocess.run([sys.executable, __file__, out_path, ",".join(names)], env=environment,
                                 capture_output=True, text=True, timeout=600)
            assert ran.returncode == 0 and os.path.exists(out_path), ran.stdout + ran.stderr
            with open(out_path) as results:
                done[job] = json.load(results)
        return done[job]

    return of


@pytest.mark.parametrize(("job", "name"), [(job, name) for job, (names, _) in JOBS.items() for name in names])
def test_on_the_second_device(outcomes: Callable[[str], dict[str, str]], job: str, name: str) -> None:
    assert outcomes(job)[name] == "ok", outcomes(job)[name]


if __name__ == "__main__":
    run_scenarios(sys.argv[1], sys.argv[2].split(","))
