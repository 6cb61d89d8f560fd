"""The eager mode: how ops on pjrt tensors are executed."""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable


class EagerMode(enum.Enum):
    """DEFER_NEVER: each op runs as its own cached program, asynchronously (the default).
    DEFER_NEVER_AND_LAUNCH_BLOCKING: the same, waiting for each op to finish (debugging).
    DEFER_AND_FUSE: ops are recorded and run as one fused program at sync points.
    """

    DEFER_NEVER = "defer_never"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "defer_never_and_launch_blocking"
    DEFER_AND_FUSE = "defer_and_fuse"


def _from_environment() -> EagerMode:
    if os.environ.get("TORCH_PJRT_LAUNCH_BLOCKING", "") not in ("", "0"):
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    name = os.environ.get("TORCH_PJRT_EAGER_MODE", "").strip().lower()
    if not name:
        return EagerMode.DEFER_NEVER
    try:
        return EagerMode(name)
    except ValueError:
        raise RuntimeError(
            f"TORCH_PJRT_EAGER_MODE={name!r} is not a mode; use one of "
            + ", ".join(m.value for m in EagerMode)
            + "."
        ) from None


class _State:
    mode: EagerMode = EagerMode.DEFER_NEVER
    blocking: bool = False
    fusing: bool = False


state = _State()
# who is told the flags at each change, (blocking, fusing): the native dispatch reads them per call
_listeners: list[Callable[[bool, bool], None]] = []


def on_change(listener: Callable[[bool, bool], None]) -> None:
    """Call `listener(blocking, fusing)` now and at every mode change."""
    _listeners.append(listener)
    listener(state.blocking, state.fusing)


def current() -> EagerMode:
    return state.mode


def _apply(mode: EagerMode) -> None:
    mode = EagerMode(mode)
    if state.fusing and mode is not EagerMode.DEFER_AND_FUSE:
        from torch_pjrt.eager import fusion

        fusion.flush("eager mode change")
    state.mode = mode
    state.blocking = mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    state.fusing = mode is EagerMode.DEFER_AND_FUSE
    for listener in _listeners:
        listener(state.blocking, state.fusing)


class set_eager_mode(contextlib.AbstractContextManager):  # noqa: N801 (a function to users)
    """Set the eager mode; also usable as `with torch.pjrt.set_eager_mode(mode):` to restore it."""

    def __init__(self, mode: EagerMode | str) -> None:
        self.previous = state.mode
        _apply(EagerMode(mode) if not isinstance(mode, EagerMode) else mode)

    def __exit__(self, *exc: object) -> None:
        _apply(self.previous)


def load_from_environment() -> None:
    _apply(_from_environment())
