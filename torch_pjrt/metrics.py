"""Public counters: compiles, cache hits and misses, ops, CPU fallbacks, transfers."""

from torch_pjrt.runtime.metrics import counters, report, reset

__all__ = ["counters", "report", "reset"]
