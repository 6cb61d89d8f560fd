"""FSDP2 on pjrt storages, which cannot be resized in place (yet).

FSDP2 frees an unsharded parameter with `untyped_storage().resize_(0)` and re-allocates it
with `resize_(nbytes)` before the next all-gather writes every element. For pjrt tensors the
free drops the storage's device array instead (the memory is released; the storage reads as
uninitialised) and the re-allocation has nothing to do. Other devices keep FSDP2's functions.
"""

from __future__ import annotations

from typing import Any

import torch

_state = {"installed": False}


def _free(original: Any) -> Any:
    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.device.type != "pjrt":
            return original(tensor)
        from torch_pjrt import storage

        storage.storage_of(tensor).array = None
        return None

    return free_storage


def _alloc(original: Any) -> Any:
    def alloc_storage(tensor: torch.Tensor) -> None:
        return None if tensor.device.type == "pjrt" else original(tensor)

    return alloc_storage


def install() -> None:
    """Route FSDP2's storage free/alloc for pjrt tensors (idempotent)."""
    if _state["installed"]:
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc = _alloc(_fsdp_param.alloc_storage)
    _fsdp_param.free_storage = _free(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage = alloc
    _fsdp_param_group.alloc_storage = alloc
    _state["installed"] = True
