"""What the profiler integration costs a strict-eager op, when profiling and when not, in one run.

One op (16x16 float32 `a + b`), timed as: the bare `jax.jit` call on the same device arrays; pjrt
through the native hit path with no profiler (the fast path: csrc/dispatch.cpp has no profiler check,
so this is the path as it was); the same under a CPU-only torch.profiler (no device recording: the
native path stays on); pjrt through the Python kernel with no profiler (Program.call's one flag
check is on this path); and pjrt under a CPU+PrivateUse1 profiler (Python path, each program timed
to completion). The cost of the flag check itself is timed apart. Rounds are interleaved and each
figure is the best round (this machine is shared and noisy).
Run: .venv/bin/python bench/profiler_overhead.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
from torch.profiler import ProfilerActivity, profile

import torch_pjrt  # noqa: F401
from torch_pjrt import native
from torch_pjrt.eager import dispatch
from torch_pjrt.runtime import metrics, profiling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dispatch_overhead import per_call_us, rounds_and_calls  # noqa: E402


def flag_check_ns(calls: int) -> float:
    """Per call, Program.call's `profiling.recording is None` minus an empty loop."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        if profiling.recording is None:
            pass
    checked = time.perf_counter_ns() - start
    start = time.perf_counter_ns()
    for _ in range(calls):
        pass
    return max(checked - (time.perf_counter_ns() - start), 0) / calls


def main() -> None:
    args = rounds_and_calls(__doc__)
    module = native.dispatch_module()
    a, b = torch.randn(16, 16).to("pjrt"), torch.randn(16, 16).to("pjrt")
    jitted_add, ja, jb = jax.jit(jnp.add), dispatch.read(a), dispatch.read(b)

    def op() -> object:
        return a + b

    def under(activities: list[ProfilerActivity]) -> Callable[[Callable[[], object], int], float]:
        def timed(fn: Callable[[], object], calls: int) -> float:
            with profile(activities=activities):
                return per_call_us(fn, calls)
        return timed

    def python_path(fn: Callable[[], object], calls: int) -> float:
        module.set_dispatch_enabled(False)
        try:
            return per_call_us(fn, calls)
        finally:
            module.set_dispatch_enabled(True)

    cases: dict[str, tuple[Callable[[], object], Callable[..., float]]] = {
        "bare jax.jit": (lambda: jitted_add(ja, jb), per_call_us),
        "native, no profiler": (op, per_call_us),
        "native, CPU-only profiler": (op, under([ProfilerActivity.CPU])),
        "Python, no profiler": (op, python_path),
        "device profiler (Python, timed)": (op, under([ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])),
    }
    if module is None:
        del cases["native, no profiler"], cases["native, CPU-only profiler"]
        cases["Python, no profiler"] = (op, per_call_us)
    for fn, timer in cases.values():
        timer(fn, 200)
    recorded_before = metrics.counters()["profiled_programs"]
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, (fn, timer) in cases.items():
            best[name] = min(best[name], timer(fn, args.calls))
    recorded = metrics.counters()["profiled_programs"] - recorded_before
    check_ns = min(flag_check_ns(1_000_000) for _ in range(args.rounds))

    print(f"16x16 float32 add, best of {args.rounds} interleaved rounds of {args.calls} calls, us per op")
    jit = best["bare jax.jit"]
    for name, us in best.items():
        print(f"  {name:<34}{us:>9.1f}{us / jit:>8.2f}x jit")
    print(f"  Program.call's flag check (Python path only): {check_ns:.1f} ns")
    print(f"  programs timed for a profiler: {int(recorded)} (= {args.rounds} rounds x {args.calls}: only the "
          "device profiler's)")


if __name__ == "__main__":
    main()
