"""PyTorch's profiler sees the pjrt device (docs/profiler.md).

A profiler started with `ProfilerActivity.PrivateUse1` (torch.profiler) or `use_device="pjrt"`
(torch.autograd.profiler) opens a device recording (runtime/profiling.py) for its window: every
program launch is then timed to its completion, and the native hit path is off, so every op goes
through Python where the launches are timed. When the window closes, each launch becomes a device
event in `events()` / `key_averages()` (and a kernel of the innermost CPU op that was running when
it launched: its issuing aten op or graph), and a slice on a "pjrt:N" device track of the Chrome
trace, with a flow arrow from that CPU op. TORCH_PJRT_PROFILE_JAX_DIR also runs jax's own profiler
for the window. Nothing happens for profilers that do not ask for the device.
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import os
import warnings
import weakref
from typing import Any

import torch

from torch_pjrt import _torch_private, envvars, native
from torch_pjrt.runtime import profiling, startup

DEVICE_TRACK_THREAD = 0
FLOW_CATEGORY = "ac2g"  # the category kineto gives its CPU-op-to-device-kernel arrows


@dataclasses.dataclass
class Window:
    """One profiling window of a profiler object: its recording while open, its launches once closed."""

    recording: profiling.Recording | None
    native_was_on: bool
    jax_trace_dir: str | None
    launches: list[profiling.Launch] = dataclasses.field(default_factory=list)


_windows: weakref.WeakKeyDictionary[Any, Window] = weakref.WeakKeyDictionary()


def install() -> bool:
    """Hook PyTorch's profiler (cheap, no jax); False where this torch has no place to hook."""
    return _torch_private.hook_profiler(_started, _stopping, _parsed, _exported)


def launches_of(profile: Any) -> list[profiling.Launch]:
    """The program launches recorded in `profile`'s last closed window (a torch.profiler.profile or the
    torch.autograd.profiler.profile inside it)."""
    window = _windows.get(getattr(profile, "profiler", None) or profile)
    return [] if window is None else list(window.launches)


def jax_trace_dir_of(profile: Any) -> str | None:
    """The folder jax's profiler wrote `profile`'s last window to (TORCH_PJRT_PROFILE_JAX_DIR), or None."""
    window = _windows.get(getattr(profile, "profiler", None) or profile)
    return None if window is None else window.jax_trace_dir


def _wants_device(profile: Any) -> bool:
    return getattr(profile, "use_device", None) == startup.NAME


def _started(profile: Any) -> None:
    if not _wants_device(profile):
        return
    startup.ensure_started()
    recording = profiling.start()
    module = native.dispatch_module()
    native_was_on = module is not None and module.dispatch_enabled()
    if native_was_on:
        module.set_dispatch_enabled(False)
    jax_dir = envvars.value("TORCH_PJRT_PROFILE_JAX_DIR").strip() or None
    window = _windows[profile] = Window(recording, native_was_on, jax_dir)
    if jax_dir is not None:
        import jax

        try:
            jax.profiler.start_trace(jax_dir)
        except Exception as error:  # noqa: BLE001 (the torch profile goes on without jax's trace)
            window.jax_trace_dir = None
            warnings.warn(f"TORCH_PJRT_PROFILE_JAX_DIR={jax_dir}: jax's profiler did not start ({error}); "
                          "profiling without its trace.", stacklevel=2)


def _stopping(profile: Any) -> None:
    window = _windows.get(profile)
    if window is None or window.recording is None:
        return
    try:
        _flush_fused()
    finally:
        profiling.stop()
        window.launches, window.recording = window.recording.launches, None
        if window.native_was_on:
            native.dispatch_module().set_dispatch_enabled(True)
        if window.jax_trace_dir is not None:
            import jax

            jax.profiler.stop_trace()


def _flush_fused() -> None:
    """Run pending fused work now, inside the window, under an op of its own (launches while recording
    wait for their results: nothing else is queued)."""
    from torch_pjrt.eager import fusion

    if fusion.pending():
        with torch.profiler.record_function("pjrt::synchronize"):
            fusion.flush("profiler stop")


def _innermost(starts: list[float], ends: list[float], start: float, end: float) -> int | None:
    """Of spans sorted by start, the latest-started one that covers [start, end] (CPU ops nest, so the
    innermost op open over a launch: the one that issued it), or None."""
    for position in range(bisect.bisect_right(starts, start) - 1, -1, -1):
        if ends[position] >= end:
            return position
    return None


def _parsed(profile: Any, events: list[Any], trace_start_ns: int) -> list[Any]:
    window = _windows.get(profile)
    if window is None or not window.launches:
        return events
    cpu_type = torch.autograd.DeviceType.CPU
    cpu = sorted((e for e in events if e.device_type == cpu_type and not e.is_async), key=lambda e: e.time_range.start)
    starts, ends = [e.time_range.start for e in cpu], [e.time_range.end for e in cpu]
    next_id = max((e.id for e in events), default=0) + 1
    for launch in window.launches:
        start_us, end_us = (launch.start_ns - trace_start_ns) / 1000, (launch.end_ns - trace_start_ns) / 1000
        position = _innermost(starts, ends, start_us, end_us)
        issuer = None if position is None else cpu[position]
        if issuer is not None:
            issuer.append_kernel(launch.name, launch.device, end_us - start_us)
        events.append(_torch_private.profiler_device_event(
            next_id, launch.name, 0 if issuer is None else issuer.thread, start_us, end_us, launch.device,
            profile.use_device))
        next_id += 1
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    return events


def _exported(profile: Any, path: str) -> None:
    window = _windows.get(profile)
    if window is None or not (window.launches or window.jax_trace_dir):
        return
    with open(path, "rb") as file:
        compressed = file.read(2) == b"\x1f\x8b"  # kineto writes plain JSON whatever the name says
    opener = gzip.open if compressed else open
    with opener(path, "rt") as file:
        trace = json.load(file)
    add_device_tracks(trace, window.launches)
    if window.jax_trace_dir is not None:
        trace["pjrtJaxTraceDir"] = os.path.abspath(window.jax_trace_dir)
    with opener(path, "wt") as file:
        json.dump(trace, file)


def _device_pid(device: int) -> str:
    """The trace process of a device: a name, as kineto names its "Spans" process (its numbers 0-15 are GPU rows)."""
    return f"pjrt:{device}"


def add_device_tracks(trace: dict[str, Any], launches: list[profiling.Launch]) -> None:
    """Add a "pjrt:N" process per device to a Chrome trace (kineto's JSON), one slice per launch, and
    a flow arrow from the innermost CPU op slice of the launching thread to each slice."""
    events = trace.setdefault("traceEvents", [])
    base_ns = int(trace.get("baseTimeNanoseconds", 0))
    slices: dict[Any, list[dict[str, Any]]] = {}  # this process's slices by thread, sorted by start
    for event in events:
        if event.get("ph") == "X" and event.get("pid") == os.getpid():
            slices.setdefault(event.get("tid"), []).append(event)
    for thread in slices.values():
        thread.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in thread] for tid, thread in slices.items()}
    ends = {tid: [e["ts"] + e.get("dur", 0) for e in thread] for tid, thread in slices.items()}
    devices = sorted({launch.device for launch in launches})
    flow_ids = [e["id"] for e in events if e.get("ph") in ("s", "f") and isinstance(e.get("id"), int)]
    next_flow = max(flow_ids, default=0) + 1
    for device in devices:
        pid = _device_pid(device)
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pid}},
            {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "XLA programs"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": 1000 + device}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": DEVICE_TRACK_THREAD,
             "args": {"name": "programs (launch to completion)"}},
        ]
    for launch in launches:
        pid = _device_pid(launch.device)
        ts = round((launch.start_ns - base_ns) / 1000, 3)
        duration = round((launch.end_ns - launch.start_ns) / 1000, 3)
        position = _innermost(starts.get(launch.thread, []), ends.get(launch.thread, []), ts, ts + duration)
        issuer = None if position is None else slices[launch.thread][position]
        events.append({"ph": "X", "cat": "kernel", "name": launch.name, "pid": pid, "tid": DEVICE_TRACK_THREAD,
                       "ts": ts, "dur": duration,
                       "args": {"device": launch.device, "issued by": None if issuer is None else issuer["name"],
                                "includes compile": launch.compiled_now, "correlation": next_flow}})
        if issuer is not None:
            events.append({"ph": "s", "id": next_flow, "pid": issuer["pid"], "tid": issuer["tid"], "ts": ts,
                           "cat": FLOW_CATEGORY, "name": FLOW_CATEGORY})
            events.append({"ph": "f", "id": next_flow, "pid": pid, "tid": DEVICE_TRACK_THREAD, "ts": ts,
                           "cat": FLOW_CATEGORY, "name": FLOW_CATEGORY, "bp": "e"})
        next_flow += 1

