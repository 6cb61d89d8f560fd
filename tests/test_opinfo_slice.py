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
    "abs", "add", "addmm", "amax", "argmax", "bmm", "cat", "clamp", "cumsum", "div.no_rounding_mode", "exp",
    "gather", "index_select", "log_softmax", "matmul", "mean", "mul", "nn.functional.gelu",
    "nn.functional.layer_norm", "nn.functional.linear", "nn.functional.relu", "nn.functional.silu",
    "permute", "pow", "reshape", "rsqrt", "sigmoid", "softmax", "sum", "tanh", "transpose", "where",
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
