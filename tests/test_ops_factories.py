"""Tensor factories on pjrt against the same calls on CPU: values, dtypes, shapes, strides, out=, autograd."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import assert_same, check

from torch_pjrt.ops import graph

# Floating results may differ from CPU's vectorised kernels in the last bit.
TOLERANCES = {
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
    torch.float32: {"atol": 1e-6, "rtol": 1e-6},
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
}


def same_on_both(fn: Callable[[str], Any]) -> Any:
    """Call a factory with device="cpu" and device="pjrt"; compare (dtype-aware tolerance)."""
    expected = fn("cpu")
    actual = fn("pjrt")
    dtype = expected.dtype if isinstance(expected, torch.Tensor) else None
    assert_same(actual, expected, **TOLERANCES.get(dtype, {"atol": 0, "rtol": 0}))
    return actual


# --- arange -------------------------------------------------------------------------------------

ARANGE_CASES = [
    ((7,), {}),
    ((0,), {}),
    ((2, 11), {}),
    ((2, 11, 3), {}),
    ((10, -4, -3), {}),
    ((0, 1, 0.1), {}),
    ((1.5, 7.25, 0.25), {"dtype": torch.float64}),
    ((10, -3.5, -1.5), {}),
    ((0.5, 7.3, 1.5), {"dtype": torch.int64}),
    ((0.5, 7.3, 1.5), {"dtype": torch.int32}),
    ((-3, 40, 7), {"dtype": torch.int8}),
    ((0, 300, 0.7), {"dtype": torch.bfloat16}),
    ((0, 20, 0.3), {"dtype": torch.float16}),
    ((5,), {"dtype": torch.float32}),
]


@pytest.mark.parametrize(("args", "kwargs"), ARANGE_CASES)
def test_arange(args: tuple, kwargs: dict) -> None:
    same_on_both(lambda d: torch.arange(*args, **kwargs, device=d))


def test_arange_new_values_reuse_no_wrong_cache() -> None:
    for end in (3, 4, 9):
        same_on_both(lambda d, end=end: torch.arange(1, end, device=d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int16])
def test_arange_out(dtype: torch.dtype) -> None:
    same_on_both(lambda d: torch.arange(2, 9, 2, out=torch.empty(0, dtype=dtype, device=d)))
    out = torch.empty(4, dtype=dtype, device="pjrt")
    result = torch.arange(4, out=out)
    assert result is out
    assert_same(out, torch.arange(4, dtype=dtype))


def test_arange_requires_grad() -> None:
    x = torch.arange(0, 2, 0.5, device="pjrt", requires_grad=True)
    assert x.requires_grad and x.is_leaf
    (x * x).sum().backward()
    assert_same(x.grad, 2 * torch.arange(0, 2, 0.5))


def test_arange_errors_like_pytorch() -> None:
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, -1, device="pjrt")
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, 0, device="pjrt")


# --- linspace / logspace -------------------------------------------------------------------------

LINSPACE_CASES = [
    ((0, 1, 7), {}),
    ((-3.3, 1e4, 1001), {}),
    ((2, -2, 8), {"dtype": torch.float64}),
    ((0.5, 10.7, 5), {"dtype": torch.int64}),
    ((-100, 100, 9), {"dtype": torch.int8}),
    ((-2, 4, 6), {"dtype": torch.int16}),
    ((2.5, 7, 1), {}),
    ((2.5, 7, 0), {}),
    ((0, 100, 33), {"dtype": torch.bfloat16}),
    ((-1, 1, 21), {"dtype": torch.float16}),
]


@pytest.mark.parametrize(("args", "kwargs"), LINSPACE_CASES)
def test_linspace(args: tuple, kwargs: dict) -> None:
    same_on_both(lambda d: torch.linspace(*args, **kwargs, device=d))


def test_linspace_hits_both_ends_exactly() -> None:
    x = torch.linspace(0.1, 0.7, 13, device="pjrt").cpu()
    assert x[0].item() == torch.tensor(0.1).item() and x[-1].item() == torch.tensor(0.7).item()


@pytest.mark.parametrize("variant", ["tensor_tensor", "tensor_scalar", "scalar_tensor"])
def test_linspace_logspace_tensor_ends(variant: str) -> None:
    def ends(d: str) -> tuple[Any, Any]:
        start, end = torch.tensor(1.5, device=d), torch.tensor(4, device=d)
        return {"tensor_tensor": (start, end), "tensor_scalar": (start, 4), "scalar_tensor": (1.5, end)}[variant]

    same_on_both(lambda d: torch.linspace(*ends(d), 6, device=d))
    same_on_both(lambda d: torch.logspace(*ends(d), 6, base=2, device=d))
    same_on_both(lambda d: torch.linspace(*ends(d), 6, dtype=torch.int32, device=d))


def test_linspace_changing_ends_do_not_recompile_wrongly() -> None:
    for start in (0.0, 0.25, -3.0):
        same_on_both(lambda d, start=start: torch.linspace(start, 2.0, 5, device=d))


LOGSPACE_CASES = [
    ((0, 1, 7), {}),
    ((-2, 5, 11), {"base": 2}),
    ((0.5, 3.7, 6), {"dtype": torch.int64}),
    ((2.5, 7, 1), {"dtype": torch.int64}),
    ((-1, 2, 9), {"dtype": torch.float64, "base": 3.5}),
    ((0, 2, 5), {"dtype": torch.bfloat16}),
    ((1, 3, 0), {}),
]


@pytest.mark.parametrize(("args", "kwargs"), LOGSPACE_CASES)
def test_logspace(args: tuple, kwargs: dict) -> None:
    same_on_both(lambda d: torch.logspace(*args, **kwargs, device=d))


def test_linspace_logspace_out() -> None:
    same_on_both(lambda d: torch.linspace(0, 1, 6, out=torch.empty(6, dtype=torch.float64, device=d)))
    same_on_both(lambda d: torch.linspace(-5, 5, 4, out=torch.empty(0, dtype=torch.int32, device=d)))
    same_on_both(lambda d: torch.logspace(0, 2, 6, out=torch.empty(0, device=d)))


def test_linspace_requires_grad() -> None:
    x = torch.linspace(-2.0, 4.0, 6, device="pjrt", requires_grad=True)
    assert x.requires_grad and x.is_leaf
    (3 * x).sum().backward()
    assert_same(x.grad, torch.full((6,), 3.0))


# --- eye, tril/triu indices ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "dtype"), [((3,), None), ((3, 5), None), ((4, 2), torch.int32), ((0, 3), None), ((3,), torch.bool),
                        ((2, 2), torch.bfloat16)]
)
def test_eye(args: tuple, dtype: torch.dtype | None) -> None:
    same_on_both(lambda d: torch.eye(*args, dtype=dtype, device=d))


def test_eye_out_and_requires_grad() -> None:
    same_on_both(lambda d: torch.eye(3, 2, out=torch.empty(0, device=d)))
    same_on_both(lambda d: torch.eye(4, out=torch.empty(4, 4, dtype=torch.int64, device=d)))
    x = torch.eye(3, device="pjrt", requires_grad=True)
    assert x.requires_grad and x.is_leaf


@pytest.mark.parametrize("fn", [torch.tril_indices, torch.triu_indices])
@pytest.mark.parametrize(("row", "col", "offset"), [(3, 4, 0), (5, 3, -1), (4, 4, 2), (0, 3, 0), (3, 3, -5)])
def test_trilu_indices(fn: Callable, row: int, col: int, offset: int) -> None:
    same_on_both(lambda d: fn(row, col, offset, device=d))


def test_trilu_indices_dtype() -> None:
    same_on_both(lambda d: torch.tril_indices(4, 3, dtype=torch.int32, device=d))


# --- filled tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "dtype"), [(3.7, None), (3.7, torch.int64), (-2, None), (True, None),
                                              (0.1, torch.float64), (1.5, torch.bfloat16)])
def test_scalar_tensor(value: Any, dtype: torch.dtype | None) -> None:
    same_on_both(lambda d: torch.scalar_tensor(value, dtype=dtype, device=d))


# (base on CPU, view taken on each device): transfers give contiguous tensors, so views come after them.
LIKE_INPUTS: dict[str, tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "float32": (lambda: torch.randn(3, 4), lambda t: t),
    "int64": (lambda: torch.randint(-5, 5, (2, 3)), lambda t: t),
    "bfloat16_transposed": (lambda: torch.randn(4, 3).to(torch.bfloat16), lambda t: t.t()),
    "float64_sliced": (lambda: torch.randn(6, 5, dtype=torch.float64), lambda t: t[::2, 1:]),
    "bool": (lambda: torch.randn(5) > 0, lambda t: t),
}


@pytest.mark.parametrize("name", list(LIKE_INPUTS))
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.int32])
def test_full_zeros_ones_like(name: str, dtype: torch.dtype | None) -> None:
    make, view = LIKE_INPUTS[name]
    x = make()
    check(lambda t: torch.full_like(view(t), 2.7, dtype=dtype), x)
    check(lambda t: torch.zeros_like(view(t), dtype=dtype), x)
    check(lambda t: torch.ones_like(view(t), dtype=dtype), x)


@pytest.mark.parametrize("name", list(LIKE_INPUTS))
def test_like_keeps_layout(name: str) -> None:
    make, view = LIKE_INPUTS[name]
    x = make()
    for fn in (torch.empty_like, torch.zeros_like, lambda t: torch.full_like(t, 2)):
        expected = fn(view(x))
        actual = fn(view(x.to("pjrt")))
        assert actual.device.type == "pjrt"
        assert (actual.dtype, actual.shape, actual.stride()) == (expected.dtype, expected.shape, expected.stride())
    actual.fill_(1)
    assert_same(actual, torch.ones_like(view(x)))


def test_like_requires_grad_and_dtype_override() -> None:
    x = torch.randn(3, device="pjrt")
    for y in (torch.zeros_like(x, requires_grad=True), torch.full_like(x, 2.0, requires_grad=True),
              torch.empty_like(x, dtype=torch.float64, requires_grad=True)):
        assert y.requires_grad and y.is_leaf and y.device.type == "pjrt"
    (torch.ones_like(x, requires_grad=True) * x).sum().backward()


@pytest.mark.parametrize("dtype", [None, torch.int8, torch.float64])
def test_new_factories(dtype: torch.dtype | None) -> None:
    x = torch.randn(3, 2)
    check(lambda t: t.new_zeros((2, 3), dtype=dtype), x)
    check(lambda t: t.new_ones((4,), dtype=dtype), x)
    check(lambda t: t.new_full((2, 2), 3.5, dtype=dtype), x)
    y = x.to("pjrt")
    for made in (y.new_empty((2, 3), dtype=dtype), y.new_empty_strided((2, 3), (1, 2), dtype=dtype)):
        assert made.device.type == "pjrt" and made.shape == (2, 3)
        assert made.dtype == (dtype or torch.float32)
    assert y.new_empty_strided((2, 3), (1, 2)).stride() == (1, 2)


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.bfloat16, torch.bool])
def test_full_zeros_ones(dtype: torch.dtype | None) -> None:
    same_on_both(lambda d: torch.full((2, 3), 7.5, dtype=dtype, device=d))
    same_on_both(lambda d: torch.zeros(4, dtype=dtype, device=d))
    same_on_both(lambda d: torch.ones(2, 1, dtype=dtype, device=d))
    x = torch.zeros(2, 3, device="pjrt", requires_grad=dtype is None)
    assert x.requires_grad == (dtype is None)


def test_allocation_lowerings_serve_traced_graphs() -> None:
    """empty / empty_strided have eager kernels of their own; decompositions and compile use these."""

    def fn() -> torch.Tensor:
        a = torch.empty((2, 3), dtype=torch.float64).fill_(1.0)
        b = torch.empty_strided((2, 3), (1, 2)).fill_(2.0)
        return a + b

    result = graph.lower_callable(fn, (), {})
    assert result.shape == (2, 3)
    assert float(result.sum()) == 18.0


def test_dtype_the_device_cannot_hold_is_not_implemented():
    """complex32 has no XLA element type: a clear NotImplementedError (still a TypeError), never a wrong copy."""
    x = torch.ones(3, device="pjrt")
    conversions = (lambda: x.chalf(), lambda: x.to(torch.complex32),
                   lambda: torch.zeros(2, dtype=torch.complex32, device="pjrt"))
    for convert in conversions:
        with pytest.raises(NotImplementedError, match="complex32"):
            convert()
        with pytest.raises(TypeError, match="complex32"):
            convert()


@pytest.mark.parametrize("sizes", [(2, 3, 4, 5), (1, 5, 0), (3, 0, 2**62), (), (2**40, 2**40), (2**62,), (-1, 2)])
@pytest.mark.parametrize("memory_format", [None, torch.contiguous_format, torch.channels_last, torch.preserve_format])
def test_empty_layout_and_errors_match_cpu(sizes: tuple[int, ...], memory_format: Any) -> None:
    """torch.empty's strides, or its error, as on CPU (contiguous strides are computed here, not by the meta kernel)."""
    kwargs = {} if memory_format is None else {"memory_format": memory_format}

    def outcome(device: str) -> tuple:
        try:
            made = torch.empty(sizes, dtype=torch.float32, device=device, **kwargs)
        except RuntimeError as error:
            return type(error), str(error)
        return made.dtype, made.shape, made.stride()

    assert outcome("pjrt") == outcome("cpu")


# --- fill values are traced -------------------------------------------------------------------------

FILLS = {
    "full": lambda device, like, value, dtype: torch.full((2, 3), value, dtype=dtype, device=device),
    "full_like": lambda device, like, value, dtype: torch.full_like(like.to(device), value, dtype=dtype),
    "new_full": lambda device, like, value, dtype: like.to(device).new_full((4,), value, dtype=dtype),
    "fill_": lambda device, like, value, dtype: torch.empty(3, 2, dtype=dtype, device=device).fill_(value),
    "scalar_tensor": lambda device, like, value, dtype: torch.scalar_tensor(value, dtype=dtype, device=device),
}


@pytest.mark.parametrize("fused", [False, True], ids=["strict", "fused"])
@pytest.mark.parametrize("name", sorted(FILLS))
def test_one_program_serves_every_fill_value(name: str, fused: bool) -> None:
    """A factory's fill value is a traced number, not part of its program's key: after the first value of a
    type and dtype, other values (generate()'s `full((batch,), is_done)` stop flag, True then False) give CPU's
    results and compile nothing; the sizes and a dtype taken from the value's type stay in the key."""
    import torch_pjrt

    mode = torch.pjrt.EagerMode.DEFER_AND_FUSE if fused else torch.pjrt.EagerMode.DEFER_NEVER
    like = torch.randn(2, 5)
    offset = torch.randn(1, dtype=torch.float64)
    series = [((True, False, True), torch.bool), ((True, False), None), ((3, -7, 12), torch.int32),
              ((5, -2), None), ((2.5, -1.25, 1e-3), torch.float32), ((-0.75, 3.5), None), ((7, -4), torch.float64)]
    with torch.pjrt.set_eager_mode(mode):
        for values, dtype in series:
            compiles = []
            for value in values:
                want = FILLS[name]("cpu", like, value, dtype)
                got = FILLS[name]("pjrt", like, value, dtype)
                # (a use of the result, so the fused graph holds more than the factory)
                want_sum, got_sum = want.double() + offset, (got.double() + offset.to("pjrt")).cpu()
                assert got.dtype == want.dtype and got.shape == want.shape, (value, got.dtype, want.dtype)
                assert torch.equal(got.cpu(), want), (value, got.cpu(), want)
                assert torch.equal(got_sum, want_sum), (value, got_sum, want_sum)
                compiles.append(torch_pjrt.metrics.counters()["compiles"])
            assert compiles[-1] == compiles[0], (values, dtype, compiles)


# --- a fill value the dtype cannot hold ----------------------------------------------------------------

FITTED = {**FILLS, "masked_fill": lambda device, like, value, dtype: torch.zeros(3, 2, dtype=dtype, device=device)
          .masked_fill(torch.tensor([[True, False]] * 3, device=device), value)}


def _filled(name: str, device: str, like: torch.Tensor, value: Any, dtype: torch.dtype) -> torch.Tensor | str:
    """The fill's result on the CPU, or the message of the RuntimeError it raised."""
    try:
        return FITTED[name](device, like, value, dtype).cpu()
    except RuntimeError as error:
        return str(error)


@pytest.mark.parametrize("fused", [False, True], ids=["strict", "fused"])
@pytest.mark.parametrize("name", sorted(FITTED))
def test_a_fill_value_the_dtype_cannot_hold_raises_cpus_error(name: str, fused: bool) -> None:
    """CPU converts a fill value with Scalar.to<T>(), which raises on overflow; pjrt raised nothing and gave a
    wrapped or infinite value (full((3,), 2**40, dtype=int32) was zeros). Now the same error, from a device-side
    check at the next host wait for a traced value; values that fit (an unsigned type's negatives wrap) as CPU.
    float32 is not checked (casts._WIDE_FLOATS): a number beyond its range fills inf where CPU raises."""
    mode = torch.pjrt.EagerMode.DEFER_AND_FUSE if fused else torch.pjrt.EagerMode.DEFER_NEVER
    like = torch.randn(2, 5)
    fits = int(torch.randint(-100, 100, ()))
    cases = [(2 ** 40, torch.int32), (fits, torch.int32), (300, torch.int8), (-1, torch.uint8), (-256, torch.uint8),
             (-2 ** 63, torch.uint8), (2 ** 63 - 1, torch.int64), (-2 ** 63, torch.int64),
             (float("nan"), torch.int32), (1e6 * (1 + torch.rand(()).item()), torch.float16),
             (float("inf"), torch.float16), (1000.0, torch.float8_e4m3fn),
             (torch.randn(()).item(), torch.float32)]
    with torch.pjrt.set_eager_mode(mode):
        for value, dtype in cases:
            if name == "masked_fill" and value != value and not dtype.is_floating_point:
                continue  # PyTorch's own masked_fill reference, run for the result's shape, raises ValueError first
            want, got = _filled(name, "cpu", like, value, dtype), _filled(name, "pjrt", like, value, dtype)
            if isinstance(want, str):
                assert isinstance(got, str) and want in got, (value, dtype, want, got)
            else:
                assert isinstance(got, torch.Tensor) and torch.equal(got, want), (value, dtype, want, got)
        unchecked = _filled(name, "pjrt", like, -1e39, torch.float32)
        assert isinstance(unchecked, torch.Tensor) and bool(unchecked.isinf().any()), unchecked


@pytest.mark.parametrize("fused", [False, True], ids=["strict", "fused"])
def test_a_python_int_past_int64_behaves_as_on_cpu(fused: bool) -> None:
    """PyTorch takes a Python int in [2**63, 2**64) as a uint64 Scalar: int64 arithmetic wraps it, float arithmetic
    keeps it, a fill raises CPU's overflow error. pjrt passed it to jax as a program argument, which raised
    OverflowError for every op."""
    mode = torch.pjrt.EagerMode.DEFER_AND_FUSE if fused else torch.pjrt.EagerMode.DEFER_NEVER
    ints, floats = torch.randint(-1000, 1000, (3, 2)), torch.randn(3, 2, dtype=torch.float64)
    big = 2 ** 63 + int(torch.randint(0, 1000, ()))
    ops = {"add": lambda t: t + big, "mul": lambda t: t.mul(big), "sub": lambda t: t.sub(big)}
    with torch.pjrt.set_eager_mode(mode):
        for name, op in ops.items():
            for t in (ints, floats):
                assert torch.equal(op(t.to("pjrt")).cpu(), op(t)), (name, t.dtype)
        for fill in (lambda device: torch.full((2,), big, device=device),
                     lambda device: torch.zeros(2, dtype=torch.int64, device=device).fill_(big)):
            with pytest.raises(RuntimeError, match="value cannot be converted to type int64_t without overflow"):
                fill("cpu")
            with pytest.raises(RuntimeError, match="value cannot be converted to type int64_t without overflow"):
                fill("pjrt").cpu()
