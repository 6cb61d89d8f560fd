"""PyTorch Lightning on pjrt: `Trainer(accelerator="pjrt")` trains with CPU's losses, one device and DDP on two.

Runs in .venv-libs (`make test-libs`); skipped where pytorch_lightning is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

LIBS = Path(__file__).parent / "fixtures" / "libs"
sys.path.insert(0, str(LIBS))
import lightning_ddp  # noqa: E402
import lightning_model  # noqa: E402

STEPS = 8


def test_pjrt_is_a_registered_accelerator() -> None:
    from pytorch_lightning.accelerators import AcceleratorRegistry

    assert "pjrt" in AcceleratorRegistry.available_accelerators()
    accelerator = AcceleratorRegistry.get("pjrt")
    assert accelerator.is_available() and accelerator.auto_device_count() == torch.pjrt.device_count()
    assert accelerator.get_parallel_devices("0,") == accelerator.get_parallel_devices("1") == [torch.device("pjrt", 0)]
    assert accelerator.get_parallel_devices(-1) == [torch.device("pjrt", i) for i in range(torch.pjrt.device_count())]
    with pytest.raises(ValueError, match="pjrt device"):
        accelerator.get_parallel_devices(torch.pjrt.device_count() + 1)


def test_single_device_trains_with_cpu_losses() -> None:
    expected, cpu_trainer = lightning_model.train("cpu", STEPS, devices=1)
    actual, trainer = lightning_model.train("pjrt", STEPS, devices=1)
    assert type(trainer.accelerator).__name__ == "PjrtAccelerator"
    assert trainer.strategy.root_device == torch.device("pjrt", 0)
    assert actual.parameter_devices == {"pjrt"} and expected.parameter_devices == {"cpu"}
    assert len(actual.losses) == STEPS and actual.losses[-1] < actual.losses[0]
    torch.testing.assert_close(actual.losses, expected.losses, rtol=1e-5, atol=1e-6)
    for trained, reference in zip(actual.parameters(), expected.parameters()):
        torch.testing.assert_close(trained.cpu(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_autocasts_on_pjrt(precision: str) -> None:
    actual, trainer = lightning_model.train("pjrt", 3, devices=1, precision=precision)
    plugin = trainer.precision_plugin
    assert plugin.device == "pjrt"
    assert (plugin.scaler is not None and plugin.scaler._device == "pjrt") == (precision == "16-mixed")
    # Lightning's CPU accelerator turns "16-mixed" into bf16; the reference gets Lightning's plugin with CPU autocast.
    from pytorch_lightning.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    expected, _ = lightning_model.train("cpu", 3, devices=1, plugins=[MixedPrecision(precision, "cpu", scaler)])
    torch.testing.assert_close(actual.losses, expected.losses, rtol=1e-3, atol=1e-4)


def run_ddp(accelerator: str, folder: Path) -> list[dict]:
    folder.mkdir()
    env = {**os.environ, "TORCH_PJRT_CPU_DEVICES": "2"}
    done = subprocess.run([sys.executable, str(LIBS / "lightning_ddp.py"), accelerator, str(folder)], env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ddp_on_two_processes_trains_with_cpu_losses(tmp_path: Path) -> None:
    expected = run_ddp("cpu", tmp_path / "cpu")
    actual = run_ddp("pjrt", tmp_path / "pjrt")
    for rank, (result, reference) in enumerate(zip(actual, expected)):
        assert result["strategy"] == "DDPStrategy" and result["world_size"] == 2
        assert result["root_device"] == f"pjrt:{rank}" and result["parameter_devices"] == ["pjrt"]
        assert result["backend"] == "pjrt" and reference["backend"] == "gloo"
        assert len(result["losses"]) == lightning_ddp.STEPS
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    assert actual[0]["losses"] != actual[1]["losses"], "each rank trains on its own shard of the data"

