"""Device memory accounting: bytes held by live pjrt storages, per device."""

from __future__ import annotations

import threading


class MemoryStats:
    """Bytes held by live pjrt storages, per device (what torch.cuda.memory_allocated counts).

    Storages are made and freed on every thread (autograd's device threads, a user's threads, the
    garbage collector), so updates take a lock: unlocked read-modify-writes lose updates under threads.
    """

    def __init__(self) -> None:
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.allocations: dict[int, int] = {}
        # Reentrant: a storage's __del__ may run on this thread while it holds the lock.
        self._lock = threading.RLock()

    def add(self, index: int, nbytes: int) -> None:
        with self._lock:
            now = self.allocated.get(index, 0) + nbytes
            self.allocated[index] = now
            if now > self.peak.get(index, 0):
                self.peak[index] = now
            if nbytes > 0:
                self.allocations[index] = self.allocations.get(index, 0) + 1

    def reset_peak(self, index: int) -> None:
        with self._lock:
            self.peak[index] = self.allocated.get(index, 0)


stats = MemoryStats()
