"""Strict-eager dispatch cost of a 16x16 float32 add, side by side in one run.

Compares torch on CPU, a bare jitted jax add, and `a + b` on pjrt, then splits the pjrt
time into its parts: PyTorch's dispatcher reaching a Python kernel, the jitted call,
making the output tensor, and the rest (argument scan, cache key, bookkeeping).
Run: .venv/bin/python bench/dispatch_overhead.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

import torch_pjrt  # noqa: F401
from torch_pjrt import storage
from torch_pjrt.eager import dispatch


def per_call_us(fn: Callable[[], object], calls: int = 4000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def python_kernel_entry_us() -> float:
    """A custom op whose Python kernel returns its input: the dispatcher's own cost."""
    library = torch.library.Library("pjrt_bench", "DEF")
    library.define("identity(Tensor x) -> Tensor")
    library.impl("identity", lambda x: x, "CPU")
    x = torch.randn(16, 16)
    op = torch.ops.pjrt_bench.identity.default
    return per_call_us(lambda: op(x)), library


def main() -> None:
    a_cpu, b_cpu = torch.randn(16, 16), torch.randn(16, 16)
    a, b = a_cpu.to("pjrt"), b_cpu.to("pjrt")
    ja, jb = dispatch.read(a), dispatch.read(b)
    jitted_add = jax.jit(jnp.add)

    torch_cpu = per_call_us(lambda: a_cpu + b_cpu)
    jax_jit = per_call_us(lambda: jitted_add(ja, jb))
    pjrt = per_call_us(lambda: a + b)
    entry, _library = python_kernel_entry_us()

    plan = dispatch.plan_for(torch.ops.aten.add.Tensor)
    scan = dispatch.Scan(plan)
    values = plan.normalize((a, b), {})
    described = [scan.value(k, v) for k, v in zip(plan.kinds, values)]
    cached = dispatch._cache.entries[dispatch.cache_key(scan, described)]
    inputs = dispatch._inputs(cached, scan, plan, values)
    program = per_call_us(lambda: cached.program.call(*inputs))
    flat = cached.program.call(*inputs)[0]
    wrap = per_call_us(lambda: storage.new_tensor(flat, torch.float32, a.device, (16, 16), (16, 1), 256))
    rest = pjrt - entry - program - wrap

    print(f"{'16x16 float32 add':<44}{'us/op':>8}{'x torch cpu':>13}")
    for name, value in (
        ("torch CPU eager", torch_cpu),
        ("jax.jit(jnp.add), bare", jax_jit),
        ("pjrt strict eager (a + b)", pjrt),
    ):
        print(f"{name:<44}{value:>8.1f}{value / torch_cpu:>13.1f}")
    print("\nwhere the pjrt time goes")
    for name, value in (
        ("dispatcher -> Python kernel (no-op kernel)", entry),
        ("cached jitted program call", program),
        ("output tensor (storage.new_tensor)", wrap),
        ("argument scan, cache key, bookkeeping", rest),
    ):
        print(f"  {name:<42}{value:>8.1f}{value / pjrt * 100:>12.0f}%")
    def scan() -> object:
        fresh = dispatch.Scan(plan)
        return [fresh.value(k, v) for k, v in zip(plan.kinds, values)]

    alone = program + per_call_us(scan)
    alternating = per_call_us(lambda: (cached.program.call(*inputs), scan()))
    print(f"  the jitted call and the argument scan: {alone:.1f} us run apart, {alternating:.1f} us alternating")
    print(f"\ngoal: at most 12 us per op; pjrt / bare jax.jit = {pjrt / jax_jit:.2f}")


if __name__ == "__main__":
    main()
