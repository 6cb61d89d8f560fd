"""Sorting and selection on pjrt against CPU (values, indices, NaN order, ties)."""

from __future__ import annotations

import pytest
import torch
from support import check

NAN = {"equal_nan": True}


def _distinct(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values without ties (so indices are unique) and without zeros."""
    n = torch.Size(shape).numel()
    signs = torch.where(torch.rand(n) > 0.5, 1.0, -1.0)
    return ((torch.randperm(n) + 1).float() / n * signs).reshape(shape).to(dtype)


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaNs, signed zeros and infinities where PyTorch's order is subtle."""
    x = x.clone()
    flat = x.view(-1)
    flat[1], flat[4], flat[7], flat[9] = float("nan"), -0.0, 0.0, float("inf")
    flat[-2], flat[-1] = float("nan"), -float("inf")
    return x


def _grads(fn, x):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device)
    (out * weight).sum().backward()
    return x.grad


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sort_floats_with_nan_and_signed_zero(descending, dtype):
    x = _with_specials(torch.randn(5, 6)).to(dtype)
    check(lambda x: torch.sort(x, dim=1, descending=descending, stable=True), x, **NAN)
    check(lambda x: torch.sort(x, dim=0, descending=descending, stable=True), x, **NAN)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_sort_integers_stable_ties(descending, dtype):
    x = torch.randint(0, 3, (4, 9)).to(dtype)
    check(lambda x: torch.sort(x, descending=descending, stable=True), x)
    check(lambda x: torch.argsort(x, dim=0, descending=descending, stable=True), x)


def test_sort_non_contiguous_and_scalar():
    x = _distinct(6, 5)
    check(lambda x: torch.sort(x.t()[:, ::2]), x)
    check(lambda x: torch.msort(x), x)
    check(lambda x: torch.sort(x[0, 0]), x)


def test_sort_out():
    x = _distinct(6, 5)

    def with_out(x):
        values = torch.empty(6, 5, device=x.device)
        indices = torch.empty(6, 5, dtype=torch.long, device=x.device)
        torch.sort(x, 0, out=(values, indices))
        return values, indices

    check(with_out, x)


def _check_topk_with_signed_zero_ties(x: torch.Tensor, k: int) -> None:
    """topk's values equal CPU's (NaN first); its indices point at those values. Between -0.0 and 0.0, which
    compare equal, CPU's pick depends on the rest of the row (its selection algorithm), so the indices are
    not compared with CPU's."""
    expected = torch.topk(x, k)
    values, indices = (t.cpu() for t in torch.topk(x.to("pjrt"), k))
    torch.testing.assert_close(values, expected.values, equal_nan=True)
    torch.testing.assert_close(x.gather(-1, indices), values, equal_nan=True)
    assert all(len(set(row)) == k for row in indices.tolist())


def test_topk_kthvalue():
    x = _distinct(5, 8)
    check(lambda x: torch.topk(x, 3), x)
    check(lambda x: torch.topk(x, 2, dim=0, largest=False), x)
    check(lambda x: torch.topk(x, 8, sorted=True), x)
    _check_topk_with_signed_zero_ties(_with_specials(x), 3)
    check(lambda x: torch.kthvalue(x, 3, 1), x)
    check(lambda x: torch.kthvalue(x, 2, 0, keepdim=True), x)
    check(lambda x: torch.topk(x.long(), 2), (x * 100))



@pytest.mark.parametrize("largest", [True, False])
def test_topk_ties_keep_the_first_of_equal_values(largest: bool) -> None:
    """Among tied values pjrt's topk takes the lowest indices first: the prefix of CPU's stable sort.

    CPU's own topk breaks ties by its partial-sort internals (of four equal values it returns
    indices 2 and 3); PyTorch leaves the choice unspecified, so the stable order is the contract here.
    """
    x = torch.randint(0, 4, (6, 16)).float()  # many ties per row
    x[0] = 0.5  # a whole row tied, as a zero-initialised MoE router gives
    values, indices = torch.topk(x.to("pjrt"), 5, dim=1, largest=largest)
    expected_values, expected_indices = torch.sort(x, dim=1, descending=largest, stable=True)
    torch.testing.assert_close(values.cpu(), torch.topk(x, 5, dim=1, largest=largest).values, rtol=0, atol=0)
    torch.testing.assert_close(values.cpu(), expected_values[:, :5], rtol=0, atol=0)
    torch.testing.assert_close(indices.cpu(), expected_indices[:, :5], rtol=0, atol=0)

def test_median_nanmedian_mode():
    x, y = _distinct(5, 6), _with_specials(_distinct(5, 6))
    check(torch.median, x)
    check(torch.median, y, **NAN)
    check(lambda x: torch.median(x, 1), x)
    check(lambda x: torch.median(x, 1, keepdim=True), y, **NAN)
    check(torch.nanmedian, y, **NAN)
    check(lambda x: torch.nanmedian(x, 1), y, **NAN)
    check(lambda x: torch.nanmedian(x, 0), torch.full((3, 2), float("nan")), **NAN)
    check(lambda x: torch.mode(x, 1), torch.randint(0, 3, (4, 9)))
    check(lambda x: torch.mode(x, 0), torch.randint(0, 4, (7, 3)).float())


def test_searchsorted_bucketize():
    seq = torch.sort(torch.randn(10)).values
    check(torch.searchsorted, seq, torch.randn(3, 4))
    check(lambda s, v: torch.searchsorted(s, v, right=True), torch.sort(torch.randint(0, 5, (10,))).values,
          torch.randint(0, 5, (3, 4)))
    check(lambda s, v: torch.searchsorted(s, v, side="right"), torch.sort(torch.randn(3, 10)).values,
          torch.randn(3, 4))
    check(lambda s, v: torch.searchsorted(s, v, sorter=torch.argsort(s)), torch.randn(10), torch.randn(5))
    check(lambda s: torch.searchsorted(s, 0.3), seq)
    check(lambda s, v: torch.searchsorted(s, v, out_int32=True), seq, torch.randn(4))
    check(lambda v, b: torch.bucketize(v, b), torch.randn(4, 4), torch.linspace(-1, 1, 5))
    check(lambda v, b: torch.bucketize(v, b, right=True), torch.randint(-2, 3, (4, 4)), torch.arange(-2, 3))


def test_sorting_backward():
    x = _distinct(4, 6)
    check(lambda x: _grads(lambda t: torch.sort(t, 1, descending=True).values, x), x)
    check(lambda x: _grads(lambda t: torch.topk(t, 2).values, x), x)
    check(lambda x: _grads(lambda t: torch.kthvalue(t, 2, 0).values, x), x)
    check(lambda x: _grads(lambda t: torch.median(t, 1).values, x), x)


def test_histc():
    x = torch.randn(100)
    check(lambda x: torch.histc(x, 7), x)
    check(lambda x: torch.histc(x, 5, -1, 1), x)
    check(lambda x: torch.histc(x, 4), torch.full((5,), 2.5))
    check(lambda x: torch.histc(x, 6, 0, 3), torch.tensor([0.0, 1, 2, 3, 3, 4, -1], dtype=torch.float64))


def test_searchsorted_and_unique_on_empty_slices() -> None:
    check(lambda s, v: torch.searchsorted(s, v), torch.empty(0, 0), torch.empty(0, 0))
    check(lambda x: torch.unique(x, dim=1), torch.randn(5, 0, 5))
    check(lambda x: torch.unique_consecutive(x, dim=0), torch.randn(0, 3))
