"""A fixed fast slice of the OpInfo battery (battery/run_opinfo.py): float32, forward and backward.

Entries that pass on pjrt in the full battery, across families; each must keep passing
on its first SAMPLES sample inputs. The whole battery is `make battery-ops`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from battery import run_opinfo

SAMPLES = 3
SLICE = (
    "abs", "add", "addmm", "amax", "argmax", "bmm", "cat", "cumsum", "div.no_rounding_mode", "einsum", "fft.rfft",
    "gather", "index_put", "index_select", "linalg.vector_norm", "log_softmax", "masked_fill", "matmul",
    "nn.functional.conv2d", "nn.functional.cross_entropy", "nn.functional.embedding", "nn.functional.gelu",
    "nn.functional.linear", "nn.functional.pad.constant", "reshape", "softmax", "sort", "special.erfcx", "sum",
    "topk", "transpose", "var_mean", "where",
)


@functools.cache
def entries() -> dict[str, Any]:
    return run_opinfo.load_entries()


@pytest.mark.parametrize("key", SLICE)
def test_opinfo_float32(key: str) -> None:
    op = entries()[key]
    for dtype, direction in run_opinfo.cells(op, ["float32"]):
        row = run_opinfo.run_cell(op, key, dtype, direction, SAMPLES)
        assert row["status"] == "pass", f"{key} {dtype} {direction}: {row['status']}: {row['detail']}"


@pytest.mark.parametrize("key", ["addbmm", "as_strided.partial_views"])
def test_opinfo_every_sample(key: str) -> None:
    """Every float32 sample of the entries of issue #14: addbmm's float32 results that miss CPU's are float32
    roundings of the exact sum; as_strided.partial_views reads storage outside its view, which the battery
    copies with the samples."""
    op = entries()[key]
    for dtype, direction in run_opinfo.cells(op, ["float32"]):
        row = run_opinfo.run_cell(op, key, dtype, direction, None)
        assert row["status"] == "pass", f"{key} {dtype} {direction}: {row['status']}: {row['detail']}"


def test_exact_reference_excuses_only_floating_rounding() -> None:
    """A float32 result that misses CPU's passes when about as near the double-precision result as CPU's; one
    much farther, an integer result that differs, or a nan where CPU has a number does not."""
    exact = torch.randn(50, dtype=torch.float64) * 100
    exact[:3] = 0.5
    cpu = exact.float()
    cpu[0] += 4e-5
    near, far = cpu.clone(), cpu.clone()
    near[0], near[1] = exact[0].float(), near[1] + 4e-5
    far[1] += 1e-3
    indices = torch.arange(50)
    check = lambda actual, expected, value: run_opinfo._as_exact_as_cpu(actual, expected, lambda: value, "")
    assert check(near.to("pjrt"), cpu, exact)
    assert not check(far.to("pjrt"), cpu, exact)
    assert not check((near.to("pjrt"), indices.flip(0).to("pjrt")), (cpu, indices), (exact, indices))
    assert check((near.to("pjrt"), indices.to("pjrt")), (cpu, indices), (exact, indices))
    with_nan = near.clone()
    with_nan[2] = float("nan")
    assert not check(with_nan.to("pjrt"), cpu, exact)


def test_report_counts_samples_and_capped_cells() -> None:
    """The report says how many samples an entry compared, and whether a capped run left some out."""
    from battery import report

    op = entries()["add"]
    capped = run_opinfo.run_cell(op, "add", "int32", "forward", 2)
    whole = run_opinfo.run_cell(op, "add", "float32", "forward", None)
    assert capped["capped"] and capped["total"] == 2
    assert not whole["capped"] and whole["total"] > 2
    entry = {"cells": {("int32", "forward"): capped, ("float32", "forward"): whole}}
    assert report.samples_run(entry, capped_runs=True) == f"{2 + whole['total']}+"
    del capped["capped"]
    assert report.samples_run(entry, capped_runs=True) == f"{2 + whole['total']}?"
    assert report.samples_run(entry, capped_runs=False) == f"{2 + whole['total']}"
