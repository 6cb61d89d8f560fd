"""The persistent compile cache: shared by processes, survives corrupt entries."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import torch, torch_pjrt
    x = torch.arange(12.0).reshape(3, 4).to("pjrt")
    y = (x.sin() * 2 + x.t().sum()).cos().sum()
    counters = torch_pjrt.metrics.counters()
    print(round(y.item(), 4), counters["persistent_cache_hits"], counters["persistent_cache_misses"])
    """
)


def run(cache: Path) -> list[str]:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_second_process_hits_the_cache(tmp_path: Path) -> None:
    value, hits, misses = run(tmp_path)
    assert int(hits) == 0 and int(misses) > 0
    assert any((tmp_path / "xla").iterdir())
    again, hits, misses = run(tmp_path)
    assert again == value
    assert int(hits) > 0 and int(misses) == 0


def test_corrupt_entries_are_recompiled(tmp_path: Path) -> None:
    value, _, _ = run(tmp_path)
    for entry in (tmp_path / "xla").rglob("*"):
        if entry.is_file():
            entry.write_bytes(entry.read_bytes()[: max(1, entry.stat().st_size // 3)])
    again, _, _ = run(tmp_path)
    assert again == value
