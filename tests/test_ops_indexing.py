"""Advanced indexing, gather/scatter, masks and the data-dependent kernels on pjrt against CPU."""

from __future__ import annotations

import pytest
import torch
from support import check


def _grads(fn, *inputs):
    """Gradients of the float inputs for a fixed cotangent; integer inputs are passed through."""
    leaves = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device)
    (out * weight).sum().backward()
    return [t.grad for t in leaves if t.is_floating_point()]


def _distinct(*shape: int) -> torch.Tensor:
    """Random floats without ties or zeros."""
    n = torch.Size(shape).numel()
    signs = torch.where(torch.rand(n) > 0.5, 1.0, -1.0)
    return ((torch.randperm(n) + 1).float() / n * signs).reshape(shape)


# --- advanced indexing -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_integer_index_dtypes(dtype):
    x = (torch.randn(5, 4, 3) * 10).to(dtype)
    i = torch.tensor([0, 2, -1, 2])
    check(lambda x, i: x[i], x, i)
    check(lambda x, i: x[:, i[:3]], x, i)


def test_index_placement_rules():
    x, i = torch.randn(5, 4, 3), torch.tensor([0, 2, -1])
    check(lambda x, i: x[i, :, i], x, i)
    check(lambda x, i: x[:, i, i], x, i)
    check(lambda x, i: x[None, i, None, ..., 1], x, i)
    check(lambda x, i: x[i.view(3, 1), i[:2]], x, i)
    check(lambda x, i: x.transpose(0, 2)[i.clamp(0, 2)], x, i)
    check(lambda x: x[torch.tensor([1, 0])], x)


def test_boolean_masks():
    x = torch.randn(5, 4, 3)
    m = x > 0
    check(lambda x, m: x[m], x, m)
    check(lambda x, m: x[m[..., 0]], x, m)
    check(lambda x, m: x[:, m[0, :, 0]], x, m)
    check(lambda x, m: x[m[:, 0, 0], 1:], x, m)
    check(lambda x: x[torch.tensor([True, False, True, False, True])], x)
    with pytest.raises(IndexError):
        x.to("pjrt")[m[0].to("pjrt")]


def test_mask_write_without_sync_and_with_values():
    x = torch.randn(5, 4, 3)
    m = x > 0

    def fill(x, m):
        y = x.clone()
        y[m] = 0.5
        y[m[:, 0, 0]] = torch.arange(3.0).to(x.device)
        return y

    check(fill, x, m)

    def values(x, m):
        y = x.clone()
        y[m] = y[m] * 2
        return y

    check(values, x, m)


def test_index_put_and_accumulate_duplicates():
    x = torch.randn(5, 4, 3)

    def assign(x, i):
        y = x.clone()
        y[i] = torch.full((4, 3), 7.0, device=x.device)
        y[:, i[:2], 0] = -1.0
        return y

    check(assign, x, torch.tensor([0, 3]))

    def accumulate(x, i, v):
        return x.clone().index_put_((i,), v, accumulate=True)

    check(accumulate, x, torch.tensor([0, 3, 0, 0]), torch.randn(4, 4, 3))
    check(lambda x, i, v: torch.index_put(x, (i, i), v, accumulate=True), x, torch.tensor([1, 1, 2]),
          torch.randn(3, 3))

    def iadd(x, i):
        y = x.clone()
        y[i] += 1.0
        return y

    check(iadd, x, torch.tensor([4, 1]))


VIEWS = {
    "row": lambda b: b[1],
    "column": lambda b: b[:, 2],
    "transposed": lambda b: b.transpose(1, 2)[0],
    "strided box": lambda b: b[::2, 1:5],
}



def _along_last(v, i):
    """index_put_'s index list selecting `i` along v's last dim."""
    return [None] * (v.dim() - 1) + [i]


def _source(v, i, s):
    """Values for the selected positions of v's last dim (fresh random numbers, broadcast over the rest)."""
    return s[: i.numel()].expand(*v.shape[:-1], i.numel()) * 1


SCATTERS = {
    "index_put_": lambda v, i, s: torch.ops.aten.index_put_(v, _along_last(v, i), _source(v, i, s)),
    "index_put_ accumulate": lambda v, i, s: torch.ops.aten.index_put_(v, _along_last(v, i), _source(v, i, s), True),
    "setitem": lambda v, i, s: v.__setitem__((..., i), s[: i.numel()]),
    "index_copy_": lambda v, i, s: v.index_copy_(-1, i.unique(), _source(v, i.unique(), s)),
    "index_add_": lambda v, i, s: v.index_add_(-1, i, _source(v, i, s), alpha=0.5),
    "index_fill_": lambda v, i, s: v.index_fill_(-1, i, -2.0),
    "put_ accumulate": lambda v, i, s: v.put_(i, s[: i.numel()], accumulate=True),
}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("op", SCATTERS)
def test_scatters_into_a_view_write_only_its_elements(op, view, mode, monkeypatch):
    """An in-place scatter into a view of part of a storage scatters into the storage itself (a KV-cache write
    into one large buffer must not copy it): the program takes that path, and the whole storage, read through
    another view, equals CPU's."""
    from torch_pjrt.ops import indexing

    through = []
    monkeypatch.setattr(indexing, "scatter_through", lambda *a, f=indexing.scatter_through: through.append(1) or f(*a))
    base, source = torch.randn(3, 6, 8), torch.randn(8)
    index = torch.tensor([0, -1, 2, 2])

    def write(base, index, source):
        whole = base.clone()
        SCATTERS[op](VIEWS[view](whole), index.remainder(6) if op in ("index_copy_", "index_add_") else index, source)
        return whole.view(-1) * 1

    expected = write(base, index, source)
    mode_name = torch.pjrt.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.pjrt.EagerMode.DEFER_NEVER
    with torch.pjrt.set_eager_mode(mode_name):
        actual = write(*(t.to("pjrt") for t in (base, index, source)))
    torch.testing.assert_close(actual.cpu(), expected)
    assert through, "the write read and rewrote the whole view"


BUFFERS = {  # (the buffer's dtype, the view's): a wider view of a byte buffer (vLLM's KV caches), one of equal width
    "float32 in int8": (torch.int8, torch.float32),
    "bfloat16 in uint8": (torch.uint8, torch.bfloat16),
    "float32 in int32": (torch.int32, torch.float32),
}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("buffer", BUFFERS)
@pytest.mark.parametrize("op", ["index_put_", "setitem", "index_fill_", "index_put_ accumulate"])
def test_scatters_into_a_view_of_another_dtype_write_only_its_bytes(op, buffer, mode, monkeypatch):
    """A layer's float cache viewed inside one byte buffer: an assignment scatters its values' bytes into the
    buffer (reinterpreting the whole buffer made XLA copy it on every write); an add through such a view takes
    the whole-view path. The whole buffer's bytes equal CPU's."""
    from torch_pjrt.ops import indexing

    written = []
    monkeypatch.setattr(indexing, "scatter_through",
                        lambda *a, f=indexing.scatter_through: written.append(f(*a)) or written[-1])
    buffer_dtype, view_dtype = BUFFERS[buffer]
    base = torch.randn(4 * 3 * 6 * 8).to(view_dtype).view(buffer_dtype)
    source, index = torch.randn(8).to(view_dtype), torch.tensor([0, -1, 2, 5])

    def write(base, index, source):
        whole = base.clone()
        layer = whole.view(view_dtype).view(4, 3, 6, 8)[2]  # part of the buffer, as the view dtype
        SCATTERS[op](layer[:, 1:], index.remainder(5) if op == "index_fill_" else index, source)
        return whole

    expected = write(base, index, source)
    mode_name = torch.pjrt.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.pjrt.EagerMode.DEFER_NEVER
    with torch.pjrt.set_eager_mode(mode_name):
        actual = write(*(t.to("pjrt") for t in (base, index, source)))
    assert torch.equal(actual.cpu(), expected)
    assert written, "the op did not take the scatter form"
    assert all((w is None) == op.endswith("accumulate") for w in written)


def test_a_bad_index_into_a_view_raises_like_cpu():
    base = torch.randn(3, 6, 8, device="pjrt")
    with pytest.raises(RuntimeError, match="index_put: index 9 is out of bounds for dimension 0 with size 6"):
        base[1].index_put_((torch.tensor([9], device="pjrt"),), torch.zeros(8, device="pjrt"))
        base.cpu()


def test_index_put_into_an_expanded_tensor_writes_through_its_shared_elements():
    """CPU writes each selected element's one address (with a deprecation warning): accumulate adds every value
    into the element that the expanded rows share, and an assignment reaches every row."""
    rows, columns = torch.randn(1, 3), torch.randn(3)

    def put(base, i, v, expand, accumulate):
        expanded = expand(base.clone())
        with pytest.warns(UserWarning, match="index_put_ on expanded tensors"):
            expanded.index_put_((i,), v, accumulate=accumulate)
        return expanded

    def rows_of(t):
        return t.expand(4, 3)

    def columns_of(t):
        return t.expand(2, 3).t()

    for accumulate in (False, True):
        check(put, rows, torch.tensor([2]), torch.randn(1, 3), rows_of, accumulate)
        check(put, rows, torch.tensor([1, 3]), torch.randn(3), rows_of, accumulate)
        check(put, columns, torch.tensor([0, 2]), torch.randn(2, 1), columns_of, accumulate)


def test_index_backward():
    x = torch.randn(5, 4, 3)
    check(lambda x, i: _grads(lambda x, i: x[i], x, i), x, torch.tensor([0, 0, 3]))
    check(lambda x, m: _grads(lambda x, m: x[m], x, m), x, x > 0)
    check(lambda x, i, v: _grads(lambda x, i, v: x.index_put((i,), v, accumulate=True), x, i, v),
          x, torch.tensor([1, 1]), torch.randn(2, 4, 3))


# --- gather / scatter --------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_gather_scatter_dtypes(dtype):
    x = (torch.randn(5, 4, 3) * 10).to(dtype)
    index = torch.randint(0, 4, (5, 2, 3))
    src = (torch.randn(5, 2, 3) * 10).to(dtype)
    check(lambda x, i: torch.gather(x, 1, i), x, index)
    check(lambda x, i: torch.gather(x, 2, i[:2, :, :2] % 3), x, index)
    check(lambda x, i, s: torch.scatter(x, 1, i, s), x, index, src)
    check(lambda x, i: torch.scatter(x, 1, i, 3), x, index)
    check(lambda x, i, s: torch.scatter_add(x, 1, i, s), x, index, src)
    check(lambda x, i, s: x.clone().scatter_add_(1, i, s), x, index, src)
    check(lambda x, i, s: torch.scatter(x, 1, i, s, reduce="multiply"), x, index, src)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    x, index, src = torch.randn(5, 3), torch.randint(0, 5, (7, 3)), torch.randn(7, 3)
    check(lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce, include_self=include_self), x, index, src)
    ints = torch.randint(-9, 9, (5, 3)), index, torch.randint(-9, 9, (7, 3))
    check(lambda x, i, s: torch.scatter_reduce(x, 0, i, s, reduce, include_self=include_self), *ints)


def test_gather_scatter_backward():
    x, index, src = torch.randn(5, 4, 3), torch.randint(0, 4, (5, 2, 3)), torch.randn(5, 2, 3)
    check(lambda x, i: _grads(lambda x, i: torch.gather(x, 1, i), x, i), x, index)
    check(lambda x, i, s: _grads(lambda x, i, s: torch.scatter_add(x, 1, i, s), x, i, s), x, index, src)
    check(lambda x, i, s: _grads(lambda x, i, s: torch.scatter(x, 1, i, s), x, i, s), x, index, src)
    check(lambda x, i: _grads(lambda x, i: torch.take_along_dim(x, i, 1), x, i), x, index)


# --- index_* along a dim, take, masks ----------------------------------------------------------


@pytest.mark.filterwarnings("ignore:index_reduce")
def test_index_along_dim():
    x = torch.randn(5, 4, 3)
    check(lambda x, i: torch.index_select(x, 1, i), x, torch.tensor([3, 0, 0]))
    check(lambda x, i: torch.index_select(x.t(), 0, i), x[0], torch.tensor([2, 0]))
    check(lambda x, i, s: x.index_add(1, i, s, alpha=2), x, torch.tensor([3, 0, 0]), torch.randn(5, 3, 3))
    check(lambda x, i, s: x.clone().index_add_(0, i, s), x, torch.tensor([4, 4]), torch.randn(2, 4, 3))
    check(lambda x, i, s: x.index_copy(1, i, s), x, torch.tensor([3, 0]), torch.randn(5, 2, 3))
    check(lambda x, i: x.index_fill(2, i, -1.0), x, torch.tensor([2, 0]))
    check(lambda x, i, s: x.index_reduce(0, i, s, "amax", include_self=False), x, torch.tensor([3, 0, 3]),
          torch.randn(3, 4, 3))
    check(lambda x, i: _grads(lambda x, i: torch.index_select(x, 1, i), x, i), x, torch.tensor([3, 0, 0]))


def test_take_put_masked():
    x = torch.randn(5, 4, 3)
    m = x > 0
    check(lambda x, i: torch.take(x, i), x, torch.tensor([[0, 59], [-1, 7]]))
    check(lambda x, i, s: x.put(i, s, accumulate=True), x, torch.tensor([1, 1, 5]), torch.randn(3))
    check(lambda x, m: x.masked_fill(m, 3.0), x, m)
    check(lambda x, m: x.masked_fill(m[0], -2), x, m)
    check(lambda x, m: x.clone().masked_fill_(m, 1.5), x, m)
    check(lambda x, m, s: x.masked_scatter(m, s), x, m, torch.randn(60))
    check(lambda c, x, y: torch.where(c, x, y), m, x, torch.randn(4, 3))
    check(lambda x, m: _grads(lambda x, m: x.masked_fill(m, 0.0), x, m), x, m)


# --- data-dependent kernels --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_nonzero(dtype):
    x = (torch.randn(4, 5) > 0).to(dtype) * (torch.randint(1, 9, (4, 5)).to(dtype))
    check(torch.nonzero, x)
    check(lambda x: torch.nonzero(x, as_tuple=True), x)
    check(lambda x: torch.where(x), x)
    check(torch.argwhere, x)
    check(torch.nonzero, torch.tensor(2.0))


def test_masked_select_and_nonzero_static():
    x = torch.randn(4, 5)
    check(torch.masked_select, x, x > 0)
    check(lambda x, m: torch.masked_select(x, m), x, x[0] > 0)
    check(lambda x: torch.nonzero_static(x > 0, size=25), x)
    check(lambda x: _grads(lambda x: torch.masked_select(x, x > 0), x), x)


def test_unique_family():
    x = torch.randint(0, 5, (4, 6))
    check(lambda x: torch.unique(x), x)
    check(lambda x: torch.unique(x, return_inverse=True, return_counts=True), x)
    check(lambda x: torch.unique(x.float(), return_inverse=True), x)
    check(lambda x: torch.unique(x % 2, dim=1, return_inverse=True, return_counts=True), x)
    check(lambda x: torch.unique(x % 2, dim=0), x)
    y = torch.randint(0, 2, (12,))
    check(lambda y: torch.unique_consecutive(y, return_inverse=True, return_counts=True), y)
    check(lambda x: torch.unique_consecutive(x % 2, dim=0), x.repeat_interleave(2, 0))


def test_repeat_interleave_and_bincount():
    r = torch.tensor([2, 0, 3, 1, 1])
    check(torch.repeat_interleave, r)
    check(lambda x, r: torch.repeat_interleave(x, r, dim=0), torch.randn(5, 2), r)
    check(lambda x: torch.repeat_interleave(x, 2, dim=1), torch.randn(5, 2))
    v = torch.randint(0, 7, (20,))
    check(torch.bincount, v)
    check(lambda v, w: torch.bincount(v, w, minlength=10), v, torch.randn(20), atol=1e-5, rtol=1e-5)


def test_data_dependent_results_feed_later_ops():
    x = _distinct(6, 3)
    check(lambda x: x[torch.nonzero(x > 0, as_tuple=True)].sum(), x, atol=1e-5, rtol=1e-5)


def test_writes_through_views():
    x = torch.randn(4, 5)

    def mask_set_on_transpose(a):
        b = a.clone()
        v = b.t()
        v[v > 0] = 0.0
        return b

    def iadd_on_transpose(a, i):
        b = a.clone()
        b.t()[i] += 1
        return b

    def accumulate_on_transpose(a, i):
        b = a.clone()
        b.t().index_put_((i,), torch.ones(2, 4, device=a.device), accumulate=True)
        return b

    def scatter_add_on_rows(a, i):
        b = a.clone()
        b[1:3].scatter_add_(1, i, torch.ones(2, 2, device=a.device))
        return b

    check(mask_set_on_transpose, x)
    check(iadd_on_transpose, x, torch.tensor([0, 2]))
    check(accumulate_on_transpose, x, torch.tensor([1, 1]))
    check(scatter_add_on_rows, x, torch.tensor([[0, 0], [4, 4]]))
    check(lambda a: torch.nonzero(a.t() > 0), x)
    check(lambda a: torch.masked_select(a[:, ::2], a[:, ::2] > 0), x)


def test_more_backward():
    x = torch.randn(4, 5)
    check(lambda a, s, m: _grads(lambda a, s, m: a.masked_scatter(m, s), a, s, m), x, torch.randn(20), x > 0)
    index, src = torch.randint(0, 4, (6, 5)), torch.randn(6, 5)
    for reduce in ("prod", "amax", "mean"):
        check(lambda a, i, s, r=reduce: _grads(lambda a, i, s: a.scatter_reduce(0, i, s, r), a, i, s), x, index, src)
    check(lambda a, i: _grads(lambda a, i: torch.take(a, i), a, i), x, torch.tensor([1, 1, 7]))


@pytest.mark.xfail(reason="core: meta run gets the CPU 0-dim `value` as a CPU tensor; refs.masked_fill refuses it")
def test_masked_fill_cpu_scalar_tensor_value():
    x = torch.randn(4, 5)
    check(lambda x: x.masked_fill(x > 0, torch.tensor(3.0)), x)


def test_bool_accumulating_scatters_are_logical_or_and_and() -> None:
    self = torch.rand(4, 5) > 0.5
    src = torch.rand(4, 5) > 0.5
    index = torch.randint(0, 4, (4, 5))
    check(lambda s, i, v: s.scatter_add(0, i, v), self, index, src)
    check(lambda s, i, v: s.scatter_reduce(0, i, v, "prod"), self, index, src)
    check(lambda s, i, v: s.index_put((i[:, 0],), v, accumulate=True), self, index, src)
    check(lambda s, i, v: s.put(i.flatten(), v.flatten(), accumulate=True), self, index, src)


def test_gather_and_scatter_with_an_empty_index_of_higher_rank() -> None:
    source = torch.randn(5, requires_grad=True)
    index = torch.zeros(2, 0, dtype=torch.long)
    check(lambda s, i: torch.gather(s, 0, i), source.detach(), index)
    check(lambda s, i: s.scatter_add(0, i, torch.zeros(2, 0, device=s.device)), source.detach(), index)
