"""Warm start: what a fresh process with a filled cache folder skips, and that it computes the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

STEP = textwrap.dedent(
    """
    import json, sys, torch, torch_pjrt
    torch.manual_seed(int(sys.argv[1]))
    reference = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model.load_state_dict(reference.state_dict())
    model.to("pjrt")
    batches = [(torch.randn(6, 5), torch.randn(6, 3)) for _ in range(3)]

    def step(model, optimizer, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    compiled = torch.compile(step, backend="pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches:
        loss = compiled(model, optimizer, x.to("pjrt"), y.to("pjrt"))
        expected = step(reference, reference_optimizer, x, y)
        torch.testing.assert_close(loss.cpu(), expected, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-4, atol=1e-5)
    counters = torch_pjrt.metrics.counters()
    print(json.dumps({"cudagraph_trees": "torch._inductor.cudagraph_trees" in sys.modules,
                      "graph_compiles": counters["graph_compiles"], "disk_store_hits": counters["disk_store_hits"]}))
    """
)


def run_step(cache: Path, seed: int) -> dict:
    result = subprocess.run([sys.executable, "-c", STEP, str(seed)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


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
    import torch
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
