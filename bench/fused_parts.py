"""The parts of a fused flush (eager/fusion.py's PendingGraph.flush) that the host-time benches time apart.

bench/generate_tokens.py --breakdown (a decode token) and bench/step_breakdown.py --fused-host (a training
step) split the flush the same way: the earlier programs' finished device-side check codes read (checks.raise_pending,
which a flush calls first: one read to the host a token in a decode), the numbers passed (Replay.arguments, packing
included), the replay match, the donation scan and the device-side checks issued; what is left of the flush outside
jax's program call is reported as its rest (live results found, counters, results wired, the inputs released).
(raise_pending also runs in torch.pjrt.synchronize and Event.synchronize, which neither bench calls while timing.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch_pjrt.eager import fusion
from torch_pjrt.runtime import checks

# part name -> (owner, attribute) of the function that does it
FLUSH_PARTS: dict[str, tuple[Any, str]] = {
    "check codes read": (checks, "raise_pending"),
    "numbers": (fusion.Replay, "arguments"),
    "replay match": (fusion.Replay, "matches"),
    "donation scan": (fusion, "_unreferenced"),
    "checks issued": (checks, "issued"),
}


@contextlib.contextmanager
def timed_flush_parts(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Inside, each part's function is `wrap(name, original)` (a bench's timer); the originals come back after."""
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in FLUSH_PARTS.items()}
    try:
        for name, (owner, attribute) in FLUSH_PARTS.items():
            setattr(owner, attribute, wrap(name, originals[name]))
        yield
    finally:
        for name, (owner, attribute) in FLUSH_PARTS.items():
            setattr(owner, attribute, originals[name])
