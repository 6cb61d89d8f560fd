"""What device-side checks cost: the GPT training step in each pjrt mode with checks on vs off, side by side.

The step is bench/train_step.py's (2 layers, width 128, sequence 64, batch 8, AdamW; its embedding
lookups and cross-entropy are checked ops, forward and backward). Checks on and off run in one
process, in interleaved rounds (on, off, off, on, ...) so drift hits both alike; each figure is the
best round's median step time. On and off keep separate program caches (a program's checks are
fixed when it is traced), as two processes with and without TORCH_PJRT_DEVICE_CHECKS=0 would.
Also shown: device-check codes issued per step, and reads of codes alone per step (a read the
host makes only for checks; codes otherwise ride on the loss.item() transfer, so 0 is the goal).
Run: .venv/bin/python bench/device_checks.py [--rounds N] [--steps-per-round K]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_pjrt
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
    best: dict[tuple[str, bool], float] = {}
    per_step: dict[tuple[str, bool], tuple[float, float]] = {}
    for round_index in range(args.rounds):
        order = (True, False) if round_index % 2 == 0 else (False, True)
        for name, mode in MODES.items():
            for enabled in order:
                checks_on(enabled)
                times, issued, reads = timed_steps(steps[name, enabled], mode, data, args.steps_per_round)
                median = statistics.median(times)
                best[name, enabled] = min(best.get((name, enabled), median), median)
                per_step[name, enabled] = (issued, reads)
    checks_on(True)
    print(f"GPT step (2 layers, width 128, seq 64, batch 8, AdamW): best of {args.rounds} interleaved rounds, "
          f"median of {args.steps_per_round} steps each")
    print(f"{'':<18}{'checks on ms':>14}{'checks off ms':>15}{'on / off':>10}{'codes/step':>12}"
          f"{'check-only reads/step':>23}")
    for name in MODES:
        on, off = best[name, True], best[name, False]
        issued, reads = per_step[name, True]
        print(f"{name:<18}{on * 1e3:>14.2f}{off * 1e3:>15.2f}{on / off:>10.3f}{issued:>12.1f}{reads:>23.2f}")
    print("goal: on / off under 1.03, and no read of check codes alone (they ride on the loss.item() transfer)")


if __name__ == "__main__":
    main()
