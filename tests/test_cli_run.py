"""`torch-pjrt run`: an unmodified CUDA script trains on pjrt; unsupported ops are reported with their line."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from torch_pjrt.cli import cuda_shim
from torch_pjrt.cli.main import main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "cli")


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    argv, path = list(sys.argv), list(sys.path)
    status = main(["run", *args])
    captured = capsys.readouterr()
    assert sys.argv == argv and sys.path == path
    return status, captured.out, captured.err


def test_cuda_training_script_trains_on_pjrt(capsys: pytest.CaptureFixture) -> None:
    status, out, err = run(capsys, fixture("cuda_train.py"), "--steps", "4")
    assert status == 0, err
    assert "argv=['--steps', '4'] device=pjrt:0" in out
    assert "== torch-pjrt run report:" in err
    assert "exit status      0" in err
    assert "ops executed" in err and "aten.addmm.default" in err
    assert "compiles" in err and "host->device" in err
    assert "unsupported ops  none" in err


def test_shim_is_undone_after_the_run(capsys: pytest.CaptureFixture) -> None:
    run(capsys, fixture("raises.py"))
    assert not torch.cuda.is_available()
    assert torch.autocast is torch.amp.autocast_mode.autocast
    assert torch.amp.GradScaler is torch.amp.grad_scaler.GradScaler
    assert torch.ones(1).to("cpu").device.type == "cpu"
    assert not torch.overrides._get_current_function_mode_stack()


def test_unsupported_op_is_reported_with_its_line(capsys: pytest.CaptureFixture) -> None:
    status, _, err = run(capsys, fixture("unsupported_op.py"))
    assert status == 1
    assert "NotImplementedError" in err
    assert f"cli_fixture::triple.default at {os.path.relpath(fixture('unsupported_op.py'))}:11: " \
           "tripled = triple(values)" in err
    assert "rerun with --cpu-fallback" in err


def test_cpu_fallback_runs_the_op_and_counts_it(capsys: pytest.CaptureFixture) -> None:
    status, out, err = run(capsys, "--cpu-fallback", fixture("unsupported_op.py"))
    assert status == 0, err
    assert out == "tripled [3.0, 3.0, 3.0, 3.0]\n"
    assert "CPU fallbacks    1 call(s) of 1 op(s):" in err
    assert f"cli_fixture.triple.default at {os.path.relpath(fixture('unsupported_op.py'))}:11:" in err


def test_script_that_raises(capsys: pytest.CaptureFixture) -> None:
    status, _, err = run(capsys, "--eager-mode", "defer_never_and_launch_blocking", fixture("raises.py"))
    assert status == 1
    assert 'raises.py", line 5, in check' in err
    assert "ValueError: bad input on pjrt:0" in err
    assert "raises.py raised ValueError" in err
    assert "eager mode       defer_never_and_launch_blocking" in err
    assert torch.pjrt.eager_mode.value == "defer_never"


def test_script_exit_status_is_kept(tmp_path: str, capsys: pytest.CaptureFixture) -> None:
    path = os.path.join(tmp_path, "exits.py")
    with open(path, "w") as handle:
        handle.write("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(3)\n")
    status, out, err = run(capsys, path, "a", "--b")
    assert status == 3
    assert out == "__main__ ['a', '--b']\n"
    assert "exit status      3" in err


def test_missing_script(capsys: pytest.CaptureFixture) -> None:
    status, _, err = run(capsys, "no_such_script.py")
    assert status == 2
    assert "no_such_script.py: no such file" in err


def test_compile_flag(capsys: pytest.CaptureFixture) -> None:
    """--compile sends torch.compile to the pjrt backend, or says clearly that the backend is missing."""
    from torch_pjrt.cli.run import compile_backend_ready

    status, out, err = run(capsys, "--compile", fixture("uses_compile.py"))
    if compile_backend_ready():
        assert status == 0, err
        assert out == "compiled [0.9093, 0.9093, 0.9093]\n"
    else:
        assert status == 2
        assert 'backend "pjrt" is not registered' in err


def test_device_mapping() -> None:
    assert cuda_shim.map_device("cuda", "pjrt") == torch.device("pjrt")
    assert cuda_shim.map_device("cuda:1", "pjrt") == torch.device("pjrt", 1)
    assert cuda_shim.map_device(torch.device("cuda", 0), "cpu") == torch.device("cpu")
    assert cuda_shim.map_device("cudax", "pjrt") == "cudax"
    assert cuda_shim.cuda_target(2, "pjrt") == torch.device("pjrt", 2)
    with cuda_shim.CudaShim("pjrt"):
        assert torch.cuda.is_available()
        x = torch.ones(2, device=torch.device("cuda")).cuda(0).to("cuda:0", torch.float64)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x.float() @ x.float()
        assert x.device == torch.device("pjrt", 0) and x.dtype == torch.float64
        assert y.dtype == torch.bfloat16
        assert torch.cuda.amp.GradScaler()._device == "pjrt"
