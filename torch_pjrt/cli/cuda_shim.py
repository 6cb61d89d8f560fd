"""Run CUDA code unmodified on another device: `torch.cuda`, "cuda" devices and CUDA AMP, redirected.

Three pieces, all undone on exit:
- `torch.cuda`'s functions and classes become torch.pjrt's (`is_available()` is true);
- a TorchFunctionMode rewrites "cuda", "cuda:N" and torch.device("cuda") arguments of every torch
  function and tensor method (factories, `.to()`, `.cuda()`, hence `Module.cuda()`) to the target;
- `torch.autocast("cuda")` and the CUDA GradScalers use the target device type.

The mode is per thread, like every TorchFunctionMode: work that a script starts in other threads
(DataLoader workers excepted: they only build CPU tensors) is not redirected.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

DEVICE_STRING = re.compile(r"cuda(:\d+)?")

# torch.cuda members that torch.pjrt mirrors under the same name.
MIRRORED = (
    "is_available device_count current_device set_device synchronize manual_seed manual_seed_all seed seed_all "
    "initial_seed get_rng_state set_rng_state get_rng_state_all set_rng_state_all get_device_name "
    "get_device_properties get_device_capability memory_allocated max_memory_allocated memory_reserved "
    "max_memory_reserved memory_stats reset_peak_memory_stats reset_max_memory_allocated empty_cache "
    "mem_get_info is_bf16_supported is_initialized init device Stream Event current_stream default_stream "
    "stream set_stream"
).split()


def map_device(value: Any, target: str) -> Any:
    """A CUDA device (string, torch.device) as the target device; anything else unchanged."""
    if isinstance(value, str) and DEVICE_STRING.fullmatch(value):
        value = torch.device(value)
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device(target) if target == "cpu" or value.index is None else torch.device(target, value.index)
    return value


def cuda_target(device: Any, target: str) -> torch.device:
    """Where `tensor.cuda(device)` goes: an index, a CUDA device or None."""
    if device is None or target == "cpu":
        return torch.device(target)
    if isinstance(device, int):
        return torch.device(target, device)
    return map_device(torch.device(device), target)


class DeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch functions and tensor methods; sees every backward call."""

    def __init__(self, target: str, on_backward: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.target = target
        self.on_backward = on_backward

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return self.cuda(*args, **kwargs)
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]  # pinned host memory is a CUDA transfer optimisation; PJRT copies from any buffer
        if name == "backward" and self.on_backward is not None and args and isinstance(args[0], torch.Tensor):
            self.on_backward(args[0])
        args = tuple(map_device(value, self.target) for value in args)
        kwargs = {key: map_device(value, self.target) for key, value in kwargs.items()}
        return func(*args, **kwargs)

    def cuda(self, tensor: torch.Tensor, device: Any = None, non_blocking: bool = False,
             memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        return tensor.to(cuda_target(device, self.target), non_blocking=non_blocking, memory_format=memory_format)


def device_module_function(function: Callable) -> Callable:
    """A torch.pjrt function that accepts the CUDA device arguments a script passes to torch.cuda."""

    def mapped(*args: Any, **kwargs: Any) -> Any:
        args = tuple(map_device(value, "pjrt") for value in args)
        kwargs = {key: map_device(value, "pjrt") for key, value in kwargs.items()}
        return function(*args, **kwargs)

    mapped.__name__ = getattr(function, "__name__", "mapped")
    mapped.__doc__ = getattr(function, "__doc__", None)
    return mapped


def amp_classes(target: str) -> dict[str, type]:
    """autocast and GradScaler classes that read a CUDA device type as the target's."""
    base_autocast = torch.amp.autocast_mode.autocast
    base_scaler = torch.amp.grad_scaler.GradScaler

    def device_type(value: Any) -> str:
        mapped = map_device(value, target)
        return mapped.type if isinstance(mapped, torch.device) else value

    class Autocast(base_autocast):
        def __init__(self, device_type_: str, *args: Any, **kwargs: Any) -> None:
            super().__init__(device_type(device_type_), *args, **kwargs)

    class CudaAmpAutocast(base_autocast):
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> None:
            super().__init__(target, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    class GradScaler(base_scaler):
        def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
            super().__init__(device_type(device), *args, **kwargs)

    class CudaAmpGradScaler(base_scaler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(target, *args, **kwargs)

    for cls, name in ((Autocast, "autocast"), (CudaAmpAutocast, "autocast"), (GradScaler, "GradScaler"),
                      (CudaAmpGradScaler, "GradScaler")):
        cls.__name__ = cls.__qualname__ = name
    return {"autocast": Autocast, "cuda_autocast": CudaAmpAutocast, "GradScaler": GradScaler,
            "cuda_GradScaler": CudaAmpGradScaler}


class CudaShim:
    """`with CudaShim("pjrt"):` runs CUDA code on pjrt (target "cpu" runs it on CPU, for baselines)."""

    def __init__(self, target: str = "pjrt", on_backward: Callable[[torch.Tensor], None] | None = None) -> None:
        if target not in ("pjrt", "cpu"):
            raise ValueError(f"the CUDA shim targets pjrt or cpu, not {target!r}")
        self.target = target
        self.mode = DeviceMode(target, on_backward)
        self.saved: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name, None))))
        setattr(owner, name, value)

    def __enter__(self) -> CudaShim:
        device_module = torch.pjrt
        for name in MIRRORED:
            value = getattr(device_module, name)
            if not isinstance(value, type):
                value = device_module_function(value)
            self.patch(torch.cuda, name, value)
        classes = amp_classes(self.target)
        self.patch(torch, "autocast", classes["autocast"])
        self.patch(torch.amp, "autocast", classes["autocast"])
        self.patch(torch.amp, "GradScaler", classes["GradScaler"])
        self.patch(torch.cuda.amp, "autocast", classes["cuda_autocast"])
        self.patch(torch.cuda.amp, "GradScaler", classes["cuda_GradScaler"])
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()
