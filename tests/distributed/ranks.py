"""Shared by the rank scripts (worker.py, pipeline_worker.py) and the tests that launch them.

`launch` starts ranks in torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT on a free port, two CPU devices per process); `run_scenarios` is a rank's main loop:
each named scenario's outcome ("ok" or its traceback) goes to OUT_DIR/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    """A MASTER_PORT that is free with the port above it, where jax's distributed runtime coordinator listens."""
    from torch_pjrt.runtime import multiprocess

    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port < 65535 and not multiprocess.port_in_use(port + 1):
                return port
    raise RuntimeError("found no free pair of ports in 100 tries; free some local ports and run again.")


def launch(worker: str, out_dir: str, scenarios: list[str], world_size: int = 2, timeout: float = 240,
           **env: str) -> list[tuple[int, dict, str]]:
    """Start `world_size` ranks of `worker`; returns (exit code, results, output) per rank."""
    port = str(free_port())
    processes = []
    for rank in range(world_size):
        rank_env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
            "TORCH_PJRT_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1", **env,
        }
        processes.append(subprocess.Popen(
            [sys.executable, worker, out_dir, ",".join(scenarios)], env=rank_env,
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


def run_scenarios(scenarios: dict[str, Callable[[Any], None]], out_dir: str, names: str) -> None:
    """A rank's main: join the group (backend from DIST_BACKEND, timeout DIST_TIMEOUT), run each scenario on
    this rank's device, record each outcome as it ends."""
    import torch
    import torch.distributed as dist

    import torch_pjrt.distributed as pjrt_dist

    pjrt_dist.register()
    timeout = timedelta(seconds=float(os.environ.get("DIST_TIMEOUT", "60")))
    dist.init_process_group(backend=os.environ.get("DIST_BACKEND") or None, timeout=timeout)
    device = pjrt_dist.local_device()
    torch.pjrt.set_device(device)
    results = {}
    for name in names.split(","):
        try:
            scenarios[name](device)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as handle:
            json.dump(results, handle)
    dist.destroy_process_group()
