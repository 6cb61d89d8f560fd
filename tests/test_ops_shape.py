"""Copying shape ops (cat, stack, flip, roll, tril/triu, repeat, diag, ...) on pjrt against CPU."""

from __future__ import annotations

import pytest
import torch
from support import check

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]


def _random(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(*shape).to(dtype)
    return torch.randint(-50, 50, shape, dtype=dtype)


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device)
    (out * weight).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat_stack_dtypes(dtype):
    a, b = _random(2, 3, dtype=dtype), _random(4, 3, dtype=dtype)
    check(lambda a, b: torch.cat([a, b]), a, b)
    check(lambda a, b: torch.cat([a.t(), b.t()], dim=-1), a, b)
    check(lambda a, b: torch.stack([a, b[:2]], dim=1), a, b)


def test_cat_empty_promotion_and_out():
    check(lambda a, b: torch.cat([a, torch.empty(0, device=a.device), b], 1), torch.randn(2, 3), torch.randn(2, 1))
    check(lambda a, b: torch.cat([a, b]), torch.randn(2, 3), torch.randint(0, 9, (1, 3)))
    check(lambda a, b: torch.cat([a, b]), torch.randn(2, 3).half(), torch.randn(1, 3).double())
    check(lambda a, b: torch.cat([a, b[:, :0]], 1), torch.randn(2, 3), torch.randn(2, 3))


def test_cat_out():
    def with_out(a, b):
        out = torch.empty(5, 3, device=a.device)
        return torch.cat([a, b], out=out)

    check(with_out, torch.randn(2, 3), torch.randn(3, 3))


def test_split_chunk_unbind():
    x = torch.randn(7, 4)
    check(lambda x: torch.split(x, 3), x)
    check(lambda x: torch.split(x, [1, 3], dim=1), x)
    check(lambda x: torch.chunk(x, 3), x)
    check(lambda x: torch.unbind(x, 1), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_flip_roll(dtype):
    x = _random(3, 4, 5, dtype=dtype)
    check(lambda x: torch.flip(x, [0, -1]), x)
    check(lambda x: x.transpose(0, 2).flip(1), x)
    check(lambda x: torch.roll(x, 2), x)
    check(lambda x: torch.roll(x, (1, -3), (0, 2)), x)
    check(lambda x: torch.fliplr(x[0]), x)


@pytest.mark.parametrize("diagonal", [-1, 0, 2])
def test_tril_triu(diagonal):
    x = torch.randn(2, 4, 5)
    check(lambda x: torch.tril(x, diagonal), x)
    check(lambda x: torch.triu(x, diagonal), x)
    check(lambda x: x.clone().triu_(diagonal), x)
    check(lambda x: torch.tril(x.mT, diagonal), x)


def test_repeat_tile():
    x = torch.randn(2, 3)
    check(lambda x: x.repeat(2, 1, 3), x)
    check(lambda x: torch.tile(x, (2,)), x)
    check(lambda x: x.t().repeat(1, 2), x)


def test_diag_family():
    x, v = torch.randn(3, 4, 5), torch.randn(2, 4)
    check(lambda v: torch.diag_embed(v, offset=1), v)
    check(lambda v: torch.diag_embed(v, offset=-1, dim1=0, dim2=2), v)
    check(lambda x: torch.diagonal(x, 1, 1, 2).clone(), x)
    check(lambda x: torch.diagonal_copy(x, -1, 0, 2), x)
    check(lambda v: torch.diag(v[0], 1), v)
    check(lambda x: torch.diag(x[0]), x)


def test_copy_variants_of_views():
    x = torch.randn(3, 4, 5)
    check(lambda x: torch.permute_copy(x, (2, 0, 1)), x)
    check(lambda x: torch.expand_copy(x[:, :1], (2, 3, 4, 5)), x)
    check(lambda x: torch.narrow_copy(x, 1, 1, 2), x)
    check(lambda x: torch.narrow_copy(x, -1, -3, 2), x)
    check(lambda x: torch.view_copy(x, (12, -1)), x)
    check(lambda x: torch.unsqueeze_copy(x, -1), x)
    check(lambda x: torch.squeeze_copy(x[:, :1]), x)
    check(lambda x: torch.select_copy(x, 1, -1), x)
    check(lambda x: torch.slice_copy(x, 2, 1, 10, 2), x)
    check(lambda x: torch.transpose_copy(x, 0, 2), x)
    check(lambda x: torch.unfold_copy(x, 2, 2, 2), x)
    check(lambda x: torch.as_strided_copy(x, (2, 2), (5, 1), 3), x)
    check(lambda x: torch.view_as_real_copy(torch.view_as_complex(x[..., :4].contiguous().view(3, 4, 2, 2))), x)


def test_scatter_twins_of_views():
    x = torch.randn(4, 5, 6)
    check(lambda x, s: torch.slice_scatter(x, s, 1, 1, 5, 2), x, torch.randn(4, 2, 6))
    check(lambda x, s: torch.select_scatter(x, s, 2, -1), x, torch.randn(4, 5))
    check(lambda x, s: torch.diagonal_scatter(x, s, 1, 0, 2), x, torch.randn(5, 4))
    check(lambda x, s: torch.as_strided_scatter(x, s, (3, 3), (6, 1), 2), x, torch.randn(3, 3))

    def write_through_views(x):
        y = x.clone()
        y[:, 1:3].mul_(2)
        y.diagonal(0, 1, 2).zero_()
        y[2].add_(1)
        return y

    check(write_through_views, x)


def test_shape_backward():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    check(lambda a, b: _grads(lambda a, b: torch.cat([a, b]).roll(1, 0).flip(1), a, b), a, b)
    check(lambda a, b: _grads(lambda a, b: torch.stack([a, b[:2]], 2).tril().repeat(1, 2, 1), a, b), a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_as_strided_partial_views(dtype):
    """as_strided of a view made on the device reads the whole storage: its own offset by default, an explicit
    offset anywhere in the base (the battery copies as_strided samples with their whole storage to show it)."""

    def views(base):
        part = base[5:15]
        return [torch.as_strided(part, (2, 2), (1, 2)), torch.as_strided(part, (2, 2), (1, 2), storage_offset=0),
                torch.as_strided(part, (2, 2), (1, 2), storage_offset=10), part.as_strided((3,), (4,), 1)]

    check(views, _random(20, dtype=dtype))


def test_as_strided_partial_view_gradient():
    check(lambda base: _grads(lambda b: torch.as_strided(b[5:15], (2, 2), (1, 2), storage_offset=10), base),
          torch.randn(20))
    check(lambda base: _grads(lambda b: torch.as_strided(b[5:15], (3, 2), (1, 2)), base), torch.randn(20))


@pytest.mark.parametrize("offset", [None, 0, 3, 10])
def test_as_strided_gradient_of_a_partial_view_leaf(offset):
    """The OpInfo backward samples: the leaf is the view base[5:15] itself (the base needs no gradient), and
    as_strided may read (overlapping) elements outside it, which get no gradient."""

    def grads(base):
        leaf = base[5:15].requires_grad_()
        args = ((3, 2), (1, 0)) if offset is None else ((3, 2, 2), (2, 1, 2), offset)
        out = torch.as_strided(leaf, *args)
        weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device)
        return torch.autograd.grad((out * weight).sum(), leaf)

    check(grads, torch.randn(20))


def test_out_variants_write_through_unsafe_view() -> None:
    """kron(out=) views `out` with _unsafe_view and multiplies into it: the view must alias, as on CPU."""
    a, b = torch.randn(2, 3), torch.randn(3, 2)
    out = torch.empty(6, 6, device="pjrt")
    torch.kron(a.to("pjrt"), b.to("pjrt"), out=out)
    torch.testing.assert_close(out.cpu(), torch.kron(a, b))
