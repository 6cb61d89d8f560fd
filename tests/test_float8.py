"""float8 tensors on pjrt: storage, casts bit for bit with CPU in every mode, and torch._scaled_mm.

Casts are compared as bytes (NaN payloads and signs included) on fresh random values, random bit
patterns and the values where the float8 rules bite (saturation, ties, double rounding, subnormals).
"""

from __future__ import annotations

import contextlib
import io
import random
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from support import assert_same, to_device
from torch.utils import _pytree as pytree

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]
WIDE_FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTEGERS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]
SPECIAL = [
    0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 448, -449, 464, 465, 480, 1e30,
    57344, 57345, 61439, 61440, 65504, 1e-9, 2**-9, 2**-10, 2**-16, 2**-17, 3 * 2**-17, 2**-127, 2**-128,
    1.5 * 2**-127, 2**127, 2**128, 1.5, 3.0, 448.0 * 1.5, 1.0625 + 2**-40, 1.0625 - 2**-40, 1e-40, -1e-40,
]
_INTEGER_CARRIER = {2: torch.int16, 4: torch.int32}
# Every dtype in strict mode; fused and compiled programs reach the same cast lowering, so they take the
# saturating format and the exponent-only one (each has its own rule).
CAST_CASES = [("strict", d) for d in FLOAT8] + [
    (mode, d) for mode in ("fused", "compiled") for d in (torch.float8_e4m3fn, torch.float8_e8m0fnu)]


@pytest.fixture(autouse=True)
def generic_cpu_reference():  # noqa: ANN201
    """CPU's oneDNN float8 kernels exist only on some hosts (AMX/AVX512-FP16) and take other inputs and
    word their errors otherwise; the reference is CPU's generic path, the same on every host."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
        with torch.backends.mkldnn.flags(enabled=False):
            yield


@pytest.fixture(scope="module")
def generator() -> torch.Generator:
    seed = random.randrange(2**31)
    print(f"float8 test seed {seed}")
    return torch.Generator().manual_seed(seed)


def _values(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values over many scales, random bit patterns and the special values, in `dtype`."""
    if dtype is torch.bool:
        return torch.rand(64, generator=generator) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        wide = torch.randint(max(info.min, -2**62), min(info.max, 2**62), (512,), generator=generator)
        small = torch.randint(-600 if info.min < 0 else 1, 600, (512,), generator=generator)
        return torch.cat([wide, small]).to(dtype)
    scales = torch.tensor([1e-40, 1e-6, 1e-3, 1.0, 30.0, 300.0, 1e5, 1e40], dtype=torch.float64).repeat(128)
    values = torch.cat([torch.randn(1024, generator=generator, dtype=torch.float64) * scales,
                        torch.tensor(SPECIAL, dtype=torch.float64)]).to(dtype)
    if dtype.itemsize in _INTEGER_CARRIER:
        carrier = _INTEGER_CARRIER[dtype.itemsize]
        info = torch.iinfo(carrier)
        patterns = torch.randint(info.min, info.max, (1024,), generator=generator).to(carrier).view(dtype)
        values = torch.cat([values, patterns])
    return values


def _every_float8(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().contiguous().view(torch.uint8)


def _in_range(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a float8 -> integer conversion is defined (C++ leaves NaN and overflow undefined)."""
    wide = values.double()
    if dtype is torch.bool:
        return torch.ones_like(wide, dtype=torch.bool)
    info = torch.iinfo(dtype)
    return (wide >= info.min) & (wide < float(info.max) + 1)


@contextlib.contextmanager
def _strict() -> Iterator[None]:
    yield


MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "strict": _strict,
    "fused": lambda: torch.pjrt.set_eager_mode(torch.pjrt.EagerMode.DEFER_AND_FUSE),
}


def _run(mode: str, fn: Callable, *args: torch.Tensor) -> list[torch.Tensor]:
    if mode == "compiled":
        torch._dynamo.reset()
        return [t.cpu() for t in torch.compile(fn, backend="pjrt", fullgraph=True, dynamic=False)(*args)]
    with MODES[mode]():
        return [t.cpu() for t in fn(*args)]


@pytest.mark.parametrize(("mode", "float8"), CAST_CASES, ids=str)
def test_casts_to_float8_are_bit_exact(mode: str, float8: torch.dtype, generator: torch.Generator) -> None:
    sources = WIDE_FLOATS + INTEGERS + [torch.bool] + [d for d in FLOAT8 if d is not float8]
    inputs = [_values(d, generator) if d not in FLOAT8 else _every_float8(d) for d in sources]
    results = _run(mode, lambda *xs: [x.to(float8) for x in xs], *to_device(inputs))
    for source, x, got in zip(sources, inputs, results):
        expected = x.to(float8)
        differ = (_bytes(got) != _bytes(expected)).nonzero().flatten()[:4]
        assert differ.numel() == 0, (f"{source} -> {float8} ({mode}): {x[differ].tolist()} gave bytes "
                                     f"{_bytes(got)[differ].tolist()}, CPU {_bytes(expected)[differ].tolist()}")


@pytest.mark.parametrize(("mode", "float8"), CAST_CASES, ids=str)
def test_casts_from_float8_are_bit_exact(mode: str, float8: torch.dtype) -> None:
    targets = WIDE_FLOATS + INTEGERS + [torch.bool] + [d for d in FLOAT8 if d is not float8]
    every = _every_float8(float8)
    results = _run(mode, lambda x: [x.to(d) for d in targets], every.to("pjrt"))
    for target, got in zip(targets, results):
        expected = every.to(target)
        assert got.dtype == target
        defined = torch.ones(256, dtype=torch.bool) if target.is_floating_point else _in_range(every.float(), target)
        differ = ((_bytes(got) != _bytes(expected)).view(256, -1).any(1) & defined).nonzero().flatten()[:4]
        assert differ.numel() == 0, (f"{float8} -> {target} ({mode}): bytes {_bytes(every)[differ].tolist()} gave "
                                     f"{got[differ].tolist()}, CPU {expected[differ].tolist()}")


@pytest.mark.parametrize("float8", FLOAT8, ids=str)
def test_host_round_trips_keep_the_bytes(float8: torch.dtype) -> None:
    every = _every_float8(float8).reshape(16, 16)
    on_device = every.to("pjrt")
    assert on_device.dtype == float8 and on_device.device.type == "pjrt"
    assert torch.equal(_bytes(on_device), _bytes(every))
    assert torch.equal(_bytes(on_device.t().contiguous()), _bytes(every.t().contiguous()))
    buffer = io.BytesIO()
    torch.save(on_device, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert loaded.device.type == "pjrt" and loaded.dtype == float8
    assert torch.equal(_bytes(loaded), _bytes(every))
    assert repr(on_device.cpu()) == repr(every)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_what_cpu_runs_on_float8_runs_on_pjrt(mode: str, generator: torch.Generator) -> None:
    x = (torch.randn(4, 6, generator=generator) * 200).to(torch.float8_e4m3fn)
    y = (torch.randn(4, 6, generator=generator) * 200).to(torch.float8_e4m3fn)
    mask = torch.randn(4, 6, generator=generator) > 0
    index = torch.tensor([3, 0])

    def ops(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
        filled = x.clone().fill_(-1000.0 / 3)
        put = x.clone().index_put_((index,), y[:2])
        return [torch.cat([x, y]), torch.stack([x, y]), x.t().contiguous(), x[index], put, filled,
                torch.where(mask, x, y), x.masked_select(mask), x * y, x.abs(), x == y, x != y, x.isnan(),
                x.flip(0), x.roll(1, 0), x.repeat(2, 1), torch.nn.functional.pad(x, (1, 1)), x.any(),
                torch.slice_scatter(x, y[:2], 0, 0, 2), x @ y.t(), torch.addmm(x[:, :4], x, y.t()),
                x.view(torch.uint8), x.to(torch.float8_e5m2)]

    expected = ops(x, y, mask, index)
    with MODES[mode]():
        outputs = ops(*to_device((x, y, mask, index)))
        assert {t.device.type for t in outputs} == {"pjrt"}
        actual = [t.cpu() for t in outputs]
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        assert torch.equal(_bytes(a), _bytes(e)), (a, e)
    assert x.to("pjrt")[1, 2].item() == x[1, 2].item()
    assert x.to("pjrt").tolist() == x.tolist()



# Ops CPU has no float8 kernel for, each with its own kernel name in CPU's message.
REFUSED: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "div": lambda x, y: x / y,
    "scalar mul": lambda x, y: x * 2, "add_": lambda x, y: x.clone().add_(y), "neg": lambda x, y: -x,
    "sum": lambda x, y: x.sum(), "mean": lambda x, y: x.mean(), "max": lambda x, y: x.max(),
    "argmax": lambda x, y: x.argmax(), "cumsum": lambda x, y: x.cumsum(0), "exp": lambda x, y: x.exp(),
    "sqrt": lambda x, y: x.sqrt(), "pow": lambda x, y: x**2, "lt": lambda x, y: x < y,
    "maximum": lambda x, y: torch.maximum(x, y), "clamp": lambda x, y: x.clamp(0, 1),
    "relu": lambda x, y: torch.relu(x), "gelu": lambda x, y: torch.nn.functional.gelu(x),
    "softmax": lambda x, y: x.softmax(-1), "bmm": lambda x, y: torch.bmm(x[None], y.t()[None]),
    "sort": lambda x, y: x.sort(), "tril": lambda x, y: x.tril(), "sign": lambda x, y: x.sign(),
    "masked_fill": lambda x, y: x.masked_fill(x == y, 1.0), "nonzero": lambda x, y: x.nonzero(),
    "unique": lambda x, y: torch.unique(x),
}


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("float8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cpu_refuses_on_float8_pjrt_refuses(name: str, float8: torch.dtype, mode: str,
                                                 generator: torch.Generator) -> None:
    """CPU's NotImplementedError, with its message, rather than a value computed anyway."""
    x, y = ((torch.randn(4, 6, generator=generator) * 20).to(float8) for _ in range(2))
    with pytest.raises(NotImplementedError) as on_cpu:
        REFUSED[name](x, y)
    assert "not implemented for 'Float8" in str(on_cpu.value)
    with pytest.raises(NotImplementedError) as on_pjrt:
        _run(mode, lambda a, b: list(pytree.tree_leaves(REFUSED[name](a, b))), *to_device((x, y)))
    assert str(on_pjrt.value) == str(on_cpu.value)

def _scaled_mm_operands(generator: torch.Generator, rows: int = 32, inner: int = 64, cols: int = 48) -> tuple:
    a = (torch.randn(rows, inner, generator=generator) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(cols, inner, generator=generator) * 4).to(torch.float8_e4m3fn).t()  # column-major
    return a, b


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaling", ["tensor-wise", "row-wise"])
@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_scaled_mm_matches_cpu(mode: str, scaling: str, out_dtype: torch.dtype, generator: torch.Generator) -> None:
    a, b = _scaled_mm_operands(generator)
    if scaling == "tensor-wise":
        scale_a, scale_b = torch.rand((), generator=generator) + 0.5, torch.rand((), generator=generator) + 0.5
    else:
        scale_a = torch.rand(a.shape[0], 1, generator=generator) + 0.5
        scale_b = torch.rand(1, b.shape[1], generator=generator) + 0.5
    bias = torch.randn(b.shape[1], generator=generator).to(out_dtype)

    def product(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                bias: torch.Tensor) -> list[torch.Tensor]:
        return [torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype),
                torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)]

    expected = product(a, b, scale_a, scale_b, bias)
    actual = _run(mode, product, *to_device((a, b, scale_a, scale_b, bias)))
    # Float32 sums of the same products in another order differ by a few ulps of the sum of their magnitudes.
    magnitude = ((a.float().abs() @ b.float().abs()) * scale_a * scale_b).max().item()
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype
        if out_dtype is torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=4 * torch.finfo(torch.float32).eps * magnitude)
        else:
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-4)


def test_scaled_mm_float8_output_and_scale_result(generator: torch.Generator) -> None:
    a, b = _scaled_mm_operands(generator, rows=16, inner=32, cols=24)
    scale_a, scale_b, scale_result = torch.tensor(0.75), torch.tensor(1.5), torch.tensor(3.0)
    for out_dtype in (None, torch.float8_e5m2, torch.float8_e4m3fnuz):
        expected = torch._scaled_mm(a, b, scale_a, scale_b, scale_result=scale_result, out_dtype=out_dtype)
        actual = torch._scaled_mm(*to_device((a, b, scale_a, scale_b)), scale_result=scale_result.to("pjrt"),
                                  out_dtype=out_dtype)
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=0.125, atol=0, equal_nan=True)


def _bad_scaled_mm_calls() -> dict[str, Callable[[Callable], tuple]]:
    """Calls CPU rejects, as functions of a converter (identity for CPU, .to('pjrt') for pjrt)."""
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(24, 32).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    return {
        "float32 operand": lambda on: (on(a.float()), on(b), on(one), on(one)),
        "float64 scale": lambda on: (on(a), on(b), on(one.double()), on(one)),
        "two-element scale": lambda on: (on(a), on(b), on(torch.ones(2)), on(one)),
        "row-wise scales of the wrong shape": lambda on: (on(a), on(b), on(torch.ones(16)), on(torch.ones(24))),
        "row-wise and tensor-wise mixed": lambda on: (on(a), on(b), on(torch.ones(16, 1)), on(one)),
        "3-d operand": lambda on: (on(a[None]), on(b), on(one), on(one)),
        "shapes that do not multiply": lambda on: (on(a), on(b[:16]), on(one), on(one)),
    }


@pytest.mark.parametrize("case", list(_bad_scaled_mm_calls()))
def test_scaled_mm_rejects_what_cpu_rejects(case: str) -> None:
    call = _bad_scaled_mm_calls()[case]
    with pytest.raises(Exception) as on_cpu:
        torch._scaled_mm(*call(lambda t: t), out_dtype=torch.float32)
    with pytest.raises(type(on_cpu.value)) as on_pjrt:
        torch._scaled_mm(*call(lambda t: t.to("pjrt")), out_dtype=torch.float32)
    assert str(on_pjrt.value).split("\n")[0] == str(on_cpu.value).split("\n")[0]


def test_scaled_mm_rejects_bad_bias_and_scale_result() -> None:
    a, b = _scaled_mm_operands(torch.Generator().manual_seed(0), rows=16, inner=32, cols=24)
    one = torch.tensor(1.0)
    for extra in ({"bias": torch.randn(16)}, {"scale_result": torch.ones(2)}, {"scale_result": one.double()}):
        with pytest.raises(RuntimeError) as on_cpu:
            torch._scaled_mm(a, b, one, one, **extra)
        with pytest.raises(RuntimeError, match=str(on_cpu.value)):
            torch._scaled_mm(*to_device((a, b, one, one)), **to_device(extra))


def test_float8_promotion_is_rejected_like_cpu() -> None:
    x = torch.randn(4).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
        torch.cat([x.to("pjrt"), torch.randn(4, device="pjrt")])
    assert_same(torch.cat([x.to("pjrt"), x.to("pjrt")]).float(), torch.cat([x, x]).float())


def test_unheld_dtypes_name_the_ones_that_are() -> None:
    with pytest.raises(TypeError, match="float8_e4m3fn.*float4_e2m1fn_x2"):
        torch.zeros(2, dtype=torch.complex32).to("pjrt")


def _fp4_pairs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Random bytes as torch.float4_e2m1fn_x2: two e2m1 values per byte, every code (NaN-free format) possible."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).view(torch.float4_e2m1fn_x2)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_fp4_pairs_move_and_select_byte_for_byte(mode: str, generator: torch.Generator) -> None:
    """What CPU does with packed fp4 (held on pjrt as its bytes): copies, views, joins, selection, equality."""
    x, y = _fp4_pairs(generator, 4, 6), _fp4_pairs(generator, 4, 6)
    mask = torch.randn(4, 6, generator=generator) > 0

    def ops(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        return [x.clone(), torch.empty_like(x).copy_(y), torch.cat([x, y]), torch.stack([x, y]), x.t().contiguous(),
                x[1:3, ::2].clone(), torch.where(mask, x, y), x.flip(0), x == y, x != y, x.view(torch.uint8),
                torch.zeros(3, 2, dtype=x.dtype, device=x.device)]

    expected = ops(x, y, mask)
    with MODES[mode]():
        outputs = ops(*to_device((x, y, mask)))
        assert {t.device.type for t in outputs} == {"pjrt"}
        actual = [t.cpu() for t in outputs]
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(_bytes(a), _bytes(e)), (a, e)
    buffer = io.BytesIO()
    torch.save(x.to("pjrt"), buffer)
    buffer.seek(0)
    assert torch.equal(_bytes(torch.load(buffer)), _bytes(x))


# What CPU refuses on packed fp4 (every cast and arithmetic, fills other than zeros, gathers).
FP4_REFUSED: dict[str, Callable[[torch.Tensor], object]] = {
    "to float32": lambda x: x.float(), "from float32": lambda x: torch.ones(2, device=x.device).to(x.dtype),
    "to float8": lambda x: x.to(torch.float8_e4m3fn), "mul": lambda x: x * x, "fill_": lambda x: x.clone().fill_(1),
    "ones": lambda x: torch.ones(3, dtype=x.dtype, device=x.device), "index": lambda x: x[[2, 0]],
    "sum": lambda x: x.sum(),
}


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("name", list(FP4_REFUSED))
def test_what_cpu_refuses_on_fp4_pairs_pjrt_refuses(name: str, mode: str, generator: torch.Generator) -> None:
    x = _fp4_pairs(generator, 4, 6)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float4_e2m1fn_x2'"):
        FP4_REFUSED[name](x)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float4_e2m1fn_x2'"):
        _run(mode, lambda t: [FP4_REFUSED[name](t)], x.to("pjrt"))
