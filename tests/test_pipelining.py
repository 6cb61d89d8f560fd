"""Pipeline parallelism on pjrt: torch.distributed.pipelining's GPipe and 1F1B on two ranks.

A small transformer in two stages (rank r holds stage r on pjrt:r) trains a few steps and must
match the whole model trained in one process on CPU. The stages talk through send/recv
(batch_isend_irecv), which the "pjrt" backend serves with gloo over host copies. One job per
configuration runs several scenarios, to pay the ranks' start-up once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "distributed", "pipeline_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import ranks  # noqa: E402 (tests/distributed/ranks.py, shared with the rank scripts)


def launch(out_dir: str, scenarios: list[str], timeout: float = 180, **env: str) -> list[tuple[int, dict, str]]:
    """Two ranks of the pipeline worker in torchrun's environment; (exit code, results, output) per rank."""
    return ranks.launch(WORKER, out_dir, scenarios, 2, timeout, **{"DIST_TIMEOUT": "30", **env})


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
    """Rank 1 raises in its second forward and stays alive; rank 0 fails within the group's timeout (10 s: the
    stages' set-up exchanges wait on the other rank's first compiles, which took over 4 s beside another test run)."""
    _outcome(launch(str(tmp_path), ["fail"], timeout=90, DIST_TIMEOUT="10"), "fail")
