"""Device-side checks: a bad index or value found inside the program, raised when the host next waits.

XLA clamps an out-of-range index and goes on; CPU raises. A lowering that indexes or validates
data calls `fail_if(bad, op, message, error, value)` while it is traced: `bad` is a traced boolean
array (its elements that fail the check CPU's kernel makes), `value` the offending values for the
message. The executor that traced it (strict dispatch, a fused graph, a compiled graph) collects
them with `collecting()` and makes their `code()` one more program output, kept on the device. The
host reads pending codes where it waits anyway (`.cpu()`, `.item()`, `synchronize()`, an Event) and
raises the first failure as a RuntimeError naming the op, the check and the user's line, CUDA's
contract; with `at_once` (launch-blocking mode) the op raises CPU's own exception class and message.
`TORCH_PJRT_DEVICE_CHECKS=0` turns the checks off (XLA's clamping, no extra outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import linecache
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from torch_pjrt import envvars
from torch_pjrt.runtime import metrics

ENABLED = envvars.flag("TORCH_PJRT_DEVICE_CHECKS")
# Codes read once this many are pending without a host wait (the oldest half, long finished by then).
MAX_PENDING = 64
# Frames in these folders are not the user's line (torch_pjrt's, torch's)
_LIBRARIES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
              os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


@dataclasses.dataclass(frozen=True)
class Check:
    """One check a lowering makes: CPU's message and exception class. In the message, `{value}` is the
    first offending value and `{position}` its position in the checked array (row-major)."""

    op: str
    message: str
    error: type[Exception] = RuntimeError
    # the user's line, when it is known at trace time (a compiled graph's node)
    where: str | None = None

    def text(self, value: int, position: int) -> str:
        return self.message.format(value=value, position=position)


class Collector:
    """The checks traced into one program, in the order they were made."""

    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.failed: list[Any] = []
        self.values: list[Any] = []
        self.where: str | None = None
        # padded execution: the mask of true elements for an array of this shape (None: drop the check)
        self.valid: Callable[[tuple[int, ...]], Any] | None = None

    def code(self) -> Any:
        """Three int64: 1 + the first failed check's index (0: none failed), its first offending value
        and that value's position. Reductions are plain mins (an argmax is a slow variadic reduce)."""
        import jax.numpy as jnp

        if len(self.failed) == 1:
            return jnp.concatenate([self.failed[0].astype(jnp.int64)[None], self.values[0]])
        return _first(jnp.stack(self.failed), jnp.stack(self.values), jnp.arange(1, len(self.failed) + 1))


def _first(failed: Any, rows: Any, numbers: Any) -> Any:
    """The code of the first failed row (`numbers` its check number, 0 when none failed)."""
    import jax.numpy as jnp

    count = failed.shape[0]
    first = jnp.min(jnp.where(failed, jnp.arange(count), count))
    picked = jnp.minimum(first, count - 1)
    return jnp.concatenate([jnp.where(first < count, numbers[picked], 0)[None], rows[picked]])


class _Tracing(threading.local):
    def __init__(self) -> None:
        self.collectors: list[Collector] = []


_tracing = _Tracing()


@contextmanager
def collecting() -> Iterator[Collector]:
    """Collect the checks made by lowerings traced in this block (nested programs collect their own)."""
    collector = Collector()
    _tracing.collectors.append(collector)
    try:
        yield collector
    finally:
        _tracing.collectors.pop()


@contextmanager
def masked(valid: Callable[[tuple[int, ...]], Any]) -> Iterator[None]:
    """Padded execution: checks see only the true elements (padding holds garbage)."""
    collector = _tracing.collectors[-1] if _tracing.collectors else None
    if collector is None:
        yield
        return
    previous, collector.valid = collector.valid, valid
    try:
        yield
    finally:
        collector.valid = previous


def at_source(stack_trace: str | None) -> None:
    """The user's source of the graph node being traced (a compiled graph), for its checks."""
    if stack_trace and _tracing.collectors:
        _tracing.collectors[-1].where = stack_trace


def fail_if(bad: Any, op: str, message: str, error: type[Exception] = RuntimeError, value: Any = None) -> None:
    """Report a check while tracing a lowering: `bad` marks the elements that fail it, `value` (broadcast
    like `bad`) holds what the message's `{value}` shows; CPU's `error` class and message."""
    if not ENABLED or not _tracing.collectors:
        return
    import jax.numpy as jnp

    collector = _tracing.collectors[-1]
    bad = jnp.asarray(bad)
    if collector.valid is not None:
        mask = collector.valid(tuple(bad.shape))
        if mask is None:
            return
        bad = bad & mask
    flat = bad.reshape(-1)
    count = flat.shape[0]
    if count == 0:
        return
    collector.checks.append(Check(op, message, error, collector.where))
    if value is None and "{position}" not in message:
        # the message names neither: one cheap `any`, no position or value to find
        collector.failed.append(jnp.any(flat))
        collector.values.append(jnp.zeros((2,), jnp.int64))
        return
    first = jnp.min(jnp.where(flat, jnp.arange(count, dtype=jnp.int64), count))
    offending = jnp.zeros((), jnp.int64) if value is None else jnp.broadcast_to(
        jnp.asarray(value), bad.shape).reshape(-1)[jnp.minimum(first, count - 1)].astype(jnp.int64)
    collector.failed.append(first < count)
    collector.values.append(jnp.stack([offending, first]))


def combine(codes: Sequence[Any], offsets: Sequence[int]) -> Any:
    """One code for several programs' codes traced into one (a fused graph): check numbers offset."""
    import jax.numpy as jnp

    stacked = jnp.stack(codes)
    failed = stacked[:, 0] > 0
    return _first(failed, stacked[:, 1:], stacked[:, 0] + jnp.asarray(offsets, jnp.int64))


# --- the host side: issued codes, read where the host waits --------------------------------------


@dataclasses.dataclass
class Issued:
    """A program's code on the device, its checks, and the user line of each (None: the check's own)."""

    code: Any
    checks: tuple[Check, ...]
    lines: tuple[Any, ...]


class DeviceCheckError(RuntimeError):
    """A device-side check failed in an op issued earlier (raised where the host waited)."""


_lock = threading.Lock()
_pending: list[Issued] = []


def caller() -> tuple[str, int] | None:
    """The user's frame that issued the current op (file, line); cheap: no formatting. None where no
    Python frame issued it (a native call on autograd's backward thread)."""
    frame = sys._getframe(0).f_back
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARIES) and not name.startswith("<frozen"):
            return name, frame.f_lineno
        frame = frame.f_back
    return None


def issued(code: Any, checks: tuple[Check, ...], lines: tuple[Any, ...], at_once: bool = False) -> None:
    """A program with checks was dispatched; `at_once` (launch blocking) raises CPU's exception now."""
    item = Issued(code, checks, lines)
    metrics.bump("device_check_codes")
    if at_once:
        _raise_first([item], _read([code]), cpu_style=True)
        return
    with _lock:
        _pending.append(item)
        oldest = None
        if len(_pending) >= MAX_PENDING:
            oldest = _pending[:MAX_PENDING // 2]
            del _pending[:MAX_PENDING // 2]
    if oldest is not None:
        _read_oldest(oldest)


def _read_oldest(items: list[Issued]) -> None:
    """Codes pending too long without a host wait: folded into one on the device and read at once
    (one transfer; they finished long ago). Codes on several devices are read one by one."""
    offsets = np.cumsum([0] + [len(item.checks) for item in items[:-1]], dtype=np.int64)
    try:
        code = _fold()([item.code for item in items], offsets)
    except ValueError:  # codes on different devices
        _raise_first(items, _read([item.code for item in items]))
        return
    folded = Issued(code, tuple(c for item in items for c in item.checks),
                    tuple(line for item in items for line in item.lines))
    _raise_first([folded], _read([code]))


@functools.cache
def _fold() -> Any:
    import jax

    return jax.jit(combine)


def take(ready_only: bool = False) -> list[Issued]:
    """The pending codes (only those already computed if `ready_only`), handed to a caller that reads them
    with its own transfer (`verify`); the others stay pending."""
    if not _pending:
        return []
    with _lock:
        if not ready_only:
            taken = list(_pending)
            _pending.clear()
            return taken
        taken = [item for item in _pending if item.code.is_ready()]
        if taken:
            ready = {id(item) for item in taken}
            _pending[:] = [item for item in _pending if id(item) not in ready]
    return taken


def verify(taken: list[Issued], values: Sequence[Any]) -> None:
    """Raise the first failure among codes taken with `take` and read to the host."""
    if taken:
        _raise_first(taken, values)


def raise_pending(wait: bool = True) -> None:
    """Read the pending codes (only those already computed unless `wait`) and raise the first failure."""
    taken = take(ready_only=not wait)
    if taken:
        _raise_first(taken, _read([item.code for item in taken]))


def clear() -> None:
    """Forget pending codes without reading them."""
    with _lock:
        _pending.clear()


def _read(codes: list[Any]) -> list[Any]:
    """Codes to the host: waited for first (a failed program's array raises in the wait, where converting it
    would abort the process), then each read as it is. Not jax.device_get: its copy started per array waits on
    another thread on CPU (a ready code read at a fused flush: 158-167 us CPU against 32-36 us this way)."""
    import jax

    metrics.bump("device_check_reads")
    jax.block_until_ready(codes)
    return [np.asarray(code) for code in codes]


def _raise_first(items: Sequence[Issued], values: Sequence[Any], cpu_style: bool = False) -> None:
    for item, value in zip(items, values):
        position = int(value[0])
        if position == 0:
            continue
        check = item.checks[position - 1]
        text = check.text(int(value[1]), int(value[2]))
        if cpu_style:
            raise check.error(text)
        line = _line(item.lines[position - 1]) if item.lines[position - 1] is not None else _trace_line(check.where)
        with _lock:
            _pending.clear()  # the first failure is the one to fix; later ones may follow from it
        raise DeviceCheckError(
            f"{check.op}: {text} (a device-side check, {check.error.__name__} on CPU; the op was "
            f"issued at {line}); results computed from it are wrong: fix the input, or set "
            f"TORCH_PJRT_LAUNCH_BLOCKING=1 to raise at the op itself."
        )


def _line(frame: tuple[str, int]) -> str:
    filename, lineno = frame
    source = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}: {source}" if source else f"{filename}:{lineno}"


def _trace_line(stack_trace: str | None) -> str:
    """The innermost user frame (outside torch) of a traced node's stack trace, as `file:line: source`."""
    if not stack_trace:
        return "no line of yours (autograd's backward, or a graph without stack traces, issued it)"
    lines = [line.strip() for line in stack_trace.splitlines()]
    frames = [(i, _FRAME.match(line)) for i, line in enumerate(lines) if _FRAME.match(line)]
    if not frames:
        return lines[-1]
    users = [(i, found) for i, found in frames if not os.path.abspath(found.group(1)).startswith(_LIBRARIES)]
    position, found = (users or frames)[-1]
    source = lines[position + 1] if position + 1 < len(lines) else ""
    return f"{found.group(1)}:{found.group(2)}: {source}" if source else f"{found.group(1)}:{found.group(2)}"


_FRAME = re.compile(r'File "(.*)", line (\d+)')
