"""Device memory accounting, and the out-of-memory error users see (torch.OutOfMemoryError, as on CUDA)."""

from __future__ import annotations

import threading

import torch

from torch_pjrt import native


class MemoryStats:
    """Bytes held by live pjrt storages, per device (what torch.cuda.memory_allocated counts).

    With the native module, storages count themselves (csrc/hooks.cpp: from when they are made until
    their DataPtr is freed). Without it, DeviceStorage objects call `add` when made and freed; they are
    made and freed on every thread (autograd's device threads, a user's threads, the garbage
    collector), so updates take a lock: unlocked read-modify-writes lose updates under threads.
    """

    def __init__(self) -> None:
        self._allocated: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self._allocations: dict[int, int] = {}
        self._out_of_memory: dict[int, int] = {}
        # Reentrant: a storage's __del__ may run on this thread while it holds the lock.
        self._lock = threading.RLock()

    def add(self, index: int, nbytes: int) -> None:
        with self._lock:
            now = self._allocated.get(index, 0) + nbytes
            self._allocated[index] = now
            if now > self._peak.get(index, 0):
                self._peak[index] = now
            if nbytes > 0:
                self._allocations[index] = self._allocations.get(index, 0) + 1

    def counts(self, index: int) -> tuple[int, int, int]:
        """(bytes allocated, peak bytes, allocations made) on pjrt:index."""
        module = native.counting_module()
        if module is not None:
            return module.memory_counts(index)
        with self._lock:
            return self._allocated.get(index, 0), self._peak.get(index, 0), self._allocations.get(index, 0)

    def out_of_memory_errors(self, index: int) -> int:
        """How many allocations pjrt:index refused (torch.OutOfMemoryError raised), as CUDA's num_ooms."""
        with self._lock:
            return self._out_of_memory.get(index, 0)

    def count_out_of_memory(self, index: int) -> None:
        with self._lock:
            self._out_of_memory[index] = self._out_of_memory.get(index, 0) + 1

    def allocated(self, index: int) -> int:
        return self.counts(index)[0]

    def reset_peak(self, index: int) -> None:
        module = native.counting_module()
        if module is not None:
            module.reset_peak(index)
            return
        with self._lock:
            self._peak[index] = self._allocated.get(index, 0)


stats = MemoryStats()


def format_size(nbytes: int) -> str:
    """Bytes as CUDA's messages show them (1.50 GiB)."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    value = nbytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def out_of_memory(
    index: int, asked: int | None, total: int, source: str, free: int | None = None, detail: str = ""
) -> torch.OutOfMemoryError:
    """The error for an allocation pjrt:index cannot hold: the size asked, the device, what is in use."""
    size = "an unknown size" if asked is None else format_size(asked)
    stats.count_out_of_memory(index)
    free_part = "" if free is None else f", {format_size(free)} free"
    cause = f" ({detail})" if detail else ""
    return torch.OutOfMemoryError(
        f"pjrt:{index} is out of memory: tried to allocate {size} on a device of {format_size(total)} "
        f"({source}{free_part}) where pjrt tensors hold {format_size(stats.allocated(index))} "
        f"(torch.pjrt.memory_allocated()){cause}; free tensors that are no longer needed, or use smaller "
        "sizes or batches."
    )
