"""Where the GPT training step's time goes in each pjrt mode, against JAX, side by side in one process.

For each mode: the median step time, the main thread's CPU time per step (Python and the host work
around the programs), then the programs that one step ran replayed back-to-back on the same inputs
(the compute alone, no Python between them), and the difference (PyTorch's module, autograd and
optimizer code, our dispatch, recording and wrapping, and the waits between). The JAX row is one
jitted program per step. The loop reads loss.item() every step, so a fused step takes at least its
recording plus its program; strict eager overlaps its Python with the programs.
Then the device time alone, compiled and fused against JAX: each program of the compiled step, all of them, and the
fused step's program replayed on their recorded inputs, alternating with the JAX step's one program replayed the
same way (best round of each): the split of a step's gap to JAX into program time and host time.
With --host, only the compiled step's main-thread CPU time split into the batch's transfers, our graph calls,
the rest of the step call (Dynamo, AOTAutograd, autograd, the optimizer's wrappers) and loss.item().
With --fused-host, only the fused step's main-thread CPU time split by phase (transfers, zero_grad, forward,
backward, clipping, AdamW, and loss.item()'s flush: ours before and after jax's program call, the call, the wait).
With --graph-calls, only the compiled step, and each of its graph calls' CPU time on the thread that made it
(forward and optimizer on the main thread, backward on autograd's), by graph.
`--backward` picks the compiled step's route (bench/train_step.py's TorchRow): AOTAutograd's backward run by
autograd (default), compiled autograd, or Dynamo tracing loss.backward() ("traced": two programs a step).
Run: .venv/bin/python bench/step_breakdown.py [--steps N] [--adamw default|fused]
    [--backward autograd|compiled autograd|traced] [--graph-calls | --host | --fused-host]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import torch

sys.path.insert(0, os.path.dirname(__file__))

from train_step import JaxRow, TorchRow  # noqa: E402

from torch_pjrt import native  # noqa: E402
from torch_pjrt.compile import backend  # noqa: E402
from torch_pjrt.runtime import programs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from gpt import GPT, batches, corpus_bytes  # noqa: E402

# (program, arguments) of every program call of the step being recorded, in call order.
calls: list[tuple[programs.Program, tuple]] = []
recording = [False]


def set_native(on: bool) -> None:
    """The native hit path calls programs without Program.call, so the recorded step runs through the
    Python kernels (the same programs)."""
    module = native.dispatch_module()
    if module is not None:
        module.set_dispatch_enabled(on)


_call = programs.Program.call


def _recording_call(self: programs.Program, *args: Any) -> Any:
    if recording[0]:
        # Copies: in-place ops donate their input buffers, which the replay needs again.
        calls.append((self, jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)))
    return _call(self, *args)


def replay_ms(step_calls: list[tuple[Callable[..., Any], tuple]], repeats: int = 10) -> float:
    """The programs of one step (each a jitted callable) run back-to-back on their recorded inputs, waited for
    once (each repeat on fresh copies made before its clock starts: programs donate the buffers they write)."""
    times = []
    for _ in range(repeats + 1):
        runs = [(fn, jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args))
                for fn, args in step_calls]
        jax.block_until_ready(runs)
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for fn, args in runs])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


Calls = list[tuple[Callable[..., Any], tuple]]


def compute_split(compiled_calls: Calls, fused_calls: Calls, jax_call: tuple[Callable[..., Any], tuple],
                  rounds: int = 5) -> None:
    """Device time alone, the compiled and fused steps against the JAX step's one program, replayed in alternation
    (rounds of each, best round kept): each compiled program on its own, and each step's programs back-to-back."""
    best: dict[str, float] = {}
    rows = {f"compiled program {i + 1} ({len(jax.tree.leaves(args))} args)": [(fn, args)]
            for i, (fn, args) in enumerate(compiled_calls)}
    rows["compiled, all programs"] = compiled_calls
    rows[f"fused, its {len(fused_calls)} program(s)"] = fused_calls
    rows["JAX jit, its one program"] = [jax_call]
    for _ in range(rounds):
        for label, step_calls in rows.items():
            best[label] = min(best.get(label, math.inf), replay_ms(step_calls))
    print(f"\ndevice time alone (programs replayed on their recorded inputs, no Python between them; best of "
          f"{rounds} alternating rounds, load {open('/proc/loadavg').read().split()[0]}):")
    for label, ms in best.items():
        print(f"  {label:<40}{ms:>8.2f} ms")
    for label, name in (("compiled", "compiled, all programs"), ("fused", f"fused, its {len(fused_calls)} program(s)")):
        print(f"  {label} programs / JAX's program: {best[name] / best['JAX jit, its one program']:.2f}x")


def timed_steps(row: TorchRow | JaxRow, data: list) -> tuple[list[float], list[float]]:
    """Each step's wall time (its updates done) and the main thread's CPU time during it."""
    walls, cpus = [], []
    for batch in data:
        cpu = time.thread_time()
        walls.append(row.run([batch])[0])
        cpus.append(time.thread_time() - cpu)
    return walls, cpus


def step_phases(row: TorchRow, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float, float]:
    """One step's main-thread CPU seconds in four parts: the batch's two transfers (each: the first is the first
    host work after the last step's wait), the step call, loss.item()."""
    start = time.thread_time()
    tokens = tokens.to("pjrt")
    first = time.thread_time()
    targets = targets.to("pjrt")
    sent = time.thread_time()
    loss = row.step(tokens, targets)
    stepped = time.thread_time()
    loss.item()
    return first - start, sent - first, stepped - sent, time.thread_time() - stepped


def jax_host_parts(model: torch.nn.Module, data: list) -> dict[str, list[float]]:
    """The hand-written JAX step's main-thread CPU seconds per step (after 3 warm-up steps) in three parts: the
    batch's transfers, its one program call, float(loss) (its wait and read)."""
    jax_row = JaxRow(model, 2, 4)
    jax_row.run(data[:3])
    jax_parts: dict[str, list[float]] = {"transfers": [], "its one program call": [], "float(loss)": []}
    for tokens, targets in data[3:]:
        jax_row.count += 1
        start = time.thread_time()
        tokens, targets = jax.numpy.asarray(tokens.numpy()), jax.numpy.asarray(targets.numpy())
        sent = time.thread_time()
        jax_row.params, jax_row.state, loss = jax_row.step(jax_row.params, jax_row.state,
                                                           jax.numpy.float32(jax_row.count), tokens, targets)
        stepped = time.thread_time()
        float(loss)
        jax_parts["transfers"].append(sent - start)
        jax_parts["its one program call"].append(stepped - sent)
        jax_parts["float(loss)"].append(time.thread_time() - stepped)
    return jax_parts


def host_split(model: torch.nn.Module, data: list, fused_adamw: bool, backward: str) -> None:
    """The compiled step's main-thread CPU time per step split by what the host does: the batch's two transfers,
    our graph calls (forward, clipping, AdamW and the loss's detach; the backward's runs on autograd's thread),
    everything else inside the compiled step call (Dynamo's frames and guards, AOTAutograd's wrappers, the autograd
    engine, the optimizer's wrappers, zero_grad), and loss.item()."""
    main_thread = threading.get_ident()
    graph_cpu = [0.0]
    call = backend.CompiledGraph.__call__

    def timed(self: backend.CompiledGraph, *args: Any) -> Any:
        if threading.get_ident() != main_thread:
            return call(self, *args)
        start = time.thread_time()
        try:
            return call(self, *args)
        finally:
            graph_cpu[0] += time.thread_time() - start

    row = TorchRow(model, "pjrt", "compile", cpu_threads=1, fused_adamw=fused_adamw, backward=backward)
    row.run(data[:3])
    parts: dict[str, list[float]] = {"transfers": [], "graph calls": [], "Dynamo, AOTAutograd, autograd, optimizer": [],
                                     "item": []}
    backend.CompiledGraph.__call__ = timed
    try:
        for tokens, targets in data[3:]:
            graph_cpu[0] = 0.0
            first, second, step, item = step_phases(row, tokens, targets)
            parts["transfers"].append(first + second)
            parts["graph calls"].append(graph_cpu[0])
            parts["Dynamo, AOTAutograd, autograd, optimizer"].append(step - graph_cpu[0])
            parts["item"].append(item)
    finally:
        backend.CompiledGraph.__call__ = call
    jax_parts = jax_host_parts(model, data)
    load = open("/proc/loadavg").read().split()[0]
    print(f"main-thread CPU ms per step (median of {len(data) - 3} steps, load {load})")
    for title, found in (("pjrt torch.compile", parts), ("JAX jit (hand-written)", jax_parts)):
        medians = {name: statistics.median(values) * 1e3 for name, values in found.items()}
        print(f"{title}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in medians.items())
              + f"; total {sum(medians.values()):.3f}")


def fused_host_split(model: torch.nn.Module, data: list, fused_adamw: bool) -> None:
    """The fused (DEFER_AND_FUSE) step's main-thread CPU per step split by phase: the batch's transfers,
    zero_grad, the forward and loss (recording), backward (the main thread's CPU, and its wall time: autograd's
    thread records the backward's ops while the main thread waits), gradient clipping, AdamW's step, and
    loss.item(), which flushes the step's one program: the flush before the program call (live results, donated
    inputs, replay match, numbers as arrays), jax's call, the flush after it (results wired), then the wait and
    the read (the wait's own CPU apart from what follows it: the first host work after a wait runs on cold caches,
    as does the step's first transfer, timed apart from its second). Our flush is split further: the earlier
    programs' check codes read, the donation scan, the replay match, the numbers passed (Replay.arguments, packing
    included), the device-side checks issued, and the rest (kept results found, counters, results wired).
    With the graph's size: ops, inputs (Python numbers among them, and those passed packed) and outputs, and what
    holds the outputs when the program runs (each costs jax ~2 us a call): parameters, their gradients (which
    zero_grad(set_to_none=True) drops unread at the next step), optimizer state, or other tensors. Then the JAX
    step's transfers, program call and float(loss), timed the same way."""
    from fused_parts import FLUSH_PARTS, timed_flush_parts

    from torch_pjrt import storage
    from torch_pjrt.eager import fusion

    main_thread = threading.get_ident()
    times: dict[str, float] = {}
    sizes: dict[str, int] = {}
    holders: Counter = Counter()
    flushing = [False]

    def timed(name: str, fn: Callable[..., Any], wall: str | None = None) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != main_thread:
                return fn(*args, **kwargs)
            start, started = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.thread_time() - start
                if wall is not None:
                    times[wall] = times.get(wall, 0.0) + time.perf_counter() - started
        return run

    flush, program_call = fusion.PendingGraph.flush, programs.Program.call

    def sized_flush(self: fusion.PendingGraph, reason: str) -> None:
        if self.nodes and "ops" not in sizes:  # (counted once: the count would be timed as our flush's)
            sizes.update(ops=len(self.nodes), inputs=len(self.inputs),
                         numbers=sum(type(value) in (int, float, bool, complex) for value in self.inputs))
            holders.update(output_holders(self))
        flushing[0] = True
        try:
            flush(self, reason)
        finally:
            flushing[0] = False

    def timed_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
        """jax.block_until_ready timed where loss.item() waits for the step's program (not the flush's reads)."""
        waiting = timed("wait", fn)
        return lambda *args: fn(*args) if flushing[0] else waiting(*args)

    def output_holders(pending: fusion.PendingGraph) -> Counter:
        """How many of the graph's live results each kind of tensor holds (a pending result is its storage's array)."""
        kinds: dict[int, str] = {}
        for parameter in row.model.parameters():
            kinds[id(storage.storage_of(parameter).array)] = "parameters"
            if parameter.grad is not None:
                kinds[id(storage.storage_of(parameter.grad).array)] = "gradients"
            for value in row.optimizer.state[parameter].values():
                if isinstance(value, torch.Tensor) and value.device.type == "pjrt":
                    kinds[id(storage.storage_of(value).array)] = "optimizer state"
        return Counter(kinds.get(id(deferred), "other") for ref in pending.outputs if (deferred := ref()) is not None)

    def counted_call(self: programs.Program, *args: Any) -> Any:
        results = program_call(self, *args)
        sizes["outputs"] = len(results)
        return results

    row = TorchRow(model, "pjrt", "fuse", cpu_threads=1, fused_adamw=fused_adamw)
    row.run(data[:3])
    optimizer, clip, backward = row.optimizer, torch.nn.utils.clip_grad_norm_, torch.Tensor.backward
    optimizer.zero_grad = timed("zero_grad", optimizer.zero_grad)
    optimizer.step = timed("AdamW step", optimizer.step)
    torch.nn.utils.clip_grad_norm_ = timed("clip", clip)
    torch.Tensor.backward = timed("backward", backward, wall="backward (wall)")
    fusion.PendingGraph.flush = timed("flush", sized_flush)
    programs.Program.call = timed("program call", counted_call)
    block_until_ready = jax.block_until_ready
    jax.block_until_ready = timed_wait(block_until_ready)
    parts: dict[str, list[float]] = {}
    try:
        with torch.pjrt.set_eager_mode("defer_and_fuse"), timed_flush_parts(timed):
            for tokens, targets in data[3:]:
                times.clear()
                first, second, step, item = step_phases(row, tokens, targets)
                flush_rest = times.get("flush", 0.0) - times.get("program call", 0.0)
                split = {name: times.get(name, 0.0) for name in FLUSH_PARTS}
                found = {
                    "transfers": first + second, "  the first": first, "  the second": second,
                    "zero_grad": times.get("zero_grad", 0.0),
                    "forward and loss": step - sum(times.get(name, 0.0) for name in (
                        "zero_grad", "backward", "clip", "AdamW step")),
                    "backward": times.get("backward", 0.0), "clip": times.get("clip", 0.0),
                    "AdamW step": times.get("AdamW step", 0.0), "flush (ours)": flush_rest,
                    **{f"  {name}": seconds for name, seconds in split.items()},
                    "  the rest": flush_rest - sum(split.values()),
                    "program call": times.get("program call", 0.0),
                    "wait and read": item - times.get("flush", 0.0), "  the wait": times.get("wait", 0.0),
                    "  after the wait": item - times.get("flush", 0.0) - times.get("wait", 0.0),
                    "backward (wall)": times.get("backward (wall)", 0.0),
                }
                for name, seconds in found.items():
                    parts.setdefault(name, []).append(seconds)
    finally:
        torch.nn.utils.clip_grad_norm_, torch.Tensor.backward = clip, backward
        fusion.PendingGraph.flush, programs.Program.call = flush, program_call
        jax.block_until_ready = block_until_ready
    medians = {name: statistics.median(values) * 1e3 for name, values in parts.items()}
    packed = sum(len(positions) for _, positions in getattr(fusion.graph().replay, "packed", ()))
    print(f"DEFER_AND_FUSE step, main-thread CPU ms per step (median of {len(data) - 3} steps, load "
          f"{open('/proc/loadavg').read().split()[0]}); its program: {sizes.get('ops')} ops, {sizes.get('inputs')} "
          f"inputs ({sizes.get('numbers')} Python numbers, {packed} of them "
          f"packed), {sizes.get('outputs')} outputs (held by: "
          f"{', '.join(f'{kind} {count}' for kind, count in holders.most_common())}"
          f"{'; and the device-side checks code' if sizes.get('outputs') == sum(holders.values()) + 1 else ''})")
    for name, ms in medians.items():
        print(f"  {name:<20}{ms:>8.3f}")
    total = sum(ms for name, ms in medians.items() if name[0] != " " and name != "backward (wall)")
    print(f"  {'total (CPU)':<20}{total:>8.3f}")
    jax_medians = {name: statistics.median(values) * 1e3 for name, values in jax_host_parts(model, data).items()}
    print("JAX jit (hand-written), the same way: " + ", ".join(f"{name} {ms:.3f}" for name, ms in jax_medians.items())
          + f"; total {sum(jax_medians.values()):.3f}")


def graph_calls(model: torch.nn.Module, data: list, fused_adamw: bool, backward: str) -> None:
    """Each compiled graph's calls: inputs, calls per step and the median CPU time of one call (thread_time on the
    calling thread, so the backward's is autograd's), over the steps after the first three, split into the program
    call (jax), torch's own part of the graph (views and host ops, run by torch after the program) and the rest
    (our checks of the inputs, batching and wrapping of the outputs)."""
    calls_of: dict[int, list[list[float]]] = {}  # per graph, per call: [all, program, torch's part]
    inputs: dict[int, int] = {}
    within = threading.local()
    call, make, program_call = backend.CompiledGraph.__call__, backend.CompiledGraph.__init__, programs.Program.call

    def part_timer(index: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_part(*args: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                if getattr(within, "times", None) is not None:
                    within.times[index] += time.thread_time() - start
        return timed_part

    def made(self: backend.CompiledGraph, *args: Any, **kwargs: Any) -> None:
        make(self, *args, **kwargs)
        if self.eager_part is not None:  # before any native plan takes its forward
            self.eager_part.forward = part_timer(2, self.eager_part.forward)

    def timed(self: backend.CompiledGraph, *args: Any) -> Any:
        within.times = times = [0.0, 0.0, 0.0]
        start = time.thread_time()
        try:
            return call(self, *args)
        finally:
            times[0] = time.thread_time() - start
            within.times = None
            calls_of.setdefault(id(self), []).append(times)
            inputs[id(self)] = len(args)

    backend.CompiledGraph.__init__ = made
    programs.Program.call = part_timer(1, program_call)
    try:
        row = TorchRow(model, "pjrt", "compile", cpu_threads=1, fused_adamw=fused_adamw, backward=backward)
        row.run(data[:3])
        backend.CompiledGraph.__call__ = timed
        try:
            timed_steps(row, data[3:])
        finally:
            backend.CompiledGraph.__call__ = call
    finally:
        backend.CompiledGraph.__init__, programs.Program.call = make, program_call
    steps = len(data) - 3
    print(f"compiled GPT step's graph calls over {steps} steps (CPU us per call, median, on the calling thread; "
          f"load {open('/proc/loadavg').read().split()[0]})")
    print(f"{'inputs':>8}{'calls/step':>12}{'cpu us':>10}{'program':>10}{'torch part':>12}{'rest':>8}")
    for key, times in calls_of.items():
        columns = [statistics.median(t[k] for t in times) * 1e6 for k in range(3)]
        rest = statistics.median((t[0] - t[1] - t[2]) for t in times) * 1e6
        print(f"{inputs[key]:>8}{len(times) / steps:>12.1f}{columns[0]:>10.0f}{columns[1]:>10.0f}{columns[2]:>12.0f}"
              f"{rest:>8.0f}")
    totals = [sum(t[k] for ts in calls_of.values() for t in ts) / steps * 1e6 for k in range(3)]
    print(f"{'total':>8}{'':>12}{totals[0]:>10.0f}{totals[1]:>10.0f}{totals[2]:>12.0f}"
          f"{totals[0] - totals[1] - totals[2]:>8.0f}  (per step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--graph-calls", action="store_true", help="only the compiled step's graph calls, timed")
    parser.add_argument("--host", action="store_true", help="only the compiled step's main-thread CPU, split by part")
    parser.add_argument("--fused-host", action="store_true",
                        help="only the fused step's main-thread CPU, split by phase and flush part")
    parser.add_argument("--adamw", choices=["default", "fused"], default="default",
                        help="fused: AdamW(fused=True), one aten::_fused_adamw_ a step (as bench/train_step.py)")
    parser.add_argument("--backward", choices=["autograd", "compiled autograd", "traced"], default="autograd",
                        help="the compiled step's backward route (bench/train_step.py's TorchRow)")
    args = parser.parse_args()
    fused_adamw = args.adamw == "fused"
    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context=64)
    data = batches(corpus_bytes(), 8, 64, args.steps)
    if args.graph_calls:
        graph_calls(model, data, fused_adamw, args.backward)
        return
    if args.host:
        host_split(model, data, fused_adamw, args.backward)
        return
    if args.fused_host:
        fused_host_split(model, data, fused_adamw)
        return
    programs.Program.call = _recording_call
    rows = []
    for label, mode in (("pjrt strict eager", "eager"), ("pjrt DEFER_AND_FUSE", "fuse"),
                        ("pjrt torch.compile", "compile")):
        row = TorchRow(model, "pjrt", mode, cpu_threads=1, fused_adamw=fused_adamw,
                       backward=args.backward if mode == "compile" else "autograd")
        walls, cpus = timed_steps(row, data[:-1])
        calls.clear()
        recording[0] = True
        set_native(False)
        row.run(data[-1:])
        recording[0] = False
        set_native(True)
        step_ms = statistics.median(walls[3:]) * 1e3
        step_calls = [(program.jitted, args) for program, args in calls]
        rows.append((label, step_ms, statistics.median(cpus[3:]) * 1e3, len(calls), replay_ms(step_calls)))
        if mode == "compile":
            compiled_calls = step_calls
        elif mode == "fuse":
            fused_calls = step_calls
    jax_row = JaxRow(model, 2, 4)
    jax_walls, jax_cpus = timed_steps(jax_row, data)
    jax_ms = statistics.median(jax_walls[3:]) * 1e3
    tokens, targets = (jax.numpy.asarray(t.numpy()) for t in data[-1])
    jax_call = (jax_row.step, (jax_row.params, jax_row.state, jax.numpy.float32(jax_row.count), tokens, targets))
    compute_split(compiled_calls, fused_calls, jax_call)
    print(f"GPT step (2 layers, width 128, seq 64, batch 8, AdamW), median of steps 4-{args.steps - 1}")
    print(f"{'':<24}{'step ms':>9}{'host cpu ms':>13}{'programs':>10}{'compute ms':>12}{'rest ms':>9}")
    for label, step_ms, cpu_ms, count, compute_ms in rows:
        print(f"{label:<24}{step_ms:>9.1f}{cpu_ms:>13.1f}{count:>10}{compute_ms:>12.1f}{step_ms - compute_ms:>9.1f}")
    print(f"{'JAX jit (hand-written)':<24}{jax_ms:>9.1f}{statistics.median(jax_cpus[3:]) * 1e3:>13.1f}{1:>10}")
    strict, fused, compiled = (row[1] for row in rows)
    print(f"\nfused: best case if its Python cost nothing: strict / fused compute = {strict / rows[1][4]:.2f}x "
          f"(goal 2x; measured {strict / fused:.2f}x)")
    print(f"compiled: compute alone / JAX = {rows[2][4] / jax_ms:.2f}x, step / JAX = {compiled / jax_ms:.2f}x "
          f"(goal 1.10x)")


if __name__ == "__main__":
    main()
