"""The pjrt device itself: registration, torch.pjrt, tensors, transfers, views, serialization, errors."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_pjrt

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environment, timeout=300
    )


def test_import_torch_alone_gives_the_device() -> None:
    result = run_python(
        """
        import sys, torch
        x = torch.ones(2, 3, device="pjrt")
        assert type(x) is torch.Tensor and x.device.type == "pjrt"
        assert "torch_pjrt" in sys.modules
        print(x.cpu().sum().item())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "6.0"


def test_autoload_does_not_load_jax() -> None:
    result = run_python("import sys, torch; print('jax' in sys.modules, torch.pjrt.is_initialized())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_device_module_mirrors_cuda() -> None:
    assert torch.pjrt.is_available()
    assert torch.pjrt.device_count() >= 1
    assert torch.pjrt.current_device() == 0
    with torch.pjrt.device(0):
        assert torch.pjrt.current_device() == 0
    torch.pjrt.set_device(0)
    torch.pjrt.synchronize()
    assert torch.accelerator.current_accelerator().type == "pjrt"
    props = torch.pjrt.get_device_properties(0)
    assert props.platform == "cpu" and props.total_memory > 0
    assert isinstance(torch.pjrt.get_device_name(), str)
    assert torch.pjrt.is_bf16_supported()
    assert torch.bfloat16 in torch.pjrt.get_amp_supported_dtype()
    with pytest.raises(RuntimeError, match="pjrt:7 does not exist"):
        torch.pjrt.set_device(7)
    with pytest.raises(RuntimeError, match="no CUDA compute capability"):
        torch.pjrt.get_device_capability()


def test_generated_methods() -> None:
    a = torch.randn(2, 2)
    x = a.pjrt()
    assert x.is_pjrt and not a.is_pjrt
    module = torch.nn.Linear(3, 2).pjrt()
    assert module.weight.device.type == "pjrt" and isinstance(module.weight, torch.nn.Parameter)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    a = (torch.randn(5, 7) * 50).to(dtype)
    x = a.to("pjrt")
    assert x.dtype == dtype and x.device.type == "pjrt" and x.shape == a.shape
    assert torch.equal(x.cpu(), a)


def test_transfers_non_blocking_and_pinned_source() -> None:
    a = torch.randn(4, 4)
    pinned = a.pin_memory()
    assert pinned.is_pinned() and not a.is_pinned()
    assert torch.equal(pinned.to("pjrt", non_blocking=True).cpu(), a)
    assert torch.equal(a.to("pjrt").to("cpu", non_blocking=True), a)


def test_empty_host_cache_with_pjrt_as_accelerator() -> None:
    # torch 2.13 crashes here when the accelerator registers no host allocator (vLLM calls it at shutdown).
    assert torch.accelerator.current_accelerator().type == "pjrt"
    torch.empty(8).pin_memory()
    torch.accelerator.empty_host_cache()


@pytest.mark.usefixtures("settled_memory")
def test_memory_accounting_follows_tensors() -> None:
    before = torch.pjrt.memory_allocated()
    x = torch.empty(1000, dtype=torch.float32, device="pjrt")
    assert torch.pjrt.memory_allocated() == before + 4000
    assert torch.pjrt.max_memory_allocated() >= before + 4000
    del x
    assert torch.pjrt.memory_allocated() == before
    torch.pjrt.reset_peak_memory_stats()
    assert torch.pjrt.max_memory_allocated() == before
    stats = torch.pjrt.memory_stats()
    assert stats["allocated_bytes.all.current"] == stats["active_bytes.all.current"] == before
    assert stats["active_bytes.all.peak"] == torch.pjrt.max_memory_allocated()
    assert stats["reserved_bytes.all.current"] == torch.pjrt.memory_reserved()
    assert stats["reserved_bytes.all.peak"] == torch.pjrt.max_memory_reserved()
    assert stats["num_alloc_retries"] == 0


def test_events_time_work() -> None:
    start, end = torch.pjrt.Event(enable_timing=True), torch.pjrt.Event(enable_timing=True)
    start.record()
    x = torch.ones(256, 256, device="pjrt")
    x.fill_(3.0)
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0.0
    stream = torch.pjrt.current_stream()
    stream.synchronize()
    assert stream.query()


def test_views_alias_like_cuda() -> None:
    a = torch.randn(6, 5)
    x = a.to("pjrt")
    for view in (
        lambda t: t.view(5, 6), lambda t: t.t(), lambda t: t[1:4, ::2], lambda t: t.diagonal(),
        lambda t: t[:, :1].expand(6, 5), lambda t: t.as_strided((3, 3), (1, 2), 1), lambda t: t.unfold(0, 2, 1),
        lambda t: t.permute(1, 0)[2:], lambda t: t.view(torch.int32), lambda t: t[2],
    ):
        assert torch.equal(view(x).cpu(), view(a))


def test_writes_through_views_reach_the_base() -> None:
    a = torch.randn(6, 5)
    x = a.to("pjrt")
    for write in (
        lambda t: t[1:4, ::2].fill_(7.0), lambda t: t.t()[0].zero_(), lambda t: t.diagonal().fill_(3.0),
        lambda t: t[2].copy_(torch.arange(5.0)), lambda t: t.data[0].fill_(-1.0),
        lambda t: t.view(30)[::7].fill_(9.0), lambda t: t.__setitem__((slice(None), 3), 4.5),
    ):
        write(a)
        write(x)
        assert torch.equal(x.cpu(), a)


def test_write_into_expanded_view_is_refused_like_cpu() -> None:
    x = torch.zeros(1, 3, device="pjrt").expand(4, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        x.zero_()


def test_copy_between_layouts_and_dtypes() -> None:
    a, b = torch.randn(4, 6), torch.randn(6, 4)
    x, y = a.to("pjrt"), b.to("pjrt")
    x.copy_(y.t())
    a.copy_(b.t())
    assert torch.equal(x.cpu(), a)
    z = torch.empty(4, 6, dtype=torch.float64, device="pjrt").copy_(x)
    assert torch.equal(z.cpu(), a.double())
    x[0].copy_(torch.randn(6).double())


def test_factories_and_clone() -> None:
    assert torch.equal(torch.zeros(2, 3, device="pjrt").cpu(), torch.zeros(2, 3))
    assert torch.equal(torch.ones(2, 3, device="pjrt").cpu(), torch.ones(2, 3))
    assert torch.equal(torch.full((2,), 2.5, device="pjrt").cpu(), torch.full((2,), 2.5))
    assert torch.equal(torch.zeros(3, dtype=torch.int64, device="pjrt").cpu(), torch.zeros(3, dtype=torch.int64))
    a = torch.randn(3, 4)
    assert torch.equal(a.to("pjrt").t().clone().cpu(), a.t().clone())


def test_save_and_load_round_trips(tmp_path: object) -> None:
    a = torch.randn(3, 4)
    x = a.to("pjrt")
    state = {"x": x, "row": x[1], "ints": torch.tensor([1, 2, 3]).to("pjrt")}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for location in (None, "pjrt", "cpu"):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=location)
        expected_type = "cpu" if location == "cpu" else "pjrt"
        assert loaded["x"].device.type == expected_type
        assert torch.equal(loaded["x"].cpu(), a) and torch.equal(loaded["row"].cpu(), a[1])
        assert torch.equal(loaded["ints"].cpu(), torch.tensor([1, 2, 3]))


def test_module_state_dict_round_trip() -> None:
    model = torch.nn.Linear(4, 3).pjrt()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = torch.nn.Linear(4, 3).pjrt()
    other.load_state_dict(torch.load(buffer))
    assert torch.equal(other.weight.cpu(), model.weight.cpu())


def test_safetensors_round_trip(tmp_path: object) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    a, b = torch.randn(3, 4), torch.randn(5)
    path = str(tmp_path / "weights.safetensors")
    safetensors_torch.save_file({"a": a.to("pjrt"), "b": b.to("pjrt")}, path)
    loaded = safetensors_torch.load_file(path, device="pjrt")
    assert loaded["a"].device.type == "pjrt"
    assert torch.equal(loaded["a"].cpu(), a) and torch.equal(loaded["b"].cpu(), b)


# An op with only a CPU kernel: what an op with no pjrt lowering looks like.
CPU_ONLY_OP = """
import torch
library = torch.library.Library("pjrt_test", "DEF")
library.define("scaled(Tensor x, float factor) -> Tensor")
library.impl("scaled", lambda x, factor: x * factor, "CPU")
"""
exec(CPU_ONLY_OP)


def test_missing_lowering_names_the_op_and_the_fallback() -> None:
    x = torch.randn(10).to("pjrt")
    with pytest.raises(NotImplementedError, match=r"pjrt_test::scaled.*TORCH_PJRT_CPU_FALLBACK=1"):
        torch.ops.pjrt_test.scaled(x, 2.0)


def test_cpu_fallback_runs_counts_and_warns_once() -> None:
    a = torch.randn(10)
    x = a.to("pjrt")
    torch_pjrt.metrics.reset()
    with torch_pjrt.cpu_fallback():
        with pytest.warns(UserWarning, match="pjrt_test.scaled"):
            result = torch.ops.pjrt_test.scaled(x, 3.0)
        torch.ops.pjrt_test.scaled(x, 3.0)
    assert result.device.type == "pjrt"
    assert torch.equal(result.cpu(), a * 3.0)
    counters = torch_pjrt.metrics.counters()
    assert counters["cpu_fallbacks"] == 2
    assert "pjrt_test.scaled.default" in torch_pjrt.metrics.report()


def test_cpu_fallback_from_environment() -> None:
    result = run_python(
        CPU_ONLY_OP + """
import torch_pjrt
x = torch.tensor([0.5, 1.5, 2.5, 0.1]).to("pjrt")
print(torch.ops.pjrt_test.scaled(x, 2.0).device, torch_pjrt.metrics.counters()["cpu_fallbacks"])
""",
        TORCH_PJRT_CPU_FALLBACK="1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pjrt:0", "1"]


def test_metrics_counters_and_reset() -> None:
    torch_pjrt.metrics.reset()
    x = torch.randn(8).to("pjrt")
    x.cpu()
    counters = torch_pjrt.metrics.counters()
    for name in ("compiles", "cache_hits", "cache_misses", "ops_executed", "cpu_fallbacks",
                 "transfers_to_device", "transfers_to_host"):
        assert name in counters
    assert counters["transfers_to_device"] == 1 and counters["transfers_to_host"] == 1
    torch_pjrt.metrics.reset()
    assert torch_pjrt.metrics.counters()["transfers_to_host"] == 0


def test_eager_modes() -> None:
    modes = torch.pjrt.EagerMode
    assert torch.pjrt.eager_mode is modes.DEFER_NEVER
    with torch.pjrt.set_eager_mode(modes.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert torch.pjrt.eager_mode is modes.DEFER_NEVER_AND_LAUNCH_BLOCKING
        x = torch.ones(3, device="pjrt")
        x.fill_(2.0)
        assert torch.equal(x.cpu(), torch.full((3,), 2.0))
    assert torch.pjrt.eager_mode is modes.DEFER_NEVER
    result = run_python("import torch; print(torch.pjrt.eager_mode.name)", TORCH_PJRT_LAUNCH_BLOCKING="1")
    assert result.stdout.strip() == "DEFER_NEVER_AND_LAUNCH_BLOCKING", result.stderr


def test_two_cpu_devices() -> None:
    result = run_python(
        """
        import torch
        assert torch.pjrt.device_count() == 2
        a = torch.randn(3, 4)
        x = a.to("pjrt:1")
        assert x.device == torch.device("pjrt", 1)
        y = x.to("pjrt:0")
        assert y.device == torch.device("pjrt", 0) and torch.equal(y.cpu(), a)
        z = torch.zeros(2, device="pjrt:1")
        assert z.device.index == 1
        with torch.pjrt.device(1):
            assert torch.ones(2, device="pjrt").device.index == 1
        try:
            x.copy_(y) ; x + y
        except RuntimeError as error:
            assert "same device" in str(error)
        print("ok")
        """,
        TORCH_PJRT_CPU_DEVICES="2",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_resize_and_resize_as_keep_the_prefix_as_on_cpu() -> None:
    values = torch.randn(6)
    grown_cpu, grown = values.clone(), values.to("pjrt")
    grown_cpu.resize_(2, 2)
    grown.resize_(2, 2)
    torch.testing.assert_close(grown.cpu(), grown_cpu)
    template = torch.empty(3, 4)
    grown_cpu.resize_as_(template)
    grown.resize_as_(template.to("pjrt"))
    assert grown.shape == grown_cpu.shape and grown.stride() == grown_cpu.stride()
    torch.testing.assert_close(grown.cpu().flatten()[:6], values)


def test_copy_then_in_place_update_keeps_the_copy() -> None:
    """copy_ must not share the source's buffer: in-place ops donate their input buffers."""
    source = torch.randn(4, 4)
    a = source.to("pjrt")
    b = torch.empty(4, 4, device="pjrt")
    b.copy_(a)
    a.add_(1)
    torch.testing.assert_close(b.cpu(), source)
    torch.testing.assert_close(a.cpu(), source + 1)


def test_a_host_tensor_stays_resizable_after_its_copy_to_the_device() -> None:
    """Copying a CPU tensor to pjrt leaves it as it was: numpy() on it would have made its storage unresizable
    (a later out= call or resize_ raised "Trying to resize storage that is not resizable")."""
    for host in (torch.empty(0, dtype=torch.bool), torch.randn(3), torch.randint(0, 9, (2, 3))):
        copy = host.to("pjrt")
        assert torch.equal(copy.cpu(), host)
        host.resize_(4, 5)
        assert host.shape == (4, 5)
    out = torch.empty(0, dtype=torch.bool)
    out.to("pjrt")
    bools = torch.randn(2, 3) > 0
    assert torch.equal(torch.pow(bools, True, out=out), bools)


def test_host_writes_after_a_transfer_do_not_reach_the_device_copy() -> None:
    """A reused host buffer (a loader's pinned batch) must not alias the device tensor made from it."""
    source = torch.randn(1000)
    expected = source.clone()
    made, copied, pinned = source.to("pjrt"), torch.empty(1000, device="pjrt"), source.pin_memory()
    copied.copy_(source)
    from_pinned = pinned.to("pjrt", non_blocking=True)
    source.mul_(2)
    pinned.zero_()
    for tensor in (made, copied, from_pinned):
        torch.testing.assert_close(tensor.cpu(), expected)


def test_like_factories_place_their_result_on_another_device() -> None:
    """`zeros_like(x, device="cpu")` on a device tensor gives a CPU tensor of x's layout, as on CUDA."""
    source = torch.randn(3, 4).t()
    x = source.to("pjrt")
    for device in ("cpu", "meta"):
        zeros = torch.zeros_like(x, device=device)
        full = torch.full_like(x, 2.5, device=device)
        assert zeros.device.type == full.device.type == device
        assert zeros.stride() == torch.zeros_like(source).stride() and zeros.shape == source.shape
        if device == "cpu":
            torch.testing.assert_close(zeros, torch.zeros_like(source))
            torch.testing.assert_close(full, torch.full_like(source, 2.5))
    torch.testing.assert_close(x.new_ones(2, device="cpu"), torch.ones(2))


def test_copies_keep_or_take_the_memory_format_as_on_cpu() -> None:
    """`.to(memory_format=...)` is honoured and a dense layout (channels_last, a transpose) survives `.cpu()`."""
    source = torch.randn(2, 3, 4, 5)
    x = source.to("pjrt")
    channels_last, contiguous = torch.channels_last, torch.contiguous_format
    cases = [
        (lambda t: t.to(memory_format=channels_last), None),
        (lambda t: t.to(torch.float64, memory_format=channels_last), None),
        (lambda t: t.contiguous(memory_format=channels_last), lambda t: t.cpu()),
        (lambda t: t.contiguous(memory_format=channels_last), lambda t: t.to("cpu", memory_format=contiguous)),
        (lambda t: t[0, 0].t(), lambda t: t.cpu()),
    ]
    for make, read in cases:
        expected = make(source) if read is None else read(make(source))
        actual = make(x) if read is None else read(make(x))
        assert actual.stride() == expected.stride()
        torch.testing.assert_close(actual.cpu(), expected)
    moved = source.to("pjrt", memory_format=channels_last)
    assert moved.stride() == source.contiguous(memory_format=channels_last).stride()
    torch.testing.assert_close(moved.cpu(), source)


def test_the_readme_names_every_registered_environment_variable() -> None:
    from pathlib import Path

    from torch_pjrt import envvars

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Environment variables") :].split("\n## ")[0]
    assert [name for name in envvars.VARIABLES if f"`{name}" not in table] == []


def test_an_empty_environment_variable_reads_as_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_pjrt import envvars

    monkeypatch.setenv("TORCH_PJRT_VLLM_ASYNC_SCHEDULING", "")
    monkeypatch.setenv("TORCH_PJRT_FUSE_MAX_NODES", "")
    assert envvars.flag("TORCH_PJRT_VLLM_ASYNC_SCHEDULING")
    assert envvars.value("TORCH_PJRT_FUSE_MAX_NODES") == "1000"
    monkeypatch.setenv("TORCH_PJRT_VLLM_ASYNC_SCHEDULING", "0")
    assert not envvars.flag("TORCH_PJRT_VLLM_ASYNC_SCHEDULING")
