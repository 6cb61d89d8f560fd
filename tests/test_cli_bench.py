"""`torch-pjrt bench`: JSON fields on a CUDA script and on the gpt preset, cost, progress bar, bad input."""

from __future__ import annotations

import io
import json
import os

import pytest

from torch_pjrt.cli import bench
from torch_pjrt.cli.main import main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "cli")
STEP_FIELDS = {"median", "p10", "p90", "mean"}


def bench_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(["bench", "--json", "--no-progress", *args]) == 0
    return json.loads(capsys.readouterr().out)


def check_result(result: dict, device: str, unit: str) -> None:
    assert result["device"] == device
    assert result["time_to_first_step_s"] > 0
    assert set(result["step_time_s"]) == STEP_FIELDS
    assert result["step_time_s"]["p10"] <= result["step_time_s"]["median"] <= result["step_time_s"]["p90"]
    assert result["throughput"] > 0 and result["throughput_unit"] == f"{unit}/s"
    assert isinstance(result["peak_memory_bytes"], int)
    assert result["peak_memory_kind"] == ("device peak allocated" if device == "pjrt" else "process max-RSS growth")
    if device == "pjrt":
        assert result["compiles"] >= 0 and result["compile_seconds"] >= 0
    else:
        assert result["compiles"] is None


def test_script_bench_json(capsys: pytest.CaptureFixture) -> None:
    report = bench_json(capsys, "--script", os.path.join(FIXTURES, "cuda_train.py"), "--script-args", "--steps 3",
                        "--items-per-step", "32", "--devices", "cpu,pjrt", "--price-per-hour", "pjrt=3.6")
    assert report["unit"] == "samples" and report["items_per_step"] == 32
    cpu, pjrt = report["results"]
    check_result(cpu, "cpu", "samples")
    check_result(pjrt, "pjrt", "samples")
    assert pjrt["steps"] == 3 and len(pjrt["losses"]) == 3 and len(pjrt["step_times_s"]) == 2
    assert pjrt["losses"][-1] < pjrt["losses"][0]
    assert "cost" not in cpu
    assert pjrt["cost"]["per"] == "1k samples"
    assert pjrt["cost"]["usd"] == pytest.approx(3.6 / 3600 / pjrt["throughput"] * 1e3)


def test_gpt_preset_json_and_table(capsys: pytest.CaptureFixture) -> None:
    report = bench_json(capsys, "--preset", "gpt", "--size", "tiny", "--steps", "3", "--devices", "pjrt",
                        "--price-per-hour", "pjrt=2")
    (result,) = report["results"]
    check_result(result, "pjrt", "tokens")
    assert report["items_per_step"] == 2 * 16 and result["cost"]["per"] == "1M tokens"
    # compiles may be 0 here: an earlier test in this worker process can have compiled the same programs
    assert len(result["losses"]) == 3
    assert main(["bench", "--preset", "gpt", "--size", "tiny", "--steps", "2", "--devices", "pjrt"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "bench gpt (tiny): 32 tokens per step"
    assert table[1].split()[:3] == ["device", "first", "step"] and table[2].startswith("pjrt")


def test_profile_writes_a_trace_with_device_tracks(tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    path = os.path.join(str(tmp_path), "bench_trace.json")
    assert main(["bench", "--json", "--no-progress", "--preset", "gpt", "--size", "tiny", "--steps", "3",
                 "--warmup", "1", "--devices", "cpu,pjrt", "--profile", path]) == 0
    printed = capsys.readouterr()
    # (the table keeps the 12 ops of most device time: which ones make it varies from run to run)
    assert f"written to {path}" in printed.err and "aten::" in printed.err
    cpu, pjrt = json.loads(printed.out)["results"]
    assert "profile" not in cpu
    assert pjrt["profile"]["trace"] == path and pjrt["profile"]["first_step"] == 1
    assert pjrt["profile"]["steps"] == 2 and pjrt["profile"]["device_seconds"] > 0
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    device = [e for e in events if e.get("pid") == "pjrt:0" and e.get("ph") == "X"]
    assert any(e["name"] == "aten.mm.default" and e["args"]["issued by"] == "aten::mm" for e in device)


def test_resnet_runs_on_cpu(capsys: pytest.CaptureFixture) -> None:
    report = bench_json(capsys, "--preset", "resnet", "--size", "tiny", "--steps", "2", "--devices", "cpu")
    check_result(report["results"][0], "cpu", "samples")


def test_progress_bar() -> None:
    stream = io.StringIO()
    progress = bench.Progress(3, "pjrt", stream, enabled=True, width=6)
    for _ in range(3):
        progress.update(0.02)
    progress.close()
    assert "\rpjrt   [######] 3/3     20.0 ms/step\n" in stream.getvalue()


def test_percentile() -> None:
    assert bench.percentile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert bench.percentile([1.0, 2.0], 0.1) == pytest.approx(1.1)


@pytest.mark.parametrize(("args", "message"), [
    (["--price-per-hour", "pjrt"], "expected DEVICE=USD"),
    (["--devices", "tpu"], "use a comma-separated list"),
    (["--script", "no_such_script.py"], "no_such_script.py: no such file"),
    (["--steps", "0"], "at least one step"),
    (["--devices", "cpu", "--profile", "trace.json"], "add pjrt to --devices"),
])
def test_bad_input(capsys: pytest.CaptureFixture, args: list[str], message: str) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_plot_draws_step_time_and_loss(tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert main(["bench", "--preset", "gpt", "--size", "tiny", "--steps", "3", "--devices", "cpu,pjrt",
                 "--no-progress", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert f"plot written to {path}" in capsys.readouterr().err


def test_plot_needs_matplotlib(capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    assert main(["bench", "--plot", "out.png", "--devices", "cpu"]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err
