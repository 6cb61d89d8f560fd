"""AOTAutograd's cache holding the pjrt backend's graphs (compile/warm_start.py): a fresh process with the
same cache folder loads its forward and backward graphs instead of tracing them, and computes CPU's results."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from test_warm_start import run_step

import torch_pjrt

STEP = textwrap.dedent(
    """
    import json, sys, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.GELU(), torch.nn.Linear(9, 4))
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.GELU(), torch.nn.Linear(9, 4))
    model.load_state_dict(reference.state_dict())
    model.to("pjrt")
    batches = [(torch.randn(5, 6), torch.randn(5, 4)) for _ in range(3)]

    def step(model, optimizer, x, y):
        loss = torch.nn.functional.smooth_l1_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    compiled = torch.compile(step, backend="pjrt")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    for x, y in batches:
        loss = compiled(model, optimizer, x.to("pjrt"), y.to("pjrt"))
        torch.testing.assert_close(loss.cpu(), step(reference, reference_optimizer, x, y), rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-4, atol=1e-5)
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({name: counters[name] for name in ("aot_cache_writes", "aot_cache_hits", "graph_compiles")}))
    """
)


def test_a_warm_process_loads_its_graphs_from_aotautograds_cache_in_our_folder(tmp_path: Path) -> None:
    cold = run_step(tmp_path, 3, STEP)
    assert cold["aot_cache_hits"] == 0
    assert cold["aot_cache_writes"] >= 2  # the forward, the backward and the optimizer's graph at least
    assert cold["graph_compiles"] >= 2
    entries = list((tmp_path / "aotautograd").rglob("*"))
    assert any(entry.is_file() for entry in entries)
    warm = run_step(tmp_path, 4, STEP)  # other weights and data: the same graphs
    assert warm["aot_cache_hits"] == cold["aot_cache_writes"]
    assert warm["aot_cache_writes"] == 0
    assert warm["graph_compiles"] == 0  # programs from our store, as before


def test_graphs_with_symbolic_sizes_are_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_PJRT_CACHE_DIR", str(tmp_path))

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3

    torch._dynamo.reset()
    before = torch_pjrt.metrics.counters()["aot_cache_writes"]
    for rows in (5, 7):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(torch.compile(f, backend="pjrt", dynamic=True)(x.to("pjrt")).cpu(), f(x))
    assert torch_pjrt.metrics.counters()["aot_cache_writes"] == before
    torch._dynamo.reset()
    x = torch.randn(6, 4)
    torch.testing.assert_close(torch.compile(f, backend="pjrt", dynamic=False)(x.to("pjrt")).cpu(), f(x))
    assert torch_pjrt.metrics.counters()["aot_cache_writes"] == before + 1


def test_other_backends_keep_pytorchs_cache_settings_after_a_pjrt_compile() -> None:
    from torch._functorch import config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor import codecache

    before = (config.bundled_autograd_cache, config.force_non_lazy_backward_lowering,
              config.enable_autograd_cache, AOTAutogradCache._get_tmp_dir(), codecache.init_backend_registration)
    torch._dynamo.reset()
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def f(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight).sum()

    device_weight = weight.detach().to("pjrt").requires_grad_()
    loss = torch.compile(f, backend="pjrt")(device_weight, x.to("pjrt"))
    loss.backward()
    expected = f(weight, x)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    torch.testing.assert_close(device_weight.grad.cpu(), weight.grad)
    after = (config.bundled_autograd_cache, config.force_non_lazy_backward_lowering,
             config.enable_autograd_cache, AOTAutogradCache._get_tmp_dir(), codecache.init_backend_registration)
    assert after == before


def test_a_loaded_graph_without_its_stored_program_traces_it_from_the_described_values(tmp_path: Path) -> None:
    """The nodes' values rebuilt from their descriptions are all the lowering needs: with our store emptied, the
    warm process traces every graph again from AOTAutograd's cached graphs and still matches CPU."""
    cold = run_step(tmp_path, 6, STEP)
    for kind in ("graphs", "executables", "xla"):
        shutil.rmtree(tmp_path / kind, ignore_errors=True)
    warm = run_step(tmp_path, 7, STEP)
    assert warm["aot_cache_hits"] == cold["aot_cache_writes"]
    assert warm["graph_compiles"] == cold["graph_compiles"]


def test_a_stored_graph_without_its_executable_compiles_from_its_stored_module(tmp_path: Path) -> None:
    """A graph whose StableHLO is stored but whose executable is not (deserialized only then): the warm process
    compiles every graph from the stored module and still matches CPU."""
    cold = run_step(tmp_path, 6, STEP)
    shutil.rmtree(tmp_path / "executables")
    warm = run_step(tmp_path, 7, STEP)
    assert warm["aot_cache_hits"] == cold["aot_cache_writes"]
    assert warm["graph_compiles"] == cold["graph_compiles"] > 0


PRECOMPILED = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TORCH_CACHING_PRECOMPILE"] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["TORCH_PJRT_CACHE_DIR"], "inductor")
    import torch, torch_pjrt
    import torch._dynamo.convert_frame as convert_frame
    traced = []
    compile_frame = convert_frame._compile
    convert_frame._compile = lambda *args, **kwargs: traced.append(1) or compile_frame(*args, **kwargs)
    artifacts = os.path.join(os.environ["TORCH_PJRT_CACHE_DIR"], "artifacts.bin")
    if os.path.exists(artifacts):
        with open(artifacts, "rb") as file:
            torch.compiler.load_cache_artifacts(file.read())
    torch.manual_seed(int(sys.argv[1]))
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.GELU(), torch.nn.Linear(9, 4))
    x, y = torch.randn(5, 6), torch.randn(5, 4)

    def loss_of(model, x, y):
        return torch.nn.functional.smooth_l1_loss(model(x), y)

    expected = loss_of(model, x, y)
    expected.backward()
    expected_grads = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.to("pjrt")
    loss = torch.compile(loss_of, backend="pjrt")(model, x.to("pjrt"), y.to("pjrt"))
    loss.backward()
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-6)
    for parameter, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(parameter.grad.cpu(), grad, rtol=1e-5, atol=1e-6)
    if not os.path.exists(artifacts):
        with open(artifacts, "wb") as file:
            file.write(torch.compiler.save_cache_artifacts()[0])
    print(json.dumps({"dynamo_frames": len(traced)}))
    """
)


def test_dynamos_caching_precompile_loads_pjrt_graphs_and_skips_tracing(tmp_path: Path) -> None:
    """With TORCH_CACHING_PRECOMPILE=1 a process saves Dynamo's package of a pjrt compile (its graphs as
    AOTAutograd's cache stores ours) with torch.compiler.save_cache_artifacts; the next loads it and runs
    the forward and backward without Dynamo tracing a frame, with CPU's values and grads."""
    cold = run_step(tmp_path, 11, PRECOMPILED)
    assert cold["dynamo_frames"] > 0 and (tmp_path / "artifacts.bin").exists()
    warm = run_step(tmp_path, 12, PRECOMPILED)  # other random values through the same graphs
    assert warm["dynamo_frames"] == 0
