"""What device-side checks cost: the GPT training step in each pjrt mode with checks on vs off, side by side.

The step is bench/train_step.py's (2 layers, width 128, sequence 64, batch 8, AdamW; its embedding
lookups and cross-entropy are checked ops, forward and backward). Checks on and off run in one
process, in interleaved rounds (on, off, off, on, ...) so drift hits both alike: shown are the best
round's median step time and the median over rounds of that round's on/off ratio (robust to a
loaded machine). On and off keep separate program caches (a program's checks are
fixed when it is traced), as two processes with and without TORCH_PJRT_DEVICE_CHECKS=0 would; the
native dispatch cache (csrc/dispatch.cpp) holds one program per signature, so it is off here and
strict eager runs its Python kernels in both settings (with checks on, checked ops run there anyway).
Also shown: device-check codes issued per step, reads of codes alone per step (a read the host
makes only for checks; codes otherwise ride on the loss.item() transfer, so 0 is the goal), and
the price of one checked op alone.
Run: .venv/bin/python bench/device_checks.py [--rounds N] [--steps-per-round K]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_pjrt
from torch_pjrt import native
from torch_pjrt.eager import dispatch
from torch_pjrt.runtime import checks, programs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes, train_step  # noqa: E402

MODES = {"strict eager": "defer_never", "DEFER_AND_FUSE": "defer_and_fuse", "torch.compile": "compile"}
_caches = {True: dispatch._cache, False: programs.ProgramCache()}


def checks_on(enabled: bool) -> None:
    """Switch checks, with the strict-eager program cache that was traced under that setting."""
    checks.ENABLED = enabled
    dispatch._cache = _caches[enabled]


def make_step(model: torch.nn.Module, mode: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    model = copy.deepcopy(model).to("pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return train_step(model, optimizer, tokens, targets)

    return torch.compile(step, backend="pjrt") if mode == "compile" else step


def timed_steps(step: Callable, mode: str, data: list, count: int) -> tuple[list[float], float, float]:
    """Step times (s) over `count` steps, and codes issued and reads of codes alone per step."""
    eager_mode = "defer_never" if mode == "compile" else mode
    before = torch_pjrt.metrics.counters()
    times = []
    with torch.pjrt.set_eager_mode(eager_mode):
        for index in range(count):
            tokens, targets = data[index % len(data)]
            start = time.perf_counter()
            step(tokens.to("pjrt"), targets.to("pjrt")).item()
            times.append(time.perf_counter() - start)
    after = torch_pjrt.metrics.counters()
    issued = (after["device_check_codes"] - before["device_check_codes"]) / count
    reads = (after["device_check_reads"] - before["device_check_reads"]) / count
    return times, issued, reads


def main() -> None:
    native_dispatch = native.dispatch_module()
    if native_dispatch is not None:
        torch.zeros(1, device="pjrt")  # the device starts (and configures the native dispatch)
        native_dispatch.set_dispatch_enabled(False)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context=64)
    data = batches(corpus_bytes(), 8, 64, 8)
    steps: dict[tuple[str, bool], Callable] = {}
    for name, mode in MODES.items():
        for enabled in (True, False):
            checks_on(enabled)
            steps[name, enabled] = make_step(model, mode)
            timed_steps(steps[name, enabled], mode, data, 3)  # compiles
    medians: dict[tuple[str, bool], list[float]] = {key: [] for key in steps}
    per_step: dict[tuple[str, bool], tuple[float, float]] = {}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for name, mode in MODES.items():
            for enabled in order:
                checks_on(enabled)
                times, issued, reads = timed_steps(steps[name, enabled], mode, data, args.steps_per_round)
                medians[name, enabled].append(statistics.median(times))
                per_step[name, enabled] = (issued, reads)
    checks_on(True)
    print(f"GPT step (2 layers, width 128, seq 64, batch 8, AdamW): {args.rounds} interleaved rounds of "
          f"{args.steps_per_round} steps; best round's median, and the median of each round's on/off ratio")
    print(f"{'':<18}{'checks on ms':>14}{'checks off ms':>15}{'best on/off':>13}{'paired on/off':>15}"
          f"{'codes/step':>12}{'check-only reads/step':>23}")
    for name in MODES:
        on, off = min(medians[name, True]), min(medians[name, False])
        paired = statistics.median(a / b for a, b in zip(medians[name, True], medians[name, False]))
        issued, reads = per_step[name, True]
        print(f"{name:<18}{on * 1e3:>14.2f}{off * 1e3:>15.2f}{on / off:>13.3f}{paired:>15.3f}{issued:>12.1f}"
              f"{reads:>23.2f}")
    print("goal: on / off under 1.03, and no read of check codes alone (they ride on the loss.item() transfer)")
    op_cost()


def op_cost(count: int = 1000, rounds: int = 7) -> None:
    """One checked op alone (an embedding lookup, strict eager): the per-op price, host and program."""
    weight = torch.randn(256, 128, device="pjrt")
    tokens = torch.randint(0, 256, (8, 64), device="pjrt")
    best = {True: math.inf, False: math.inf}
    for round_index in range(rounds):
        for enabled in (True, False) if round_index % 2 == 0 else (False, True):
            checks_on(enabled)
            torch.nn.functional.embedding(tokens, weight)
            torch.pjrt.synchronize()
            start = time.perf_counter()
            for _ in range(count):
                torch.nn.functional.embedding(tokens, weight)
            torch.pjrt.synchronize()
            best[enabled] = min(best[enabled], (time.perf_counter() - start) / count)
    checks_on(True)
    print(f"one embedding lookup (8x64 ids, 256x128 table), strict eager, best of {rounds}: "
          f"checks on {best[True] * 1e6:.1f} us/op, off {best[False] * 1e6:.1f} us/op "
          f"(+{(best[True] - best[False]) * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
