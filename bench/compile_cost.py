"""XLA's compile time per program kind, and what XLA's CPU options trade of run speed for it.

Three workloads each run in a fresh process with the persistent cache off, so every program is
compiled: strict eager (Hugging Face generate() of bench/tiny_llama's Llama, 4 new tokens), the same
in DEFER_AND_FUSE, examples/gpt.py's AdamW training step in strict eager ("strict-step") and that
step under torch.compile(backend="pjrt"). Every
program XLA compiles there is captured (its StableHLO and compile options) with its compile time.
Then, in this process, each captured program of a kind is compiled again under each option set and
run on random inputs: the columns are the kind's total compile CPU ms (best of `--rounds`) and its
summed run us (median of 20 runs each), each option set side by side with XLA's defaults.
Strict eager's programs are one op each; the fused and compiled kinds are their largest programs
(the decode step's fused program, the training step's graphs).
With --stages it shows instead where a new bucket's compile seconds go, stage by stage: in a fresh
process on an empty cache folder, Hugging Face generate() of bench/prompt_lengths.py's Llama at prompts
7 and 11 (bucket 64), then prompt 60 timed (8 new tokens take it past 64: bucket 128, all of whose
programs are new), in strict eager and in DEFER_AND_FUSE.
Run: .venv/bin/python bench/compile_cost.py [--rounds 2] | [--stages]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(BENCH, "..", "examples")

CAPTURE = textwrap.dedent(
    """
    import pickle, sys, time, warnings
    from jax._src import compiler
    captured = []
    original = compiler.backend_compile_and_load

    def capturing(backend, module, executable_devices, options, host_callbacks):
        start = time.perf_counter()
        result = original(backend, module, executable_devices, options, host_callbacks)
        name = str(module.operation.attributes["sym_name"]).strip('"')
        captured.append((name, str(module), options.SerializeAsString(), time.perf_counter() - start))
        return result

    compiler.backend_compile_and_load = capturing
    import torch, torch_pjrt
    warnings.simplefilter("ignore")
    workload, out = sys.argv[1], sys.argv[2]
    if workload in ("strict", "fused"):
        sys.path.insert(0, BENCH)
        from tiny_llama import cpu_and_pjrt_llama
        if workload == "fused":
            torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
        _, model = cpu_and_pjrt_llama()
        ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(1)).to("pjrt")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           pad_token_id=0).cpu()
    else:
        sys.path.insert(0, EXAMPLES)
        from gpt import GPT, batches, corpus_bytes, train_step
        torch.manual_seed(0)
        model = GPT(width=128, layers=2, heads=4, context=64).to("pjrt")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tokens, targets = batches(corpus_bytes(), 8, 64, 1)[0]
        step = train_step if workload == "strict-step" else torch.compile(train_step, backend="pjrt")
        step(model, optimizer, tokens.to("pjrt"), targets.to("pjrt")).item()
    with open(out, "wb") as file:
        pickle.dump(captured, file)
    """
)

STAGES = textwrap.dedent(
    """
    import collections, functools, json, sys, time, warnings
    import torch, torch_pjrt
    from jax._src import compiler, pjit, stages
    from jax._src.interpreters import mlir
    from jax.experimental import serialize_executable
    from torch_pjrt.eager import dispatch
    from torch_pjrt.runtime import disk_store
    warnings.simplefilter("ignore")
    seconds, calls = collections.Counter(), collections.Counter()
    open_stages = []  # [stage, start] of the stages running now, innermost last

    def timed(owner, attribute, stage):
        original = getattr(owner, attribute)

        @functools.wraps(original)  # (its signature stays readable: client._pass_compile_options binds to it)
        def wrapper(*args, **kwargs):
            if open_stages and open_stages[-1][0] == stage:  # a recursive call counts in the outer one
                return original(*args, **kwargs)
            open_stages.append([stage, time.perf_counter()])
            try:
                return original(*args, **kwargs)
            finally:
                _, start = open_stages.pop()
                elapsed = time.perf_counter() - start
                seconds[stage] += elapsed
                calls[stage] += 1
                if open_stages:  # each stage's own time: the outer one does not count this one's
                    seconds[open_stages[-1][0]] -= elapsed

        setattr(owner, attribute, wrapper)

    for owner, attribute, stage in STAGE_HOOKS:
        timed(eval(owner), attribute, stage)
    if sys.argv[1] == "fused":
        torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    sys.path.insert(0, BENCH)
    from tiny_llama import cpu_and_pjrt_llama
    cpu, pjrt = cpu_and_pjrt_llama()

    def generate(model, ids, device):
        with torch.no_grad():
            return model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=8,
                                  do_sample=False, pad_token_id=0).cpu()

    generator = torch.Generator().manual_seed(1)
    for length in (7, 11, 60):
        ids = torch.randint(1, 256, (1, length), generator=generator)
        want = generate(cpu, ids, "cpu")
        seconds.clear()
        calls.clear()
        start = time.perf_counter()
        got = generate(pjrt, ids, "pjrt")
        wall = time.perf_counter() - start
    found = {stage: (seconds[stage], calls[stage]) for stage in seconds}
    print(json.dumps(dict(wall=wall, equal=torch.equal(want, got), stages=found)))
    """
)

# The stages timed by --stages: (object, attribute, label). Each stage's time is its own: a stage inside another
# (XLA's compile inside jax's compile step, a fused flush inside an op's padded form) counts only in itself.
STAGE_HOOKS = (
    ("dispatch", "_padded_form", "padded form (meta kernels, per bucket)"),
    ("dispatch", "_build", "op entry build"),
    ("pjit", "jit_trace", "jax trace (our lowerings to a jaxpr)"),
    ("stages.Traced", "lower", "jaxpr to StableHLO, but its MLIR context"),
    ("mlir", "make_ir_context", "a fresh MLIR context (one per lowering)"),
    ("compiler", "compile_or_get_cached", "jax's compile step around XLA's"),
    ("compiler", "backend_compile_and_load", "XLA's compile"),
    ("serialize_executable", "serialize", "serialize executable"),
    ("disk_store", "write", "cache folder writes"),
)


def stages(mode: str) -> dict:
    """Seconds and calls per stage of prompt 60's generate() (bucket 128, new) in a fresh process."""
    code = STAGES.replace("BENCH", repr(BENCH)).replace("STAGE_HOOKS", repr(STAGE_HOOKS))
    with tempfile.TemporaryDirectory() as folder:
        environment = {**os.environ, "TORCH_PJRT_CACHE_DIR": folder, "TORCH_PJRT_DYNAMIC_GENERATE": "1"}
        result = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} stages run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def print_stages() -> None:
    print("a new bucket's programs: generate() at prompt 60 (bucket 128) after prompts 7 and 11 (bucket 64), "
          "empty cache folder")
    for mode in ("strict", "fused"):
        row = stages(mode)
        found = row["stages"]
        programs = found.get("XLA's compile", (0, 0))[1]
        print(f"\n{mode}: wall {row['wall']:.2f} s, {programs} XLA compiles, tokens equal CPU's: {row['equal']}")
        print(f"{'stage':<42}{'ms':>9}{'calls':>7}{'ms each':>9}{'ms a program':>14}{'of wall':>9}")
        for _, _, label in STAGE_HOOKS:
            total, count = found.get(label, (0.0, 0))
            print(f"{label:<42}{total * 1000:>9.0f}{count:>7}{total * 1000 / max(count, 1):>9.1f}"
                  f"{total * 1000 / max(programs, 1):>14.1f}{total / row['wall']:>9.0%}")
        rest = row["wall"] - sum(total for total, _ in found.values())
        print(f"{'the rest (running the ops, Python, HF)':<42}{rest * 1000:>9.0f}{'':>7}{'':>9}{'':>14}"
              f"{rest / row['wall']:>9.0%}", flush=True)


# Option sets: (label, XLA debug options through jax's compiler options).
VARIANTS = (
    ("XLA defaults", {}),
    ("fusion emitters off", {"xla_cpu_use_fusion_emitters": False}),
    ("LLVM expensive passes off", {"xla_llvm_disable_expensive_passes": True}),
    ("fusion emitters + expensive passes off", {"xla_cpu_use_fusion_emitters": False,
                                                "xla_llvm_disable_expensive_passes": True}),
    ("emitter verification level 0", {"xla_cpu_emitter_verification_level": 0}),
    ("parallel codegen split 1", {"xla_cpu_parallel_codegen_split_count": 1}),
    ("backend optimization level 0", {"xla_backend_optimization_level": 0}),
)


def capture(workload: str, folder: str) -> list[tuple[str, str, bytes, float]]:
    """The programs one fresh process compiles for a workload: (module name, StableHLO, options, compile s);
    read from `folder` where an earlier run left them (--captures)."""
    out = os.path.join(folder, f"{workload}.pickle")
    if os.path.exists(out):
        with open(out, "rb") as file:
            return pickle.load(file)
    code = CAPTURE.replace("BENCH", repr(BENCH)).replace("EXAMPLES", repr(EXAMPLES))
    environment = {**os.environ, "TORCH_PJRT_CACHE_DIR": "0"}
    result = subprocess.run([sys.executable, "-c", code, workload, out], capture_output=True, text=True,
                            env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"the {workload} workload failed:\n{result.stderr[-3000:]}")
    with open(out, "rb") as file:
        return pickle.load(file)


def _inputs(module: object) -> list:
    """Random host arrays for a module's main function's parameters (never zeros)."""
    import numpy as np
    from jax._src.lib.mlir import ir

    generator = np.random.default_rng(0)
    main = next(op for op in module.body.operations if str(op.attributes["sym_name"]).strip('"') == "main")
    arrays = []
    for kind in ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs:
        tensor = ir.RankedTensorType(kind)
        dtype = _dtype(str(tensor.element_type))
        shape = tuple(tensor.shape)
        if dtype == np.bool_:
            value = generator.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            value = generator.integers(1, 4, shape).astype(dtype)
        else:
            value = generator.standard_normal(shape).astype(dtype)
        arrays.append(value)
    return arrays


def _dtype(name: str) -> object:
    import ml_dtypes
    import numpy as np

    table = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "i1": np.bool_,
             "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "ui8": np.uint8, "ui32": np.uint32,
             "ui64": np.uint64}
    return np.dtype(table[name])


def _compiled(text: str, options: bytes, debug: dict) -> tuple[float, object, list]:
    """One compile of a captured program under extra debug options: its CPU seconds (every thread of this
    process: less swayed by other processes than wall time on a loaded machine), executable, random inputs."""
    import jax
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client

    device = jax.devices()[0]
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(text)
        compile_options = xla_client.CompileOptions.ParseFromString(options)
        compile_options.env_option_overrides = [*compile_options.env_option_overrides, *debug.items()]
        start = time.process_time()
        executable = compiler.backend_compile_and_load(device.client, module, xla_client.DeviceList((device,)),
                                                       compile_options, [])
        seconds = time.process_time() - start
        return seconds, executable, _inputs(module)


def _run_us(executable: object, host: list) -> float:
    """Median us of 20 runs on fresh device copies of the inputs (a program may donate them)."""
    import jax

    device = jax.devices()[0]
    runs = []
    for _ in range(22):
        arguments = [jax.device_put(value, device) for value in host]
        jax.block_until_ready(arguments)
        start = time.perf_counter()
        results = executable.execute_sharded(arguments)
        for array in results.disassemble_into_single_device_arrays():
            for part in array:
                part.block_until_ready()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[2:]) * 1e6


def measure(programs: list, rounds: int, variants: tuple) -> dict[str, tuple[float, float]]:
    """Per option set, the programs' summed compile CPU ms (each its best of `rounds`, option sets
    interleaved round by round) and summed run us."""
    best: dict[tuple[str, int], float] = {}
    run_us: dict[str, float] = {}
    for round_index in range(rounds):
        for label, debug in variants:
            for index, (_, text, options, _) in enumerate(programs):
                seconds, executable, host = _compiled(text, options, debug)
                best[(label, index)] = min(best.get((label, index), float("inf")), seconds)
                if round_index == rounds - 1:
                    run_us[label] = run_us.get(label, 0.0) + _run_us(executable, host)
    return {label: (sum(best[(label, i)] for i in range(len(programs))) * 1000, run_us[label])
            for label, _ in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="compiles per program and option set (best kept)")
    parser.add_argument("--captures", help="a folder keeping the captured programs between runs")
    parser.add_argument("--kinds", default="strict,strict-step,fused,compiled", help="program kinds measured")
    parser.add_argument("--variants", default=",".join(map(str, range(len(VARIANTS)))),
                        help="option sets measured, by their index in VARIANTS (0: XLA's defaults, the baseline)")
    parser.add_argument("--ops", type=int, default=40, help="distinct strict ops kept (the first compiled)")
    parser.add_argument("--largest", type=int, default=4, help="programs kept per fused and compiled workload")
    parser.add_argument("--stages", action="store_true", help="where a new bucket's compile seconds go, by stage")
    arguments = parser.parse_args()
    if arguments.stages:
        print_stages()
        return
    import jax

    jax.config.update("jax_enable_x64", True)
    with tempfile.TemporaryDirectory() as temporary:
        folder = arguments.captures or temporary
        captured = {workload: capture(workload, folder) for workload in ("strict", "strict-step", "fused", "compiled")}
    print(f"{'kind':<34}{'programs':>9}{'compile ms in workload':>24}")
    for workload, programs in captured.items():
        print(f"{workload:<34}{len(programs):>9}{sum(p[3] for p in programs) * 1000:>24.0f}")
    kinds = {"strict op": _distinct(captured["strict"])[:arguments.ops],
             "strict-step op": _distinct(captured["strict-step"])[:arguments.ops],
             "fused program": _largest(captured["fused"], arguments.largest),
             "compiled graph": _largest(captured["compiled"], arguments.largest)}
    variants = tuple(VARIANTS[int(index)] for index in arguments.variants.split(","))
    kinds = {kind: programs for kind, programs in kinds.items() if kind.split()[0] in arguments.kinds.split(",")}
    print(f"\n{'kind, option set':<58}{'compile CPU ms':>15}{'x default':>10}{'run us':>10}{'x default':>10}")
    for kind, programs in kinds.items():
        figures = measure(programs, arguments.rounds, variants)
        base = figures[variants[0][0]]
        for label, (compile_ms, run_us) in figures.items():
            print(f"{kind + ' (' + str(len(programs)) + '), ' + label:<58}{compile_ms:>15.1f}"
                  f"{compile_ms / base[0]:>10.2f}{run_us:>10.1f}{run_us / base[1]:>10.2f}", flush=True)


def _distinct(programs: list) -> list:
    seen: dict[str, tuple] = {}
    for program in programs:
        seen.setdefault(program[1], program)
    return list(seen.values())


def _largest(programs: list, count: int) -> list:
    return sorted(_distinct(programs), key=lambda program: len(program[1]), reverse=True)[:count]


if __name__ == "__main__":
    main()
