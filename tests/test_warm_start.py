"""Warm start: what a fresh process with a filled cache folder skips, and that it computes the same."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torch_pjrt

STEP = textwrap.dedent(
    """
    import json, sys, torch, torch_pjrt
    import torch._dynamo.convert_frame as convert_frame

    own_frames = []  # the frames of this script Dynamo traces (not an optimizer's)
    trace = convert_frame._compile

    def counted(code, *args, **kwargs):
        own_frames.append(code.co_filename == globals().get("__file__", "<string>"))
        return trace(code, *args, **kwargs)

    convert_frame._compile = counted
    seed, width, batch = [*map(int, sys.argv[1:]), 7, 6][:3]
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    model = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    model.load_state_dict(reference.state_dict())
    model.to("pjrt")
    batches = [(torch.randn(batch, 5), torch.randn(batch, 3)) for _ in range(3)]

    def step(model, optimizer, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled = torch.compile(step, backend="pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = compiled(model, optimizer, x.to("pjrt"), y.to("pjrt"))
        expected = step(reference, reference_optimizer, x, y)
        torch.testing.assert_close(loss.cpu(), expected, rtol=1e-4, atol=1e-5)
        losses.append(loss.item())
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-4, atol=1e-5)
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"cudagraph_trees": "torch._inductor.cudagraph_trees" in sys.modules,
                      "graph_compiles": counters["graph_compiles"], "disk_store_hits": counters["disk_store_hits"],
                      "own_frames": sum(own_frames), "losses": losses, "loaded": counters.get("dynamo_package_hits", 0),
                      "written": counters.get("dynamo_package_writes", 0)}))
    """
)


def run_step(cache: Path, seed: int, code: str = STEP, *arguments: int, script: Path | None = None) -> dict:
    """A fresh process running `code` (from the file `script`, if given) with this cache folder, seed and further
    arguments: what its last line reports."""
    if script is not None:
        script.write_text(code)
    command = ["-c", code] if script is None else [str(script)]
    result = subprocess.run([sys.executable, *command, str(seed), *map(str, arguments)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


CALLABLES = textwrap.dedent(
    """
    import functools, json, sys, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    model = torch.nn.Linear(5, 3)
    on_device = torch.nn.Linear(5, 3).to("pjrt")
    on_device.load_state_dict(model.state_dict())

    def step(module, x):
        return module(x).relu().sum()

    class Step:
        def __call__(self, x):
            return step(on_device, x)

    x = torch.randn(4, 5)
    results = [torch.compile(f, backend="pjrt")(x.to("pjrt")).item()
               for f in (functools.partial(step, on_device), Step())]
    print(json.dumps({"results": results, "cpu": step(model, x).item()}))
    """
)


def test_a_partial_or_callable_object_compiles_cold_and_warm_with_the_cache_folder_on(tmp_path: Path) -> None:
    """A compiled callable with no code of its own (a partial, an object with __call__) is traced as without stored
    frames instead of failing where its frames would be keyed, in a cold and a warm process alike."""
    for seed in (5, 6):
        ran = run_step(tmp_path, seed, CALLABLES, script=tmp_path / "callables.py")
        assert ran["results"] == pytest.approx([ran["cpu"]] * 2, rel=1e-5)


def test_a_compiled_optimizer_step_equals_cpu_cold_and_warm_without_inductors_cuda_graph_trees(tmp_path: Path) -> None:
    """Dynamo's optimizer tracing no longer imports Inductor's CUDA graph trees for pjrt tensors, and a warm
    process runs the stored executables of every graph (no compile) with the same results as CPU."""
    cold = run_step(tmp_path, 3)
    assert not cold["cudagraph_trees"]
    assert cold["graph_compiles"] > 0 and cold["disk_store_hits"] == 0
    warm = run_step(tmp_path, 4)  # other random values through the same programs
    assert not warm["cudagraph_trees"]
    assert warm["graph_compiles"] == 0 and warm["disk_store_hits"] == 2 * cold["graph_compiles"]


def test_dynamo_still_asks_pytorch_about_cuda_tensors() -> None:
    """The optimizer check answers for non-CUDA tensors only; a CUDA tensor goes to PyTorch's own function."""
    from torch._dynamo.variables import optimizer

    from torch_pjrt import _torch_private

    _torch_private.dynamo_optimizer_without_cudagraph_import()
    asked = []
    wrapped = optimizer._is_static_for_cudagraphs
    cell = wrapped.__closure__[wrapped.__code__.co_freevars.index("original")]
    original = cell.cell_contents
    try:
        cell.cell_contents = lambda tensor: asked.append(tensor) or False
        assert wrapped(torch.randn(2))
        assert wrapped(torch.randn(2, device="meta"))

        class OnCuda:
            is_cuda = True

        cuda = OnCuda()
        assert wrapped(cuda) is False and asked == [cuda]
    finally:
        cell.cell_contents = original


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_warmup_compiles_every_bucket_so_later_sizes_compile_nothing(mode: str) -> None:
    """After warming sizes 3, 9 and 40 of a dim marked up to 64 (buckets 4, 16, 64), new sizes in those buckets
    compile nothing and equal CPU; a size past the bound (70, exact) still compiles."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 5))
    on_device = copy.deepcopy(model).to("pjrt")
    # Dynamo caches frames by code object: Linear.forward compiled by earlier tests in this process counts
    # against its recompile limit, past which it runs eagerly (and compiles per size).
    torch._dynamo.reset()
    fn = torch.compile(on_device, backend="pjrt") if mode == "compiled" else on_device

    def marked(host: torch.Tensor) -> torch.Tensor:
        torch_pjrt.mark_dynamic(host, 1, max=64)  # padded as it moves
        return host.to("pjrt")

    if mode == "fused":
        torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE)
    try:
        warmed = torch_pjrt.warmup(fn, marked(torch.randn(3, 10, 7)), sizes={(0, 1): [3, 9, 40]})
        assert [w.sizes for w in warmed] == [{(0, 1): 3}, {(0, 1): 9}, {(0, 1): 40}]
        assert all(w.programs_compiled > 0 for w in warmed)
        for length, compiles in ((4, 0), (12, 0), (57, 0), (70, None)):
            host = torch.randn(3, length, 7)
            before = torch_pjrt.metrics.counters()["compiles"]
            with torch.no_grad():
                result = fn(marked(host))
            torch.pjrt.synchronize()  # fused mode runs (and compiles) here
            made = torch_pjrt.metrics.counters()["compiles"] - before
            assert made == compiles if compiles is not None else made > 0, (length, made)
            # (in fused mode this read compiles a program per true length: its graph unpads the result)
            torch.testing.assert_close(result.cpu(), model(host).detach(), rtol=1e-4, atol=1e-5)
    finally:
        torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_NEVER)


def test_warmup_refuses_sizes_of_an_argument_that_is_not_a_tensor() -> None:
    with pytest.raises(ValueError, match="argument 1, which is not a tensor"):
        torch_pjrt.warmup(lambda x, n: x * n, torch.randn(2).to("pjrt"), 3, sizes={(1, 0): [4]})
    with pytest.raises(ValueError, match="no dim 2"):
        torch_pjrt.warmup(lambda x: x * 2, torch.randn(2, 3).to("pjrt"), sizes={(0, 2): [4]})


TWO_DEVICES = textwrap.dedent(
    """
    import torch, torch_pjrt
    torch.manual_seed(int(__import__("sys").argv[1]))
    f = torch.compile(lambda x: (x.sin() * 3).sum(0), backend="pjrt")
    for device in ("pjrt:0", "pjrt:1"):
        x = torch.randn(5, 3)
        y = f(x.to(device))
        assert y.device == torch.device(device), y.device
        torch.testing.assert_close(y.cpu(), (x.sin() * 3).sum(0))
    counters = torch_pjrt.metrics.counters()
    print(counters["disk_store_hits"], counters["disk_store_writes"], counters["graph_compiles"])
    """
)


def test_a_stored_executable_runs_on_the_device_it_was_compiled_for(tmp_path: Path) -> None:
    """One graph on two devices: one traced program, an executable per device, each loaded for its own device."""
    def run(seed: int) -> list[str]:
        result = subprocess.run([sys.executable, "-c", TWO_DEVICES, str(seed)], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path),
                                                  "TORCH_PJRT_CPU_DEVICES": "2"})
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.split()

    assert run(1) == ["1", "3", "2"]  # the graph stored once (device 1 finds it), an executable per device
    assert run(2) == ["4", "0", "0"]


FUSED = textwrap.dedent(
    """
    import json, sys, torch, torch_pjrt
    from torch_pjrt.eager import fusion
    keys = []
    stored_key = fusion._stored_key
    fusion._stored_key = lambda *args: keys.append(stored_key(*args)) or keys[-1]
    torch.manual_seed(int(sys.argv[1]))

    def variant(name, x, w, scale):
        y = x @ w
        y = y + (w if name == "wiring" else x)
        y = y.softmax(dim=0 if name == "static argument" else 1)
        return y.add(0 if name == "scalar constant" else 1).mul(scale)

    names = ("base", "static argument", "dtype", "wiring", "scalar constant", "traced scalar")
    programs = {}
    with torch_pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE):
        for name in names:
            dtype = torch.float64 if name == "dtype" else torch.float32
            x, w = torch.randn(4, 4, dtype=dtype), torch.randn(4, 4, dtype=dtype)
            scale = 3.5 if name == "traced scalar" else 2.5
            before = len(keys)
            found = variant(name, x.to("pjrt"), w.to("pjrt"), scale).cpu()
            torch.testing.assert_close(found, variant(name, x, w, scale))
            programs[name] = keys[before:]

        torch.manual_seed(0)
        reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        model.load_state_dict(reference.state_dict())
        model.to("pjrt")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        torch.manual_seed(int(sys.argv[1]))
        for _ in range(3):
            x, y = torch.randn(6, 5), torch.randn(6, 3)
            for net, opt, device in ((model, optimizer, "pjrt"), (reference, reference_optimizer, "cpu")):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(net(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                if device == "cpu":
                    torch.testing.assert_close(found_loss, loss.detach(), rtol=1e-4, atol=1e-5)
                found_loss = loss.detach().cpu()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-4, atol=1e-5)
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"programs": programs, "keys": keys, "fused_traces": counters["fused_traces"],
                      "fused_compiles": counters["fused_compiles"]}))
    """
)


def test_a_warm_process_loads_the_stored_fused_programs_and_never_a_wrong_one(tmp_path: Path) -> None:
    """Fused programs that differ only in a static argument, a dtype, the wiring or a constant scalar are
    stored under different keys (a traced scalar's value is no part of it); a fresh process with the same
    cache folder runs them and a fused AdamW step from the store, with CPU's results, tracing none."""
    cold = run_step(tmp_path, 5, FUSED)
    assert all(key is not None for key in cold["keys"]) and cold["fused_traces"] == len(set(cold["keys"])) > 0
    variants = cold["programs"]
    assert variants.pop("traced scalar") == []  # base's program, already made in this process
    assert all(len(keys) == 1 for keys in variants.values()), variants
    assert len({keys[0] for keys in variants.values()}) == len(variants)
    warm = run_step(tmp_path, 6, FUSED)  # other random values through the same programs
    assert warm["keys"] == cold["keys"] and warm["programs"] == {**variants, "traced scalar": []}
    assert warm["fused_traces"] == 0 and warm["fused_compiles"] == cold["fused_compiles"]


def test_the_first_fused_program_does_not_depend_on_when_python_collects_cycles(tmp_path: Path) -> None:
    """torch._dynamo's first import leaves a cycle of frames holding its importer's frames (once a meta kernel's
    inside a recording, so its inputs; now the device start's): the first fused program's live outputs must not
    depend on whether a collection ran before its flush (a process with the collector off stores the same
    programs)."""
    cold = run_step(tmp_path, 5, "import gc; gc.disable()\n" + FUSED)
    warm = run_step(tmp_path, 6, FUSED)
    assert warm["keys"] == cold["keys"] and warm["fused_traces"] == 0


CHECKED = textwrap.dedent(
    """
    import json, sys, torch, torch_pjrt
    from torch_pjrt.eager import dispatch
    traced = []
    trace_now = dispatch._trace_now
    dispatch._trace_now = lambda *args: traced.append(1) or trace_now(*args)
    torch.manual_seed(int(sys.argv[1]))
    mode = torch_pjrt.EagerMode.DEFER_AND_FUSE if sys.argv[2] == "fused" else torch_pjrt.EagerMode.DEFER_NEVER
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    index = torch.randint(0, 5, (7,))
    with torch_pjrt.set_eager_mode(mode):
        found = (x.to("pjrt").index_select(0, index.to("pjrt")) @ w.to("pjrt")).relu().sum(1).cpu()
        torch.testing.assert_close(found, (x.index_select(0, index) @ w).relu().sum(1))
        try:
            x.to("pjrt").index_select(0, torch.full((7,), 9).to("pjrt")).cpu()
            raised = ""
        except (IndexError, RuntimeError) as error:
            raised = str(error)
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"raised": raised, "compiles": counters["compiles"], "fused_traces": counters["fused_traces"],
                      "hits": counters["op_store_hits"], "ops_traced_alone": len(traced)}))
    """
)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_warm_process_keeps_each_ops_device_checks_without_tracing_it(tmp_path: Path, mode: str) -> None:
    """An op's device-side checks are stored with its program: a fresh process that loads the op (strict) or
    its fused program computes CPU's values and still raises for an index out of range, lowering nothing."""
    def run(seed: int) -> dict:
        result = subprocess.run([sys.executable, "-c", CHECKED, str(seed), mode], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    cold = run(1)
    assert "out of range" in cold["raised"] and cold["compiles"] > 0
    assert (cold["ops_traced_alone"] == 0) == (mode == "strict")  # strict: traced by the compile itself
    warm = run(2)  # other random values and indices through the same programs
    assert warm["raised"] == cold["raised"]
    assert warm["compiles"] == warm["fused_traces"] == warm["ops_traced_alone"] == 0 and warm["hits"] > 0


GARBAGE_AT_START = textwrap.dedent(
    """
    import gc, sys, torch
    torch.manual_seed(int(sys.argv[1]))
    full_collections = []
    gc.callbacks.append(lambda phase, info: full_collections.append(1) if phase == "start" and
                        info["generation"] == 2 else None)
    alive = len(gc.get_objects())
    torch.pjrt.init()
    started_with = len(full_collections)
    x = torch.randn(4, 5)
    torch.testing.assert_close((x.to("pjrt") * 3).tanh().cpu(), (x * 3).tanh())
    print(started_with, int(gc.isenabled()), int(gc.get_freeze_count() >= alive))
    """
)


def test_the_device_starts_without_a_full_garbage_collection_and_leaves_the_collector_on() -> None:
    """Starting the device (jax, the lowering table) runs no full collection of the process's objects, then
    leaves the collector on with what was alive frozen out of its later collections."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    result = subprocess.run([sys.executable, "-c", GARBAGE_AT_START, seed], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0", "1", "1"]


DYNAMO_AT_START = textwrap.dedent(
    """
    import gc, sys, torch
    torch.manual_seed(int(sys.argv[1]))
    torch.pjrt.init()
    import torch._dynamo.convert_frame, torch._dynamo.symbolic_convert
    in_generations = {id(o) for o in gc.get_objects()}
    modules = [torch._dynamo, torch._dynamo.convert_frame, torch._dynamo.symbolic_convert]
    frozen = not any(id(vars(module)) in in_generations for module in modules)
    x, w = torch.randn(4, 5), torch.randn(3, 5)
    found = torch.softmax(torch.nn.functional.linear(x.to("pjrt"), w.to("pjrt")), -1).cpu()
    torch.testing.assert_close(found, torch.softmax(torch.nn.functional.linear(x, w), -1))
    print(int(frozen), int(gc.isenabled()))
    """
)


def test_the_device_start_loads_dynamo_frozen_out_of_later_collections() -> None:
    """PyTorch imports Dynamo at a process's first ops anyway (meta kernels, decompositions, the optimizer);
    the device start loads it with the collector paused and freezes it, so no later full collection walks it."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    result = subprocess.run([sys.executable, "-c", DYNAMO_AT_START, seed], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "1"]


STARTER_FREED = textwrap.dedent(
    """
    import sys, weakref, torch
    torch.manual_seed(int(sys.argv[1]))

    def load():
        weights = torch.randn(64, 32)  # a local of the function whose first pjrt op starts the device
        moved = weights.to("pjrt")
        torch.testing.assert_close(moved.cpu(), weights)
        return weakref.ref(weights), moved

    weights, moved = load()
    print(int(weights() is None))
    """
)


def test_the_locals_of_the_function_that_starts_the_device_are_freed_when_it_returns() -> None:
    """The start's collector is paused and what is alive after it frozen: a reference cycle made there through
    the caller's frames (torch._dynamo's import makes one) would keep that function's locals forever."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    result = subprocess.run([sys.executable, "-c", STARTER_FREED, seed], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TORCH_PJRT_CACHE_DIR": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"]


PRELOADED = textwrap.dedent(
    """
    import json, sys, threading, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    x, w, b = torch.randn(4, 6), torch.randn(6, 3), torch.randn(3)
    torch.pjrt.init()  # the device start: the thread loads while Dynamo imports, then holds
    at_start = torch_pjrt.metrics.counters().get("preload_hits", 0)
    product = x.to("pjrt") @ w.to("pjrt")  # the first executable asked for: the thread goes on
    for thread in threading.enumerate():
        if thread.name == "torch_pjrt-preload":
            thread.join()  # so every later recorded executable is found preloaded, not raced to by this thread
    found = torch.tanh(product + b.to("pjrt")).sum(0).cpu()
    torch.testing.assert_close(found, torch.tanh(x @ w + b).sum(0))
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"at_start": at_start, **{name: counters.get(name, 0) for name in (
        "preload_hits", "preload_first_runs", "op_store_hits", "op_store_writes", "compiles")}}))
    """
)


def test_a_second_process_finds_the_executables_its_entry_point_used_preloaded(tmp_path: Path) -> None:
    """A process records the stored executables it used; the next process of the same entry point loads them
    in the background from its device start on (no op asked for one yet), runs each once, and its ops take them
    from there, with CPU's results. The first op asked for may come before the thread took it up: then it loads
    it."""
    cold = run_step(tmp_path, 7, PRELOADED)
    assert cold["preload_hits"] == 0 and cold["op_store_writes"] > 0
    assert list((tmp_path / "preload").iterdir())
    warm = run_step(tmp_path, 8, PRELOADED)  # other random values through the same programs
    assert warm["compiles"] == 0 and warm["op_store_hits"] == cold["op_store_writes"]
    stored = len(list((tmp_path / "executables").iterdir()))
    assert warm["at_start"] >= 1 and warm["preload_hits"] in (stored - 1, stored) and stored > 1
    # each executable the thread loaded it also ran once (on zeros, its results dropped), so its first run's own
    # cost is not paid by the op that first needs it; the ops' results are still CPU's (asserted in the process)
    assert cold["preload_first_runs"] == 0 and warm["preload_first_runs"] == warm["preload_hits"]


def test_a_stored_graphs_values_come_back_as_fake_tensors_of_the_same_layout() -> None:
    """AOTAutograd's cache keeps a graph's node values as descriptions; each comes back a fake tensor of the one
    fake mode given, with the dtype, shape, strides, storage offset and device of the traced value; values of one
    description share one fake tensor."""
    from torch_pjrt import _torch_private
    from torch_pjrt.compile import warm_start

    base = torch.randn(7, 9, dtype=torch.float64, device="pjrt")
    values = [base, base.t(), base[2:, 3:5], base[1, 4:].view(1, 5), torch.randint(0, 5, (0, 3)),
              torch.ones((), dtype=torch.bfloat16)]
    mode = _torch_private.fake_mode()
    for value in values:
        rebuilt = warm_start._rebuilt(warm_start._described(value), mode, {})
        assert rebuilt.fake_mode is mode
        assert (rebuilt.dtype, rebuilt.shape, rebuilt.stride(), rebuilt.storage_offset(), rebuilt.device) == (
            value.dtype, value.shape, value.stride(), value.storage_offset(), value.device)
    items = [base[1:3], (3, None, torch.float16, [base.t()])]
    rebuilt = warm_start._rebuilt(warm_start._described(items), mode, {})
    assert isinstance(rebuilt, list) and isinstance(rebuilt[1], tuple) and rebuilt[1][:3] == (3, None, torch.float16)
    assert rebuilt[0].storage_offset() == 9 and rebuilt[1][3][0].stride() == (1, 9)
    with mode:  # the fake mode computes with them as with its own tensors
        assert (rebuilt[0] @ rebuilt[1][3][0]).shape == (2, 7)
    made: dict = {}
    first, same, other = (warm_start._rebuilt(warm_start._described(value), mode, made)
                          for value in (base, base.clone(), base.t()))
    assert first is same and other is not first and len(made) == 2


def test_a_stored_graph_comes_back_with_the_same_nodes_code_and_results() -> None:
    """A stored graph (AOTAutograd's lazy graph module; aten overloads, getitem, a higher-order op, lists, keyword
    dtypes and devices in its arguments) loads with the same nodes, generated code and kept metadata, and computes
    what the original computes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_pjrt import _torch_private

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, indices = torch.topk(x, 3)
        joined = torch.cat([values, y.to(torch.float64)], dim=1)
        ones = torch.ones(2, 1, dtype=torch.float64, device="cpu")
        state, noise = torch.ops.higher_order.run_and_save_rng_state(torch.ops.aten.rand.default, [2, 2],
                                                                             device=torch.device("cpu"))
        return joined * ones, indices, torch.var_mean(x, dim=0)[1], state.shape, noise.shape

    x, y = torch.randn(2, 6), torch.randn(2, 2)
    gm = make_fx(f)(x, y)
    for node in gm.graph.nodes:
        node.meta.update(stack_trace=f"line of {node.name}", dropped=node.name)
    loaded = _torch_private.unpickle_graph(_torch_private.pickle_graph(gm, keep=lambda key: key == "stack_trace"))
    assert loaded.code == gm.code
    originals, copies = list(gm.graph.nodes), list(loaded.graph.nodes)
    assert [(n.op, n.name, n.target, str(n.args), str(n.kwargs), n.type) for n in copies] == [
        (n.op, n.name, n.target, str(n.args), str(n.kwargs), n.type) for n in originals]
    assert [n.meta for n in copies] == [{"stack_trace": f"line of {n.name}"} for n in originals]
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in copies)
    loaded.graph.lint()
    expected, got = f(x, y), torch.fx.Interpreter(loaded).run(x, y)
    for mine, theirs in zip(got[:3], expected[:3]):
        torch.testing.assert_close(mine, theirs)
    assert got[3:] == expected[3:]



TORCH_SOURCE_KEY = textwrap.dedent(
    """
    import json, os, pathlib, sys, torch, torch_pjrt
    from torch._inductor import codecache
    torch.manual_seed(int(sys.argv[1]))
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    loss = torch.compile(lambda x, w: torch.tanh(x @ w).sum(), backend="pjrt")(x.to("pjrt"), w.to("pjrt"))
    torch.testing.assert_close(loss.cpu(), torch.tanh(x @ w).sum())
    counters = torch_pjrt.metrics.counters()
    hashed = codecache.torch_key()  # outside the backend's call PyTorch hashes its files (again)
    folder = pathlib.Path(os.environ["TORCH_PJRT_CACHE_DIR"], "torch_source_key")
    stored = [path.read_bytes()[32:] for path in folder.iterdir()]  # past the payload's SHA-256
    print(json.dumps({"hits": counters.get("torch_source_key_hits", 0),
                      "writes": counters.get("torch_source_key_writes", 0),
                      "aot_cache_hits": counters["aot_cache_hits"], "stored_equals_hashed": stored == [hashed]}))
    """
)


def test_a_warm_process_reads_pytorchs_source_digest_from_the_cache_folder_and_leaves_pytorchs_own_after(
        tmp_path: Path) -> None:
    """AOTAutograd's cache keys hold PyTorch's digest of its source files: the first process stores it, the next
    reads it there instead of hashing torch's files, and the one value stored is the one PyTorch hashes."""
    cold = run_step(tmp_path, 1, TORCH_SOURCE_KEY)
    assert cold["writes"] == 1 and cold["hits"] == 0 and cold["stored_equals_hashed"]
    shutil.rmtree(tmp_path / "dynamo", ignore_errors=True)  # else the stored Dynamo frame runs: no AOTAutograd
    warm = run_step(tmp_path, 2, TORCH_SOURCE_KEY)
    assert warm["hits"] == 1 and warm["writes"] == 0 and warm["aot_cache_hits"] > 0 and warm["stored_equals_hashed"]


REGISTRATION = textwrap.dedent(
    """
    import hashlib, json, sys, torch, torch_pjrt
    from torch_pjrt.eager import dispatch, kernels
    from torch_pjrt.ops import registry
    schemas_read, searched = [], []
    read_schema_facts = dispatch._read_schema_facts
    dispatch._read_schema_facts = lambda op: schemas_read.append(op) or read_schema_facts(op)
    search = registry._searched_counterpart
    registry._searched_counterpart = lambda op: searched.append(op) or search(op)
    torch.manual_seed(int(sys.argv[1]))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(torch.add(x.to("pjrt"), y.to("pjrt"), alpha=2).cpu(), torch.add(x, y, alpha=2))
    counted, counterparts_searched = len(schemas_read), len(searched)
    digest = hashlib.sha256()
    for op in kernels._aten_overloads(None):  # the search a warm start skips, here to list what was registered
        plan = dispatch.plan_for(op)
        if plan is not None:
            fields = {name: value for name, value in vars(plan).items() if name not in ("op", "lowering")}
            lowering = {name: getattr(value, "__qualname__", value) for name, value in vars(plan.lowering).items()}
            counterpart = registry.functional_counterpart(op) if plan.mutated else None
            digest.update(repr((str(op), fields, lowering, counterpart)).encode())
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"plans": digest.hexdigest(), "schemas_read": counted, "searched": counterparts_searched,
                      "hits": counters.get("registration_hits", 0), "writes": counters.get("registration_writes", 0)}))
    """
)


def test_a_warm_start_registers_the_same_plans_from_the_cache_folder_without_reading_schemas(tmp_path: Path) -> None:
    """What registration finds in torch's dispatcher and schemas (mutating ops' functional counterparts among it) is
    stored by the first process and read by the next instead of searched again; every registered plan and
    counterpart is the same as with no cache folder."""
    cold = run_step(tmp_path, 1, REGISTRATION)
    assert cold["writes"] == 1 and cold["hits"] == 0 and cold["schemas_read"] > 1000 and cold["searched"] > 1000
    warm = run_step(tmp_path, 2, REGISTRATION)
    assert warm["hits"] == 1 and warm["writes"] == 0 and warm["schemas_read"] == 0 and warm["searched"] == 0
    without_cache = run_step(Path("0"), 3, REGISTRATION)
    assert without_cache["hits"] == 0 and without_cache["writes"] == 0
    assert cold["plans"] == warm["plans"] == without_cache["plans"]


def run_step_script(cache: Path, seed: int, width: int = 7, batch: int = 6) -> dict:
    """STEP run from a script file: Dynamo stores the frames of functions that have a source file."""
    return run_step(cache, seed, STEP, width, batch, script=cache.parent / "step.py")


needs_packages = pytest.mark.skipif(not __import__("torch_pjrt._torch_private").
                                    _torch_private.dynamo_packages_supported(),
                                    reason="this torch has no Dynamo packages (torch 2.13 has)")


@needs_packages
def test_a_warm_process_runs_the_training_steps_stored_frames_without_dynamo_tracing_them(tmp_path: Path) -> None:
    """The first process's Dynamo frames of a compiled training step (the step and its resume functions) are stored
    in the cache folder; the next process runs them behind their stored guards without tracing them, with the
    same losses as the first (both equal CPU's)."""
    cache = tmp_path / "cache"
    cold = run_step_script(cache, 1)
    assert cold["own_frames"] > 0 and cold["loaded"] == 0 and cold["written"] == cold["own_frames"]
    assert any((cache / "dynamo").rglob("entry"))
    warm = run_step_script(cache, 1)
    assert warm["own_frames"] == 0 and warm["loaded"] == 1 and warm["written"] == 0
    assert warm["losses"] == cold["losses"]


@needs_packages
def test_a_changed_batch_or_model_is_traced_again_not_served_a_stored_frame(tmp_path: Path) -> None:
    """The stored frames' guards still hold: another batch size or another model width makes the next process trace
    its frames again (and match CPU), and the first shape is then still served without tracing."""
    cache = tmp_path / "cache"
    assert run_step_script(cache, 1)["own_frames"] > 0
    assert run_step_script(cache, 2, batch=4)["own_frames"] > 0
    assert run_step_script(cache, 3, width=9)["own_frames"] > 0
    assert run_step_script(cache, 4)["own_frames"] == 0
