"""Device timing of program launches while a profiler asks for the device's activity.

Off (the default) nothing here runs: `Program.call` reads `recording` once and goes on. On, every
launch waits for its results, so each program's device time is the wall time from its launch to
its completion, with nothing of its own queued behind other work. This module knows nothing of
PyTorch's profiler; torch_pjrt/profiler.py starts and stops it and hands the launches to PyTorch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from torch_pjrt.runtime import client, metrics


class Launch(NamedTuple):
    """One executed program: its name, pjrt device index, issuing OS thread, and launch and
    completion times in ns since the Unix epoch (the clock PyTorch's profiler stamps its events with)."""

    name: str
    device: int
    thread: int
    start_ns: int
    end_ns: int
    compiled_now: bool  # jax compiled during the call: its time includes tracing and compiling


class Recording:
    """The launches of one profiling window, in order of completion."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []


# The open recording, or None: the one flag Program.call checks.
recording: Recording | None = None
_lock = threading.Lock()


def start() -> Recording:
    """Open a recording (one at a time, as PyTorch's profiler allows one at a time)."""
    global recording
    with _lock:
        if recording is not None:
            raise RuntimeError("a pjrt device recording is already open; stop the running profiler first.")
        recording = Recording()
        return recording


def stop() -> Recording | None:
    """Close the open recording and return it (None when none was open)."""
    global recording
    with _lock:
        closed, recording = recording, None
        return closed


def timed_call(run: Callable[..., Any], args: tuple, name: str, device: int | None) -> Any:
    """Call `run(*args)`, wait for its results, and record the launch in the open recording."""
    jax = client.jax_module()
    compiles = metrics.counters_now("compiles")
    start_ns = time.time_ns()
    result = run(*args)
    jax.block_until_ready(result)
    end_ns = time.time_ns()
    if device is None:
        device = client.index_of(jax.tree_util.tree_leaves(result))
    opened = recording
    if opened is not None:
        opened.launches.append(Launch(name, device, threading.get_native_id(), start_ns, end_ns,
                                       metrics.counters_now("compiles") != compiles))
        metrics.bump("profiled_programs")
    return result
