"""The native hit path (csrc/dispatch.cpp): cache hits run no Python of ours and give what the Python path gives."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch

import torch_pjrt
from torch_pjrt import native

pytestmark = pytest.mark.skipif(native.dispatch_module() is None, reason="native dispatch not built or turned off")

PACKAGE = str(Path(torch_pjrt.__file__).parent)


def python_calls_of_ours(fn: Callable[[], object]) -> list[str]:
    """The torch_pjrt Python functions entered while `fn` runs (on this thread)."""
    seen: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def pjrt(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).to("pjrt")


HIT_CASES: dict[str, Callable[[dict], Callable[[float], object]]] = {
    "add": lambda t: lambda s: t["a"] + t["b"],
    "add with a traced alpha": lambda t: lambda s: torch.add(t["a"], t["b"], alpha=s),
    "mul by a changing Python scalar": lambda t: lambda s: t["a"] * s,
    "in-place add_": lambda t: lambda s: t["c"].add_(t["b"], alpha=s),
    "out=": lambda t: lambda s: torch.mul(t["a"], t["b"], out=t["out"]),
    "addmm": lambda t: lambda s: torch.addmm(t["bias"], t["a"], t["w"]),
    "view, transpose and matmul": lambda t: lambda s: t["a"].t().reshape(16, 16) @ t["b"][:, :16],
    "reduction with static dims": lambda t: lambda s: t["a"].sum(dim=1, keepdim=True),
    # (integer division carries a device-side check, whose code a hit hands to Python: see the checked test)
    "integer ops": lambda t: lambda s: (t["i"] * 3) >> 1,
    "tensor list (cat)": lambda t: lambda s: torch.cat([t["a"], t["b"]], dim=0),
    "multiple returns (max.dim)": lambda t: lambda s: t["a"].max(dim=0),
    # (a factory's fill value is static: part of its program)
    "factories on the device": lambda t: lambda s: (torch.full((4, 4), 2.5, device="pjrt"),
                                                    torch.arange(7, device="pjrt"),
                                                    torch.scalar_tensor(-1.5, device="pjrt:0")),
    "a *_like factory": lambda t: lambda s: torch.ones_like(t["a"]) * s,
    # (a conversion on the tensor's own device is a plain lowered op; moves to and from the host are not)
    "dtype conversions on the device": lambda t: lambda s: (t["a"].to(torch.float16), t["i"].float(),
                                                            t["a"].to("pjrt", torch.bfloat16),
                                                            t["a"].to(device="pjrt:0", dtype=torch.int32)),
}


@pytest.mark.parametrize("case", sorted(HIT_CASES))
def test_a_hit_enters_no_python_of_ours(case: str) -> None:
    tensors = {"a": pjrt(16, 16), "b": pjrt(16, 16), "c": pjrt(16, 16), "out": pjrt(16, 16), "w": pjrt(16, 16),
               "bias": pjrt(16), "i": torch.randint(-50, 50, (8, 8)).to("pjrt")}
    call = HIT_CASES[case](tensors)
    call(0.5)  # the miss: Python builds and installs the program
    for _ in range(2):
        call(0.25)  # a number met again is made a device array once (client.scalar_array)
    assert python_calls_of_ours(lambda: call(0.25)) == []
    assert python_calls_of_ours(lambda: call(random.uniform(2.0, 3.0))) == []  # a new number passes as it is


@pytest.mark.parametrize("case", sorted(HIT_CASES))
def test_a_fused_recording_enters_no_python_of_ours(case: str) -> None:
    """In DEFER_AND_FUSE a seen signature is appended to the pending graph natively, its inputs the
    results of earlier recorded ops where they are; the graph then runs as Python built it."""
    torch.manual_seed(7)
    hosts = {"a": torch.randn(16, 16), "b": torch.randn(16, 16), "c": torch.randn(16, 16),
             "out": torch.randn(16, 16), "w": torch.randn(16, 16), "bias": torch.randn(16),
             "i": torch.randint(-50, 50, (8, 8))}
    strict = {name: t.to("pjrt") for name, t in hosts.items()}
    want = [HIT_CASES[case](strict)(s) for s in (0.5, 0.5, 0.25)]
    tensors = {name: t.to("pjrt") for name, t in hosts.items()}
    call = HIT_CASES[case](tensors)
    with torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE):
        got = [call(0.5), call(0.5)]  # the first is a miss: Python records it and installs the entry
        before = torch_pjrt.metrics.counters()
        entered = python_calls_of_ours(lambda: got.append(call(0.25)))
        after = torch_pjrt.metrics.counters()
        torch.pjrt.synchronize()
    assert entered == []
    assert after["cache_hits"] > before["cache_hits"] and after["fused_programs"] == before["fused_programs"]
    for expected, result in zip(want, got, strict=True):
        for e, r in zip(expected if isinstance(expected, tuple) else (expected,),
                        result if isinstance(result, tuple) else (result,), strict=True):
            assert torch.equal(e.cpu(), r.cpu())
    for name in ("c", "out"):  # in-place and out= writes went through the graph too
        assert torch.equal(strict[name].cpu(), tensors[name].cpu())


def test_native_recording_flushes_at_the_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_pjrt.eager import fusion

    monkeypatch.setattr(fusion, "MAX_NODES", 50)
    x_cpu = torch.randn(8, 8)
    x = x_cpu.to("pjrt")
    with torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE):
        x * 1.01
        torch.pjrt.synchronize()
        before = torch_pjrt.metrics.counters()["fused_programs"]
        for _ in range(120):
            x = x * 1.01
        assert torch_pjrt.metrics.counters()["fused_programs"] - before == 2
        got = x.cpu()
    for _ in range(120):
        x_cpu = x_cpu * 1.01
    torch.testing.assert_close(got, x_cpu)


def test_fused_checked_ops_record_natively_and_raise_at_the_sync() -> None:
    """A recorded embedding lookup (a device-side check) names the user's line when its graph reports a bad id."""
    torch.manual_seed(8)
    table, ids = torch.randn(10, 4), torch.randint(0, 10, (3, 5))
    on = {"table": table.to("pjrt"), "ids": ids.to("pjrt")}
    with torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE):
        for _ in range(2):
            torch.nn.functional.embedding(on["ids"], on["table"]).cpu()
        got: list[torch.Tensor] = []
        entered = python_calls_of_ours(lambda: got.append(torch.nn.functional.embedding(on["ids"], on["table"])))
        assert {name.rsplit(":", 1)[1] for name in entered} <= {"caller"}
        torch.testing.assert_close(got[0].cpu(), torch.nn.functional.embedding(ids, table))
        on["ids"] = torch.tensor([[0, 12, 3, 4, 5]] * 3).to("pjrt")
        looked_up = torch.nn.functional.embedding(on["ids"], on["table"])
        with pytest.raises(RuntimeError, match=r"aten::embedding: index out of range.*test_native_dispatch.py:\d+"):
            looked_up.cpu()


def test_hits_are_counted() -> None:
    a, b = pjrt(8, 8), pjrt(8, 8)
    a - b
    before = torch_pjrt.metrics.counters()
    for _ in range(5):
        a - b
    after = torch_pjrt.metrics.counters()
    assert after["ops_executed"] - before["ops_executed"] == 5
    assert after["cache_hits"] - before["cache_hits"] == 5
    assert after["compiles"] == before["compiles"]


def test_padded_calls_at_a_seen_true_length_replay_natively() -> None:
    """Ops on tensors marked dynamic (padded storages) replay natively once their true sizes were
    seen: Python is entered only for the padded results' layouts, and the values,
    in-place writes included, equal CPU's."""
    torch.manual_seed(4)

    def step(cache: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.cat([cache, new], dim=2)
        scores = torch.nn.functional.scaled_dot_product_attention(new, cache, cache)
        cache.mul_(0.5)
        return cache, scores * 2 + 1

    prompt, news = torch.randn(1, 2, 11, 8), [torch.randn(1, 2, 1, 8) for _ in range(3)]

    def run(device: str) -> list[torch.Tensor]:
        host = prompt.clone()
        if device == "pjrt":
            torch_pjrt.mark_dynamic(host, 2, max=64)
        cache, outputs = host.to(device), []
        for new in news:
            cache, scores = step(cache, new.to(device))
            outputs += [cache, scores]
        return outputs

    want = run("cpu")
    run("pjrt")  # misses: Python builds each padded program and installs it per true size
    before = torch_pjrt.metrics.counters()
    got: list[torch.Tensor] = []
    entered = python_calls_of_ours(lambda: got.extend(run("pjrt")[2:]))
    after = torch_pjrt.metrics.counters()
    for a, b in zip(got, want[2:]):
        torch.testing.assert_close(a.cpu(), b)
    # (each host-to-device move runs Python's transfer, which `native_miss` hands to at once: four of them;
    # no op enters Python's dispatch otherwise)
    assert [name.rsplit(":", 1)[1] for name in entered if "/eager/dispatch.py:" in name] == ["native_miss"] * 4
    assert after["dynamic_padded_ops"] > before["dynamic_padded_ops"]
    assert after["compiles"] == before["compiles"]


def test_checked_programs_hit_natively_and_raise_at_the_host_wait() -> None:
    """Ops with device-side checks (an embedding lookup, integer division) replay natively, handing only
    their check code to Python; a bad call of a seen signature still raises where the host waits,
    naming the op and the user's line."""
    torch.manual_seed(6)
    table, ids = torch.randn(10, 4), torch.randint(0, 10, (3, 5))
    numerators, divisors = torch.randint(-50, 50, (8,)), torch.randint(1, 9, (8,))
    on = {"table": table.to("pjrt"), "ids": ids.to("pjrt"), "n": numerators.to("pjrt"), "d": divisors.to("pjrt")}

    def lookup() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.embedding(on["ids"], on["table"]), on["n"] // on["d"]

    lookup()
    lookup()
    results: list[torch.Tensor] = []
    entered = python_calls_of_ours(lambda: results.extend(lookup()))
    assert {name.rsplit(":", 1)[1] for name in entered if "/eager/dispatch.py:" in name} == {"native_checks_issued"}
    torch.testing.assert_close(results[0].cpu(), torch.nn.functional.embedding(ids, table))
    assert torch.equal(results[1].cpu(), numerators // divisors)
    on["ids"] = torch.tensor([[0, 12, 3, 4, 5]] * 3).to("pjrt")  # same signature, an id past the table
    before = torch_pjrt.metrics.counters()["cache_hits"]
    looked_up = lookup()[0]
    assert torch_pjrt.metrics.counters()["cache_hits"] - before == 2
    issued_at = r"aten::embedding: index out of range.*test_native_dispatch.py:\d+: return torch.nn.functional.emb"
    with pytest.raises(RuntimeError, match=issued_at):
        looked_up.cpu()


@torch_pjrt.kernels.jax_op("native_dispatch_test::scaled_softsign")
def scaled_softsign(x: jax.Array, labels: jax.Array, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """A custom op with two results, a static scale and an integer tensor argument."""
    return x / (1 + jnp.abs(x)) * scale, x * labels[:, None]


@pytest.mark.parametrize("mode", [torch_pjrt.EagerMode.DEFER_NEVER, torch_pjrt.EagerMode.DEFER_AND_FUSE])
def test_custom_ops_hit_natively_and_give_cpus_results(mode: torch_pjrt.EagerMode) -> None:
    """A jax_op's seen call signature replays (strict) or records (fused) with no Python of ours beyond torch's
    own custom-op wrapper; its static argument keys the entry (another scale misses once), results equal CPU's."""
    op = scaled_softsign
    x, labels = torch.randn(6, 5), torch.randint(-3, 4, (6,))
    on = (x.to("pjrt"), labels.to("pjrt"))
    with torch.pjrt.set_eager_mode(mode):
        op(*on, scale=0.5)
        op(*on, scale=0.5)
        got: list[tuple[torch.Tensor, torch.Tensor]] = []
        before = torch_pjrt.metrics.counters()["cache_hits"]
        entered = python_calls_of_ours(lambda: got.append(op(*on, scale=0.5)))
        hits = torch_pjrt.metrics.counters()["cache_hits"] - before
        got.append(op(*on, scale=-2.0))
    assert entered == [] and hits == 1
    for (values, products), scale in zip(got, (0.5, -2.0), strict=True):
        torch.testing.assert_close(values.cpu(), x / (1 + x.abs()) * scale)
        assert torch.equal(products.cpu(), x * labels[:, None])


def test_gather_pages_hits_natively_and_a_bad_block_id_raises_at_the_host_wait() -> None:
    """The serving path's page gather (a jax_op with device-side checks) replays natively, handing only its
    check code to Python; a block id past the cache in a seen signature raises where the host waits."""
    from torch_pjrt.kernels import page_gather

    torch.manual_seed(8)
    cache, tables, layer = torch.randn(2, 6, 2, 4, 16), torch.randint(0, 6, (3, 2), dtype=torch.int32), 1
    on = [cache.to("pjrt"), tables.to("pjrt"), torch.tensor([layer]).to("pjrt")]
    page_gather.gather_pages(*on)
    page_gather.gather_pages(*on)
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    entered = python_calls_of_ours(lambda: got.append(page_gather.gather_pages(*on)))
    assert {name.rsplit(":", 1)[1] for name in entered if "/eager/dispatch.py:" in name} == {"native_checks_issued"}
    pages = cache[layer][tables.long()]  # (tokens, pages, kv heads, block size, 2 * head size)
    want = pages.permute(0, 2, 1, 3, 4).reshape(3, 2, 2 * 4, 16)
    assert torch.equal(got[0][0].cpu(), want[..., :8]) and torch.equal(got[0][1].cpu(), want[..., 8:])
    on[1] = torch.tensor([[0, 9]] * 3, dtype=torch.int32).to("pjrt")  # same signature, a block past the cache
    before = torch_pjrt.metrics.counters()["cache_hits"]
    keys = page_gather.gather_pages(*on)[0]
    assert torch_pjrt.metrics.counters()["cache_hits"] - before == 1
    with pytest.raises(RuntimeError, match=r"gather_pages: index 9 is out of bounds.*test_native_dispatch.py:\d+"):
        keys.cpu()


def test_advanced_indexing_hits_natively_unless_a_mask_needs_its_count() -> None:
    """Reads and writes with integer indices (and a mask write that is a `where`) replay natively, handing
    only their bounds checks to Python; a mask whose true count makes the shape runs the Python kernel
    on every call, since its result shape is not in the key."""
    torch.manual_seed(8)
    a, c, values, mask = torch.randn(16, 16), torch.randn(16, 16), torch.randn(16), torch.randn(16, 16) > 0
    ids = torch.tensor([0, 5, -1])
    on = {name: t.to("pjrt") for name, t in {"a": a, "c": c, "values": values, "ids": ids, "mask": mask}.items()}

    def calls(t: dict) -> list[torch.Tensor]:
        t["c"][2:10].index_put_((t["ids"],), t["values"], accumulate=True)
        t["c"][t["mask"]] = 0.5
        return [t["a"][t["ids"], 1:], t["c"] * 1]

    expected = calls({"a": a, "c": c.clone(), "values": values, "ids": ids, "mask": mask})
    cpu_twice = calls({"a": a, "c": expected[1].clone(), "values": values, "ids": ids, "mask": mask})
    calls(on)
    got: list[torch.Tensor] = []
    entered = python_calls_of_ours(lambda: got.extend(calls(on)))
    assert {name.rsplit(":", 1)[1] for name in entered if "/eager/" in name} == {"native_checks_issued"}
    for e, r in zip(cpu_twice, got, strict=True):
        torch.testing.assert_close(r.cpu(), e)
    selected = on["a"][on["mask"]]
    assert torch.equal(on["a"][on["mask"]].cpu(), a[mask]) and selected.shape == a[mask].shape


@pytest.mark.usefixtures("settled_memory")
def test_memory_figures_follow_native_results() -> None:
    a = pjrt(64, 64)
    a * 2
    baseline = torch.pjrt.memory_allocated()
    results = [a * 2 for _ in range(10)]
    assert torch.pjrt.memory_allocated() == baseline + 10 * 64 * 64 * 4
    del results
    assert torch.pjrt.memory_allocated() == baseline


EMPTY_CALLS: dict[str, Callable[[], torch.Tensor]] = {
    "float32 (batch, seq, 0) as generate() makes": lambda: torch.empty((1, 5, 0), device="pjrt"),
    "float16 with an index": lambda: torch.empty(3, 7, dtype=torch.float16, device="pjrt:0"),
    "int64, contiguous format named": lambda: torch.empty((2, 3, 4), dtype=torch.int64, device="pjrt",
                                                          memory_format=torch.contiguous_format),
    "a 0-dim bool": lambda: torch.empty((), dtype=torch.bool, device="pjrt"),
    "a zero size among others": lambda: torch.empty(4, 0, 9, dtype=torch.int32, device="pjrt"),
}


@pytest.mark.parametrize("case", sorted(EMPTY_CALLS))
def test_torch_empty_is_made_natively_once_python_made_its_dtype(case: str) -> None:
    """torch.empty runs its Python kernel for a dtype it has not made yet, then no Python of ours: the tensor
    has CPU's sizes, strides, dtype and storage bytes on the device asked for, counts in the memory figures,
    reads as zeros until written and holds what is written (fresh random values, compared with CPU)."""
    call = EMPTY_CALLS[case]
    call()  # the Python kernel
    call()  # natively, reading the device's unchecked allocation size once
    made: list[torch.Tensor] = []
    before = torch.pjrt.memory_allocated()
    assert python_calls_of_ours(lambda: made.append(call())) == []
    tensor, like = made[0], torch.empty(made[0].shape, dtype=made[0].dtype)
    assert (tensor.device, tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset()) == (
        torch.device("pjrt", 0), like.dtype, like.shape, like.stride(), 0)
    assert tensor.untyped_storage().nbytes() == like.untyped_storage().nbytes()
    assert torch.pjrt.memory_allocated() == before + like.untyped_storage().nbytes()
    assert torch.equal(tensor.cpu(), torch.zeros_like(like))
    values = torch.randint(-100, 100, like.shape).to(like.dtype)
    tensor.copy_(values.to("pjrt"))
    assert torch.equal(tensor.cpu(), values)


def test_torch_empty_calls_of_another_kind_run_the_python_kernel() -> None:
    """Another memory format, a negative size or bytes past int64 go to the Python kernel: CPU's strides, or
    CPU's error."""
    torch.empty(2, device="pjrt")
    for size in [(2, 3, 4, 5), (1, 8, 1, 3)]:
        made: list[torch.Tensor] = []
        entered = python_calls_of_ours(lambda: made.append(torch.empty(size, device="pjrt",  # noqa: B023
                                                                        memory_format=torch.channels_last)))
        assert any(name.endswith(":empty_memory_format") for name in entered)
        assert made[0].stride() == torch.empty(size, memory_format=torch.channels_last).stride()
    for size in [(2, -3), (2**62, 4)]:
        with pytest.raises(RuntimeError) as on_cpu:
            torch.empty(size, device="meta")
        with pytest.raises(RuntimeError) as on_pjrt:
            torch.empty(size, device="pjrt")
        assert str(on_pjrt.value).split(":")[0] == str(on_cpu.value).split(":")[0]


def test_native_padded_results_keep_their_lengths_live_as_python_does() -> None:
    """A padded result made natively notes its dynamic lengths in dynamic.live_lengths() as note_padded does:
    (bound, ops executed by then, a weak reference to its storage), newest last, with no Python of ours."""
    from torch_pjrt import storage
    from torch_pjrt.eager import dynamic

    host = torch.randn(1, 2, 11, 8)
    torch_pjrt.mark_dynamic(host, 2, max=64)
    cache, new = host.to("pjrt"), torch.randn(1, 2, 1, 8).to("pjrt")
    torch.cat([cache, new], dim=2)  # the miss
    for size in (5, 7):  # other lengths noted after it, so the native note must move 12 to the end
        dynamic.note_length(size, 64, new)
    grown: list[torch.Tensor] = []
    assert python_calls_of_ours(lambda: grown.append(torch.cat([cache, new], dim=2))) == [
        f"{storage.__file__}:holding", f"{storage.__file__}:__init__"]  # (its layout: Padded.holding)
    executed = torch_pjrt.metrics.counters()["ops_executed"]
    live = dynamic.live_lengths()
    assert list(live)[-1] == 12
    bound, seen_at, owner = live[12]
    assert (bound, seen_at, owner()) == (64, executed, storage.storage_of(grown[0]))
    torch.testing.assert_close(grown[0].cpu(), torch.cat([host, new.cpu()], dim=2))
    for size in range(20, 20 + dynamic.live_limit()):  # 12 pushed out, the table full (the limit configure has)
        dynamic.note_length(size, 64, new)
    assert python_calls_of_ours(lambda: grown.append(torch.cat([cache, new], dim=2))) == [
        f"{storage.__file__}:holding", f"{storage.__file__}:__init__"]
    assert list(live)[-1] == 12 and len(live) == dynamic.live_limit() and 20 not in live  # the oldest dropped
    grown.clear()
    assert dynamic.live_bound(12) is None  # (its owner gone)


def workload() -> list[torch.Tensor]:
    """A small training run through many kinds of call: in-place, out=, views, scalars, backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 3)).to("pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    x = torch.randn(20, 12).to("pjrt")
    y = torch.randint(0, 3, (20,)).to("pjrt")
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    extra = torch.empty(20, 3, device="pjrt")
    torch.mul(model(x).detach(), 0.5, out=extra)
    return [*losses, extra, x.t().contiguous()[2:5].exp_(), *[p.detach() for p in model.parameters()]]


@pytest.mark.parametrize("mode", [torch_pjrt.EagerMode.DEFER_NEVER, torch_pjrt.EagerMode.DEFER_AND_FUSE])
def test_native_and_python_paths_give_identical_results(mode: torch_pjrt.EagerMode) -> None:
    module = native.dispatch_module()
    with torch.pjrt.set_eager_mode(mode):
        module.set_dispatch_enabled(False)
        try:
            python = [t.cpu() for t in workload()]
        finally:
            module.set_dispatch_enabled(True)
        workload()  # warm the native cache, then run on hits
        fast = [t.cpu() for t in workload()]
    for expected, got in zip(python, fast, strict=True):
        assert torch.equal(expected, got)


# numbers a program takes as traced inputs (new, then met again: an array) or compiles in (0 and 1)
NUMBERS = [1, 1.0, 0, 0.0, -0.0, True, False, 3, -7, 2.5, -1e-30, 3e38, 2**40 + 1, 1 + 2j]


@pytest.mark.parametrize("native_on", [False, True], ids=["python", "native"])
def test_numbers_give_cpus_results_however_they_reach_the_program(native_on: bool) -> None:
    """Each number three times (passed as itself, made a device array, the array reused), into float,
    int and complex tensors: values, dtypes and the sign of zero as on CPU."""
    module = native.dispatch_module()
    cpu = {torch.float32: torch.randn(5), torch.int64: torch.randint(-9, 9, (5,)),
           torch.complex64: torch.randn(5, dtype=torch.complex64)}
    module.set_dispatch_enabled(native_on)
    try:
        for number in NUMBERS:
            for x in cpu.values():
                if isinstance(number, complex) and not x.is_complex():
                    continue
                for repeat in range(3):
                    if repeat == 1:
                        compiles = torch_pjrt.metrics.counters()["compiles"]
                    for op in (lambda t, n: t * n, lambda t, n: torch.add(t, t, alpha=n), lambda t, n: t - n):
                        try:
                            want = op(x, number)
                        except RuntimeError as refused:  # a float alpha for an int tensor
                            with pytest.raises(RuntimeError, match=re.escape(str(refused))):
                                op(x.to("pjrt"), number)
                            continue
                        got = op(x.to("pjrt"), number).cpu()
                        assert got.dtype == want.dtype
                        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
                        if not want.is_complex():
                            assert torch.equal(torch.signbit(got), torch.signbit(want)), (number, x.dtype)
                # the number as itself, then as a device array: one compiled program
                assert torch_pjrt.metrics.counters()["compiles"] == compiles, (number, x.dtype)
    finally:
        module.set_dispatch_enabled(True)


SCRIPT = textwrap.dedent(
    """
    import hashlib, torch, torch_pjrt
    from torch_pjrt import native
    import tests.test_native_dispatch as t
    print(native.dispatch_module() is not None)
    results = t.workload()
    results = t.workload()
    print(hashlib.sha256(b"".join(r.cpu().numpy().tobytes() for r in results)).hexdigest())
    """
)


def test_environment_switch_turns_the_native_path_off_with_identical_results() -> None:
    outputs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "TORCH_PJRT_NATIVE_DISPATCH": flag}
        run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                             cwd=Path(__file__).parent.parent)
        assert run.returncode == 0, run.stderr
        outputs[flag] = run.stdout.split()
    assert outputs["0"][0] == "False" and outputs["1"][0] == "True"
    assert outputs["0"][1] == outputs["1"][1]


def test_threads_share_the_native_cache() -> None:
    a_cpu, b_cpu = torch.randn(32, 32), torch.randn(32, 32)
    a, b = a_cpu.to("pjrt"), b_cpu.to("pjrt")
    expected = torch.tanh(a_cpu @ b_cpu + 1.5)
    failures: list[str] = []

    def worker() -> None:
        for _ in range(30):
            got = torch.tanh(a @ b + 1.5).cpu()
            if not torch.allclose(got, expected, atol=1e-5):
                failures.append("mismatch")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("mode", [torch_pjrt.EagerMode.DEFER_NEVER, torch_pjrt.EagerMode.DEFER_AND_FUSE])
def test_backward_on_autograds_thread_matches_cpu(mode: torch_pjrt.EagerMode) -> None:
    w_cpu = torch.randn(8, 8, requires_grad=True)
    x_cpu = torch.randn(4, 8)
    ids_cpu = torch.randint(0, 8, (4,))
    w = w_cpu.detach().to("pjrt").requires_grad_()
    x, ids = x_cpu.to("pjrt"), ids_cpu.to("pjrt")
    with torch.pjrt.set_eager_mode(mode):
        for _ in range(3):  # an embedding's backward records a checked op on autograd's thread
            w.grad = None
            (torch.relu(x @ w) * 0.5 + torch.nn.functional.embedding(ids, w)).sum().backward()
        torch.pjrt.synchronize()
    (torch.relu(x_cpu @ w_cpu) * 0.5 + torch.nn.functional.embedding(ids_cpu, w_cpu)).sum().backward()
    assert torch.allclose(w.grad.cpu(), w_cpu.grad, atol=1e-6)


def test_storages_reach_their_device_storage_through_the_data_ptr() -> None:
    """A native result's storage has no Python wrapper until asked; `_pjrt` reads the DataPtr's link,
    which only torch_pjrt's storages have."""
    a, b = pjrt(4, 4), pjrt(4, 4)
    for _ in range(2):
        result = a + b  # the second call is a native hit
    st = result.untyped_storage()._pjrt
    assert st.numel == 16 and st.dtype == torch.float32 and st.device == torch.device("pjrt:0")
    assert st is result.view(16).untyped_storage()._pjrt  # the same link from every view
    torch.testing.assert_close(result.cpu(), a.cpu() + b.cpu())
    cpu_storage = torch.randn(3).untyped_storage()
    with pytest.raises(AttributeError, match="torch_pjrt did not make it"):
        _ = cpu_storage._pjrt
    with pytest.raises(AttributeError, match="only a pjrt storage made by torch_pjrt"):
        cpu_storage._pjrt = st


STORED_OPS = textwrap.dedent(
    """
    import sys
    import torch
    import torch_pjrt
    sys.path.insert(0, sys.argv[2])
    from test_native_dispatch import python_calls_of_ours

    torch.manual_seed(int(sys.argv[1]))
    a_host, b_host, c_host = torch.randn(4, 4), torch.randn(16), torch.randn(4, 4)
    # one native signature, two storage shapes: (4, 4) and a (16,) storage seen as 4x4
    a, b, c = a_host.to("pjrt"), b_host.to("pjrt").view(4, 4), c_host.to("pjrt")
    for _ in range(3):
        for x, host in ((a, a_host), (b, b_host.view(4, 4))):
            assert torch.equal((x * 0.5 + c).cpu(), host * 0.5 + c_host)
    refusals = torch_pjrt.metrics.counters()["stored_op_refusals"]
    entered = python_calls_of_ours(lambda: [x * 0.5 + c for x in (a, b, a, b)])
    counters = torch_pjrt.metrics.counters()
    functions = sorted({name.rsplit(":", 1)[1] for name in entered})
    print(",".join(functions) or "-", counters["stored_op_refusals"] - refusals, counters["cache_misses"],
          counters["op_store_hits"], counters["op_store_writes"])
    """
)


@pytest.mark.parametrize("folder", [True, False])
def test_a_stored_op_picks_its_executable_by_shape_natively(tmp_path: Path, folder: bool) -> None:
    """A strict op's executables (one per storage shape) come from the cache folder where there is one,
    else are compiled for it. Alternating storage shapes, the native path picks the executable by the
    arrays' shapes, dtypes and weak types as StoredOp.load does (an executable refusing them goes through
    jax's slow path: no refusals once both are known), entering no Python of ours; results equal CPU's."""
    seed = random.randrange(1 << 16)
    runs = []
    for _ in ("cold", "warm") if folder else ("no folder",):
        run = subprocess.run([sys.executable, "-c", STORED_OPS, str(seed), str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TORCH_PJRT_CACHE_DIR": str(tmp_path) if folder else "0"})
        assert run.returncode == 0, run.stderr[-3000:]
        words = run.stdout.split()[-5:]
        runs.append([words[0]] + [int(word) for word in words[1:]])
    # functions entered, refusals, misses (mul and add once each), op-store hits, op-store writes:
    # 2 ops x 2 storage shapes
    assert runs == ([["-", 0, 2, 0, 4], ["-", 0, 2, 4, 0]] if folder else [["-", 0, 2, 0, 0]])


def test_an_entry_first_met_while_fusing_makes_its_jit_only_when_strict_eager_runs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature recorded while fusing hands the native path no jax.jit (it would never run one); the
    same signature in strict eager then compiles through Python once and hits natively after, with CPU's
    results."""
    from torch_pjrt.runtime import programs

    made: list[str] = []
    jitted = programs.Program.jitted

    def counted(program: programs.Program) -> object:
        if program._jitted is None:
            made.append(program.name)
        return jitted.fget(program)

    monkeypatch.setattr(programs.Program, "jitted", property(counted))
    a_host, b_host = torch.randn(5, 7), torch.randn(5, 7)
    a, b = a_host.to("pjrt"), b_host.to("pjrt")
    with torch.pjrt.set_eager_mode(torch_pjrt.EagerMode.DEFER_AND_FUSE):
        fused = [torch.atan2(a, b) for _ in range(3)]  # a miss, then native recordings
        torch.pjrt.synchronize()
    assert [name for name in made if not name.startswith("fused")] == []
    strict = [torch.atan2(a, b) for _ in range(2)]  # Python compiles the op's program, then a native hit
    assert python_calls_of_ours(lambda: strict.append(torch.atan2(a, b))) == []
    for result in fused + strict:
        torch.testing.assert_close(result.cpu(), torch.atan2(a_host, b_host))
