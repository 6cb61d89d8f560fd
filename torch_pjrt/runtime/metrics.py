"""Counters for everything the runtime does, readable as a dict or a table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

COUNTER_NAMES = (
    "compiles",
    "compile_seconds",
    "cache_hits",
    "cache_misses",
    "ops_executed",
    "cpu_fallbacks",
    "transfers_to_device",
    "transfers_to_host",
    "bytes_to_device",
    "bytes_to_host",
    "persistent_cache_hits",
    "persistent_cache_misses",
    "fused_programs",
    "fused_ops",
    "fused_compiles",
    # traces of fused programs by jax (none where a stored executable is loaded)
    "fused_traces",
    "fused_donated_buffers",
    "graph_compiles",
    "graph_compiles_seconds",
    "pad_compiles",
    "pad_compiles_seconds",
    "disk_store_hits",
    "disk_store_writes",
    "disk_store_damaged",
    # strict eager's ops loaded from, and stored into, the cache folder (their executables and checks)
    "op_store_hits",
    "op_store_writes",
    # strict ops' executables that refused arrays of other shapes (jax's slow path) before the right one ran
    "stored_op_refusals",
    # padded ops' forms (how results' sizes follow the symbols) read from, and stored into, the cache folder
    "form_store_hits",
    "form_store_writes",
    # compiled graphs AOTAutograd's cache stored into, and loaded from, the cache folder (compile/warm_start.py)
    "aot_cache_writes",
    "aot_cache_hits",
    # bounded dynamism in eager (eager/dynamic.py)
    "dynamic_padded_ops",
    "dynamic_new_buckets",
    "dynamic_unmaskable",
    "dynamic_compactions",
    # device-side checks (runtime/checks.py): codes issued, and reads of codes alone (not riding on
    # a transfer the host made anyway)
    "device_check_codes",
    "device_check_reads",
    # program launches timed for a profiler (runtime/profiling.py): none unless one asks for device time
    "profiled_programs",
    # c10d's "pjrt" backend (distributed/): collectives run as XLA programs, and those that went through host copies
    "collectives_xla",
    "collectives_host",
)

_counts: Counter = Counter()
op_counts: Counter = Counter()
fallback_ops: Counter = Counter()
# ops that met padded (dynamic) tensors without a padding rule, and ran at their true sizes
unmaskable_ops: Counter = Counter()


# Counters kept outside this table, added to it when read: the native dispatch's hit path counts its
# ops in C++ (a dict update per op costs more than the count is worth).
class KeptElsewhere(NamedTuple):
    read_all: Callable[[], dict[str, int]]
    read_one: Callable[[str], int]
    reset: Callable[[], None]


_kept_elsewhere: list[KeptElsewhere] = []


def bump(name: str, amount: float = 1) -> None:
    _counts[name] += amount


def own_counts() -> Counter:
    """The counters Python keeps itself (the native dispatch reads ops_executed there, adding its own)."""
    return _counts


def count_elsewhere(counters_kept: KeptElsewhere) -> None:
    """Add the counters kept there to every reading of these, and zero them on `reset`."""
    _kept_elsewhere.append(counters_kept)


def counters_now(name: str) -> float:
    """One counter's value (for code that reads it per op)."""
    value = _counts[name]
    for kept in _kept_elsewhere:
        value += kept.read_one(name)
    return value


def counters() -> dict[str, float]:
    """The current value of every counter (all names always present)."""
    values = {name: 0 for name in COUNTER_NAMES}
    values.update(_counts)
    for kept in _kept_elsewhere:
        for name, value in kept.read_all().items():
            values[name] = values.get(name, 0) + value
    return values


def reset() -> None:
    _counts.clear()
    for kept in _kept_elsewhere:
        kept.reset()
    op_counts.clear()
    fallback_ops.clear()
    unmaskable_ops.clear()


def report() -> str:
    """A readable table of the counters, the busiest ops and the ops that fell back to CPU."""
    lines = ["torch_pjrt metrics", "-" * 40]
    for name, value in counters().items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<28}{shown:>12}")
    if op_counts:
        lines += ["", "ops executed (top 20)", "-" * 40]
        lines += [f"{str(op):<36}{n:>6}" for op, n in op_counts.most_common(20)]
    if fallback_ops:
        lines += ["", "ops run on CPU (fallback)", "-" * 40]
        lines += [f"{str(op):<36}{n:>6}" for op, n in fallback_ops.most_common()]
    if unmaskable_ops:
        lines += ["", "ops run at true sizes on dynamic tensors", "-" * 40]
        lines += [f"{str(op):<36}{n:>6}" for op, n in unmaskable_ops.most_common()]
    return "\n".join(lines)
