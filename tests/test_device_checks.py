"""Device-side checks: where CPU raises on a bad index or value, pjrt raises too.

Deferred (CUDA's contract): the op returns, and the first failed check is raised as a RuntimeError
naming the op and the user's line where the host next waits; under launch blocking the op itself
raises CPU's exception with CPU's message. Valid inputs still give CPU's values.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt
from tests.support import assert_same, to_device
from torch_pjrt.runtime import checks

BLOCKING = torch_pjrt.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
FUSE = torch_pjrt.EagerMode.DEFER_AND_FUSE
HERE = __file__.rsplit("/", 1)[-1]


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def table(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) + 2.0  # random, never zeros


def divisors(n: int) -> torch.Tensor:
    """Random nonzero integers."""
    return torch.randint(1, 9, (n,)) * (torch.randint(0, 2, (n,)) * 2 - 1)


# name -> (fn, bad arguments, good arguments); CPU raises on the bad ones
CASES: dict[str, tuple[Callable[..., Any], Callable[[], tuple], Callable[[], tuple]]] = {
    "index": (lambda x, i: x[i], lambda: (table(5), ids(7)), lambda: (table(5), ids(4, -5, 1))),
    "index_2d": (lambda x, i, j: x[i, j], lambda: (table(3, 4), ids(1), ids(4)),
                 lambda: (table(3, 4), ids(2), ids(-1))),
    "index_put": (lambda x, i, v: x.index_put((i,), v), lambda: (table(5), ids(-6), table(1)),
                  lambda: (table(5), ids(3, -1), table(2))),
    "index_put_accumulate": (lambda x, i, v: x.index_put((i,), v, accumulate=True),
                             lambda: (table(5), ids(5), table(1)),
                             lambda: (table(5), ids(3, 3), table(2))),
    "setitem": (lambda x, i, v: x.clone().__setitem__(i, v), lambda: (table(5), ids(9), table(1)),
                lambda: (table(5), ids(0), table(1))),
    "embedding": (F.embedding, lambda: (ids(1, 7), table(5, 3)), lambda: (ids(1, 4, 0), table(5, 3))),
    "embedding_negative": (F.embedding, lambda: (ids(-1), table(5, 3)), lambda: (ids(2), table(5, 3))),
    "embedding_bag": (F.embedding_bag, lambda: (ids(1, 7), table(5, 3), ids(0)),
                      lambda: (ids(1, 4, 2), table(5, 3), ids(0, 2))),
    "embedding_bag_offsets": (F.embedding_bag, lambda: (ids(1, 4, 2), table(5, 3), ids(1, 2)),
                              lambda: (ids(1, 4, 2), table(5, 3), ids(0, 1))),
    "gather": (lambda x, i: x.gather(1, i), lambda: (table(3, 4), torch.tensor([[0], [4], [1]])),
               lambda: (table(3, 4), torch.tensor([[0], [3], [1]]))),
    "scatter": (lambda x, i, s: x.scatter(0, i, s), lambda: (table(5), ids(-1), table(1)),
                lambda: (table(5), ids(2, 4), table(2))),
    "scatter_add": (lambda x, i, s: x.scatter_add(0, i, s), lambda: (table(5), ids(5), table(1)),
                    lambda: (table(5), ids(2, 2), table(2))),
    "scatter_reduce": (lambda x, i, s: x.scatter_reduce(0, i, s, "amax"), lambda: (table(5), ids(8), table(1)),
                       lambda: (table(5), ids(1, 3), table(2))),
    "index_select": (lambda x, i: x.index_select(0, i), lambda: (table(5, 2), ids(5)),
                     lambda: (table(5, 2), ids(4, 0))),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), lambda: (table(5), ids(7), table(1)),
                  lambda: (table(5), ids(1, 1), table(2))),
    "index_copy": (lambda x, i, s: x.index_copy(0, i, s), lambda: (table(5), ids(-1), table(1)),
                   lambda: (table(5), ids(3), table(1))),
    "index_fill": (lambda x, i: x.index_fill(0, i, 3.0), lambda: (table(5), ids(-6)), lambda: (table(5), ids(-1, 2))),
    "take": (torch.take, lambda: (table(2, 3), ids(6)), lambda: (table(2, 3), ids(5, -6))),
    "put": (lambda x, i, s: x.put(i, s), lambda: (table(5), ids(5), table(1)), lambda: (table(5), ids(-5), table(1))),
    "cross_entropy": (F.cross_entropy, lambda: (table(4, 3), ids(0, 3, 1, 2)), lambda: (table(4, 3), ids(0, 2, 1, 2))),
    "cross_entropy_negative": (F.cross_entropy, lambda: (table(2, 3), ids(0, -1)), lambda: (table(2, 3), ids(0, -100))),
    "nll_loss_2d": (lambda x, t: F.nll_loss(x, t, reduction="none"),
                    lambda: (table(2, 3, 2, 2), torch.full((2, 2, 2), 3)),
                    lambda: (table(2, 3, 2, 2), torch.randint(0, 3, (2, 2, 2)))),
    "one_hot": (lambda t: F.one_hot(t, 3), lambda: (ids(0, 3),), lambda: (ids(0, 2, 1),)),
    "one_hot_negative": (lambda t: F.one_hot(t, 3), lambda: (ids(-1),), lambda: (ids(2),)),
    "multinomial": (lambda p: torch.multinomial(p, 1) * 0, lambda: (torch.tensor([0.5, -0.1]),),
                    lambda: (torch.rand(4) + 0.1,)),
    "multinomial_zero_sum": (lambda p: torch.multinomial(p, 1) * 0, lambda: (torch.zeros(2),),
                             lambda: (torch.rand(3) + 0.1,)),
    "binary_cross_entropy": (F.binary_cross_entropy, lambda: (torch.rand(3) * 0.8 + 0.1, torch.tensor([0.0, 1.0, 1.5])),
                             lambda: (torch.rand(3) * 0.8 + 0.1, torch.rand(3))),
    "binary_cross_entropy_input": (F.binary_cross_entropy, lambda: (torch.tensor([0.5, 1.5]), torch.rand(2)),
                                   lambda: (torch.rand(2) * 0.8 + 0.1, torch.rand(2))),
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s),
                       lambda: (table(2, 3), torch.tensor([True, False, True]), table(3)),
                       lambda: (table(2, 3), torch.tensor([True, False, True]), table(5))),
    "bernoulli": (lambda p: torch.bernoulli(p) * 0, lambda: (torch.tensor([1.5]),), lambda: (torch.rand(3),)),
    "floor_divide_by_zero": (torch.floor_divide, lambda: (divisors(4), divisors(4).index_fill(0, ids(2), 0)),
                             lambda: (divisors(4), divisors(4))),
    "remainder_by_zero": (lambda a, b: a % b, lambda: (divisors(3), 0), lambda: (divisors(3), 3)),
    "fmod_by_zero": (torch.fmod, lambda: (divisors(3), divisors(3) * 0), lambda: (divisors(3), divisors(3))),
    "div_trunc_by_zero": (lambda a, b: torch.div(a, b, rounding_mode="trunc"),
                          lambda: (divisors(2), divisors(2).index_fill(0, ids(0), 0)),
                          lambda: (divisors(2), divisors(2))),
}
# these sync anyway (their result's size depends on the values): CPU's exception at the op
AT_THE_OP = {
    "bincount": (torch.bincount, lambda: (ids(-1, 2),), lambda: (ids(1, 2, 2),)),
    "repeat_interleave": (torch.repeat_interleave, lambda: (ids(1, -1),), lambda: (ids(1, 2),)),
    "repeat_interleave_values": (torch.repeat_interleave, lambda: (table(2), ids(1, -1)),
                                 lambda: (table(2), ids(2, 1))),
    "one_hot_inferred": (F.one_hot, lambda: (ids(-1, 2),), lambda: (ids(0, 2),)),
}


def cpu_error(fn: Callable[..., Any], args: tuple) -> BaseException:
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught.value


def check_values(fn: Callable[..., Any], args: tuple, on_device: Callable[..., Any] | None = None) -> None:
    expected = fn(*args)
    assert_same((on_device or fn)(*to_device(args)), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_failed_check_is_raised_where_the_host_waits(name: str) -> None:
    fn, bad, good = CASES[name]
    args = bad()
    error = cpu_error(fn, args)
    result = fn(*to_device(args))  # no wait: nothing raised yet
    with pytest.raises(RuntimeError) as caught:
        torch.pjrt.synchronize()
    message = str(caught.value)
    assert type(caught.value) is checks.DeviceCheckError
    assert str(error).splitlines()[0] in message, message
    assert f"{type(error).__name__} on CPU" in message
    assert re.search(rf"{HERE}:\d+", message), message
    del result
    torch.pjrt.synchronize()  # raised once: the device stays usable
    check_values(fn, good())


@pytest.mark.parametrize("name", sorted(CASES) + sorted(AT_THE_OP))
def test_launch_blocking_raises_cpus_exception_at_the_op(name: str) -> None:
    fn, bad, good = CASES.get(name) or AT_THE_OP[name]
    args = bad()
    error = cpu_error(fn, args)
    with torch.pjrt.set_eager_mode(BLOCKING):
        with pytest.raises(type(error)) as caught:
            fn(*to_device(args))
        assert str(caught.value) == str(error)
        check_values(fn, good())


@pytest.mark.parametrize("name", sorted(AT_THE_OP))
def test_ops_that_sync_anyway_raise_cpus_exception_at_once(name: str) -> None:
    fn, bad, good = AT_THE_OP[name]
    args = bad()
    error = cpu_error(fn, args)
    with pytest.raises(type(error), match=re.escape(str(error))):
        fn(*to_device(args))
    check_values(fn, good())


def test_reading_a_result_raises_and_names_the_op_and_line() -> None:
    x = torch.arange(5.0, device="pjrt")
    picked = x[torch.tensor([7], device="pjrt")]
    with pytest.raises(RuntimeError, match=rf"aten::index: index 7 is out of bounds .*{HERE}:\d+: picked = x\["):
        picked.cpu()
    assert x[torch.tensor([4], device="pjrt")].item() == 4.0


def test_item_and_printing_raise() -> None:
    weight = torch.randn(5, 3, device="pjrt")
    loss = F.embedding(torch.tensor([9], device="pjrt"), weight).sum()
    with pytest.raises(RuntimeError, match="aten::embedding: index out of range in self"):
        loss.item()
    loss = F.cross_entropy(torch.randn(2, 3, device="pjrt"), torch.tensor([0, 5], device="pjrt"))
    with pytest.raises(RuntimeError, match="Target 5 is out of bounds"):
        print(loss)


def test_an_event_wait_raises_a_finished_ops_failure() -> None:
    gathered = torch.randn(4, device="pjrt").gather(0, torch.tensor([4], device="pjrt"))
    event = torch.pjrt.Event()
    event.record()
    with pytest.raises(RuntimeError, match="aten::gather"):
        event.synchronize()
    del gathered


def test_the_first_failure_is_raised_and_the_rest_cleared() -> None:
    x = torch.randn(5, device="pjrt")
    bad_first = x[torch.tensor([6], device="pjrt")]
    bad_second = x.take(torch.tensor([8], device="pjrt"))
    with pytest.raises(RuntimeError, match="index 6 is out of bounds"):
        torch.pjrt.synchronize()
    torch.pjrt.synchronize()
    del bad_first, bad_second


def test_pending_codes_stay_bounded_without_a_host_wait() -> None:
    x = torch.randn(5, device="pjrt")
    index = torch.tensor([1], device="pjrt")
    for _ in range(3 * checks.MAX_PENDING):
        x[index]
    assert len(checks._pending) < checks.MAX_PENDING
    bad = torch.tensor([5], device="pjrt")
    with pytest.raises(RuntimeError, match="index 5 is out of bounds"):
        for _ in range(checks.MAX_PENDING):
            x[bad]  # raised once the oldest codes are read, still without a wait on the newest
    checks.clear()


def test_backward_ops_check_their_indices() -> None:
    logits = torch.randn(3, 4, device="pjrt", requires_grad=True)
    target = torch.tensor([1, 4, 0], device="pjrt")
    with torch_pjrt.set_eager_mode(BLOCKING), pytest.raises(IndexError, match="Target 4 is out of bounds"):
        torch.ops.aten.nll_loss_backward(torch.tensor(1.0, device="pjrt"), logits.detach(), target, None, 1, -100,
                                         torch.tensor(3.0, device="pjrt"))
    grad = torch.randn(1, device="pjrt")
    with torch_pjrt.set_eager_mode(BLOCKING), pytest.raises(IndexError, match="index out of range in self"):
        torch.ops.aten.index_select_backward(grad, [5], 0, torch.tensor([7], device="pjrt"))
    # valid: gradients equal CPU's
    weight = table(5, 3)
    tokens = ids(1, 4, 4, 0)

    def grads(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        w = w.clone().requires_grad_()
        (F.embedding(t, w).square().sum() + w.gather(0, t[:, None].expand(4, 3)).sum()).backward()
        return w.grad

    assert_same(grads(*to_device((weight, tokens))), grads(weight, tokens))


def test_fused_mode_raises_at_the_flush_and_names_the_line() -> None:
    weight = table(5, 3)
    with torch.pjrt.set_eager_mode(FUSE):
        w = weight.to("pjrt")
        y = F.embedding(torch.tensor([1, 7], device="pjrt"), w) * 2
        total = (y.sum() + w.sum()).relu()
        with pytest.raises(RuntimeError, match=rf"aten::embedding: .*{HERE}:\d+: y = F.embedding"):
            total.item()
        good = F.embedding(torch.tensor([1, 4], device="pjrt"), w) * 2
        assert_same(good, F.embedding(ids(1, 4), weight) * 2)


@pytest.mark.parametrize("name", ["index", "embedding", "gather", "cross_entropy", "one_hot", "index_put"])
def test_fused_mode_checks_every_op(name: str) -> None:
    fn, bad, good = CASES[name]
    with torch.pjrt.set_eager_mode(FUSE):
        result = fn(*to_device(bad()))
        with pytest.raises(RuntimeError, match=re.escape(str(cpu_error(fn, bad())).splitlines()[0])):
            result.cpu()
        check_values(fn, good())


@pytest.mark.parametrize("name", ["index", "embedding", "gather", "cross_entropy", "one_hot", "index_put", "take"])
def test_compiled_graphs_check_with_the_line_recorded_at_trace_time(name: str) -> None:
    fn, bad, good = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a), backend="pjrt", fullgraph=True, dynamic=False)
    check_values(fn, good(), compiled)
    result = compiled(*to_device(bad()))
    with pytest.raises(RuntimeError, match=re.escape(str(cpu_error(fn, bad())).splitlines()[0])) as caught:
        result.cpu()
    assert HERE in str(caught.value)
    check_values(fn, good(), compiled)
    with torch.pjrt.set_eager_mode(BLOCKING), pytest.raises(type(cpu_error(fn, bad()))):
        compiled(*to_device(bad()))


def test_padded_dynamic_tensors_check_only_their_true_elements() -> None:
    weight = table(7, 3)
    good = torch.randint(0, 7, (2, 37))
    host = good.clone()
    torch_pjrt.mark_dynamic(host, 1, max=128)
    tokens = host.to("pjrt")
    assert_same(F.embedding(tokens, weight.to("pjrt")), F.embedding(good, weight))
    torch.pjrt.synchronize()  # padding is never read as an index
    bad = good.clone()
    bad[1, 30] = 7
    host = bad.clone()
    torch_pjrt.mark_dynamic(host, 1, max=128)
    F.embedding(host.to("pjrt"), weight.to("pjrt"))
    with pytest.raises(RuntimeError, match="index out of range in self"):
        torch.pjrt.synchronize()


def test_checks_off_clamps_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "ENABLED", False)
    x = torch.arange(11.0, device="pjrt")  # shapes of their own: programs traced with checks off
    assert x[torch.tensor([13], device="pjrt")].item() == 10.0
    F.embedding(torch.tensor([20], device="pjrt"), torch.randn(11, 2, device="pjrt")).cpu()
    torch.pjrt.synchronize()
    assert not checks._pending


def test_the_first_of_several_checks_in_one_program_wins() -> None:
    bad_input, bad_target = torch.tensor([0.5, 1.5]), torch.tensor([2.0, 0.5])
    error = cpu_error(F.binary_cross_entropy, (bad_input, bad_target))
    F.binary_cross_entropy(bad_input.to("pjrt"), bad_target.to("pjrt"))
    with pytest.raises(RuntimeError, match=re.escape(str(error))):
        torch.pjrt.synchronize()
    with torch.pjrt.set_eager_mode(FUSE):
        x = torch.randn(5, device="pjrt")
        total = x.take(torch.tensor([1, 9], device="pjrt")).sum() + x[torch.tensor([6], device="pjrt")].sum()
        with pytest.raises(RuntimeError, match=r"aten::take: .*index 9 on a tensor of 5 elements"):
            total.item()


def test_a_fused_flush_raises_a_finished_programs_failure() -> None:
    from torch_pjrt.eager import fusion

    with torch.pjrt.set_eager_mode(FUSE):
        x = torch.randn(5, device="pjrt")
        picked = x[torch.tensor([8], device="pjrt")] + 1
        fusion.flush("test")  # the size cap, say: no wait
        checks._pending[-1].code.block_until_ready()  # the program has finished by the next flush
        later = x * 2
        with pytest.raises(RuntimeError, match="index 8 is out of bounds"):
            fusion.flush("test")
        del picked, later
