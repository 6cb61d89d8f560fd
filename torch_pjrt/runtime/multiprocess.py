"""jax's multi-process runtime, started from torchrun's environment before jax's backends.

Collectives across processes run inside XLA programs (gloo on jaxlib's CPU client, NCCL on
GPUs, ICI on TPUs) only when jax's distributed runtime joins the processes before any backend
exists. So the first device use of a process launched by torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) calls `jax.distributed.initialize` with process id RANK; the
coordinator listens on MASTER_PORT + 1 of MASTER_ADDR unless TORCH_PJRT_COORDINATOR names
another address. Where that cannot happen, `status()` says why, and c10d's "pjrt" backend
uses its host engine (gloo over host copies) instead.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from torch_pjrt import envvars

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800
_state: dict[str, Any] = {"joined": False, "reason": "no device has been used yet", "timeout_s": None}


def wanted() -> str | None:
    """Why the runtime will not be started in this process, or None when it will."""
    choice = envvars.value("TORCH_PJRT_DISTRIBUTED").strip().lower()
    if choice == "host":
        return "TORCH_PJRT_DISTRIBUTED=host"
    if choice not in ("", "auto", "xla"):
        raise RuntimeError(f"TORCH_PJRT_DISTRIBUTED={choice!r} is not a choice; use auto, xla or host.")
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        return f"no torchrun environment ({', '.join(missing)} unset)"
    if int(os.environ["WORLD_SIZE"]) < 2:
        return "WORLD_SIZE is 1"
    return None


def coordinator_address() -> str:
    explicit = envvars.value("TORCH_PJRT_COORDINATOR").strip()
    if explicit:
        return explicit
    return f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"


def port_in_use(port: int) -> bool:
    """Whether another socket listens on `port` of this host, probed as jax's coordinator service listens (every
    address, IPv6 where the host has it)."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # (no IPv6 on this host)
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return True
                continue
            return False
    return False


def _check_coordinator_port(address: str) -> None:
    """Raise if the coordinator's port is already taken on this host: jax's coordinator service (rank 0 hosts it)
    ends the process with a segmentation fault when it cannot listen, where a clear error can be given first."""
    port = int(address.rpartition(":")[2])
    if port_in_use(port):
        raise RuntimeError(
            f"port {port} for jax's distributed runtime coordinator (MASTER_PORT + 1 unless TORCH_PJRT_COORDINATOR "
            "names one) is in use on this host; set TORCH_PJRT_COORDINATOR to a free host:port, or launch with "
            "another MASTER_PORT.")


def set_collective_timeout(seconds: float) -> None:
    """The process group's timeout, for XLA's CPU collectives (read when the backend starts)."""
    if _state["timeout_s"] is None:
        _state["timeout_s"] = max(1, int(seconds))


def _collective_timeout_flags(seconds: int) -> None:
    """Bound XLA's CPU collectives by the group's timeout (a peer that never comes raises, no hang)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_timeout_seconds" not in flags:
        extra = (f"--xla_cpu_collective_timeout_seconds={seconds} "
                 f"--xla_cpu_collective_call_terminate_timeout_seconds={seconds}")
        os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()


def initialize(jax: Any) -> None:
    """Join the job's processes in jax's runtime, if torchrun launched this one (before any backend)."""
    reason = wanted()
    if reason is not None:
        _state["reason"] = reason
        return
    timeout = _state["timeout_s"] or DEFAULT_COLLECTIVE_TIMEOUT_S
    _collective_timeout_flags(timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    options: dict[str, Any] = {}
    platform = envvars.value("TORCH_PJRT_PLATFORM").strip().lower()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if platform in ("cuda", "gpu", "tpu") and local_world > 1:
        # One accelerator per process, as torchrun's one-process-per-GPU layout expects.
        options["local_device_ids"] = [int(os.environ.get("LOCAL_RANK", "0"))]
    if rank == 0:
        _check_coordinator_port(coordinator_address())
    try:
        jax.distributed.initialize(
            coordinator_address(), num_processes=world, process_id=rank,
            initialization_timeout=min(timeout, 300), heartbeat_timeout_seconds=max(10, min(timeout, 100)),
            shutdown_timeout_seconds=min(timeout, 60), **options,
        )
    except Exception as error:  # noqa: BLE001 (the host engine still works; status() reports why)
        _state["reason"] = f"jax.distributed.initialize failed: {type(error).__name__}: {error}"
        return
    _state["joined"] = True
    _state["reason"] = None


def joined() -> bool:
    """Whether this process is one of jax's distributed runtime's processes."""
    return _state["joined"]


def status() -> dict[str, Any]:
    """What `torch-pjrt info` and c10d's backend report for groups of this job's processes: the XLA engine
    (joined, or a job of one process) or the host engine, and why."""
    if _state["joined"]:
        return {"engine": "xla", "process": int(os.environ["RANK"]), "processes": int(os.environ["WORLD_SIZE"]),
                "coordinator": coordinator_address(), "collective_timeout_s": _state["timeout_s"]
                or DEFAULT_COLLECTIVE_TIMEOUT_S}
    if _state["reason"] == "WORLD_SIZE is 1":  # a one-process group's mesh is this process's device
        return {"engine": "xla", "process": 0, "processes": 1, "coordinator": None, "collective_timeout_s": None}
    return {"engine": "host", "reason": _state["reason"]}
