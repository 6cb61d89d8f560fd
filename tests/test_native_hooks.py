"""The native guard, hooks and generator (torch_pjrt._hooks), installed before the Python registration.

Each scenario runs in a fresh process: the guard must be registered before torch_pjrt registers
the device, and the autograd engine sizes its device queues once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_pjrt import native

pytestmark = pytest.mark.skipif(not native.available(), reason="torch_pjrt._hooks is not built")

# Loads the torch_pjrt package object without running its __init__ (which registers the
# device), installs the native hooks, then runs __init__: the order register() should use.
PRELUDE = """
import importlib.util, json, sys
import torch
spec = importlib.util.find_spec("torch_pjrt")
package = importlib.util.module_from_spec(spec)
sys.modules["torch_pjrt"] = package
from torch_pjrt import native
result = {"install": native.install(INSTALL_COUNT, ENGINE_DEVICES)}
spec.loader.exec_module(package)
result["installed_after_register"] = native.installed()


def attempt(fn):
    try:
        return fn()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
"""

GENERATORS = """
g = torch.Generator(device="pjrt")
result["default_device"] = str(g.device)
result["default_seed"] = g.initial_seed()
g.manual_seed(3)
result["seed"] = g.initial_seed()
result["offset_after_seed"] = g.get_offset()
g.set_offset(5)
result["offset"] = g.get_offset()
state = g.get_state()
result["state"] = [state.dtype == torch.uint8, str(state.device), state.tolist()]
other = torch.Generator(device="pjrt:1")
result["other_device"] = str(other.device)
other.set_state(state)
result["other_state"] = [other.initial_seed(), other.get_offset()]
result["clone_independent"] = [g.clone_state().get_offset(), g.clone_state().set_offset(9).get_offset(), g.get_offset()]
fresh = g.seed()
result["seed_resets_offset"] = [g.initial_seed() == fresh, g.get_offset()]
result["bad_index"] = attempt(lambda: torch.Generator(device="pjrt:2"))
result["bad_state"] = attempt(lambda: other.set_state(torch.zeros(8, dtype=torch.uint8)))
default = native.default_generator(1)
result["default_generator"] = [str(default.device), default is native.default_generator(1)]
result["accelerator"] = [torch.accelerator.device_count(), str(torch.accelerator.current_accelerator())]
torch.accelerator.set_device_index(1)
result["accelerator_index"] = torch.accelerator.current_device_index()
torch.accelerator.set_device_index(0)
"""

BACKWARD = """
for index in (0, 1):
    x = torch.randn(3).to(f"pjrt:{index}").requires_grad_()
    (x * 2).backward(torch.ones(3, device=f"pjrt:{index}"))
    result[f"grad_{index}"] = [str(x.grad.device), x.grad.cpu().tolist()]
"""

CPU_BACKWARD = """
a = torch.randn(2, requires_grad=True)
(a * 2).backward(torch.ones(2))
"""


def run_script(body: str, install_count: int, engine_devices: int = 0) -> dict:
    script = (PRELUDE + body).replace("INSTALL_COUNT", str(install_count))
    script = script.replace("ENGINE_DEVICES", str(engine_devices)) + "\nprint(json.dumps(result))\n"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCH_PJRT_CPU_DEVICES": "2"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_devices() -> dict:
    return run_script(GENERATORS + BACKWARD, install_count=2)


def test_install_takes_precedence_over_python_registration(two_devices: dict) -> None:
    assert two_devices["install"] is True
    assert two_devices["installed_after_register"] is True


def test_generator_seed_and_offset(two_devices: dict) -> None:
    assert two_devices["default_device"] == "pjrt:0"
    assert two_devices["default_seed"] == torch.Generator().initial_seed()
    assert two_devices["seed"] == 3
    assert two_devices["offset_after_seed"] == 0
    assert two_devices["offset"] == 5
    assert two_devices["seed_resets_offset"] == [True, 0]


def test_generator_state_round_trip(two_devices: dict) -> None:
    state = [3, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]
    assert two_devices["state"] == [True, "cpu", state]
    assert two_devices["other_device"] == "pjrt:1"
    assert two_devices["other_state"] == [3, 5]
    assert two_devices["clone_independent"] == [5, 9, 5]


def test_generator_errors_are_clear(two_devices: dict) -> None:
    assert two_devices["bad_index"]["error"] == "RuntimeError"
    assert "pjrt:2 does not exist" in two_devices["bad_index"]["message"]
    assert two_devices["bad_state"]["error"] == "RuntimeError"
    assert "16 bytes" in two_devices["bad_state"]["message"]


def test_default_generator_and_accelerator(two_devices: dict) -> None:
    assert two_devices["default_generator"] == ["pjrt:1", True]
    assert two_devices["accelerator"] == [2, "pjrt"]
    assert two_devices["accelerator_index"] == 1


def test_backward_on_every_device(two_devices: dict) -> None:
    assert two_devices["grad_0"] == ["pjrt:0", [2.0, 2.0, 2.0]]
    assert two_devices["grad_1"] == ["pjrt:1", [2.0, 2.0, 2.0]]


def test_count_raised_before_first_backward() -> None:
    """register() installs with an estimate; the real count may arrive later, before any backward."""
    result = run_script("native.install(1)\nnative.set_device_count(2)\n" + BACKWARD, install_count=1)
    assert result["grad_1"] == ["pjrt:1", [2.0, 2.0, 2.0]]


# install() again after the registration only updates the counts (whatever register() passed).
LATE_COUNT = (
    f"BACKWARD = {BACKWARD!r}\n"
    + "native.install(1, ENGINE_DEVICES)\n"
    + CPU_BACKWARD
    + "native.set_device_count(2)\n"
    + "result['late'] = attempt(lambda: exec(BACKWARD))\n"
)


def test_engine_reads_count_at_first_backward() -> None:
    """Why engine_devices exists: a CPU backward freezes the engine's device queues at the count of that moment."""
    result = run_script(LATE_COUNT, install_count=1)
    assert "device_ready_queues_" in result["late"]["message"]


def test_engine_devices_covers_a_late_count() -> None:
    result = run_script(LATE_COUNT, install_count=1, engine_devices=8)
    assert result["late"] is None
    assert result["grad_1"] == ["pjrt:1", [2.0, 2.0, 2.0]]


def test_without_extension_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_pjrt._hooks", None)
    assert native.install(2) is False
    assert native.installed() is False
    native.set_device_count(2)
    with pytest.raises(RuntimeError, match="not built"):
        native.default_generator(0)
