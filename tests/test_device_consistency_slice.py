"""A fixed fast slice of the OpInfo consistency tests (battery/device_tests.py) that PyTorch's
instantiate_device_type_tests generates for pjrt: the whole run is `make battery-device-tests`."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE = ("_add_", "_mul_", "_sum_", "_matmul_", "_softmax_", "_index_select_", "_cat_", "_where_", "_clamp_")


def test_consistency_slice_passes_through_the_device_test_machinery() -> None:
    selection = " or ".join(f"{name}pjrt" for name in SLICE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "battery/device_tests.py", "-k", selection],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, summary
    assert " passed" in summary and "failed" not in summary, summary
