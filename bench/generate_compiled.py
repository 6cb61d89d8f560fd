"""Compiled static-cache generation: Hugging Face generate() with cache_implementation="static" and the model's
forward compiled by torch.compile(backend="pjrt"), against torch CPU eager on the same weights.

The small Llama of bench/tiny_llama.py (4 layers, width 128), greedy, 64 new tokens after a 16-token prompt. One
warm-up generate per row (pjrt: its prefill and decode graphs compile), then rounds in which the rows take turns;
each row's best round counts. torch CPU eager runs at its default thread count and at one thread (on a shared
2-core machine one thread is often the faster): the faster of the two is the baseline. Tokens must equal CPU's.
The pjrt run twice: its eager ops between forwards (HF's loop: argmax, masks, stopping checks) in strict mode,
one program each, and in DEFER_AND_FUSE, fused into a few programs per token; and fused with Dynamo's guards
skipped (torch.compiler.set_stance(skip_guard_eval_unsafe=True): what the guards cost).
--breakdown then splits one more pjrt generate's main-thread CPU time per token into Hugging Face's loop (its
Python and the eager pjrt ops it runs between forwards), Dynamo's frame (guards and AOTAutograd's wrappers), our
graph call and the program call within it (Dynamo's frame split into AOTAutograd's runtime wrappers and the rest, with
the guards' own cost timed alone; the program call into jax's call of the executable and our Program.call around
it), and counts graphs, graph breaks, recompiles and eager ops per token;
it also times the decode program alone (each call on ready inputs, waited for) against torch CPU eager's whole
forward per token, splits CPU eager's token the same way (HF's loop runs on every device), and names the eager
pjrt ops HF's loop runs per token (their top-level ATen ops); last, the middle token's decode graph call replayed
alone on ready inputs: jax's program call against our replay around it, the arrays crossing per call, and whether
the static cache's written storages keep their device buffers (donated) or are copied; and that token's whole
forward replayed alone, split into Dynamo's frame (timed with its graph function stubbed), AOTAutograd's wrappers and
our graph call.
Run: .venv/bin/python bench/generate_compiled.py [--rounds 5] [--new-tokens 64] [--breakdown]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch

import torch_pjrt
from torch_pjrt import _torch_private, storage
from torch_pjrt.compile import backend
from torch_pjrt.eager import fusion
from torch_pjrt.runtime import client, programs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_llama import cpu_and_pjrt_llama  # noqa: E402

PROMPT = 16
# the eager ops between forwards in the default strict mode, and fused (DEFER_AND_FUSE); and fused with Dynamo's
# guards skipped (set_stance's skip_guard_eval_unsafe: only the guards that tell the prefill and decode graphs apart)
COMPILED_ROWS = ("pjrt compiled, static cache", "pjrt compiled, static cache, fused eager",
                 "pjrt compiled, static cache, fused eager, guards skipped")


def generator(model: torch.nn.Module, device: str, new_tokens: int, **options: object) -> Callable[[], torch.Tensor]:
    """A greedy generate() of exactly `new_tokens` tokens after the prompt, its tokens returned on CPU."""
    ids = torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0, **options).cpu()

    return generate


def fused(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`run` in DEFER_AND_FUSE mode: the eager ops generate() runs between forwards fuse into a few programs."""

    def in_fused_mode() -> torch.Tensor:
        with torch_pjrt.set_eager_mode("defer_and_fuse"):
            return run()

    return in_fused_mode


def guards_skipped(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`run` with Dynamo checking only the guards that tell its compiled graphs apart (unsafe in general: a change
    only the skipped guards see, such as a replaced module, is missed; a loop whose model does not change is the
    case PyTorch names for it). Inside generate the full guards cost ~0.5 ms of main-thread CPU a token, run
    with caches cold (forward_alone)."""

    def skipping() -> torch.Tensor:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return run()

    return skipping


def with_threads(count: int, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`run` with torch's CPU ops on `count` threads, the former count restored after."""

    def threaded() -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            return run()
        finally:
            torch.set_num_threads(before)

    return threaded


class CpuTimer:
    """Main-thread CPU seconds spent inside a wrapped callable (outer calls only)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.depth = 0.0, 0, 0

    def wrap(self, fn: Callable, only: Callable[..., bool] = lambda *args: True) -> Callable:
        # functools.wraps: generate() passes a forward only the arguments its signature names.
        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            if self.depth or not only(*args):
                return fn(*args, **kwargs)
            self.depth, start = 1, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
                self.calls, self.depth = self.calls + 1, 0

        return timed


def breakdown(pjrt: torch.nn.Module, run: Callable[[], torch.Tensor], new_tokens: int) -> None:
    """Print where one more pjrt generate's main-thread CPU goes per token, and its graphs and eager ops."""
    from jax import stages
    from torch._dynamo.utils import counters

    forward, aot, graph, program, jax_call = CpuTimer(), CpuTimer(), CpuTimer(), CpuTimer(), CpuTimer()
    flushed = CpuTimer()
    compiled_forward, graph_call, program_call = pjrt.forward, backend.CompiledGraph.__call__, programs.Program.call
    compiled_call, flush = stages.Compiled.__call__, fusion.PendingGraph.flush
    # Dynamo's code for the forward calls its graphs through these globals of the forward's module: AOTAutograd's
    # runtime wrappers are the time in them outside our graph call (plus the timer's own disable() wrapper).
    namespace = type(pjrt).forward.__globals__
    compiled_fns = {name: fn for name, fn in namespace.items() if name.startswith("__compiled_fn")}
    called: list[tuple[tuple, dict]] = []

    @functools.wraps(compiled_forward)
    def recorded(*args: object, **kwargs: object) -> object:
        called[:] = [(args, kwargs)]
        return compiled_forward(*args, **kwargs)

    pjrt.forward = forward.wrap(recorded)
    # (disabled for Dynamo: the timer runs inside the compiled frame, where Dynamo would trace it)
    namespace.update({name: torch.compiler.disable(aot.wrap(fn)) for name, fn in compiled_fns.items()})
    backend.CompiledGraph.__call__ = graph.wrap(graph_call)
    programs.Program.call = program.wrap(program_call, lambda self, *args: self.name == "compiled_graph")
    stages.Compiled.__call__ = jax_call.wrap(compiled_call, lambda *args: program.depth == 1)
    # fused mode: the graph call reads inputs HF's loop left pending, which runs their fused program there
    fusion.PendingGraph.flush = flushed.wrap(flush, lambda *args: graph.depth == 1)
    counters.clear()
    before = torch_pjrt.metrics.counters()
    try:
        start = time.thread_time()
        run()
        total = time.thread_time() - start
    finally:
        pjrt.forward, backend.CompiledGraph.__call__, programs.Program.call = (compiled_forward, graph_call,
                                                                                program_call)
        stages.Compiled.__call__, fusion.PendingGraph.flush = compiled_call, flush
        namespace.update(compiled_fns)
    after = torch_pjrt.metrics.counters()
    per_token = {name: (after[name] - before[name]) / new_tokens
                 for name in ("ops_executed", "fused_programs", "transfers_to_host")}
    ms = 1000 / new_tokens
    guards = guard_check_seconds(pjrt, *called[-1]) * 1000
    dynamo = (forward.seconds - graph.seconds) * ms
    wrappers = (aot.seconds - graph.seconds) * ms if aot.calls == graph.calls else float("nan")
    print(f"per token, main-thread CPU ms (load {open('/proc/loadavg').read().split()[0]}): all {total * ms:.3f} = "
          f"Hugging Face's loop and its eager pjrt ops {(total - forward.seconds) * ms:.3f} + Dynamo's frame "
          f"{dynamo:.3f} + our graph call {(graph.seconds - program.seconds - flushed.seconds) * ms:.3f} + the fused "
          f"flush of the graph's pending inputs in it {flushed.seconds * ms:.3f} + program call "
          f"{program.seconds * ms:.3f}")
    print(f"  Dynamo's frame {dynamo:.3f} = AOTAutograd's runtime wrappers {wrappers:.3f} + the rest "
          f"{dynamo - wrappers:.3f} (Dynamo's call and code, Hugging Face's forward wrapper, the guards: "
          f"{guards:.3f} when the last forward's guards are checked alone, in a loop); program call "
          f"{program.seconds * ms:.3f} = jax's call of the compiled executable {jax_call.seconds * ms:.3f} + "
          f"Program.call around it {(program.seconds - jax_call.seconds) * ms:.3f}")
    print(f"per token: forwards {forward.calls / new_tokens:.2f}, graph calls {graph.calls / new_tokens:.2f}, "
          f"eager pjrt ops {per_token['ops_executed']:.1f} (fused programs {per_token['fused_programs']:.2f}), "
          f"transfers to host {per_token['transfers_to_host']:.2f}; "
          f"in the whole generate: graphs captured {counters['stats']['unique_graphs']}, graph breaks "
          f"{sum(counters['graph_break'].values())}, recompiles {sum(counters['recompiles'].values())}")


def guard_check_seconds(model: torch.nn.Module, args: tuple, kwargs: dict, repeats: int = 200) -> float:
    """Main-thread CPU seconds of Dynamo's guard checks for one call of the model's compiled forward with these
    arguments: each compiled frame's guards tried in Dynamo's order up to the one that passes, timed in a loop
    (best of 5; caches warm, so below what the same checks cost inside generate's loop). NaN where none passes."""
    function = type(model).forward
    bound = inspect.signature(function, follow_wrapped=False).bind(model, *args, **kwargs)
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)
    frame_locals.update(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))
    tried = []
    with torch.no_grad():
        for check in _torch_private.dynamo_guard_checks(function.__code__):
            tried.append(check)
            if check(frame_locals):
                break
        else:
            return float("nan")
        best = float("inf")
        for _ in range(5):
            start = time.thread_time()
            for _ in range(repeats):
                for check in tried:
                    check(frame_locals)
            best = min(best, (time.thread_time() - start) / repeats)
    return best


def decode_call_alone(pjrt: torch.nn.Module, run: Callable[[], torch.Tensor],
                      repeats: int = 20) -> None:
    """Print one decode graph call replayed alone on ready inputs: its main-thread CPU split into jax's call of the
    executable and our replay around it, the arrays crossing per call, and whether the written storages (the
    static cache's keys, values and lengths) keep their device buffers (donated, updated in place) or are copied.

    The call is the middle token's, its arguments kept; the inputs it writes are set back to their values before
    that call between batches of calls (outside the timing), so the repeated calls stay within the cache's length
    and the cache is left as that call found it."""
    jax = client.jax_module()
    graph_call, kept = backend.CompiledGraph.__call__, []

    def keep(graph: backend.CompiledGraph, *args: object) -> object:
        kept.append((graph, args, [args[index].clone() for index, _ in graph.mutations]))
        return graph_call(graph, *args)

    backend.CompiledGraph.__call__ = keep
    try:
        run()
    finally:
        backend.CompiledGraph.__call__ = graph_call
    graph, args, saved = kept[len(kept) // 2]
    written = [args[index] for index, _ in graph.mutations]

    def buffers() -> list[int]:  # read after a wait: the addresses of the written storages' device buffers
        arrays = [storage.storage_of(tensor).array for tensor in written]
        jax.block_until_ready(arrays)
        return [array.unsafe_buffer_pointer() for array in arrays]

    program_timer, program_call = CpuTimer(), programs.Program.call
    programs.Program.call = program_timer.wrap(program_call, lambda self, *rest: self.name == "compiled_graph")
    best_call, best_program, kept_in_place = float("inf"), float("inf"), 0
    try:
        with torch.no_grad():
            for _ in range(10):
                for tensor, value in zip(written, saved):
                    tensor.copy_(value)
                before = buffers()
                program_timer.seconds, program_timer.calls = 0.0, 0
                start = time.thread_time()
                for _ in range(repeats):
                    graph(*args)
                seconds = time.thread_time() - start
                kept_in_place = sum(old == new for old, new in zip(before, buffers()))
                if seconds < best_call:
                    best_call, best_program = seconds, program_timer.seconds
    finally:
        programs.Program.call = program_call
        for tensor, value in zip(written, saved):
            tensor.copy_(value)
    inputs = [value for value in args if isinstance(value, torch.Tensor)]
    found = graph.native_last
    outputs = sum(out.is_tensor for out in graph.outputs)
    us = 1e6 / repeats
    print(f"the middle token's decode graph call alone, its inputs ready (best of 10 x {repeats}), main-thread CPU us: "
          f"{best_call * us:.1f} = jax's program call {best_program * us:.1f} + our replay around it "
          f"{(best_call - best_program) * us:.1f} (native: {found is not None and found.native is not None}); "
          f"arrays per call: {len(inputs)} tensor inputs ({sum(t.is_cpu for t in inputs)} on CPU), {len(written)} "
          f"written back ({kept_in_place} kept their device buffer after {repeats} calls: donated, updated in place; "
          f"{len(written) - kept_in_place} copied), {outputs} tensor outputs")


def forward_alone(pjrt: torch.nn.Module, run: Callable[[], torch.Tensor], repeats: int = 20) -> None:
    """Print the middle token's compiled forward replayed alone on ready inputs (main-thread CPU, best of 10 x
    `repeats`), split into Dynamo's frame (its guards, its code and the output object it builds: the forward timed
    with the frame's graph function stubbed to return that call's result), AOTAutograd's runtime wrappers (the
    graph function called alone, less our graph call) and our graph call alone. The parts are each timed alone;
    the whole forward exceeds their sum by what they cost together: Dynamo's guards walk ~1,200 guard nodes over
    the model's modules, dicts and 55 tensors, and with the CPU caches cold (as after the program call, or after
    Hugging Face's loop) they and the frame took ~3x their warm time (2026-12-08: 36 -> 105-146 us, the stubbed
    frame 60 -> 170 us). The inputs the graph writes are set back to their values before that call between
    batches."""
    namespace = type(pjrt).forward.__globals__
    compiled_fns = {name: fn for name, fn in namespace.items() if name.startswith("__compiled_fn")}
    compiled_forward, graph_call = pjrt.forward, backend.CompiledGraph.__call__
    forwards: list[tuple[tuple, dict]] = []
    graph_fns: list[tuple[str, Callable, tuple]] = []
    graphs: list[tuple[backend.CompiledGraph, tuple, list[tuple[torch.Tensor, torch.Tensor]]]] = []

    @functools.wraps(compiled_forward)
    def recorded(*args: object, **kwargs: object) -> object:
        forwards.append((args, kwargs))
        return compiled_forward(*args, **kwargs)

    def recording(name: str, fn: Callable) -> Callable:
        def graph_fn(*args: object) -> object:
            graph_fns.append((name, fn, args))
            return fn(*args)

        return torch.compiler.disable(graph_fn)

    def keep(graph: backend.CompiledGraph, *args: object) -> object:
        graphs.append((graph, args, [(args[index], args[index].clone()) for index, _ in graph.mutations]))
        return graph_call(graph, *args)

    pjrt.forward, backend.CompiledGraph.__call__ = recorded, keep
    namespace.update({name: recording(name, fn) for name, fn in compiled_fns.items()})
    try:
        run()
    finally:
        pjrt.forward, backend.CompiledGraph.__call__ = compiled_forward, graph_call
        namespace.update(compiled_fns)
    middle = len(forwards) // 2
    (args, kwargs), (name, graph_fn, fn_args), (graph, graph_args, written) = (
        forwards[middle], graph_fns[middle], graphs[middle])

    def per_call(call: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(10):
            for tensor, value in written:
                tensor.copy_(value)
            start = time.thread_time()
            for _ in range(repeats):
                call()
            best = min(best, (time.thread_time() - start) / repeats)
        for tensor, value in written:
            tensor.copy_(value)
        return best * 1e6

    with torch.no_grad():
        whole = per_call(lambda: compiled_forward(*args, **kwargs))
        wrappers = per_call(lambda: graph_fn(*fn_args))
        ours = per_call(lambda: graph(*graph_args))
        result = graph_fn(*fn_args)
        namespace[name] = torch.compiler.disable(lambda *ignored: result)
        try:
            frame = per_call(lambda: compiled_forward(*args, **kwargs))
        finally:
            namespace[name] = compiled_fns[name]
    guards = guard_check_seconds(pjrt, args, kwargs) * 1e6
    parts = frame + wrappers
    print(f"the middle token's forward alone, its inputs ready (best of 10 x {repeats}), main-thread CPU us: "
          f"{whole:.1f} = Dynamo's frame {frame:.1f} (guards {guards:.1f} of it; timed with its graph function "
          f"stubbed) + AOTAutograd's runtime wrappers {wrappers - ours:.1f} + our graph call {ours:.1f} + the parts "
          f"together beyond their sum alone {whole - parts:.1f}")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def device_side(pjrt_run: Callable[[], torch.Tensor], cpu: torch.nn.Module, cpu_run: Callable[[], torch.Tensor],
                new_tokens: int) -> None:
    """Print the decode program's own time per call (its inputs ready before, its results waited for: what the
    device spends, our host path excluded) beside torch CPU eager's forward per token, and the eager pjrt ops per
    token by name (ATen ops the profiler sees outside the compiled region and outside other ATen ops)."""
    jax = client.jax_module()
    program_wall: list[float] = []
    program_call = programs.Program.call

    def waited(self: programs.Program, *args: object) -> object:
        if self.name != "compiled_graph":
            return program_call(self, *args)
        jax.block_until_ready(args)
        start = time.perf_counter()
        results = program_call(self, *args)
        jax.block_until_ready(results)
        program_wall.append(time.perf_counter() - start)
        return results

    forward_wall: list[float] = []
    cpu_forward, cpu_timer = cpu.forward, CpuTimer()

    @functools.wraps(cpu_forward)
    def timed_forward(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return cpu_forward(*args, **kwargs)
        finally:
            forward_wall.append(time.perf_counter() - start)

    programs.Program.call, cpu.forward = waited, cpu_timer.wrap(timed_forward)
    try:
        pjrt_run()
        start = time.thread_time()
        cpu_run()
        cpu_total = time.thread_time() - start
    finally:
        programs.Program.call, cpu.forward = program_call, cpu_forward
    ms = 1000 / new_tokens
    print(f"per token, wall ms (medians): the decode program alone {median(program_wall) * 1000:.3f}, torch CPU "
          f"eager's forward {median(forward_wall) * 1000:.3f}; torch CPU eager's main-thread CPU ms per token: all "
          f"{cpu_total * ms:.3f} = Hugging Face's loop and its CPU ops {(cpu_total - cpu_timer.seconds) * ms:.3f} + "
          f"forward {cpu_timer.seconds * ms:.3f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        pjrt_run()
    ops: dict[str, int] = {}
    for event in profile.events():
        parent, inside = event.cpu_parent, False
        while parent is not None and not inside:
            inside = parent.name.startswith(("aten::", "Torch-Compiled Region"))
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and not inside:
            ops[event.name] = ops.get(event.name, 0) + 1
    listed = ", ".join(f"{name.removeprefix('aten::')} {count / new_tokens:.2f}"
                       for name, count in sorted(ops.items(), key=lambda item: -item[1]))
    print(f"eager ATen ops per token outside the compiled forward ({sum(ops.values()) / new_tokens:.1f}): {listed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--breakdown", action="store_true", help="then split one more generate's CPU time per token")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cpu, pjrt = cpu_and_pjrt_llama()
    pjrt.forward = torch.compile(pjrt.forward, backend="pjrt")
    threads = torch.get_num_threads()
    cpu_generate = generator(cpu, "cpu", args.new_tokens)
    rows = {
        f"torch CPU eager, {threads} threads": cpu_generate,
        "torch CPU eager, 1 thread": with_threads(1, cpu_generate),
    }
    strict = generator(pjrt, "pjrt", args.new_tokens, cache_implementation="static")
    rows.update(zip(COMPILED_ROWS, (strict, fused(strict), guards_skipped(fused(strict)))))
    tokens, first = {}, {}
    compiles_before = torch_pjrt.metrics.counters()["graph_compiles"]
    for name, run in rows.items():
        start = time.perf_counter()
        tokens[name] = run()
        first[name] = time.perf_counter() - start
    compiles_warm = torch_pjrt.metrics.counters()["graph_compiles"]
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(args.rounds):
        for name, run in rows.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    later = torch_pjrt.metrics.counters()["graph_compiles"] - compiles_warm

    reference = tokens[f"torch CPU eager, {threads} threads"]
    print(f"generate(): 4-layer Llama (width 128), greedy, {PROMPT}-token prompt, {args.new_tokens} new tokens; "
          f"best of {args.rounds} interleaved rounds")
    width = max(map(len, rows)) + 2
    print(f"{'':<{width}}{'first s':>9}{'tokens/s':>10}  tokens equal CPU's")
    for name in rows:
        print(f"{name:<{width}}{first[name]:>9.2f}{args.new_tokens / best[name]:>10.1f}  "
              f"{torch.equal(tokens[name], reference)}")
    print(f"pjrt graphs compiled: {compiles_warm - compiles_before} in the warm-up, {later} in the timed rounds")
    baseline = min(best[f"torch CPU eager, {threads} threads"], best["torch CPU eager, 1 thread"])
    for name in COMPILED_ROWS:
        ratio = baseline / best[name]
        same = torch.equal(tokens[name], reference)
        print(f"{name} / torch CPU eager (its faster thread count), tokens/s: {ratio:.2f}   "
              f"(goal >= 1.50 with the same tokens: {'met' if ratio >= 1.5 and same else 'not met'})")
    if args.breakdown:
        for name in COMPILED_ROWS:
            print(f"{name}:")
            breakdown(pjrt, rows[name], args.new_tokens)
        faster = min(rows, key=lambda name: best[name] if name not in COMPILED_ROWS else float("inf"))
        print(f"{COMPILED_ROWS[0]}, beside {faster}:")
        device_side(rows[COMPILED_ROWS[0]], cpu, rows[faster], args.new_tokens)
        # calls replayed from the middle token's on: within the static cache's length (the prompt and the new tokens)
        repeats = max(1, min(20, args.new_tokens // 2 - 1))
        forward_alone(pjrt, rows[COMPILED_ROWS[0]], repeats)
        decode_call_alone(pjrt, rows[COMPILED_ROWS[0]], repeats)


if __name__ == "__main__":
    main()
