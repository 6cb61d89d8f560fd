"""The optional native guard, hooks and generator of the pjrt device (torch_pjrt._hooks).

PyTorch's Python-registered guard reports a single device, so autograd keeps one device
queue, and its Python hooks have no generators. `install()` registers C++ versions first;
the Python registration then finds them and skips its own. Without the compiled module
(another torch version, a source checkout) everything falls back to the Python ones.

Ordering: the autograd engine reads the guard's device count once, at the first backward
of the process (any device, CPU included), and sizes its device queues with it; a later
`set_device_count()` only changes what the guard and `torch.accelerator` report. So
install before any backward, with a count at least as large as the real one.
"""

from __future__ import annotations

import importlib
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


def install(device_count: int) -> bool:
    """Register the native guard and hooks; False (never an error) when they cannot be used."""
    module = _module()
    if module is None:
        return False
    return module.install(device_count)


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
