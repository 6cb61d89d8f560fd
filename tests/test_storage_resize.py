"""`untyped_storage().resize_(n)` on pjrt storages, as on CPU and CUDA: FSDP2 frees its unsharded
parameters with resize_(0) and re-allocates them with resize_(nbytes) before writing every element."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_pjrt import native, storage

STRICT = torch.pjrt.EagerMode.DEFER_NEVER
FUSE = torch.pjrt.EagerMode.DEFER_AND_FUSE


@pytest.fixture(params=[STRICT, FUSE], ids=["strict", "fused"])
def mode(request: pytest.FixtureRequest):
    with torch.pjrt.set_eager_mode(request.param):
        yield request.param


def both(x: torch.Tensor) -> list[torch.Tensor]:
    """The same values on CPU and on pjrt (each its own storage)."""
    return [x.clone(), x.to("pjrt")]


def test_resize_to_zero_and_back_then_written_matches_cpu(mode) -> None:
    x, y = torch.randn(12), torch.randn(12)
    results = []
    for t in both(x):
        view = t.view(3, 4)[1:]
        s = t.untyped_storage()
        s.resize_(0)
        freed = (s.nbytes(), s.data_ptr(), view.untyped_storage().nbytes())
        s.resize_(48)
        t.copy_(y.to(t.device))
        results.append((freed, s.nbytes(), t.cpu(), view.cpu(), (view * 2 + 1).cpu()))
    (cpu_freed, cpu_size, *cpu_values), (pjrt_freed, pjrt_size, *pjrt_values) = results
    assert pjrt_freed == cpu_freed == (0, 0, 0)
    assert pjrt_size == cpu_size == 48
    for got, want in zip(pjrt_values, cpu_values):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(pjrt_values[0], y, rtol=0, atol=0)


@pytest.mark.usefixtures("settled_memory")
def test_memory_figures_and_device_storage_follow() -> None:
    before = torch.pjrt.memory_allocated()
    t = torch.randn(1000).to("pjrt")
    st = storage.storage_of(t)
    assert torch.pjrt.memory_allocated() == before + 4000
    peak = torch.pjrt.max_memory_allocated()
    t.untyped_storage().resize_(0)
    assert torch.pjrt.memory_allocated() == before
    assert (st.numel, st.nbytes, st.array) == (0, 0, None)
    assert storage.storage_of(t) is st  # the same DeviceStorage, moved to the storage's new bytes
    t.untyped_storage().resize_(4000)
    assert torch.pjrt.memory_allocated() == before + 4000
    assert torch.pjrt.max_memory_allocated() == peak
    assert (st.numel, st.nbytes, st.array) == (1000, 4000, None)  # uninitialised
    y = torch.randn(1000)
    t.copy_(y)
    torch.testing.assert_close(t.cpu(), y, rtol=0, atol=0)
    del t, st
    assert torch.pjrt.memory_allocated() == before


def test_shrink_and_grow_keep_what_fits_as_on_cpu(mode) -> None:
    x, fresh = torch.randn(10), torch.randn(16)
    results = []
    for t in both(x):
        s = t.untyped_storage()
        s.resize_(24)
        shrunk = t.new_empty(0).set_(s, 0, (6,)).to("cpu", copy=True)  # a copy on CPU too: written below
        s.resize_(64)
        whole = t.new_empty(0).set_(s, 0, (16,))
        kept = whole[:6].to("cpu", copy=True)  # on CPU the bytes beyond are uninitialised: compare what was kept
        whole.copy_(fresh.to(t.device))
        results.append((shrunk, kept, whole.cpu(), (whole[3:9] * whole[7:13]).cpu()))
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(results[1][0], x[:6], rtol=0, atol=0)


def test_storage_shared_by_two_tensors(mode) -> None:
    x, y = torch.randn(4, 6), torch.randn(8)
    results = []
    for a in both(x):
        b = a.new_empty(0).set_(a.untyped_storage(), 4, (2, 8), (8, 1))  # another tensor, other sizes and offset
        a.untyped_storage().resize_(0)
        sizes = (a.untyped_storage().nbytes(), b.untyped_storage().nbytes())
        b.untyped_storage().resize_(96)
        a.fill_(0.5)
        b[1].copy_(y.to(b.device))
        results.append((sizes, a.cpu(), b.cpu(), (a.sum(0) + b.sum()).cpu()))
    (cpu_sizes, *cpu_values), (pjrt_sizes, *pjrt_values) = results
    assert pjrt_sizes == cpu_sizes == (0, 0)
    for got, want in zip(pjrt_values, cpu_values):
        torch.testing.assert_close(got, want)


def test_enlarged_storage_takes_a_new_address_beyond_its_span() -> None:
    x, y, z = torch.randn(25), torch.randn(7), torch.randn(300)
    a, b = x.to("pjrt"), y.to("pjrt")  # a: 100 bytes, in a 128-byte span
    sa, sb = a.untyped_storage(), b.untyped_storage()
    address = sa.data_ptr()
    sa.resize_(0)
    sa.resize_(128)  # within its span: the same address
    assert sa.data_ptr() == address
    sa.resize_(1200)  # beyond it: somewhere that overlaps no other storage
    moved = sa.data_ptr()
    assert moved != address
    for other in (sb, torch.randn(5).to("pjrt").untyped_storage()):
        start, end = other.data_ptr(), other.data_ptr() + other.nbytes()
        assert end <= moved or start >= moved + 1200
    grown = a.new_empty(0).set_(sa, 0, (300,))
    grown.copy_(z)
    torch.testing.assert_close(grown.cpu(), z, rtol=0, atol=0)
    torch.testing.assert_close(b.cpu(), y, rtol=0, atol=0)


def test_fused_pending_value_is_dropped_by_a_free() -> None:
    x, y = torch.randn(32), torch.randn(32)
    with torch.pjrt.set_eager_mode(FUSE):
        t = x.to("pjrt") * 3  # pending: the fused program has not run
        kept = t[:8] + 1
        st = storage.storage_of(t)
        assert isinstance(st.array, storage.PendingArray)
        t.untyped_storage().resize_(0)
        assert st.array is None
        t.untyped_storage().resize_(128)
        t.mul_(0).add_(y.to("pjrt"))
        torch.testing.assert_close(t.cpu(), y, rtol=0, atol=0)
        torch.testing.assert_close(kept.cpu(), x[:8] * 3 + 1)


def test_out_of_memory_and_bad_sizes_change_nothing() -> None:
    x = torch.randn(16)
    t = x.to("pjrt")
    s = t.untyped_storage()
    address = s.data_ptr()
    with pytest.raises(torch.OutOfMemoryError):
        s.resize_(1 << 62)
    with pytest.raises(RuntimeError, match="cannot resize"):
        s.resize_(-1)
    assert (s.nbytes(), s.data_ptr()) == (64, address)
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)


@pytest.mark.usefixtures("settled_memory")
def test_fsdp2_free_and_alloc_storage_unpatched() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    import torch_pjrt.distributed.backend  # noqa: F401 (what once patched FSDP2's functions)

    assert _fsdp_param.free_storage.__module__ == _fsdp_param.__name__
    assert _fsdp_param_group.alloc_storage is _fsdp_param.alloc_storage
    before = torch.pjrt.memory_allocated()
    param = torch.randn(8, 16).to("pjrt")
    _fsdp_param.free_storage(param)
    assert (param.untyped_storage().size(), torch.pjrt.memory_allocated()) == (0, before)
    _fsdp_param.alloc_storage(param)
    assert (param.untyped_storage().size(), torch.pjrt.memory_allocated()) == (512, before + 512)
    shards = [torch.randn(64), torch.randn(64)]  # what an all-gather writes: every element, through views
    for view, shard in zip(torch.split(param.view(-1), 64), shards):
        view.copy_(shard.to("pjrt"))
    torch.testing.assert_close(param.cpu(), torch.cat(shards).view(8, 16), rtol=0, atol=0)
    _fsdp_param.free_storage(param)
    assert torch.pjrt.memory_allocated() == before


WITHOUT_NATIVE = """
import json, sys
sys.modules["torch_pjrt._hooks"] = None
import torch
from torch_pjrt import native, storage
x, y, z = (torch.tensor(values) for values in json.loads(sys.argv[1]))
result = {"native": native.available()}
before = torch.pjrt.memory_allocated()
t = x.to("pjrt")
view = t[2:]
s = t.untyped_storage()
s.resize_(0)
result["freed"] = [s.nbytes(), view.untyped_storage().nbytes(), torch.pjrt.memory_allocated() - before]
s.resize_(4 * len(x))
result["allocated"] = torch.pjrt.memory_allocated() - before
t.copy_(y)
result["values"] = [t.cpu().tolist(), view.cpu().tolist()]
s.resize_(8)
result["shrunk"] = t.new_empty(0).set_(s, 0, (2,)).cpu().tolist()
s.resize_(4 * len(z))
grown = t.new_empty(0).set_(s, 0, (len(z),))
grown.copy_(z)
result["grown"] = [grown.cpu().tolist(), torch.pjrt.memory_allocated() - before]
print(json.dumps(result))
"""


def test_without_the_native_module() -> None:
    x, y, z = torch.randn(6), torch.randn(6), torch.randn(40)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(WITHOUT_NATIVE),
                           json.dumps([x.tolist(), y.tolist(), z.tolist()])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["native"] is False
    assert result["freed"] == [0, 0, 0]
    assert result["allocated"] == 24
    assert result["values"] == [y.tolist(), y[2:].tolist()]
    assert result["shrunk"] == y[:2].tolist()
    assert result["grown"] == [z.tolist(), 160]


@pytest.mark.skipif(not native.available(), reason="torch_pjrt._hooks is not built")
def test_native_hooks_resize_in_place() -> None:
    t = torch.randn(4).to("pjrt")
    s = t.untyped_storage()
    assert not s.resizable()  # no allocator: the hooks resize pjrt storages themselves
    impl = s._cdata
    s.resize_(0)
    s.resize_(16)
    assert t.untyped_storage()._cdata == impl  # the same StorageImpl, as on CUDA


def test_deepcopy_and_storage_clone_copy_the_bytes() -> None:
    """PyTorch's UntypedStorage.clone allocates through a C++ allocator pjrt lacks (it crashed the process)."""
    base = torch.randn(6, 5)
    on_device = base.to("pjrt")
    view = on_device[1:, ::2]
    copied = copy.deepcopy(view)
    assert copied.device == view.device and copied.shape == view.shape and copied.stride() == view.stride()
    assert copied.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    on_device.zero_()  # the copy is independent of the original
    torch.testing.assert_close(copied.cpu(), base[1:, ::2], rtol=0, atol=0)
    cloned = torch.empty(0, device="pjrt").set_(on_device.untyped_storage().clone())
    assert cloned.shape == (30,) and not cloned.cpu().any()
    model = copy.deepcopy(torch.nn.Linear(3, 2).to("pjrt"))
    assert all(p.device.type == "pjrt" for p in model.parameters())


@pytest.mark.usefixtures("settled_memory")
def test_storages_pytorch_allocates_itself_live_on_the_device() -> None:
    """torch.UntypedStorage(n, device="pjrt") goes through the device's C++ allocator (it crashed the process
    without one): counted bytes that read as zeros until written, usable under a tensor of any dtype."""
    before = torch.pjrt.memory_allocated()
    made = torch.UntypedStorage(24, device="pjrt")
    assert made.device == torch.device("pjrt", 0) and made.nbytes() == 24
    assert torch.pjrt.memory_allocated() == before + 24
    floats = torch.empty(0, device="pjrt").set_(made, 0, (2, 3), (3, 1))
    assert torch.equal(floats.cpu(), torch.zeros(2, 3))
    values = torch.randn(2, 3)
    floats.copy_(values)
    torch.testing.assert_close((floats * 2).cpu(), values * 2, rtol=0, atol=0)
    as_bytes = torch.empty(0, dtype=torch.uint8, device="pjrt").set_(made)
    assert torch.equal(as_bytes.cpu(), values.view(-1).view(torch.uint8))
    del floats, as_bytes, made
    assert torch.pjrt.memory_allocated() == before
