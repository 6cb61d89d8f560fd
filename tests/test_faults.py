"""Faults, each with a test: out of device memory, threads, fork, a cache folder that cannot be written."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_pjrt
from torch_pjrt.runtime import client, memory

FUSE = torch.pjrt.EagerMode.DEFER_AND_FUSE


def run_script(script: str, cache: str = "0", timeout: int = 240) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "TORCH_PJRT_CACHE_DIR": cache})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def small_op_works() -> None:
    x = torch.randn(5, 7)
    torch.testing.assert_close((x.to("pjrt").sin() @ x.to("pjrt").T).cpu(), x.sin() @ x.T)


# --- out of device memory ------------------------------------------------------------------


@pytest.mark.usefixtures("settled_memory")
def test_an_allocation_larger_than_the_device_raises_out_of_memory_and_the_process_goes_on() -> None:
    asked = 10**13
    assert asked > torch.pjrt.get_device_properties().total_memory
    held = torch.ones(1000, device="pjrt")
    before = torch.pjrt.memory_allocated()
    ooms = torch.pjrt.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError) as raised:
        torch.empty(asked, dtype=torch.uint8, device="pjrt")
    assert torch.pjrt.memory_stats()["num_ooms"] == ooms + 1
    message = str(raised.value)
    assert isinstance(raised.value, RuntimeError)
    assert "tried to allocate 9.09 TiB" in message
    assert f"pjrt tensors hold {memory.format_size(before)} (torch.pjrt.memory_allocated())" in message
    assert torch.pjrt.memory_allocated() == before
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 9.09 TiB"):
        torch.empty(0, dtype=torch.uint8, device="pjrt").resize_(asked)
    small_op_works()
    assert held.sum().item() == 1000


def test_empty_tensors_count_against_the_device_before_they_are_written() -> None:
    total = torch.pjrt.get_device_properties().total_memory
    half = (total - torch.pjrt.memory_allocated()) // 2 + 1
    if torch.pjrt.mem_get_info()[0] < half:
        pytest.skip("the device has less than half of itself free")
    first = torch.empty(half, dtype=torch.uint8, device="pjrt")  # no memory taken until written
    with pytest.raises(torch.OutOfMemoryError, match=f"tried to allocate {memory.format_size(half)}"):
        torch.empty(half, dtype=torch.uint8, device="pjrt")
    del first
    small_op_works()


@pytest.mark.usefixtures("settled_memory")
def test_an_op_whose_output_is_too_large_raises_out_of_memory_before_it_runs() -> None:
    column = torch.randn(10**6).to("pjrt")
    before = torch.pjrt.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 3.64 TiB"):
        column[:, None] * column[None, :]
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 3.64 TiB"):
        torch.zeros(10**12, device="pjrt")
    assert torch.pjrt.memory_allocated() == before
    small_op_works()


@pytest.fixture
def without_size_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that looks limitless, so only XLA's own allocation can fail (how we see its error)."""
    if client.platform() == "cpu":
        try:
            overcommit = Path("/proc/sys/vm/overcommit_memory").read_text().strip()
        except OSError:
            overcommit = "unknown"
        if overcommit not in ("0", "2"):
            pytest.skip(f"vm.overcommit_memory={overcommit}: the host might grant 3.6 TiB and exhaust itself")
    monkeypatch.setattr(client, "memory_limit", lambda index: (1 << 60, "limitless for this test"))
    monkeypatch.setattr(client, "free_memory", lambda index: 1 << 60)


@pytest.mark.parametrize("fused", [False, True])
def test_an_allocation_xla_cannot_make_raises_out_of_memory(without_size_check: None, fused: bool) -> None:
    x = torch.randn(10**6)
    column = x.to("pjrt")
    with torch.pjrt.set_eager_mode(FUSE if fused else torch.pjrt.EagerMode.DEFER_NEVER):
        with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate 3.64 TiB.*Out of memory"):
            outer = column[:, None] * column[None, :]
            neighbour = column[:3] + 1
            outer.cpu()
        if fused:  # computed by the program that failed: it has no value, and says so
            with pytest.raises(RuntimeError):
                neighbour.cpu()
        del outer, neighbour
        small_op_works()
        torch.pjrt.synchronize()
        torch.testing.assert_close((column * 2).cpu(), x * 2)


# --- several threads at once -----------------------------------------------------------------


def train_and_compute(seed: int, device: str, width: int) -> list[torch.Tensor]:
    """A small model's training steps and some ops, seeded: the same numbers on any device."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    data = [(torch.randn(5, width, generator=generator), torch.randn(5, 3, generator=generator)) for _ in range(4)]
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    results = []
    for inputs, targets in data:
        optimizer.zero_grad()
        loss = ((model(inputs.to(device)) - targets.to(device)) ** 2).mean()
        loss.backward()
        optimizer.step()
        values = inputs.to(device)
        results += [loss.detach().cpu(), (values.sin() * seed).cumsum(0).amax(1).cpu(), values.argsort(1).cpu()]
    return results + [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("fused", [False, True])
def test_ops_from_several_threads_at_once_give_cpu_results(fused: bool) -> None:
    threads = 4
    expected = {seed: train_and_compute(seed, "cpu", 6 + seed) for seed in range(threads)}
    with torch.pjrt.set_eager_mode(FUSE if fused else torch.pjrt.EagerMode.DEFER_NEVER):
        before_ops = torch_pjrt.metrics.counters()["ops_executed"]
        train_and_compute(0, "pjrt", 30)  # ops of one run, counted (other shapes: the threads compile theirs)
        ops_per_run = torch_pjrt.metrics.counters()["ops_executed"] - before_ops
        gc.collect()
        before_memory = torch.pjrt.memory_allocated()
        before_ops = torch_pjrt.metrics.counters()["ops_executed"]
        barrier = threading.Barrier(threads)
        results: dict[int, list[torch.Tensor]] = {}
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                barrier.wait()
                results[seed] = train_and_compute(seed, "pjrt", 6 + seed)
            except BaseException as error:  # noqa: BLE001 (reported by the main thread)
                errors.append(error)

        workers = [threading.Thread(target=work, args=(seed,)) for seed in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert not errors, errors
        for seed in range(threads):
            for got, want in zip(results[seed], expected[seed], strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch_pjrt.metrics.counters()["ops_executed"] - before_ops == threads * ops_per_run
    gc.collect()
    assert torch.pjrt.memory_allocated() == before_memory


def test_memory_accounting_loses_no_update_under_threads() -> None:
    allocated_before, _, count_before = memory.stats.counts(0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def churn() -> None:
        for _ in range(5_000):
            torch.empty(16, device="pjrt")

    try:
        workers = [threading.Thread(target=churn) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    allocated, _, count = memory.stats.counts(0)
    assert allocated == allocated_before and count - count_before == 20_000


# --- fork ---------------------------------------------------------------------------------------


FORK = """
    import torch, torch_pjrt
    from torch.utils.data import DataLoader, Dataset

    x = torch.randn(4, 4)
    on_device = x.to("pjrt")
    assert torch.equal((on_device * 2).cpu(), x * 2)

    class HostData(Dataset):
        def __init__(self):
            self.device_tensors = [torch.ones(3, device="pjrt") for _ in range(8)]

        def __len__(self):
            return 8

        def __getitem__(self, i):
            self.device_tensors[i] = None  # an inherited device tensor freed in the worker
            return torch.full((2,), float(i)), torch.pjrt._is_in_bad_fork()

    class DeviceData(HostData):
        def __getitem__(self, i):
            return (self.device_tensors[i] + i).cpu()

    def loader(data):
        return DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")

    total = torch.zeros((), device="pjrt")
    for batch, bad_fork in loader(HostData()):
        assert bad_fork.all()
        total += batch.to("pjrt").sum()
    print("host", total.item(), torch.pjrt._is_in_bad_fork())
    try:
        list(loader(DeviceData()))
    except RuntimeError as error:
        print("device", "multiprocessing_context='spawn'" in str(error))
    print("after", torch.equal((on_device + 1).cpu(), x + 1))
"""


def test_forked_data_loader_workers_work_on_cpu_and_refuse_the_device_at_once() -> None:
    lines = run_script(FORK, timeout=180).stdout.splitlines()
    assert lines == ["host 56.0 False", "device True", "after True"]


# --- a cache folder that cannot be written ------------------------------------------------------


CACHE = """
    import errno, warnings, torch, torch_pjrt

    def work(scale):
        x = torch.arange(scale * (scale + 1)).reshape(scale, scale + 1) / 10  # new shapes: new programs
        on = x.to("pjrt")
        got = [((on.sin() * scale + on.t().sum()).cos()).cpu(), torch.compile(lambda t: (t * scale).relu().sum(),
                                                                               backend="pjrt")(on).cpu()]
        want = [(x.sin() * scale + x.t().sum()).cos(), (x * scale).relu().sum()]
        return all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(got, want))

    def fill_the_disk():
        from jax._src import lru_cache
        from torch_pjrt.runtime import disk_store

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        lru_cache.LRUCache.put = full
        disk_store.tempfile.NamedTemporaryFile = full

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = work(3)
        if FULL:
            fill_the_disk()
        second = work(4)
    cache_warnings = [str(w.message) for w in caught if "cache" in str(w.message)]
    print(first, second, len(cache_warnings))
    print(cache_warnings)
"""


def test_a_cache_folder_that_cannot_be_made_costs_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # root ignores permissions, not a file in the way
    result = run_script("FULL = False\n" + textwrap.dedent(CACHE), cache=str(blocker / "cache"))
    summary, warnings = result.stdout.splitlines()
    assert summary == "True True 1", warnings
    assert "cannot be written" in warnings and "TORCH_PJRT_CACHE_DIR" in warnings


def test_a_cache_folder_that_fills_up_costs_one_warning(tmp_path: Path) -> None:
    result = run_script("FULL = True\n" + textwrap.dedent(CACHE), cache=str(tmp_path))
    summary, warnings = result.stdout.splitlines()
    assert summary == "True True 1", warnings
    assert "No space left on device" in warnings
    assert any((tmp_path / "executables").iterdir())  # written before the disk filled
