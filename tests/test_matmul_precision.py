"""torch.set_float32_matmul_precision (and allow_tf32, and the per-backend fp32_precision) on pjrt.

XLA's CPU backend computes float32 products exactly whatever it is asked, so the programs' StableHLO
(jax's IR dump) shows what a GPU or TPU would be asked for; values are compared with CPU's too.
"""

from __future__ import annotations

import copy
import glob
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import jax
import pytest
import torch
from support import assert_same

import torch_pjrt

XLA_NAME = {"highest": "HIGHEST", "high": "HIGH", "medium": "DEFAULT"}


@pytest.fixture
def dumped(tmp_path: os.PathLike) -> Iterator[callable]:
    """Dump every program compiled in the test; the fixture returns the dot precisions seen so far."""
    previous = torch.get_float32_matmul_precision()
    jax.config.update("jax_dump_ir_to", str(tmp_path))

    def precisions() -> set[str]:
        found = set()
        for path in glob.glob(os.path.join(str(tmp_path), "*.mlir")):
            with open(path) as handle:
                found.update(re.findall(r"stablehlo\.dot_general.*precision = \[(\w+), \w+\]", handle.read()))
        for path in glob.glob(os.path.join(str(tmp_path), "*.mlir")):
            os.remove(path)
        return found

    yield precisions
    jax.config.update("jax_dump_ir_to", "")
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
def test_strict_matmuls_trace_at_the_requested_precision(dumped: callable, setting: str) -> None:
    torch.set_float32_matmul_precision(setting)
    a, b, bias = torch.randn(6, 9), torch.randn(9, 5), torch.randn(5)
    got = torch.addmm(bias.to("pjrt"), a.to("pjrt"), b.to("pjrt"))
    batch = torch.randn(2, 6, 9)
    got_bmm = torch.bmm(batch.to("pjrt"), b.expand(2, 9, 5).contiguous().to("pjrt"))
    assert dumped() == {XLA_NAME[setting]}
    assert_same(got, torch.addmm(bias, a, b), atol=1e-5, rtol=1e-5)
    assert_same(got_bmm, torch.bmm(batch, b.expand(2, 9, 5)), atol=1e-5, rtol=1e-5)


def test_changing_the_setting_compiles_once_per_setting(dumped: callable) -> None:
    a, b = torch.randn(7, 11, device="pjrt"), torch.randn(11, 3, device="pjrt")
    compiles = lambda: torch_pjrt.metrics.counters()["compiles"]  # noqa: E731
    results = {}
    for setting in ("highest", "medium", "highest", "medium"):
        torch.set_float32_matmul_precision(setting)
        before = compiles()
        results.setdefault(setting, []).append(a @ b)
        results.setdefault(setting + " compiles", []).append(compiles() - before)
    assert results["highest compiles"][1] == 0 and results["medium compiles"][1] == 0
    assert results["medium compiles"][0] >= 1
    assert dumped() == {"HIGHEST", "DEFAULT"}
    assert_same(results["medium"][0], results["highest"][0].cpu(), atol=1e-5, rtol=1e-5)


def test_fused_ops_keep_the_setting_they_were_issued_under(dumped: callable) -> None:
    a, b = torch.randn(5, 13), torch.randn(13, 4)
    with torch.pjrt.set_eager_mode(torch.pjrt.EagerMode.DEFER_AND_FUSE):
        torch.set_float32_matmul_precision("medium")
        product = torch.relu(a.to("pjrt") @ b.to("pjrt"))
        torch.set_float32_matmul_precision("highest")  # before the flush: the recorded product keeps medium
        torch.pjrt.synchronize()
    assert dumped() == {"DEFAULT"}
    assert_same(product, torch.relu(a @ b), atol=1e-5, rtol=1e-5)


def test_compiled_graphs_follow_the_setting(dumped: callable) -> None:
    linear = torch.nn.Linear(8, 6)
    compiled = torch.compile(copy.deepcopy(linear).to("pjrt"), backend="pjrt")
    x = torch.randn(4, 8)
    torch.set_float32_matmul_precision("highest")
    first = compiled(x.to("pjrt")).detach()
    assert "HIGHEST" in dumped()
    torch.set_float32_matmul_precision("high")
    second = compiled(x.to("pjrt")).detach()
    assert dumped() == {"HIGH"}
    for result in (first, second):
        assert_same(result, linear(x).detach(), atol=1e-5, rtol=1e-5)


def test_allow_tf32_asks_for_tf32(dumped: callable) -> None:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        a, b = torch.randn(3, 10), torch.randn(10, 2)
        got = a.to("pjrt") @ b.to("pjrt")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert dumped() == {"HIGH"}
    assert_same(got, a @ b, atol=1e-5, rtol=1e-5)


NEW_API = textwrap.dedent(
    """
    import glob, re, sys, tempfile, jax, torch, torch_pjrt
    folder = tempfile.mkdtemp()
    jax.config.update("jax_dump_ir_to", folder)
    a, b = torch.randn(3, 7), torch.randn(7, 2)
    seen = []
    for cuda, mkldnn in (("tf32", "tf32"), ("ieee", "ieee"), ("tf32", "bf16")):
        torch.backends.cuda.matmul.fp32_precision = cuda
        torch.backends.mkldnn.matmul.fp32_precision = mkldnn
        got = (a.to("pjrt") @ b.to("pjrt")).cpu()
        assert torch.allclose(got, a @ b, atol=1e-5), (cuda, mkldnn)
        found = set()
        for path in glob.glob(folder + "/*.mlir"):
            found.update(re.findall(r"dot_general.*precision = \\[(\\w+), \\w+\\]", open(path).read()))
            __import__("os").remove(path)
        seen.append(sorted(found))
    print(seen)
    """
)


def test_the_per_backend_api_is_read_too() -> None:
    """Once fp32_precision is set, torch.get_float32_matmul_precision() raises: pjrt reads the new API
    (in a child process, since mixing the two APIs leaves the legacy getter raising for good)."""
    env = {**os.environ, "TORCH_PJRT_CACHE_DIR": "0"}
    result = subprocess.run([sys.executable, "-c", NEW_API], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[['HIGH'], ['HIGHEST'], ['DEFAULT']]"
