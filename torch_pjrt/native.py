"""The optional native guard, hooks and generator of the pjrt device (torch_pjrt._hooks).

PyTorch's Python-registered guard reports a single device, so autograd keeps one device
queue, and its Python hooks have no generators. `install()` registers C++ versions first;
the Python registration then finds them and skips its own. Without the compiled module
(another torch version, a source checkout) everything falls back to the Python ones.

Ordering: install before the first backward of the process. The autograd engine reads the
guard's device count once, at that first backward (a CPU-only one included), and keeps that
many device queues for good: a backward on pjrt:k with k beyond it fails with an internal
assert. The real count is only known once jax starts, so `install()` takes a separate
`engine_devices`, an upper bound the engine sees whatever the count is, and
`set_device_count()` updates the count `torch.accelerator` and the generators use.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch


def _module() -> ModuleType | None:
    try:
        return importlib.import_module("torch_pjrt._hooks")
    except ImportError:
        return None


def available() -> bool:
    """Whether the native module was built for this torch."""
    return _module() is not None


def install(device_count: int, engine_devices: int = 0) -> bool:
    """Register the native guard and hooks; False (never an error) when they cannot be used."""
    module = _module()
    if module is None:
        return False
    return module.install(device_count, engine_devices)


@functools.cache
def tensor_factory() -> Callable[..., torch.Tensor] | None:
    """The native `new_tensor(index, dtype, sizes, strides, address, nbytes)`, or None (use the Python path)."""
    module = _module()
    return getattr(module, "new_tensor", None)


def dispatch_module() -> ModuleType | None:
    """The module whose native kernels run strict eager's cache hits (csrc/dispatch.cpp), or None: not
    built, or turned off by TORCH_PJRT_NATIVE_DISPATCH=0 (every op then runs its Python kernel)."""
    from torch_pjrt import envvars

    module = _module()
    if module is None or not hasattr(module, "register_kernel") or not envvars.flag("TORCH_PJRT_NATIVE_DISPATCH"):
        return None
    return module


@functools.cache
def counting_module() -> ModuleType | None:
    """The module whose storages count their own bytes (runtime/memory.py reads it), or None."""
    module = _module()
    return module if module is not None and hasattr(module, "memory_counts") else None


def new_address(nbytes: int) -> int | None:
    """A fresh fake storage address from the native allocator (None without the module: Python allocates)."""
    allocate = _allocator()
    return None if allocate is None else allocate(nbytes)


@functools.cache
def _allocator() -> Callable[[int], int] | None:
    """The native allocator, looked up once: every tensor made in Python asks it (the module's import lookup
    was 1.0 of its 1.2 us)."""
    module = _module()
    return None if module is None else module.new_address


def installed() -> bool:
    module = _module()
    return module is not None and module.installed()


def set_device_count(n: int) -> None:
    """Update the count once the real one is known (no-op without the native module)."""
    module = _module()
    if module is not None:
        module.set_device_count(n)


def default_generator(index: int) -> torch.Generator:
    """The default generator of pjrt:index (requires `install()`)."""
    module = _module()
    if module is None:
        raise RuntimeError("torch_pjrt._hooks is not built: reinstall with `pip install --no-build-isolation -e .`.")
    return module.default_generator(index)
