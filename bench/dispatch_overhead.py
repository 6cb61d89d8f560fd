"""Per-op cost of strict eager and of DEFER_AND_FUSE recording against the bare jitted call of the same math.

Two aten ops (16x16 float32 `a + b`, 64x64 `addmm`) and a custom op (kernels.jax_op: the serving
path's `gather_pages` at a tiny shape, whose program carries device-side checks), each as: torch on
CPU, the bare `jax.jit` of the same math on the same device arrays, pjrt strict eager through the native hit path
(csrc/dispatch.cpp), the same pjrt call with the native path turned off (every call through
the Python kernel, as with TORCH_PJRT_NATIVE_DISPATCH=0), and the op recorded in DEFER_AND_FUSE,
natively and through Python (recording only: the pending graph runs between timed batches, untimed).
All side by side in one run; rounds are interleaved and each figure is the best round of wall time
(this machine is shared and noisy: the best round is the least disturbed).
Run: .venv/bin/python bench/dispatch_overhead.py [--rounds N]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

import torch_pjrt
from torch_pjrt import native
from torch_pjrt.eager import dispatch, fusion
from torch_pjrt.kernels import page_gather

# recorded ops per timed batch, below the pending graph's size cap (so no flush is timed)
RECORDED_BATCH = 400


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def recording_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds to record one call of `fn` into the pending graph; each batch's graph then runs, untimed."""
    elapsed = 0.0
    torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    try:
        for _ in range(max(1, calls // RECORDED_BATCH)):
            start = time.perf_counter()
            for _ in range(RECORDED_BATCH):
                fn()
            elapsed += time.perf_counter() - start
            fusion.flush("bench")
    finally:
        torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_NEVER)
    return elapsed / (max(1, calls // RECORDED_BATCH) * RECORDED_BATCH) * 1e6


def rounds_and_calls(description: str) -> argparse.Namespace:
    """The command line of the per-op benches: --rounds (interleaved, best kept) and --calls per round."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    return parser.parse_args()


def main() -> None:
    args = rounds_and_calls(__doc__)
    module = native.dispatch_module()

    def without_native(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            module.set_dispatch_enabled(False)
            try:
                return fn()
            finally:
                module.set_dispatch_enabled(True)
        return run

    cases = {}
    a_cpu, b_cpu = torch.randn(16, 16), torch.randn(16, 16)
    a, b = a_cpu.to("pjrt"), b_cpu.to("pjrt")
    ja, jb = dispatch.read(a), dispatch.read(b)
    jitted_add = jax.jit(jnp.add)
    cases["16x16 float32 add"] = (lambda: a_cpu + b_cpu, lambda: jitted_add(ja, jb), lambda: a + b)
    c_cpu, m_cpu, n_cpu = torch.randn(64), torch.randn(64, 64), torch.randn(64, 64)
    c, m, n = c_cpu.to("pjrt"), m_cpu.to("pjrt"), n_cpu.to("pjrt")
    jc, jm, jn = dispatch.read(c), dispatch.read(m), dispatch.read(n)
    jitted_addmm = jax.jit(lambda bias, x, y: bias + jnp.dot(x, y, precision="highest"))
    cases["64x64 float32 addmm"] = (lambda: torch.addmm(c_cpu, m_cpu, n_cpu), lambda: jitted_addmm(jc, jm, jn),
                                    lambda: torch.addmm(c, m, n))

    # a custom op (kernels.jax_op): the serving path's page gather of 2 tokens' 2 pages, its CPU kernel torch indexing
    cache_cpu, tables_cpu, layer_cpu = torch.randn(2, 8, 2, 4, 16), torch.randint(0, 8, (2, 2)), torch.tensor([1])
    cache, tables, layer = cache_cpu.to("pjrt"), tables_cpu.to("pjrt"), layer_cpu.to("pjrt")
    native_gather = page_gather.native_target() is not None
    jitted_gather = jax.jit(functools.partial(page_gather._gather_pages, native=native_gather))
    arrays = [dispatch.read(t) for t in (cache, tables, layer)]
    cases["custom op gather_pages"] = (lambda: page_gather.gather_pages(cache_cpu, tables_cpu, layer_cpu),
                                       lambda: jitted_gather(*arrays),
                                       lambda: page_gather.gather_pages(cache, tables, layer))

    columns = ["torch CPU", "bare jax.jit", "pjrt native", "pjrt Python", "record native", "record Python"]
    best: dict[str, dict[str, float]] = {name: {col: float("inf") for col in columns} for name in cases}
    for cpu, jit, op in cases.values():
        for fn in (cpu, jit, op, op, without_native(op)):
            for _ in range(200):
                fn()
        recording_us(op, RECORDED_BATCH)
        recording_us(without_native(op), RECORDED_BATCH)
    for _ in range(args.rounds):
        for name, (cpu, jit, op) in cases.items():
            timed = {"torch CPU": cpu, "bare jax.jit": jit}
            recorded = {}
            if module is not None:
                timed["pjrt native"] = op
                timed["pjrt Python"] = without_native(op)
                recorded = {"record native": op, "record Python": without_native(op)}
            else:
                timed["pjrt Python"] = op
                recorded = {"record Python": op}
            for column, fn in timed.items():
                best[name][column] = min(best[name][column], per_call_us(fn, args.calls))
            for column, fn in recorded.items():
                best[name][column] = min(best[name][column], recording_us(fn, args.calls))

    print(f"best of {args.rounds} interleaved rounds, us per op (record: DEFER_AND_FUSE recording only)")
    ratios = ["pjrt native", "pjrt Python", "record native", "record Python"]
    print(f"{'':<24}" + "".join(f"{col:>14}" for col in columns) + "".join(f"{col + '/jit':>18}" for col in ratios))
    for name, row in best.items():
        jit = row["bare jax.jit"]
        cells = "".join(f"{row[col]:>14.1f}" for col in columns)
        print(f"{name:<24}{cells}" + "".join(f"{row[col] / jit:>18.2f}" for col in ratios))
    print("goals (issue 13): pjrt native / bare jax.jit <= 1.5; record native / bare jax.jit <= 1.5")


if __name__ == "__main__":
    main()
