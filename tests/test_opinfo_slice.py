"""A fixed fast slice of the OpInfo battery (battery/run_opinfo.py): float32, forward and backward.

Entries that pass on pjrt in the full battery, across families; each must keep passing
on its first SAMPLES sample inputs. The whole battery is `make battery-ops`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

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
