"""What a small host operation costs right after a program launch, after waiting for a program, and after a sleep.

Issues #32/#33: timed once right after each launch, host work measured 8-25x its back-to-back figure. Here each
sample runs the operation once untimed (so it is warm), then one condition, then the operation timed:
  back to back        nothing in between
  after a launch      a jitted chain of 768x768 matmuls is launched and runs meanwhile (waited for afterwards)
  after its wait      the same program launched and waited for (the thread sleeps while XLA's threads run it)
  after a sleep       time.sleep as long as the program takes, no program at all
  after a 1 ms sleep
For each: the operation's thread CPU time and wall time (us, medians). Where they are equal, the thread was not
kept off its core while the operation ran: what it costs more, it costs as its own work running slower.
Operations: a device put of 64 floats (the runtime's put), a 300-iteration Python loop with a numpy sum, a tiny
jitted call, and the loop 100 times longer (does a cold start add a fixed cost or multiply the work?).
Conditions are taken in a shuffled order each round. `--worker-policy batch` sets the threads jaxlib's CPU client
starts (XLA's and PJRT's) to SCHED_BATCH, which do not preempt on wake-up: compare it with `default` in fresh
processes.
Run: .venv/bin/python bench/host_after_launch.py [--samples N] [--worker-policy default|batch]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from torch_pjrt.runtime import client


def matmul_chain(a: jax.Array) -> jax.Array:
    for _ in range(4):
        a = jnp.tanh(a @ a)
    return a


def thread_ids() -> set[int]:
    """This process's thread ids (none where /proc is missing)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40, help="samples per condition and operation")
    parser.add_argument("--worker-policy", choices=("default", "batch"), default="default")
    args = parser.parse_args()
    if args.worker_policy == "batch" and not hasattr(os, "SCHED_BATCH"):
        parser.error("--worker-policy batch needs Linux's SCHED_BATCH; run without it here.")

    before = thread_ids()
    client.jax_module()  # configured as torch_pjrt configures it (x64, cache)
    program = jax.jit(matmul_chain)
    tiny = jax.jit(lambda v: v + 1)
    rng = np.random.default_rng(0)
    matrix = client.to_device(rng.standard_normal((768, 768), dtype=np.float32) / 28, 0)
    small = rng.standard_normal(64, dtype=np.float32)
    small_device = client.to_device(small.copy(), 0)
    program(matrix).block_until_ready()
    tiny(small_device).block_until_ready()
    started = sorted(thread_ids() - before - {threading.get_native_id()})
    if args.worker_policy == "batch":
        for tid in started:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))

    program_seconds = statistics.median(_timed(lambda: program(matrix).block_until_ready()) for _ in range(10))

    def python_loop(iterations: int) -> float:
        total = 0.0
        for i in range(iterations):
            total += i
        return total + float(np.sum(small))

    operations: dict[str, Callable[[], object]] = {
        "put of 64 floats": lambda: client.to_device(small.copy(), 0),
        "300-iteration loop + numpy sum": lambda: python_loop(300),
        "tiny jitted call": lambda: tiny(small_device),
        "30,000-iteration loop + numpy sum": lambda: python_loop(30_000),
    }
    conditions: dict[str, Callable[[], object]] = {
        "back to back": lambda: None,
        "after a launch": lambda: program(matrix),
        "after its wait": lambda: program(matrix).block_until_ready(),
        "after a sleep": lambda: time.sleep(program_seconds),
        "after a 1 ms sleep": lambda: time.sleep(0.001),
    }
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {
        (op, cond): [] for op in operations for cond in conditions}
    order = list(samples)
    for _ in range(args.samples):
        random.shuffle(order)
        for op_name, condition_name in order:
            operation = operations[op_name]
            operation()
            running = conditions[condition_name]()
            cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
            operation()
            wall1, cpu1 = time.perf_counter_ns(), time.thread_time_ns()
            if hasattr(running, "block_until_ready"):
                running.block_until_ready()
            samples[(op_name, condition_name)].append(((cpu1 - cpu0) / 1e3, (wall1 - wall0) / 1e3))

    print(f"program alone {program_seconds * 1e3:.1f} ms; {len(started)} threads started by the client "
          f"({args.worker_policy} policy); load average {os.getloadavg()[0]:.1f}; medians of {args.samples}")
    print("| operation | condition | thread CPU, us | wall, us |")
    print("|---|---|---|---|")
    for (op_name, condition_name), rows in samples.items():
        cpu, wall = (statistics.median(row[i] for row in rows) for i in range(2))
        print(f"| {op_name} | {condition_name} | {cpu:.0f} | {wall:.0f} |")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
