"""Jitted programs and their cache, shared by strict eager, fused and compiled execution."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

from torch_pjrt.runtime import client, metrics, profiling


class Program:
    """One jitted function. Compiles are counted by the client's jax event listener (so retraces for
    new input shapes count too); a program with a `counter` also counts its first call there."""

    __slots__ = ("_run", "_jitted", "name", "counter", "device_index")

    def __init__(self, fn: Callable, name: str, donate: tuple[int, ...] = (), device_index: int | None = None,
                 counter: str | None = None) -> None:
        jax = client.jax_module()
        options: dict[str, Any] = {"donate_argnums": donate}
        if device_index is not None:
            options["out_shardings"] = jax.sharding.SingleDeviceSharding(client.device_for(device_index))
        self._jitted = jax.jit(fn, **options)
        self.name = name
        # A metrics counter of its own kind (e.g. "graph_compiles"), counted besides "compiles".
        self.counter = counter
        self.device_index = device_index
        self._run = self._first_call

    def call(self, *args: Any) -> Any:
        """Run the program. Every program runs here, so faults are handled here, not per op: an allocation
        the device cannot make raises torch.OutOfMemoryError (and the process goes on), a forked child
        refuses at once instead of hanging, and while a profiler records the device each launch is timed."""
        client.refuse_in_forked_child()
        try:
            if profiling.recording is None:
                return self._run(*args)
            return profiling.timed_call(self._run, args, self.name, self.device_index)
        except (RuntimeError, MemoryError) as error:
            self.reraise(error, args)

    def reraise(self, error: BaseException, args: tuple) -> None:
        """Raise a failed call's error: a device allocation failure as torch.OutOfMemoryError, the rest as is."""
        if isinstance(error, (RuntimeError, MemoryError)) and client.is_out_of_memory(error):
            raise client.out_of_memory_from(error, args, self.device_index) from None
        raise error

    @property
    def compiled(self) -> bool:
        """Whether the first call (which compiles and counts) is done, so `jitted` can be called directly."""
        return self._run is self._jitted

    @property
    def jitted(self) -> Any:
        return self._jitted

    def _first_call(self, *args: Any) -> Any:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            result = self._jitted(*args)
        seconds = time.perf_counter() - start
        if self.counter:
            metrics.bump(self.counter)
            metrics.bump(f"{self.counter}_seconds", seconds)
        self._run = self._jitted
        return result

    def lower_text(self, *args: Any) -> str:
        return self._jitted.lower(*args).as_text()


class ProgramCache:
    """Programs by structural key; hits and misses are counted."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, Any] = {}

    def get(self, key: Hashable) -> Any:
        entry = self.entries.get(key)
        metrics.bump("cache_hits" if entry is not None else "cache_misses")
        return entry

    def put(self, key: Hashable, entry: Any) -> Any:
        self.entries[key] = entry
        return entry
