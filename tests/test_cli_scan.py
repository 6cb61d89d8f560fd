"""`torch-pjrt scan`: exact findings on a fixture with every category, --fix, bad input."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

from torch_pjrt.cli import scan
from torch_pjrt.cli.main import main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "cli")
PROJECT = os.path.join(FIXTURES, "scan_project")

# (file, line, category, severity, fixable) for every finding in scan_project.
EXPECTED = [
    ("ext/fused.cu", 3, "extension", "blocker", False),
    ("ext/setup.py", 3, "extension", "blocker", False),
    ("ext/setup.py", 4, "extension", "blocker", False),
    ("kernels.py", 1, "cupy-pycuda", "blocker", False),
    ("kernels.py", 2, "cupy-pycuda", "blocker", False),
    ("kernels.py", 3, "triton", "blocker", False),
    ("kernels.py", 4, "triton", "blocker", False),
    ("kernels.py", 7, "triton", "blocker", False),
    ("train.py", 8, "backend-flags", "portable", False),
    ("train.py", 9, "backend-flags", "portable", False),
    ("train.py", 10, "device-string", "mechanical", True),
    ("train.py", 10, "torch-cuda", "mechanical", True),
    ("train.py", 14, "torch-cuda", "mechanical", True),
    ("train.py", 15, "nccl", "needs-work", False),
    ("train.py", 19, "cuda-method", "mechanical", True),
    ("train.py", 20, "device-string", "mechanical", True),
    ("train.py", 21, "amp", "mechanical", True),
    ("train.py", 22, "streams-events", "mechanical", True),
    ("train.py", 23, "amp", "mechanical", True),
    ("train.py", 24, "cuda-method", "mechanical", True),
    ("train.py", 26, "cuda-graphs", "needs-work", False),
    ("train.py", 27, "torch-cuda", "mechanical", True),
    ("train.py", 28, "cuda-method", "mechanical", False),
    ("train.py", 28, "device-string", "mechanical", True),
    ("train.py", 28, "torch-cuda", "mechanical", True),
    ("train.py", 28, "torch-cuda", "mechanical", True),
]


def scan_json(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[dict], str]:
    status = main(["scan", "--format", "json", *args])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


def test_every_category_found_exactly(capsys: pytest.CaptureFixture) -> None:
    status, findings, _ = scan_json(capsys, PROJECT)
    assert status == 0
    assert all(set(f) >= {"file", "line", "category", "severity", "suggestion"} for f in findings)
    found = sorted((os.path.relpath(f["file"], PROJECT), f["line"], f["category"], f["severity"], f["fixable"])
                   for f in findings)
    assert found == EXPECTED


def test_suggestions_name_the_replacement(capsys: pytest.CaptureFixture) -> None:
    _, findings, _ = scan_json(capsys, os.path.join(PROJECT, "train.py"))
    suggestions = {(f["line"], f["suggestion"]) for f in findings}
    assert (10, "torch.accelerator.is_available") in suggestions
    assert (14, "torch.accelerator.set_device_index") in suggestions
    assert (20, '"pjrt:0"') in suggestions
    assert (21, 'torch.amp.GradScaler("pjrt", ...)') in suggestions
    assert (23, 'torch.autocast("pjrt", ...)') in suggestions
    assert (27, "torch.pjrt.synchronize") in suggestions


def test_text_output_and_summary(capsys: pytest.CaptureFixture) -> None:
    assert main(["scan", PROJECT]) == 0
    out = capsys.readouterr().out
    assert "train.py:19: mechanical rewrite: cuda-method: model.cuda() -> .to(\"pjrt\") [fixable]" in out
    assert "kernels.py:7: blocker: triton: @triton.jit" in out
    assert out.strip().splitlines()[-1] == (
        "26 finding(s) in 4 file(s): 2 portable as is, 14 mechanical rewrite, 2 needs work, 8 blocker; "
        "13 fixable with --fix")


def test_replacements_exist() -> None:
    """Every name a rewrite introduces is real on this install (the table cannot drift from torch.pjrt)."""
    for member in (*scan.ACCELERATOR, *scan.PJRT_MIRRORS, *scan.STREAMS_EVENTS, "OutOfMemoryError"):
        rule = scan.rule_for(f"torch.cuda.{member}")
        module, _, name = rule.replacement.rpartition(".")
        assert hasattr(eval(module, {"torch": torch}), name), rule.replacement  # noqa: S307 (a dotted name)


def test_fix_rewrites_in_place_and_the_result_runs(tmp_path: str, capsys: pytest.CaptureFixture) -> None:
    path = os.path.join(tmp_path, "fixable.py")
    shutil.copy(os.path.join(FIXTURES, "fixable.py"), path)
    assert main(["scan", "--fix", path]) == 0
    out = capsys.readouterr().out
    assert '-model = nn.Linear(4, 2).cuda()  # the model' in out
    assert '+model = nn.Linear(4, 2).to("pjrt")  # the model' in out
    fixed = open(path).read()
    compile(fixed, path, "exec")
    assert "cuda" not in fixed.replace("torch.cuda.amp import", "")
    assert 'with torch.autocast("pjrt", enabled=False):' in fixed
    assert main(["scan", "--format", "json", path]) == 0
    remaining = json.loads(capsys.readouterr().out)
    assert [f["category"] for f in remaining] == []
    result = runpy.run_path(path)["RESULT"]
    assert result == ("pjrt", "pjrt:0", 0, torch.pjrt.device_count())


def test_diff_changes_nothing(tmp_path: str, capsys: pytest.CaptureFixture) -> None:
    path = os.path.join(tmp_path, "train.py")
    shutil.copy(os.path.join(PROJECT, "train.py"), path)
    before = open(path).read()
    assert main(["scan", "--diff", path]) == 0
    assert "+    torch.pjrt.synchronize()" in capsys.readouterr().out
    assert open(path).read() == before


def test_syntax_error_is_named_and_other_files_still_scanned(tmp_path: str, capsys: pytest.CaptureFixture) -> None:
    with open(os.path.join(tmp_path, "broken.py"), "w") as handle:
        handle.write("import torch\n\ndef f(:\n    return torch.cuda.synchronize()\n")
    with open(os.path.join(tmp_path, "good.py"), "w") as handle:
        handle.write("x = 'cuda'\n")
    status, findings, error = scan_json(capsys, str(tmp_path))
    assert status == 1
    assert [(os.path.basename(f["file"]), f["category"]) for f in findings] == [("good.py", "device-string")]
    assert f"{os.path.join(tmp_path, 'broken.py')}:3:" in error and "syntax error" in error


def test_missing_path(capsys: pytest.CaptureFixture) -> None:
    assert main(["scan", "no/such/path"]) == 1
    assert "no/such/path: no such file or directory" in capsys.readouterr().err


def test_module_entry_point() -> None:
    """`python -m torch_pjrt scan` runs the same command in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-m", "torch_pjrt", "scan", "--format", "json",
                           os.path.join(PROJECT, "kernels.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [f["category"] for f in json.loads(done.stdout)] == ["cupy-pycuda", "cupy-pycuda", "triton", "triton",
                                                               "triton"]
