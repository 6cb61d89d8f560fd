"""torch.distributed on pjrt devices: the "pjrt" c10d backend and the per-rank device.

`register()` runs when torch_pjrt registers the device; afterwards `init_process_group()`
with no backend, under torchrun, uses the "pjrt" backend (for pjrt and CPU tensors).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from torch_pjrt.runtime.startup import NAME

_state = {"registered": False}


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    from torch_pjrt.distributed import backend

    return backend.create(store, rank, size, timeout)


def register() -> None:
    """Register the "pjrt" c10d backend for pjrt devices (idempotent, cheap, no jax)."""
    if _state["registered"] or not torch.distributed.is_available():
        return
    torch.distributed.Backend.register_backend(NAME, _create, devices=[NAME])
    _state["registered"] = True


def engine() -> dict[str, Any]:
    """Which engine runs this process's pjrt collectives: "xla" (jax's multi-process runtime) or "host", and why."""
    from torch_pjrt.runtime import multiprocess

    return multiprocess.status()


def local_device() -> torch.device:
    """This rank's device: pjrt:LOCAL_RANK when the platform has that many devices, else pjrt:0."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(NAME, local_rank if local_rank < torch.pjrt.device_count() else 0)


__all__ = ["NAME", "engine", "local_device", "register"]
