"""Starting the device on first use, and the per-thread state every layer reads.

The code that starts the device (load jax, register every kernel) is registration, at the top
of the package, and it imports everything below it. Lower layers that meet the device first
(the `torch.pjrt` module, the catch-all kernel) call `ensure_started()`, which runs the starter
registration installed here; so nothing below registration imports it.

The current device, the newest program's outputs per device (what Streams and Events wait for)
and generator keys live here too, so eager dispatch reads them without importing the device
module, which sits above it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

NAME = "pjrt"  # the device type, as PyTorch names the PrivateUse1 backend
_starter: list[Callable[[], None]] = []
_started = threading.Event()
_local = threading.local()
_newest_outputs: dict[int, Any] = {}


def install_starter(start: Callable[[], None]) -> None:
    """Registration's `initialize`, run by the first `ensure_started()`."""
    _starter[:] = [start]


def mark_started() -> None:
    _started.set()


def started() -> bool:
    return _started.is_set()


def ensure_started() -> None:
    if _started.is_set():
        return
    if not _starter:
        raise RuntimeError("the pjrt device is not registered yet; import torch_pjrt before using it.")
    _starter[0]()


def current_device() -> int:
    """The calling thread's device; with the native guard, the one autograd's device threads set too."""
    from torch_pjrt import native

    if native.installed():
        return torch.accelerator.current_device_index()
    return getattr(_local, "index", 0)


def set_current_device(index: int) -> None:
    from torch_pjrt import native

    if native.installed():
        torch.accelerator.set_device_index(index)
    else:
        _local.index = index


def newest_outputs() -> dict[int, Any]:
    """The live table `note_output` fills (the native dispatch fills it directly)."""
    return _newest_outputs


def note_output(index: int, outputs: Any) -> None:
    """Remember the newest program's results on a device (what an Event waits for)."""
    _newest_outputs[index] = outputs


class WeakResults:
    """A program's results held weakly, for the table `note_output` fills: a compiled graph's results are
    donated to the next graph that writes them, and a strong hold here would turn each donation into a copy.
    All results of one program are ready together (one execution), so one live result stands for all."""

    __slots__ = ("refs",)

    def __init__(self, arrays: list[Any]) -> None:
        self.refs = [weakref.ref(array) for array in arrays]

    def live(self) -> list[Any]:
        """The results still alive (empty where all were freed or donated to later programs)."""
        return [array for array in (ref() for ref in self.refs) if array is not None]


def generator_key(generator: torch.Generator) -> Any:
    """A jax key from a torch.Generator's seed and offset; the generator advances by one."""
    from torch_pjrt.runtime import rng

    seed = generator.initial_seed()
    offset = generator.get_offset()
    generator.set_offset(offset + 1)
    return rng.raw_key(seed, offset)
