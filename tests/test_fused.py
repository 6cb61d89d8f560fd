"""DEFER_AND_FUSE: same results as strict eager, sync points, no steady-state recompiles, errors at the op."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_pjrt
from torch_pjrt.eager import fusion
from torch_pjrt.runtime import client

sys.path.insert(0, os.path.dirname(__file__))

from test_dynamic import one_layer_llama  # noqa: E402
from test_training import random_batches, train_both  # noqa: E402

FUSE = torch.pjrt.EagerMode.DEFER_AND_FUSE


@pytest.fixture
def fused():
    with torch.pjrt.set_eager_mode(FUSE):
        yield


def test_mode_selection() -> None:
    with torch.pjrt.set_eager_mode(FUSE):
        assert torch.pjrt.eager_mode is FUSE
    assert torch.pjrt.eager_mode is torch.pjrt.EagerMode.DEFER_NEVER
    torch.pjrt.eager_mode = FUSE
    assert torch.pjrt.eager_mode is FUSE
    torch.pjrt.eager_mode = torch.pjrt.EagerMode.DEFER_NEVER


@pytest.mark.parametrize("foreach", [False, True])
def test_mlp_adam_matches_cpu(fused: None, foreach: bool) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))
    train_both(model, lambda p: torch.optim.Adam(p, lr=1e-2, foreach=foreach), random_batches((16, 12), 5, 4),
               F.cross_entropy)


def test_cnn_batch_norm_sgd_matches_cpu(fused: None) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    train_both(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), random_batches((4, 3, 8, 8), 4, 3),
               F.cross_entropy)


def test_views_in_place_and_random_match_strict_eager() -> None:
    def work() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(11)
        x = torch.randn(6, 5, device="pjrt")
        y = x.t().clone()
        y[1:3].mul_(3.0)
        x.diagonal().add_(1.0)
        z = torch.rand(4, device="pjrt")
        d = F.dropout(torch.ones(100, device="pjrt"), 0.5)
        return x.cpu(), y.cpu(), z.cpu(), d.cpu()

    strict = work()
    with torch.pjrt.set_eager_mode(FUSE):
        fused_results = work()
    for a, b in zip(strict, fused_results):
        assert torch.equal(a, b)


def test_steady_state_compiles_nothing(fused: None) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to("pjrt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    x, y = torch.randn(8, 8, device="pjrt"), torch.randint(0, 4, (8,), device="pjrt")
    compiles = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss.item()
        compiles.append(torch_pjrt.metrics.counters()["compiles"])
    assert compiles[5] == compiles[2], compiles


def test_a_replayed_graph_is_told_apart_from_one_wired_otherwise(fused: None) -> None:
    """The flush reuses its last program only for the same ops wired the same way: graphs that differ only
    in an operand's order, alternating, each give CPU's results, and each compiles once."""
    torch.manual_seed(4)
    x, w = torch.randn(5, 7), torch.randn(5, 7)

    def forward(a: torch.Tensor, b: torch.Tensor, swapped: bool) -> torch.Tensor:
        t = a * 2.5 + b
        return (a - t) if swapped else (t - a)

    compiles = []
    for _ in range(3):
        for swapped in (False, True, True, False):
            got = forward(x.to("pjrt"), w.to("pjrt"), swapped).cpu()
            torch.testing.assert_close(got, forward(x, w, swapped))
        compiles.append(torch_pjrt.metrics.counters()["compiles"])
    assert compiles[2] == compiles[1] == compiles[0], compiles


def test_a_replayed_graph_is_told_apart_by_which_result_an_op_reads(fused: None) -> None:
    """An op recorded where the last flush had the same op reads another result of a multi-output op, or the
    same input passed a different number of times: each graph gives CPU's results and compiles once."""
    torch.manual_seed(6)
    x, w = torch.randn(6, 9), torch.randn(6, 1)

    def forward(a: torch.Tensor, b: torch.Tensor, variant: int) -> torch.Tensor:
        low, high = torch.aminmax(a, dim=1, keepdim=True)
        picked = (low, high, low)[variant]
        operand = b if variant < 2 else picked
        return (picked * operand).sum(dim=1) + 0.25 * variant

    compiles = []
    for _ in range(3):
        for variant in (0, 1, 1, 2, 0, 2):
            got = forward(x.to("pjrt"), w.to("pjrt"), variant).cpu()
            torch.testing.assert_close(got, forward(x, w, variant))
        compiles.append(torch_pjrt.metrics.counters()["compiles"])
    assert compiles[2] == compiles[1] == compiles[0], compiles


def test_graphs_met_in_turn_are_each_found_again_without_a_lookup(monkeypatch: pytest.MonkeyPatch,
                                                                  fused: None) -> None:
    """A loop that flushes a few graphs in turn (a generate()'s prefill and its decode graph per padded length)
    finds each among the kept replays after its first round: no structure key is built and looked up again
    (~1.3 ms for a 192-op decode graph), and each gives CPU's results."""
    torch.manual_seed(8)
    x = torch.randn(4, 6)
    lookups = []
    traced_numbers = fusion._traced_numbers
    monkeypatch.setattr(fusion, "_traced_numbers", lambda *args, **kwargs: lookups.append(1) or traced_numbers(
        *args, **kwargs))
    forwards = [lambda a: a * 1.5 + 1.0, lambda a: (a - 0.5).exp().sum(dim=1), lambda a: a.t() @ a,
                lambda a: torch.cat([a, a * 2.0]).mean(dim=0)]
    counts = []
    for _ in range(3):
        for forward in forwards:
            torch.testing.assert_close(forward(x.to("pjrt")).cpu(), forward(x))
        counts.append(len(lookups))
    assert counts[0] >= len(forwards) and counts[2] == counts[1] == counts[0], counts


def test_a_number_repeated_in_one_program_is_not_made_a_device_array(monkeypatch: pytest.MonkeyPatch,
                                                                      fused: None) -> None:
    """A traced number becomes a device array when it comes back in a later call, not when one program takes
    it twice (a step-dependent optimizer factor: new every step, used by several ops)."""
    from torch_pjrt.runtime import client

    made = []
    make = client._made_array
    monkeypatch.setattr(client, "_made_array", lambda key, value, index: made.append(value) or make(key, value, index))
    torch.manual_seed(5)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for step in range(1, 4):
        factor, zero = 1.0 - 0.9 ** (step + 0.123), -0.0 if step % 2 else 0.0
        want = (x * factor + y * factor, (x * zero).div(-1.0), x.abs() * zero)
        got = tuple(t.cpu() for t in (x.to("pjrt") * factor + y.to("pjrt") * factor,
                                      (x.to("pjrt") * zero).div(-1.0), x.to("pjrt").abs() * zero))
        for found, expected in zip(got, want):
            torch.testing.assert_close(found, expected)
            assert torch.equal(torch.signbit(found), torch.signbit(expected))  # signed zeros kept apart
        assert factor not in made, (factor, made)


def test_a_replayed_graph_passes_each_number_it_is_given(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    """A replay reuses the device array it last passed at a number's position only for an equal number of the
    same type: values that repeat, change, swap places, or are signed zeros or NaN each give CPU's results;
    a replay whose numbers all equal the last call's looks none of them up again."""
    from torch_pjrt.runtime import client

    torch.manual_seed(7)
    x = torch.randn(5, 4)
    looked_up = []
    lookup = client.traced_number
    monkeypatch.setattr(client, "traced_number", lambda value, index: looked_up.append(value) or lookup(value, index))
    values = [(2.5, 3, 0.5), (2.5, 3, 0.5), (2.5, 3, 0.5), (0.5, 3, 2.5), (0.75, 4, 0.75), (-0.0, 4, 0.0),
              (0.0, 4, -0.0), (float("nan"), 3, 2.5), (2.5, 3, 0.5), (2.5, 3, 0.5)]
    for step, (scale, shift, weight) in enumerate(values):
        looked_up.clear()
        got = ((x.to("pjrt") * scale + shift) * weight).cpu()
        want = (x * scale + shift) * weight
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
        if step in (2, 9):  # (the same numbers as the call before, which passed each as a device array)
            assert looked_up == [], looked_up


def test_a_graphs_floats_are_passed_packed(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    """A graph with PACK_MIN or more traced floats (an optimizer's factors, new every step, and constants) passes
    them packed in one host array, to its one program: results keep CPU's values and dtypes (float32 times a
    packed factor stays float32), signed zeros and NaN, and replays compile nothing."""
    monkeypatch.setattr(fusion, "PACK_MIN", 4)
    torch.manual_seed(11)
    x = torch.randn(6, 5)
    compiles = []
    for step in range(1, 9):
        factors = [1.0 - 0.9 ** (step + k / 3) for k in range(5)]
        if step == 6:
            factors[1], factors[3] = -0.0, float("nan")
        on_device = x.to("pjrt")
        got, want = on_device * 0.25, x * 0.25
        for k, factor in enumerate(factors):
            got, want = got * factor + k, want * factor + k
        got = got.cpu()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
        compiles.append(torch_pjrt.metrics.counters()["fused_compiles"])
    kinds = {dtype: len(positions) for dtype, positions in fusion.graph().replay.packed}
    assert kinds == {np.dtype(np.float64): 6}, kinds  # the five factors and 0.25
    assert compiles[-1] == compiles[0], compiles


def test_a_graphs_ints_are_passed_packed(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    """A graph with PACK_MIN or more traced ints (a decode step's positions and lengths, new every token) passes
    them packed in one int64 host array: int32 plus a packed int stays int32, int64 keeps values near its
    bounds, float32 times an int stays float32, bools are passed one by one, and replays compile nothing."""
    monkeypatch.setattr(fusion, "PACK_MIN", 4)
    torch.manual_seed(12)
    small = torch.randint(-100, 100, (7,), dtype=torch.int32)
    wide = torch.randint(-2**40, 2**40, (7,), dtype=torch.int64)
    scale = torch.randn(7)
    compiles = []
    for step in range(1, 7):
        shifts = [step * 3 + k for k in range(4)]
        near_bound = 2**62 + step * 7919 if step % 2 else -(2**62) - step
        got_small, got_wide, got_scale = small.to("pjrt"), wide.to("pjrt"), scale.to("pjrt")
        want_small, want_wide, want_scale = small, wide, scale
        for shift in shifts:
            got_small, want_small = got_small + shift, want_small + shift
            got_scale, want_scale = got_scale * shift, want_scale * shift
        got_wide, want_wide = got_wide + near_bound, want_wide + near_bound
        got_flag, want_flag = got_small.masked_fill(got_small > 0, step % 2 == 0), \
            want_small.masked_fill(want_small > 0, step % 2 == 0)
        results = [got_small.cpu(), got_wide.cpu(), got_scale.cpu(), got_flag.cpu()]
        for got, want in zip(results, (want_small, want_wide, want_scale, want_flag)):
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
        compiles.append(torch_pjrt.metrics.counters()["fused_compiles"])
    kinds = {dtype: len(positions) for dtype, positions in fusion.graph().replay.packed}
    assert kinds.get(np.dtype(np.int64), 0) >= 9, kinds  # the shifts twice and the bound
    assert compiles[-1] == compiles[0], compiles


def test_a_jax_without_weak_scalars_passes_numbers_one_by_one(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    """Where jax's private conversion to a weakly typed scalar is missing (client.weak_scalar_maker() is None),
    a graph with PACK_MIN or more floats and ints packs none of them and passes each as before: CPU's values and
    dtypes (float32 times a float stays float32, int32 plus an int stays int32); a graph of the same ops met
    with packing on is another program, not the packed one called with unpacked arguments."""
    monkeypatch.setattr(fusion, "PACK_MIN", 3)
    torch.manual_seed(13)
    x = torch.randn(5, 3)
    n = torch.randint(-50, 50, (5, 3), dtype=torch.int32)

    def step(k: int) -> None:
        got, want = x.to("pjrt"), x
        got_n, want_n = n.to("pjrt"), n
        for j in range(4):
            factor = 0.5 + 0.1 * (k + j)
            got, want = got * factor, want * factor
            got_n, want_n = got_n + (k + j), want_n + (k + j)
        got, got_n = got.cpu(), got_n.cpu()
        assert got.dtype == torch.float32 and got_n.dtype == torch.int32
        torch.testing.assert_close(got, want)
        assert torch.equal(got_n, want_n)

    for k in (1, 2):
        step(k)
        assert fusion.graph().replay.packed, "packing on: the floats and ints are packed"
    monkeypatch.setattr(client, "weak_scalar_maker", lambda: None)
    fusion.graph().replays.clear()  # (kept for a jax whose capability never changes within a process)
    for k in (1, 2, 3):
        step(k)
        assert fusion.graph().replay.packed == (), fusion.graph().replay.packed


def test_sync_points_flush(fused: None) -> None:
    x = torch.randn(4, device="pjrt")
    checks = {
        "cpu": lambda t: t.cpu(),
        "item": lambda t: t.sum().item(),
        "tolist": lambda t: t.tolist(),
        "repr": lambda t: repr(t),
        "bool": lambda t: bool((t > -100).all()),
        "synchronize": lambda t: torch.pjrt.synchronize(),
        "save": lambda t: torch.save(t, io.BytesIO()),
        "data-dependent op": lambda t: torch.nonzero(t > 0),
    }
    for name, check in checks.items():
        y = x * 2 + 1
        assert fusion.graph().nodes, name
        check(y)
        assert not fusion.graph().nodes, f"{name} did not flush"
    assert fusion.report()["fused_programs"] > 0


def test_size_cap_flushes(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    monkeypatch.setattr(fusion, "MAX_NODES", 50)
    before = fusion.flush_reasons["size cap"]
    x = torch.ones(3, device="pjrt")
    for _ in range(1000):
        x = x * 1.0 + 1.0
    assert fusion.flush_reasons["size cap"] >= before + 20
    assert len(fusion.graph().nodes) < 50
    assert torch.equal(x.cpu(), torch.full((3,), 1001.0))


def test_memory_stays_bounded_without_sync(monkeypatch: pytest.MonkeyPatch, fused: None) -> None:
    """1,000 small ops without a sync: only live tensors hold memory; the pending graph is capped."""
    monkeypatch.setattr(fusion, "MAX_NODES", 200)
    x = torch.ones(1000, device="pjrt")
    start = torch.pjrt.memory_allocated()
    for _ in range(500):
        x = x * 1.0 + 1.0
        assert len(fusion.graph().nodes) < 200
    assert torch.pjrt.memory_allocated() <= start + 4 * 4000
    assert x[0].item() == 501.0


def test_in_place_updates_donate_buffers_nothing_else_holds(fused: None) -> None:
    """A parameter updated in place gives its old buffer to the program; a buffer a tensor still reads is kept."""
    weight, gradient = torch.randn(64), torch.randn(64)
    pjrt_weight, pjrt_gradient = weight.to("pjrt"), gradient.to("pjrt")
    before = torch_pjrt.metrics.counters()["fused_donated_buffers"]
    for _ in range(3):
        pjrt_weight.mul_(0.9).add_(pjrt_gradient, alpha=-0.1)
        weight.mul_(0.9).add_(gradient, alpha=-0.1)
        snapshot = pjrt_weight.clone()
        torch.pjrt.synchronize()
    assert torch_pjrt.metrics.counters()["fused_donated_buffers"] >= before + 2
    torch.testing.assert_close(pjrt_weight.cpu(), weight)
    torch.testing.assert_close(pjrt_gradient.cpu(), gradient)
    torch.testing.assert_close(snapshot.cpu(), weight)


def test_a_donated_buffer_holds_the_value_written_over_it(fused: None) -> None:
    """Each in-place update ends in the buffer it was given (the step's program copies none), also where a value
    of the same shape is kept that was recorded before it (a gradient before its parameter's update) and the
    updates come in another order than their inputs were first read. (The first step's inputs are the host's
    own memory, which XLA does not reuse.)"""
    from torch_pjrt import storage

    def buffers() -> list[int]:
        return [fusion.concrete(storage.storage_of(t).array).unsafe_buffer_pointer() for t in (pjrt_first, pjrt_second)]

    first, second = torch.randn(32, 16), torch.randn(32, 16)
    pjrt_first, pjrt_second = first.to("pjrt"), second.to("pjrt")
    for step in range(4):
        given = buffers()
        pjrt_gradient = pjrt_first * pjrt_second  # kept: an output of the same shape, recorded first
        gradient = first * second
        pjrt_second.mul_(0.5).add_(pjrt_gradient, alpha=-0.1)
        pjrt_first.sub_(pjrt_gradient, alpha=0.2)
        second.mul_(0.5).add_(gradient, alpha=-0.1)
        first.sub_(gradient, alpha=0.2)
        torch.pjrt.synchronize()
        if step:
            assert buffers() == given
    torch.testing.assert_close(pjrt_gradient.cpu(), gradient)
    torch.testing.assert_close(pjrt_first.cpu(), first)
    torch.testing.assert_close(pjrt_second.cpu(), second)


def test_errors_raise_at_the_op(fused: None) -> None:
    x = torch.randn(3, device="pjrt")
    with pytest.raises(RuntimeError, match="broadcast"):
        x + torch.randn(4, device="pjrt")
    assert not fusion.graph().nodes or all(entry is not None for entry, _ in fusion.graph().nodes)
    with pytest.raises(IndexError):
        x.index_select(5, torch.tensor([0], device="pjrt"))


def test_cpu_fallback_runs_outside_the_graph(fused: None) -> None:
    library = torch.library.Library("pjrt_test_fused", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CPU")
    x = torch.arange(4.0, device="pjrt") + 1
    with torch_pjrt.cpu_fallback():
        with pytest.warns(UserWarning):
            result = torch.ops.pjrt_test_fused.twice(x)
    assert torch.equal(result.cpu(), torch.arange(4.0) * 2 + 2)


def _attention_inputs(device: str, dtype: torch.dtype, heads: int, kv_heads: int, q_len: int, k_len: int,
                      mask: str) -> tuple[torch.Tensor, ...]:
    """Random q, k, v (leaves that require grad) and a mask: None, float (added) or bool (one query row
    fully masked, which the math route gives zeros for)."""
    generator = torch.Generator().manual_seed(heads * 100 + q_len * 10 + k_len)
    shapes = ((2, heads, q_len, 8), (2, kv_heads, k_len, 8), (2, kv_heads, k_len, 6))
    q, k, v = (torch.randn(shape, generator=generator).to(dtype) for shape in shapes)
    if mask == "float":
        attn_mask = torch.randn(2, 1, q_len, k_len, generator=generator).to(dtype)
    elif mask == "bool":
        attn_mask = torch.rand(q_len, k_len, generator=generator) > 0.3
        attn_mask[0] = False
    else:
        attn_mask = None
    tensors = [t.to(device).requires_grad_() for t in (q, k, v)]
    if attn_mask is not None:
        attn_mask = attn_mask.to(device)
        if attn_mask.is_floating_point():
            attn_mask.requires_grad_()
    return (*tensors, attn_mask)


@pytest.mark.parametrize("mode", [torch.pjrt.EagerMode.DEFER_NEVER, FUSE])
@pytest.mark.parametrize(("heads", "kv_heads", "q_len", "k_len", "mask", "causal", "scale"), [
    (4, 4, 5, 5, "none", False, None),
    (4, 4, 5, 5, "none", True, 0.3),
    (4, 2, 3, 7, "none", True, None),  # causal, fewer queries than keys: the mask's top-left alignment
    (4, 2, 1, 7, "none", False, None),
    (4, 2, 6, 6, "float", False, -0.5),
    (2, 2, 4, 7, "bool", False, None),
    (4, 1, 3, 3, "bool", False, 0.2),
])
def test_sdpa_is_one_op_and_matches_cpu_math(mode: torch.pjrt.EagerMode, heads: int, kv_heads: int, q_len: int,
                                            k_len: int, mask: str, causal: bool, scale: float | None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_pjrt.runtime import metrics

    dtype = torch.float32
    gqa = heads != kv_heads
    cpu = _attention_inputs("cpu", dtype, heads, kv_heads, q_len, k_len, mask)
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*cpu[:3], attn_mask=cpu[3], is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    want.backward(grad)
    with torch.pjrt.set_eager_mode(mode):
        pjrt = _attention_inputs("pjrt", dtype, heads, kv_heads, q_len, k_len, mask)
        before = dict(metrics.op_counts)
        got = F.scaled_dot_product_attention(*pjrt[:3], attn_mask=pjrt[3], is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
        got.backward(grad.to("pjrt"))
        counted = {name: n - before.get(name, 0) for name, n in metrics.op_counts.items() if n != before.get(name, 0)}
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(pjrt, cpu):
            if theirs is not None and theirs.requires_grad:
                torch.testing.assert_close(mine.grad.cpu(), theirs.grad, rtol=1e-5, atol=1e-5)
    assert counted.get("torch_pjrt.fused_attention.default") == 1
    assert counted.get("torch_pjrt.fused_attention_backward.default") == 1
    assert "aten.bmm.default" not in counted and "aten._safe_softmax.default" not in counted


def test_sdpa_kernel_math_keeps_pjrt_attention_on_the_math_route() -> None:
    """torch.nn.attention.sdpa_kernel turning the overrideable route off is honoured: the math ops run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_pjrt.runtime import metrics

    cpu = _attention_inputs("cpu", torch.float32, 4, 2, 5, 5, "none")[:3]
    want = F.scaled_dot_product_attention(*cpu, is_causal=True, enable_gqa=True)
    with torch.pjrt.set_eager_mode(FUSE), sdpa_kernel(SDPBackend.MATH):
        pjrt = _attention_inputs("pjrt", torch.float32, 4, 2, 5, 5, "none")[:3]
        before = dict(metrics.op_counts)
        got = F.scaled_dot_product_attention(*pjrt, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    counted = {name for name, n in metrics.op_counts.items() if n != before.get(name, 0)}
    assert "torch_pjrt.fused_attention.default" not in counted and "aten.bmm.default" in counted


@pytest.mark.parametrize("mode", [torch.pjrt.EagerMode.DEFER_NEVER, FUSE])
def test_the_overrideable_attention_op_called_causal_matches_cpu_math(mode: torch.pjrt.EagerMode) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cpu = _attention_inputs("cpu", torch.float32, 4, 4, 6, 9, "none")[:3]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*cpu, is_causal=True, scale=0.4)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(6))
    want.backward(grad)
    with torch.pjrt.set_eager_mode(mode):
        pjrt = _attention_inputs("pjrt", torch.float32, 4, 4, 6, 9, "none")[:3]
        got = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(*pjrt, None, 0.0, True, scale=0.4)[0]
        got.backward(grad.to("pjrt"))
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(pjrt, cpu):
            torch.testing.assert_close(mine.grad.cpu(), theirs.grad, rtol=1e-5, atol=1e-5)


def test_sdpa_half_inputs_and_dropout_take_the_math_route_values(fused: None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, attn_mask = _attention_inputs("cpu", torch.bfloat16, 4, 2, 5, 5, "bool")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        got = F.scaled_dot_product_attention(q.to("pjrt"), k.to("pjrt"), v.to("pjrt"), attn_mask=attn_mask.to("pjrt"),
                                             enable_gqa=True)
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2)
        # dropout needs the math route's random mask: all kept at p=0 equals the fused op, p=1 drops everything
        dropped = F.scaled_dot_product_attention(q.to("pjrt"), k.to("pjrt"), v.to("pjrt"), dropout_p=1.0,
                                                 enable_gqa=True)
        assert torch.equal(dropped.cpu(), torch.zeros_like(want))


class TokenStream:
    """A generate() streamer that keeps what it is given (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.put_ids: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.put_ids.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.put_ids.append([])


@pytest.mark.parametrize("mode", [torch.pjrt.EagerMode.DEFER_NEVER, FUSE], ids=["strict", "fused"])
@pytest.mark.parametrize("stops_at", ["eos", "max_new_tokens"])
def test_generate_reads_its_stop_check_a_token_late_and_gives_cpus_tokens(mode: torch.pjrt.EagerMode,
                                                                          stops_at: str) -> None:
    """generate() on pjrt reads whether to stop one token late (integrations.LateStopCheck): the token decoded
    after an end-of-sequence stop is undone, so tokens and streamed tokens equal CPU's whether it stops at an eos
    token or at max_new_tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(11)
    _, cpu, dev = one_layer_llama(transformers)
    ids = torch.randint(1, 64, (1, 9))
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        free_run = cpu.generate(ids, eos_token_id=None, **options)[0, 9:].tolist()
        # an eos token the greedy run meets halfway (its first appearance there), else none
        eos = free_run[5] if stops_at == "eos" else None
        stream = {"cpu": TokenStream(), "pjrt": TokenStream()}
        want = cpu.generate(ids, eos_token_id=eos, streamer=stream["cpu"], **options)
        late_reads = fusion.flush_reasons["stop check"]
        with torch.pjrt.set_eager_mode(mode):
            got = dev.generate(ids.to("pjrt"), eos_token_id=eos, streamer=stream["pjrt"],
                               **{**options, "attention_mask": options["attention_mask"].to("pjrt")})
            got = got.cpu()
    assert torch.equal(got, want)
    assert stream["pjrt"].put_ids == stream["cpu"].put_ids
    if stops_at == "eos":
        assert want.shape[1] == 9 + free_run.index(eos) + 1 < 9 + 12
    if mode is FUSE:
        assert fusion.flush_reasons["stop check"] - late_reads == got.shape[1] - 9 + (stops_at == "eos")


def test_numbers_of_ops_on_padded_tensors_are_traced_not_baked_in(fused: None) -> None:
    """An op on a tensor padded for a marked length, or a factory of that length, with a traced number (a fill
    value, masked_fill's value, add.Scalar's other): each call's own value, not the first call's, where the
    calls share one padded program (the old padded form held the first value as a constant)."""
    torch.manual_seed(21)
    calls = {
        "masked_fill": lambda t, v: t.masked_fill(t > 0, v),
        "full_like": lambda t, v: torch.full_like(t, v),
        "add.Scalar": lambda t, v: torch.ops.aten.add.Scalar(t, v),
        "full": lambda t, v: torch.full((3, t.shape[1]), v, device=t.device) * t[:1],
    }
    for length, value in ((29, 2.5), (29, -3.25), (27, 0.75)):
        host = torch.randn(3, length)
        torch_pjrt.mark_dynamic(host, 1, max=128)
        padded = host.to("pjrt")
        for name, call in calls.items():
            got = call(padded, value)
            assert torch_pjrt.get_dynamism_info(got)["dims"][1]["bucket"] == 32, name
            torch.testing.assert_close(got.cpu(), call(host, value), msg=f"{name} {length} {value}")
        del padded
