"""torch.save / torch.load of pjrt tensors: stored through CPU, restored onto pjrt."""

from __future__ import annotations

from typing import Any

import torch


def _tag(obj: Any) -> str | None:
    if getattr(obj, "device", None) is not None and obj.device.type == "pjrt":
        return str(obj.device)
    return None


def storage_to_pjrt(storage: Any, device: Any = None) -> torch.UntypedStorage:
    """A pjrt copy of a CPU storage's bytes (PyTorch's generated `.pjrt()` would need a C++ allocator)."""
    from torch_pjrt.eager import kernels

    device = torch.device("pjrt" if device is None else device)
    if isinstance(device, int):
        device = torch.device("pjrt", device)
    untyped = storage.untyped() if hasattr(storage, "untyped") else storage
    if untyped.device.type == "pjrt":
        return untyped
    data = torch.empty(0, dtype=torch.uint8).set_(untyped)
    return kernels.to_pjrt(data, kernels.resolve_device(device)).untyped_storage()


def _deserialize(obj: Any, location: str) -> Any:
    if not location.startswith("pjrt"):
        return None
    from torch_pjrt import device as device_module

    index = torch.device(location).index or 0
    if index >= device_module.device_count():
        index = 0
    return storage_to_pjrt(obj, torch.device("pjrt", index))


def _storage_method(self: Any, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    return storage_to_pjrt(self, torch.device("pjrt", device) if isinstance(device, int) else device)


def register() -> None:
    # Before PyTorch's own PrivateUse1 entry (23), whose storage.to(device) needs a C++ allocator.
    torch.serialization.register_package(15, _tag, _deserialize)
    torch.UntypedStorage.pjrt = _storage_method
