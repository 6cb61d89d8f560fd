"""Time to first step of a fresh process, cold compile cache against warm, side by side, and where each second goes.

Each run is a new Python process that imports torch, builds the GPT of bench/train_step.py and runs
one training step (compiled with backend="pjrt", in DEFER_AND_FUSE, or in strict eager), timed from
before `import torch` to the step's loss on the host. Cold: an empty TORCH_PJRT_CACHE_DIR; warm: the
same folder again, once as is and once without the background preload of the stored executables the
last process used (what that preload saves). The three alternate over `--rounds` rounds (each round a new
folder); the best of each is kept. Both start from Python bytecode compiled beforehand, as an installed package
does (this machine sets PYTHONDONTWRITEBYTECODE, which would make every process compile our sources).

The phases are self times (a nested phase is not counted in the one around it): imports (every
module loaded, at start or lazily, Dynamo's at the device start on a thread of its own included),
Dynamo tracing, AOTAutograd, jax's tracing and lowering of our programs (the lowering table running),
XLA compile or persistent-cache load, the main thread's time
getting the executables our store keeps (strict ops, fused programs, compiled graphs: deserializing
them, or waiting for the background thread that preloads them), Python's cyclic garbage collections
(wherever they fall), and the rest (building the model, the first run of the programs, Python around
them). The hit columns count executables from XLA's cache, entries of our store (traced graphs and
fused programs, their executables), compiled graphs from AOTAutograd's cache, the store's
executables a background thread had loaded (or was loading) when the step asked for them, and the
compiled step's Dynamo package (its own frames, stored: not traced by Dynamo) read from the cache folder.
Run: .venv/bin/python bench/first_step.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import time
    start = time.perf_counter()
    import importlib._bootstrap as bootstrap
    import json, sys
    seconds = {}
    stack = ["rest"]
    mark = [start]

    def enter(name):
        now = time.perf_counter()
        seconds[stack[-1]] = seconds.get(stack[-1], 0.0) + now - mark[0]
        stack.append(name)
        mark[0] = now

    def leave():
        now = time.perf_counter()
        name = stack.pop()
        seconds[name] = seconds.get(name, 0.0) + now - mark[0]
        mark[0] = now

    import threading
    main_thread = threading.main_thread()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if threading.current_thread() is not main_thread:  # a background preload: not the main thread's time
                return fn(*args, **kwargs)
            enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                leave()
        return wrapper

    import gc
    gc.callbacks.append(lambda phase, info: enter("gc") if phase == "start" else leave())

    original_find_and_load = bootstrap._find_and_load
    def find_and_load(name, import_):
        if not stack or stack[-1] == "imports":
            return original_find_and_load(name, import_)
        return timed("imports", original_find_and_load)(name, import_)
    bootstrap._find_and_load = find_and_load

    import torch
    from torch_pjrt import _registration
    # the device start imports Dynamo on a thread of its own while the main thread waits: an import all the same
    _registration._import_on_a_thread_of_its_own = timed("imports", _registration._import_on_a_thread_of_its_own)
    if not PRELOAD:
        from torch_pjrt.runtime import programs
        programs.start_preload = lambda: None
    jax_seconds = {}
    def jax_event(event, duration, **_):
        jax_seconds[event] = jax_seconds.get(event, 0.0) + duration

    sys.path.insert(0, EXAMPLES)
    from gpt import GPT, batches, corpus_bytes, train_step
    torch.manual_seed(0)
    model = GPT(width=128, layers=2, heads=4, context=64).to("pjrt")
    import jax
    from jax.experimental import serialize_executable
    jax.monitoring.register_event_duration_secs_listener(jax_event)
    serialize_executable.deserialize_and_load = timed("load", serialize_executable.deserialize_and_load)
    from torch_pjrt.runtime import programs
    programs._Preloads.claim = timed("load", programs._Preloads.claim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens, targets = batches(corpus_bytes(), 8, 64, 1)[0]
    step = train_step
    if MODE == "compiled":
        import torch._dynamo.convert_frame as convert_frame
        import torch._dynamo.backends.common as common
        convert_frame._compile = timed("dynamo", convert_frame._compile)
        common.aot_module_simplified = timed("aot", common.aot_module_simplified)
        step = torch.compile(train_step, backend="pjrt")
    if MODE == "fused":
        import torch_pjrt
        torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    loss = step(model, optimizer, tokens.to("pjrt"), targets.to("pjrt")).item()
    leave()
    total = time.perf_counter() - start
    trace = sum(jax_seconds.get(e, 0.0) for e in ("/jax/core/compile/jaxpr_trace_duration",
                                                  "/jax/core/compile/jaxpr_to_mlir_module_duration"))
    xla = jax_seconds.get("/jax/core/compile/backend_compile_duration", 0.0)
    seconds["trace"] = trace
    seconds["xla"] = xla
    seconds["rest"] -= trace + xla
    import torch_pjrt
    counters = torch_pjrt.metrics.counters()
    stored = counters["disk_store_hits"] + counters.get("op_store_hits", 0)
    print(json.dumps({"total": total, "phases": seconds, "loss": loss, "programs": counters["compiles"],
                      "executables": counters["persistent_cache_hits"], "graphs": stored,
                      "aot": counters["aot_cache_hits"], "preloaded": counters.get("preload_hits", 0),
                      "packages": counters.get("dynamo_package_hits", 0)}))
    """
)
MODES = (("torch.compile(backend='pjrt')", "compiled"), ("DEFER_AND_FUSE", "fused"), ("strict eager", "strict"))
GOAL = 0.5  # warm first step over cold, issue #33
# Each round's processes, in order; the last one, its executables not preloaded, shows what preloading saves.
WITHOUT_PRELOAD = "warm, no preload"
KINDS = ("cold", "warm", WITHOUT_PRELOAD)
# A child's environment reads the bytecode `compile_bytecode` wrote (an empty value unsets the variable).
BYTECODE_READ = {"PYTHONDONTWRITEBYTECODE": ""}
PHASES = (("imports", "imports"), ("dynamo", "Dynamo"), ("aot", "AOTAutograd"), ("trace", "jax trace+lower"),
          ("xla", "XLA compile/load"), ("load", "our store's load"), ("gc", "Python's GC"), ("rest", "rest"))


def first_step(cache: str, mode: str, preload: bool = True) -> dict:
    """One fresh process's first step: total seconds, seconds per phase, loss and cache hits; `preload` False
    keeps the device start from preloading the stored executables its entry point used last time."""
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    code = CHILD.replace("EXAMPLES", repr(examples)).replace("MODE", repr(mode)).replace("PRELOAD", repr(preload))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_environment(cache))
    if result.returncode != 0:
        raise RuntimeError(f"the {mode} child failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _child_environment(cache: str) -> dict[str, str]:
    """A child's environment: this cache folder, and Python bytecode read (not compiled again) in every process."""
    environment = {**os.environ, "TORCH_PJRT_CACHE_DIR": cache}
    environment.update(BYTECODE_READ)
    return environment


def compile_bytecode() -> None:
    """Our package's, the examples' and these benchmarks' bytecode, written once before any timed process."""
    import compileall
    import importlib.util

    bench = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(importlib.util.find_spec("torch_pjrt").origin)
    for folder in (package, os.path.join(bench, "..", "examples"), bench):
        compileall.compile_dir(folder, quiet=1, maxlevels=0 if folder == bench else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm pairs per mode; the best of each is kept")
    parser.add_argument("--modes", default="compiled,fused,strict")
    arguments = parser.parse_args()
    wanted = arguments.modes.split(",")
    compile_bytecode()
    best: dict[tuple[str, str], dict] = {}
    for _ in range(arguments.rounds):
        for _, mode in MODES:
            if mode not in wanted:
                continue
            with tempfile.TemporaryDirectory() as cache:
                for kind in KINDS:
                    run = first_step(cache, mode, preload=kind != WITHOUT_PRELOAD)
                    if (mode, kind) not in best or run["total"] < best[(mode, kind)]["total"]:
                        best[(mode, kind)] = run
    header = "".join(f"{title:>17}" for _, title in PHASES)
    print(f"{'first training step of a new process':<50}{'total s':>8}{header}{'programs lowered':>18}"
          f"   hits: XLA cache  our store  AOTAutograd  of them preloaded  Dynamo package")
    for label, mode in MODES:
        if mode not in wanted:
            continue
        for kind in KINDS:
            run = best[(mode, kind)]
            phases = "".join(f"{run['phases'].get(key, 0.0):>17.2f}" for key, _ in PHASES)
            print(f"{label + ', ' + kind:<50}{run['total']:>8.2f}{phases}{run['programs']:>18}"
                  f"{run['executables']:>17}{run['graphs']:>11}{run['aot']:>13}{run.get('preloaded', 0):>18}"
                  f"{run.get('packages', 0):>16}")
        cold, warm = best[(mode, "cold")], best[(mode, "warm")]
        equal = "equal" if cold["loss"] == warm["loss"] else f"DIFFER ({cold['loss']} vs {warm['loss']})"
        per_program = cold["phases"]["xla"] / max(cold["programs"], 1)
        print(f"{'  warm / cold':<50}{warm['total'] / cold['total']:>8.2f}   (losses {equal}; cold XLA compile "
              f"{per_program * 1000:.0f} ms per program lowered)")
    ratios = [(label, best[(mode, "warm")]["total"] / best[(mode, "cold")]["total"]) for label, mode in MODES
              if mode in wanted]
    print("goal, warm at most 0.50 of cold: " + "; ".join(
        f"{label} {ratio:.2f} {'met' if ratio <= GOAL else 'not met'}" for label, ratio in ratios))


if __name__ == "__main__":
    main()
