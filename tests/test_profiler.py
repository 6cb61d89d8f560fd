"""PyTorch's profiler sees the pjrt device: device time per program in key_averages, attributed to
the issuing aten op or graph, device tracks in the Chrome trace, and no recording without a profiler."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_pjrt
from torch_pjrt import native, profiler
from torch_pjrt.runtime import metrics, profiling

DEVICE_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def fresh(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.randn(*shape)
    return cpu, cpu.to("pjrt")


def averages_by_name(prof: profile) -> dict[str, object]:
    return {row.key: row for row in prof.key_averages()}


def test_hooks_installed() -> None:
    assert profiler.install()


def test_strict_ops_have_device_time_attributed_to_their_aten_ops(tmp_path: object) -> None:
    (a_cpu, a), (b_cpu, b) = fresh(32, 32), fresh(32, 32)
    (a @ b + a).cpu()  # compiled outside the window
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        result = (a @ b + a).cpu()
    torch.testing.assert_close(result, a_cpu @ b_cpu + a_cpu)
    rows = averages_by_name(prof)
    for op, program in (("aten::mm", "aten.mm.default"), ("aten::add", "aten.add.Tensor")):
        assert rows[op].device_time_total > 0 and rows[op].self_device_time_total > 0, op
        assert rows[program].self_device_time_total > 0
        assert rows[program].device_type == torch.autograd.DeviceType.PrivateUse1
    assert rows["aten::matmul"].device_time_total == rows["aten::mm"].device_time_total
    assert rows["aten::matmul"].self_device_time_total == 0
    assert "aten::mm" in prof.key_averages().table(sort_by="device_time_total", row_limit=5)
    launches = profiler.launches_of(prof)
    assert [launch.name for launch in launches] == ["aten.mm.default", "aten.add.Tensor"]
    assert all(launch.end_ns > launch.start_ns and launch.device == 0 for launch in launches)

    path = os.path.join(str(tmp_path), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    device = [e for e in events if e.get("pid") == "pjrt:0" and e.get("ph") == "X"]
    assert [e["name"] for e in device] == ["aten.mm.default", "aten.add.Tensor"]
    assert [e["args"]["issued by"] for e in device] == ["aten::mm", "aten::add"]
    assert all(e["dur"] > 0 for e in device)
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and e.get("pid") == "pjrt:0"}
    assert names == {"pjrt:0"}
    flows = [e for e in events if e.get("cat") == profiler.FLOW_CATEGORY]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    finishes = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert set(starts) == set(finishes) == {e["args"]["correlation"] for e in device}
    assert all(isinstance(starts[i]["pid"], int) and finishes[i]["pid"] == "pjrt:0" for i in starts)


def test_fused_flush_and_compiled_graph_show_up() -> None:
    (a_cpu, a), (b_cpu, b) = fresh(16, 8), fresh(8, 16)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ y).sum(dim=0)

    compiled = torch.compile(f, backend="pjrt", fullgraph=True)
    compiled(a, b)
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        graph_result = compiled(a, b).cpu()
        with torch_pjrt.set_eager_mode("defer_and_fuse"):
            fused_result = (f(a, b) * 2).cpu()
    torch.testing.assert_close(graph_result, f(a_cpu, b_cpu))
    torch.testing.assert_close(fused_result, f(a_cpu, b_cpu) * 2)
    names = [launch.name for launch in profiler.launches_of(prof)]
    assert "compiled_graph" in names and any(name.startswith("fused[") for name in names)
    rows = averages_by_name(prof)
    assert rows["compiled_graph"].self_device_time_total > 0
    fused = next(name for name in names if name.startswith("fused["))
    assert rows[fused].self_device_time_total > 0
    graph_op = next(row for key, row in rows.items() if key.startswith("Torch-Compiled Region"))
    assert graph_op.device_time_total > 0
    assert rows["aten::_to_copy"].device_time_total > 0  # the .cpu() that flushed the fused graph


def test_pending_fused_work_runs_inside_the_window() -> None:
    (a_cpu, a), _ = fresh(8), fresh(1)
    with torch_pjrt.set_eager_mode("defer_and_fuse"):
        with profile(activities=DEVICE_ACTIVITIES) as prof:
            result = a * 3 + 1
        assert [launch.name for launch in profiler.launches_of(prof)] == ["fused[2]"]
    torch.testing.assert_close(result.cpu(), a_cpu * 3 + 1)
    rows = averages_by_name(prof)
    assert rows["pjrt::synchronize"].device_time_total > 0


def test_no_recording_without_a_device_profiler() -> None:
    (a_cpu, a), (b_cpu, b) = fresh(8, 8), fresh(8, 8)
    before = metrics.counters()["profiled_programs"]
    module = native.dispatch_module()
    native_on = module is not None and module.dispatch_enabled()
    result = (a @ b).cpu()
    with profile(activities=[ProfilerActivity.CPU]) as cpu_only:
        assert profiling.recording is None
        assert module is None or module.dispatch_enabled() == native_on
        (a - b).cpu()
    assert profiling.recording is None
    assert metrics.counters()["profiled_programs"] == before
    assert profiler.launches_of(cpu_only) == []
    assert all(row.device_time_total == 0 for row in cpu_only.key_averages())
    torch.testing.assert_close(result, a_cpu @ b_cpu)
    with profile(activities=DEVICE_ACTIVITIES):
        assert profiling.recording is not None
        assert module is None or not module.dispatch_enabled()
    assert profiling.recording is None
    assert module is None or module.dispatch_enabled() == native_on


def test_an_error_inside_the_window_closes_it() -> None:
    module = native.dispatch_module()
    native_on = module is not None and module.dispatch_enabled()
    (_, a), _ = fresh(4), fresh(1)
    with pytest.raises(ValueError, match="user error"):
        with profile(activities=DEVICE_ACTIVITIES):
            (a + 1).cpu()
            raise ValueError("user error")
    assert profiling.recording is None
    assert module is None or module.dispatch_enabled() == native_on
    with profile(activities=DEVICE_ACTIVITIES) as again:
        (a + 2).cpu()
    assert [launch.name for launch in profiler.launches_of(again)] == ["aten.add.Tensor"]


@pytest.mark.parametrize("use_kineto", [False, True])
def test_autograd_profiler_with_use_device(use_kineto: bool, tmp_path: object) -> None:
    if not use_kineto and not native.available():
        pytest.skip("the legacy mode needs the native module's profiler stubs")
    (x_cpu, x), _ = fresh(4, 4), fresh(1)
    x.requires_grad_(True)
    with torch.autograd.profiler.profile(use_device="pjrt", use_kineto=use_kineto) as prof:
        (x * x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * x_cpu)
    rows = averages_by_name(prof)
    assert rows["aten::mul"].device_time_total > 0 and rows["aten::mul"].cpu_time_total > 0
    assert all(row.cpu_time_total >= 0 for row in rows.values())
    path = os.path.join(str(tmp_path), "trace.json.gz")  # kineto writes plain JSON whatever the name
    prof.export_chrome_trace(path)
    with open(path) as file:
        assert any(e.get("pid") == "pjrt:0" for e in json.load(file)["traceEvents"])


def test_jax_trace_folder_is_named_in_the_trace(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = os.path.join(str(tmp_path), "jax")
    monkeypatch.setenv("TORCH_PJRT_PROFILE_JAX_DIR", folder)
    (_, a), _ = fresh(4), fresh(1)
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        (a + 1).cpu()
    path = os.path.join(str(tmp_path), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as file:
        assert json.load(file)["pjrtJaxTraceDir"] == os.path.abspath(folder)
    assert profiler.jax_trace_dir_of(prof) == folder
    assert any(name.endswith(".xplane.pb") for _, _, files in os.walk(folder) for name in files)


def test_schedule_and_tensorboard_handler_write_device_events(tmp_path: object) -> None:
    import glob
    import gzip

    from torch.profiler import schedule, tensorboard_trace_handler

    (a_cpu, a), _ = fresh(8, 8), fresh(1)
    (a * 1).cpu()
    folder = os.path.join(str(tmp_path), "tb")
    results = []
    with profile(activities=DEVICE_ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=2),
                 on_trace_ready=tensorboard_trace_handler(folder, use_gzip=True)) as prof:
        for step in range(4):
            results.append((a * (step + 1)).cpu())
            prof.step()
    for step, result in enumerate(results):
        torch.testing.assert_close(result, a_cpu * (step + 1))
    (path,) = glob.glob(os.path.join(folder, "*.json.gz"))
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    device = [e for e in events if e.get("pid") == "pjrt:0" and e.get("ph") == "X"]
    assert [(e["name"], e["args"]["issued by"]) for e in device] == [("aten.mul.Tensor", "aten::mul")] * 2
