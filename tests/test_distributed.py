"""torch.distributed on pjrt: the "pjrt" c10d backend, DDP, FSDP2, DTensor and checkpoints.

Each job starts real ranks (torchrun's environment, a free port, two CPU devices per process)
running tests/distributed/worker.py; one job runs many scenarios to pay start-up once.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "distributed", "worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import ranks  # noqa: E402 (tests/distributed/ranks.py, shared with the rank scripts)

COLLECTIVES = (
    "all_reduce", "all_reduce_views", "async", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
    "reduce_gather_scatter", "send_recv", "coalescing", "functional", "compiled", "cpu_tensors",
)
TRAINING = ("ddp", "fsdp", "fsdp_mixed_precision", "dtensor")
def launch(out_dir: str, scenarios: list[str], world_size: int = 2, timeout: float = 240, **env: str) -> list[Any]:
    """Start `world_size` ranks of the worker; returns (exit code, results, output) per rank."""
    return ranks.launch(WORKER, out_dir, scenarios, world_size, timeout, **env)


def _outcome(outcomes: list[Any], scenario: str) -> None:
    for rank, (code, results, output) in enumerate(outcomes):
        result = results.get(scenario, f"no result (exit code {code}):\n{output[-3000:]}")
        assert result == "ok", f"rank {rank}: {result}"


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Two ranks on pjrt:0 and pjrt:1 (two CPU devices per process), backend chosen by c10d."""
    folder = tmp_path_factory.mktemp("dist")
    return launch(str(folder), ["engine", "fused_collective", *COLLECTIVES, *TRAINING, "tensor_parallel"],
                  DIST_TIMEOUT="30")


@pytest.fixture(scope="module")
def host_engine_job(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The same ranks with TORCH_PJRT_DISTRIBUTED=host: gloo over host copies, the fallback engine."""
    folder = tmp_path_factory.mktemp("dist-host")
    scenarios = ["engine", "all_reduce", "all_gather", "reduce_scatter", "compiled", *TRAINING]
    return launch(str(folder), scenarios, DIST_TIMEOUT="30", TORCH_PJRT_DISTRIBUTED="host", EXPECT_ENGINE="host")


@pytest.fixture(scope="module")
def one_device_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    """Two ranks both on pjrt:0, init_process_group("cpu:gloo,pjrt:pjrt"), fused eager mode; saves a checkpoint."""
    folder = str(tmp_path_factory.mktemp("dist1"))
    scenarios = ["all_reduce", "cpu_tensors", "ddp", "tensor_parallel", "checkpoint_save"]
    env = {
        "CHECKPOINT_DIR": folder, "TORCH_PJRT_CPU_DEVICES": "1", "DIST_BACKEND": "cpu:gloo,pjrt:pjrt",
        "TORCH_PJRT_EAGER_MODE": "defer_and_fuse",
    }
    return folder, launch(folder, scenarios, DIST_TIMEOUT="30", **env)


def test_collectives_run_as_xla_programs_without_host_copies(main_job: list[Any]) -> None:
    _outcome(main_job, "engine")


def test_a_fused_collective_is_a_node_of_the_fused_program(main_job: list[Any]) -> None:
    _outcome(main_job, "fused_collective")


@pytest.mark.parametrize("scenario", ["engine", "all_reduce", "all_gather", "reduce_scatter", "compiled", *TRAINING])
def test_host_engine(host_engine_job: list[Any], scenario: str) -> None:
    """The host engine (gloo over host copies) still gives gloo's results and single-process training."""
    _outcome(host_engine_job, scenario)


@pytest.mark.parametrize("scenario", COLLECTIVES)
def test_collective(main_job: list[Any], scenario: str) -> None:
    """Each collective and dtype on pjrt tensors equals gloo on CPU tensors."""
    _outcome(main_job, scenario)


@pytest.mark.parametrize("scenario", TRAINING)
def test_training(main_job: list[Any], scenario: str) -> None:
    """DDP and FSDP2 equal full-batch single-process training; DTensor equals plain tensors."""
    _outcome(main_job, scenario)


def test_tensor_parallel_on_second_device(main_job: list[Any]) -> None:
    _outcome(main_job, "tensor_parallel")


@pytest.mark.parametrize("scenario", ["all_reduce", "cpu_tensors", "ddp", "tensor_parallel"])
def test_explicit_backend_fused_mode(one_device_job: tuple[str, list[Any]], scenario: str) -> None:
    """cpu:gloo,pjrt:pjrt serves both kinds of tensors in fused mode; TP MLP and attention equal unsharded."""
    _outcome(one_device_job[1], scenario)


def test_checkpoint_resumes_on_another_world_size(one_device_job: tuple[str, list[Any]]) -> None:
    """A sharded checkpoint written by 2 ranks loads on 1 rank with the same values."""
    folder, outcomes = one_device_job
    _outcome(outcomes, "checkpoint_save")
    os.remove(os.path.join(folder, "rank0.json"))
    _outcome(launch(folder, ["checkpoint_load"], world_size=1, CHECKPOINT_DIR=folder), "checkpoint_load")


def test_subgroups_of_a_2d_mesh(tmp_path: Any) -> None:
    """Four ranks, a 2x2 DeviceMesh: each dimension's group and a new_group run their collectives as XLA
    programs over their own ranks, eagerly and compiled, with gloo's results."""
    outcomes = launch(str(tmp_path), ["subgroups"], world_size=4, DIST_TIMEOUT="60", TORCH_PJRT_CPU_DEVICES="1")
    _outcome(outcomes, "subgroups")


def test_failing_rank_does_not_hang(tmp_path: Any) -> None:
    """A late rank makes its peer's collective fail at the timeout; a dead one makes it fail at once."""
    start = time.monotonic()
    outcomes = launch(str(tmp_path), ["mismatched_shapes", "timeout", "fail"], timeout=120, DIST_TIMEOUT="4")
    _outcome(outcomes, "mismatched_shapes")
    _outcome(outcomes, "timeout")
    assert outcomes[1][0] == 3
    survivor = outcomes[0][1].get("fail", "")
    assert survivor != "ok" and survivor, f"rank 0 should have failed: {outcomes[0][2][-2000:]}"
    assert time.monotonic() - start < 120


def test_a_taken_coordinator_port_is_a_clear_error_before_jax_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 hosts jax's coordinator on MASTER_PORT + 1; jax's service ends the process with a segmentation fault
    when that port is taken, so the runtime refuses first, naming the port and what to set."""
    import socket

    from torch_pjrt.runtime import multiprocess

    class FakeJax:
        class config:  # noqa: N801 (jax.config's shape)
            @staticmethod
            def update(name: str, value: Any) -> None:
                pass

        class distributed:  # noqa: N801
            @staticmethod
            def initialize(*args: Any, **kwargs: Any) -> None:
                raise AssertionError("jax's runtime must not be started on a taken port")

    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port - 1), "TORCH_PJRT_DISTRIBUTED": "auto"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCH_PJRT_COORDINATOR", raising=False)
        with pytest.raises(RuntimeError, match=f"port {port} .* is in use.*TORCH_PJRT_COORDINATOR"):
            multiprocess.initialize(FakeJax)
        monkeypatch.setitem(multiprocess._state, "reason", None)
        monkeypatch.setenv("RANK", "1")  # another rank only connects to the coordinator: jax is asked
        multiprocess.initialize(FakeJax)
        assert "must not be started" in multiprocess._state["reason"]
    assert not multiprocess.port_in_use(ranks.free_port() + 1)
