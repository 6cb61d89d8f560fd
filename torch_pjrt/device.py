"""`torch.pjrt`: the device module, mirroring `torch.cuda`.

Nothing here loads jax until a function needs a device: `import torch` stays fast.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from typing import Any

import torch

from torch_pjrt.eager import modes
from torch_pjrt.eager.modes import EagerMode, set_eager_mode
from torch_pjrt.runtime import checks, startup
from torch_pjrt.runtime.startup import current_device  # noqa: F401 (torch.pjrt.current_device)


def _client() -> Any:
    from torch_pjrt.runtime import client

    startup.ensure_started()
    return client


def _index(device: Any = None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "pjrt":
        raise ValueError(f"Expected a pjrt device, but got: {device}")
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    try:
        return device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return startup.started()


def init() -> None:
    _client()


def _lazy_init() -> None:
    _client()


def _is_in_bad_fork() -> bool:
    """True in a process forked from one that had started the device (torch.manual_seed skips it then)."""
    from torch_pjrt.runtime import client

    return client.forked


def device_count() -> int:
    return len(_client().devices())


def set_device(device: Any) -> None:
    index = _index(device)
    if index < 0:
        return
    _client().device_for(index)
    startup.set_current_device(index)


class device:  # noqa: N801 (mirrors torch.cuda.device)
    """Context manager that changes the current pjrt device."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.index >= 0:
            set_device(self.index)

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0:
            set_device(self.previous)


def synchronize(device: Any = None) -> None:
    """Wait until every queued op on the device has finished."""
    from torch_pjrt.eager import fusion

    client = _client()
    fusion.flush("synchronize")
    index = _index(device)
    target = client.device_for(index)
    client.synchronize([a for a in client.jax_module().live_arrays() if target in a.devices()])
    checks.raise_pending()


# --- random numbers ----------------------------------------------------------------------


def _rng(device: Any = None) -> Any:
    from torch_pjrt.runtime import rng

    return rng.state(_index(device))


def manual_seed(seed: int) -> None:
    _rng().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    from torch_pjrt.runtime import rng

    rng.manual_seed_all(int(seed))


def seed() -> None:
    from torch_pjrt.runtime import rng

    manual_seed(rng.fresh_seed())


def seed_all() -> None:
    from torch_pjrt.runtime import rng

    manual_seed_all(rng.fresh_seed())


def initial_seed() -> int:
    return _rng().seed


def get_rng_state(device: Any = "pjrt") -> torch.Tensor:
    return torch.from_numpy(_rng(device).get_state().copy())


def set_rng_state(new_state: torch.Tensor, device: Any = "pjrt") -> None:
    _rng(device).set_state(new_state.detach().cpu().numpy())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


# --- properties and memory -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    platform: str
    index: int
    total_memory: int
    memory_source: str

    def __repr__(self) -> str:
        return (
            f"_PjrtDeviceProperties(name='{self.name}', platform='{self.platform}', "
            f"total_memory={self.total_memory // (1 << 20)}MB ({self.memory_source}))"
        )


def _pjrt_stats(index: int) -> dict[str, Any]:
    return _client().device_for(index).memory_stats() or {}


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_properties(device: Any = None) -> DeviceProperties:
    client = _client()
    index = _index(device)
    handle = client.device_for(index)
    total, source = client.memory_limit(index)
    name = getattr(handle, "device_kind", str(handle))
    return DeviceProperties(str(name), client.platform(), index, total, source)


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """The CUDA compute capability of a pjrt device on the cuda platform (what jaxlib reports)."""
    handle = _client().device_for(_index(device))
    capability = getattr(handle, "compute_capability", None)
    if not capability:
        raise RuntimeError(
            f"pjrt:{_index(device)} is a {_client().platform()} device: it has no CUDA compute capability; "
            "check torch.pjrt.get_device_properties() instead."
        )
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


def memory_allocated(device: Any = None) -> int:
    """Bytes held by live pjrt tensors' storages on the device."""
    from torch_pjrt.runtime import memory

    return memory.stats.counts(_index(device))[0]


def max_memory_allocated(device: Any = None) -> int:
    from torch_pjrt.runtime import memory

    return memory.stats.counts(_index(device))[1]


def memory_reserved(device: Any = None) -> int:
    """What PJRT reports as in use on the device (bytes_in_use), else the allocated bytes."""
    stats = _pjrt_stats(_index(device))
    return int(stats.get("bytes_in_use", memory_allocated(device)))


def max_memory_reserved(device: Any = None) -> int:
    stats = _pjrt_stats(_index(device))
    return int(stats.get("peak_bytes_in_use", max_memory_allocated(device)))


def memory_stats(device: Any = None) -> dict[str, Any]:
    """torch.cuda-style keys from torch_pjrt's accounting, plus PJRT's own figures as `pjrt.*`.

    There is no caching allocator in between: active bytes are the allocated ones, reserved bytes are what
    PJRT holds, and an allocation is never retried after freeing a cache."""
    from torch_pjrt.runtime import memory

    index = _index(device)
    allocated, peak, allocations = memory.stats.counts(index)
    stats: dict[str, Any] = {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "active_bytes.all.current": allocated,
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.current": memory_reserved(index),
        "reserved_bytes.all.peak": max_memory_reserved(index),
        "allocation.all.allocated": allocations,
        "num_alloc_retries": 0,
        "num_ooms": memory.stats.out_of_memory_errors(index),
    }
    for key, value in _pjrt_stats(index).items():
        stats[f"pjrt.{key}"] = value
    return stats


def reset_peak_memory_stats(device: Any = None) -> None:
    from torch_pjrt.runtime import memory

    memory.stats.reset_peak(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def empty_cache() -> None:
    """A no-op kept for torch.cuda parity: PJRT frees a buffer as soon as its tensor dies."""


def guard_empty_host_cache() -> None:
    """Make `torch.accelerator.empty_host_cache()` a no-op while pjrt is the accelerator.

    torch 2.13 empties the host cache of the allocator registered for the accelerator's device type, and
    crashes the process when none is registered (pjrt's pinned allocator frees each block on release, so
    it has no cache and registers none). vLLM calls it at shutdown.
    """
    original = torch.accelerator.empty_host_cache
    if getattr(original, "_pjrt_guarded", False):
        return

    def empty_host_cache() -> None:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != "pjrt":
            original()

    empty_host_cache._pjrt_guarded = True  # type: ignore[attr-defined]
    empty_host_cache.__doc__ = original.__doc__
    torch.accelerator.empty_host_cache = empty_host_cache


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: PJRT's figures, or the host's memory where the device is host memory (CPU)."""
    client = _client()
    index = _index(device)
    return client.free_memory(index), client.memory_limit(index)[0]


# --- streams and events ----------------------------------------------------------------------
# PJRT runs a device's programs in issue order on one queue. A Stream is that queue: work
# cannot be split across streams, so wait_* calls are no-ops and synchronize waits for the
# device. An Event marks the last program issued when it is recorded.


def _is_ready(outputs: Any) -> bool:
    """Whether a program's results are computed (results of a fused graph not yet run are not)."""
    from torch_pjrt import storage

    if outputs is None:
        return True
    if isinstance(outputs, startup.WeakResults):
        outputs = outputs.live()
    for leaf in _client().jax_module().tree_util.tree_leaves(outputs):
        if isinstance(leaf, storage.PendingArray):
            leaf = getattr(leaf, "value", None)
            if leaf is None:
                return False
        if not leaf.is_ready():
            return False
    return True


class Stream:
    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("pjrt", _index(device))
        self.priority = priority

    def synchronize(self) -> None:
        synchronize(self.device)

    def wait_stream(self, stream: Stream) -> None:
        """Ordering between streams is implied: there is one queue per device."""

    def wait_event(self, event: Event) -> None:
        """Ordering is implied by the single queue per device."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return _is_ready(startup.newest_outputs().get(self.device.index))

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)


class Event:
    """Marks the newest program issued on a device; a watcher thread timestamps its completion."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.outputs: Any = None
        self.completed_at: float | None = None
        self.watcher: threading.Thread | None = None

    def record(self, stream: Stream | None = None) -> None:
        from torch_pjrt.eager import fusion

        fusion.flush("event")
        index = stream.device.index if stream is not None else current_device()
        self.outputs = startup.newest_outputs().get(index)
        if isinstance(self.outputs, startup.WeakResults):  # held until done, as a CUDA event holds its stream's work
            self.outputs = self.outputs.live()
        self.completed_at = None
        if _is_ready(self.outputs):
            self.completed_at = time.perf_counter()
            self.watcher = None
        else:
            self.watcher = threading.Thread(target=self._watch, daemon=True)
            self.watcher.start()

    def _watch(self) -> None:
        from torch_pjrt.eager import fusion

        arrays = _client().jax_module().tree_util.tree_map(fusion.concrete, self.outputs)
        _client().jax_module().block_until_ready(arrays)
        self.completed_at = time.perf_counter()

    def query(self) -> bool:
        return self.completed_at is not None or _is_ready(self.outputs)

    def synchronize(self) -> None:
        """Wait for the recorded work; a failed device-side check of an op that finished raises here."""
        if self.watcher is not None:
            self.watcher.join()
        checks.raise_pending(wait=False)

    def wait(self, stream: Stream | None = None) -> None:
        """Ordering is implied by the single queue per device."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between the completion of this event's work and end_event's."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time.")
        self.synchronize()
        end_event.synchronize()
        if self.completed_at is None or end_event.completed_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.completed_at - self.completed_at) * 1000.0


def current_stream(device: Any = None) -> Stream:
    return Stream(device)


def default_stream(device: Any = None) -> Stream:
    return Stream(device)


def stream(stream: Stream | None) -> Any:
    return stream if stream is not None else Stream()


def set_stream(stream: Stream) -> None:
    """Every stream is the device's one queue, so there is nothing to switch."""


# --- mixed precision -----------------------------------------------------------------------


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


# --- the module object (module-level property for eager_mode) -------------------------------


class _DeviceModule(types.ModuleType):
    @property
    def eager_mode(self) -> EagerMode:
        return modes.current()

    @eager_mode.setter
    def eager_mode(self, mode: EagerMode) -> None:
        set_eager_mode(mode)


def build_module() -> types.ModuleType:
    module = _DeviceModule("torch.pjrt", __doc__)
    for name, value in globals().items():
        if not name.startswith("__") and name not in ("build_module", "_DeviceModule"):
            setattr(module, name, value)
    module.EagerMode = EagerMode
    module.set_eager_mode = set_eager_mode
    return module
