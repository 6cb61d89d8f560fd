"""Ray Train on pjrt: TorchTrainer with two local workers trains with the losses of the same DDP run under torchrun.

Runs in .venv-libs (`make test-libs`); skipped where ray is not installed. Both runs execute
tests/fixtures/libs/ray_ddp.py's loop in two processes, rank r on pjrt:r, c10d backend "pjrt".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train.torch")

SCRIPT = Path(__file__).parent / "fixtures" / "libs" / "ray_ddp.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(launcher: str, folder: Path) -> list[dict]:
    """Ray's driver (it starts and shuts down a local Ray of 2 CPUs) or torchrun, in a process of its own."""
    folder.mkdir()
    if launcher == "ray":
        command = [sys.executable, str(SCRIPT), "ray", str(folder)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), str(SCRIPT), "torchrun", str(folder)]
    env = {**os.environ, "TORCH_PJRT_CPU_DEVICES": "2", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_torch_trainer_trains_with_the_losses_of_torchrun(tmp_path: Path) -> None:
    expected = run("torchrun", tmp_path / "torchrun")
    actual = run("ray", tmp_path / "ray")
    for rank, (result, reference) in enumerate(zip(actual, expected)):
        assert result["in_ray_worker"] and not reference["in_ray_worker"]
        for run_result in (result, reference):
            assert run_result["backend"] == "pjrt" and run_result["world_size"] == 2
            assert run_result["device"] == f"pjrt:{rank}" and run_result["parameter_devices"] == ["pjrt"]
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(result["weights"], reference["weights"], rtol=1e-6, atol=0)
    # Each rank trained on its own half of the data, and DDP kept the trained weights equal across ranks.
    assert actual[0]["losses"] != actual[1]["losses"]
    assert actual[0]["weights"] == actual[1]["weights"]
