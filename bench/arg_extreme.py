"""argmax's two lowerings side by side: the two passes (the maximum, then its least index) against XLA's one
variadic reduce (jnp.argmax), over the last dim of float32 inputs of several sizes, on pjrt's device.

`torch_pjrt.ops.reductions` takes the two passes up to TWO_PASS_ARG_EXTREME_ELEMENTS elements: this bench
is the measurement behind that bound (the rows either side of it). Each shape runs both forms, jitted,
in interleaved rounds, best round kept (mean of the calls in a round); results are checked equal.
Run: .venv/bin/python bench/arg_extreme.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torch_pjrt  # noqa: F401 (the pjrt device, and jax configured as it uses it)
from torch_pjrt.ops import reductions

SHAPES = [(8, 256), (32, 256), (128, 256), (32, 32000), (1024, 1024), (2048, 1024), (4096, 1024), (16384, 256)]


def mean_us(fn: object, x: jax.Array, calls: int) -> float:
    fn(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        result = fn(x)
    result.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.zeros(1, device="pjrt")  # starts the device
    two_passes = jax.jit(_two_passes)
    one_reduce = jax.jit(lambda x: jnp.argmax(x, axis=-1))
    bound = reductions.TWO_PASS_ARG_EXTREME_ELEMENTS
    print(f"the lowering takes two passes up to {bound} elements")
    print("| shape | elements | two passes, us | variadic reduce, us | two passes / reduce |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = jax.device_put(rng.standard_normal(shape).astype(np.float32))
        assert np.array_equal(np.asarray(two_passes(x)), np.asarray(one_reduce(x)))
        calls = max(3, int(1e7 // np.prod(shape)))
        best = {"two": float("inf"), "one": float("inf")}
        for _ in range(args.rounds):
            best["two"] = min(best["two"], mean_us(two_passes, x, calls))
            best["one"] = min(best["one"], mean_us(one_reduce, x, calls))
        print(f"| {shape} | {int(np.prod(shape))} | {best['two']:.1f} | {best['one']:.1f} | "
              f"{best['two'] / best['one']:.2f} |")


def _two_passes(x: jax.Array) -> jax.Array:
    """The lowering's two-pass form whatever the size (the bound lifted while it traces)."""
    saved = reductions.TWO_PASS_ARG_EXTREME_ELEMENTS
    reductions.TWO_PASS_ARG_EXTREME_ELEMENTS = x.size
    try:
        return reductions._arg_extreme(jnp.max, jnp.argmax, x, -1, False)
    finally:
        reductions.TWO_PASS_ARG_EXTREME_ELEMENTS = saved


if __name__ == "__main__":
    main()
