"""torch.save / torch.load of pjrt tensors: stored through CPU, restored onto pjrt."""

from __future__ import annotations

from typing import Any

import torch


def _tag(obj: Any) -> str | None:
    if getattr(obj, "device", None) is not None and obj.device.type == "pjrt":
        return str(obj.device)
    return None


def _deserialize(obj: Any, location: str) -> Any:
    if not location.startswith("pjrt"):
        return None
    from torch_pjrt import device as device_module

    index = torch.device(location).index or 0
    if index >= device_module.device_count():
        index = 0
    return obj.pjrt(index) if hasattr(obj, "pjrt") else obj


def register() -> None:
    torch.serialization.register_package(30, _tag, _deserialize)
