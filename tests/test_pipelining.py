"""Pipeline parallelism on pjrt: torch.distributed.pipelining's GPipe and 1F1B on two ranks.

A small transformer in two stages (rank r holds stage r on pjrt:r) trains a few steps and must
match the whole model trained in one process on CPU. The stages talk through send/recv
(batch_isend_irecv), which the "pjrt" backend serves with gloo over host copies. One job per
configuration runs several scenarios, to pay the ranks' start-up once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "distributed", "pipeline_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(out_dir: str, scenarios: list[str], timeout: float = 180, **env: str) -> list[tuple[int, dict, str]]:
    """Two ranks of the pipeline worker in torchrun's environment; (exit code, results, output) per rank."""
    port = str(_free_port())
    processes = []
    for rank in range(2):
        rank_env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "TORCH_PJRT_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1",
            "DIST_TIMEOUT": "30", **env,
        }
        processes.append(subprocess.Popen(
            [sys.executable, WORKER, out_dir, ",".join(scenarios)], env=rank_env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outcomes = []
    deadline = time.monotonic() + timeout
    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise AssertionError(f"rank {rank} hung past {timeout}s") from None
        path = os.path.join(out_dir, f"rank{rank}.json")
        results = json.load(open(path)) if os.path.exists(path) else {}
        outcomes.append((process.returncode, results, output))
    return outcomes


def _outcome(outcomes: list[tuple[int, dict, str]], scenario: str) -> None:
    for rank, (code, results, output) in enumerate(outcomes):
        result = results.get(scenario, f"no result (exit code {code}):\n{output[-3000:]}")
        assert result == "ok", f"rank {rank}: {result}"
        assert code == 0, f"rank {rank} exited with {code}:\n{output[-3000:]}"


@pytest.fixture(scope="module")
def default_job(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, dict, str]]:
    """Strict eager mode, the backend's default engine choice."""
    return launch(str(tmp_path_factory.mktemp("pipe")), ["exchange", "gpipe", "1f1b"])


@pytest.fixture(scope="module")
def fused_job(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, dict, str]]:
    """The fused eager mode: each send/recv's host copy is a sync point of the pending graph."""
    return launch(str(tmp_path_factory.mktemp("pipe-fused")), ["1f1b"], TORCH_PJRT_EAGER_MODE="defer_and_fuse")


@pytest.fixture(scope="module")
def host_engine_job(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, dict, str]]:
    """TORCH_PJRT_DISTRIBUTED=host: every collective of the job (shape exchange included) over gloo."""
    return launch(str(tmp_path_factory.mktemp("pipe-host")), ["gpipe"], TORCH_PJRT_DISTRIBUTED="host")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_matches_single_process(default_job: list[tuple[int, dict, str]], schedule: str) -> None:
    """Losses and final parameters of both stages equal the whole model trained on CPU."""
    _outcome(default_job, schedule)


def test_send_before_receive_on_both_ranks(default_job: list[tuple[int, dict, str]]) -> None:
    """send/recv in flight: no deadlock, receives written back below autograd and through views."""
    _outcome(default_job, "exchange")


def test_1f1b_fused_mode(fused_job: list[tuple[int, dict, str]]) -> None:
    _outcome(fused_job, "1f1b")


def test_gpipe_host_engine(host_engine_job: list[tuple[int, dict, str]]) -> None:
    _outcome(host_engine_job, "gpipe")


def test_rank_failing_mid_schedule_does_not_hang(tmp_path: Any) -> None:
    """Rank 1 raises in its second forward and stays alive; rank 0 fails within the group's timeout."""
    _outcome(launch(str(tmp_path), ["fail"], timeout=90, DIST_TIMEOUT="4"), "fail")
