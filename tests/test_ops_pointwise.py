"""Pointwise lowerings (and the prims behind the refs decompositions) against PyTorch on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from support import check, to_device

NAN, INF = math.nan, math.inf
FLOATS = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10),
       torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2), torch.float16: dict(atol=1e-3, rtol=1e-3)}


def uniform(shape: tuple[int, ...], low: float, high: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.rand(shape, dtype=torch.float64) * (high - low) + low).to(dtype)


def integers(shape: tuple[int, ...], low: int = -9, high: int = 10, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(low, high, shape, dtype=dtype)


# op name -> input domain
UNARY_FLOAT = {
    "sqrt": (0.1, 4), "rsqrt": (0.1, 4), "exp": (-3, 3), "exp2": (-3, 3), "expm1": (-3, 3), "log": (0.1, 4),
    "log2": (0.1, 4), "log10": (0.1, 4), "log1p": (-0.5, 4), "sin": (-4, 4), "cos": (-4, 4), "tan": (-1.4, 1.4),
    "asin": (-0.9, 0.9), "acos": (-0.9, 0.9), "atan": (-4, 4), "sinh": (-3, 3), "cosh": (-3, 3), "tanh": (-3, 3),
    "asinh": (-3, 3), "acosh": (1.1, 4), "atanh": (-0.9, 0.9), "sigmoid": (-5, 5), "erf": (-2, 2), "erfc": (-2, 2),
    "erfinv": (-0.9, 0.9), "lgamma": (0.1, 5), "digamma": (0.1, 5), "i0": (-3, 3), "neg": (-3, 3), "abs": (-3, 3),
    "sign": (-3, 3), "sgn": (-3, 3), "reciprocal": (0.5, 3), "floor": (-3, 3), "ceil": (-3, 3), "round": (-3, 3),
    "trunc": (-3, 3), "frac": (-3, 3), "square": (-3, 3), "deg2rad": (-90, 90), "rad2deg": (-3, 3),
    "sinc": (-3, 3), "angle": (-3, 3), "isnan": (-1, 1), "isinf": (-1, 1), "isfinite": (-1, 1),
    "signbit": (-1, 1), "logical_not": (-1, 1), "nan_to_num": (-1, 1), "positive": (-1, 1),
}
SPECIAL = {
    "erfcx": (-2, 5), "i0e": (-3, 3), "i1": (-3, 3), "i1e": (-3, 3), "ndtri": (0.05, 0.95), "ndtr": (-3, 3),
    "log_ndtr": (-10, 3), "entr": (0.01, 3), "expit": (-4, 4), "sinc": (-2, 2), "erfinv": (-0.9, 0.9),
    "modified_bessel_i0": (-3, 3), "modified_bessel_i1": (-3, 3), "spherical_bessel_j0": (-5, 5),
    "bessel_j0": (-40, 40), "bessel_j1": (-40, 40), "bessel_y0": (0.05, 40), "bessel_y1": (0.05, 40),
    "modified_bessel_k0": (0.05, 30), "modified_bessel_k1": (0.05, 30), "scaled_modified_bessel_k0": (0.05, 300),
    "scaled_modified_bessel_k1": (0.05, 300), "airy_ai": (-10, 5),
}


@pytest.mark.parametrize("name", sorted(UNARY_FLOAT))
def test_unary_float32(name: str) -> None:
    check(getattr(torch, name), uniform((6, 7), *UNARY_FLOAT[name]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["sqrt", "exp", "log", "sin", "tanh", "sigmoid", "erfinv", "lgamma", "round", "abs"])
def test_unary_dtypes(name: str, dtype: torch.dtype) -> None:
    check(getattr(torch, name), uniform((5, 4), *UNARY_FLOAT[name], dtype), **TOL[dtype])


@pytest.mark.parametrize("name", ["sqrt", "exp", "sin", "sigmoid", "abs", "neg", "sign", "floor", "round",
                                  "reciprocal", "square", "isnan", "signbit", "logical_not", "bitwise_not"])
def test_unary_int64(name: str) -> None:
    check(getattr(torch, name), integers((5, 4)), atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special(name: str) -> None:
    check(getattr(torch.special, name), uniform((5, 4), *SPECIAL[name]), atol=1e-5, rtol=1e-4)


def test_special_binary_and_parametrized() -> None:
    x, q = uniform((5, 4), 1.5, 4), uniform((5, 4), 0.5, 3)
    check(torch.special.zeta, x, q, atol=1e-5, rtol=1e-4)
    check(lambda a: torch.special.zeta(a, 2.0), x, atol=1e-5, rtol=1e-4)
    check(torch.special.xlog1py, uniform((5, 4), -2, 2), q)
    check(torch.special.xlogy, uniform((5, 4), -2, 2), q)
    check(lambda a: torch.special.polygamma(2, a), q, atol=1e-4, rtol=1e-4)
    negative = torch.tensor([-0.5, -1.5, -2.3, -3.7, -10.2, -0.01, 0.3, 2.5], dtype=torch.float64)
    for n in (1, 2, 3):
        check(lambda a, n=n: torch.polygamma(n, a), negative, atol=1e-9, rtol=1e-9)
        check(lambda a, n=n: torch.polygamma(n, a), uniform((30,), -150, 20), atol=1e-3, rtol=1e-3)
    check(_grad(torch.digamma), negative, atol=1e-9, rtol=1e-9)
    check(lambda a: torch.special.multigammaln(a, 3), x, atol=1e-5, rtol=1e-5)
    check(lambda a: torch.logit(a, 0.1), uniform((5, 4), 0, 1))
    check(torch.special.gammainc, x, q, atol=1e-5, rtol=1e-4)
    check(torch.special.gammaincc, x, q, atol=1e-5, rtol=1e-4)


BINARY = {
    "add": (-3, 3), "sub": (-3, 3), "mul": (-3, 3), "div": (0.5, 3), "floor_divide": (-5, 5), "remainder": (-5, 5),
    "fmod": (-5, 5), "pow": (0.2, 2), "atan2": (-3, 3), "hypot": (-3, 3), "copysign": (-3, 3),
    "nextafter": (-3, 3), "logaddexp": (-3, 3), "logaddexp2": (-3, 3), "xlogy": (0.1, 3), "maximum": (-3, 3),
    "minimum": (-3, 3), "fmax": (-3, 3), "fmin": (-3, 3), "eq": (-1, 1), "ne": (-1, 1), "lt": (-1, 1),
    "le": (-1, 1), "gt": (-1, 1), "ge": (-1, 1), "logical_and": (-1, 1), "logical_or": (-1, 1),
    "logical_xor": (-1, 1), "heaviside": (-1, 1), "rsub": (-3, 3), "true_divide": (0.5, 3),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_float32(name: str) -> None:
    low, high = BINARY[name]
    check(getattr(torch, name), uniform((4, 5), low, high), uniform((4, 5), low, high), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "remainder", "pow", "eq", "lt"])
def test_binary_scalar_and_broadcast(name: str) -> None:
    fn = getattr(torch, name)
    x = uniform((4, 5), 0.5, 2)
    check(lambda a: fn(a, 1.5), x)
    check(lambda a: fn(a, 2), x)
    check(lambda a, b: fn(a, b), x, uniform((5,), 0.5, 2))
    check(lambda a, b: fn(a, b), x, torch.tensor(1.25))


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "floor_divide", "remainder", "fmod", "pow",
                                  "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift",
                                  "bitwise_right_shift", "gcd", "lcm", "maximum", "minimum", "eq", "ge"])
def test_binary_int64(name: str) -> None:
    divisor = integers((4, 5), 1, 6) * (integers((4, 5), 0, 2) * 2 - 1)
    other = divisor.abs() if "shift" in name or name == "pow" else divisor
    check(getattr(torch, name), integers((4, 5)), other)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", ["add", "mul", "div", "remainder", "atan2", "pow", "maximum", "nextafter"])
def test_binary_dtypes(name: str, dtype: torch.dtype) -> None:
    check(getattr(torch, name), uniform((4, 5), 0.5, 3, dtype), uniform((4, 5), 0.5, 3, dtype), **TOL[dtype])


def test_alpha_and_wrapped_numbers() -> None:
    x, y = uniform((3, 4), -2, 2), uniform((3, 4), -2, 2)
    check(lambda a, b: torch.add(a, b, alpha=2.5), x, y)
    check(lambda a, b: torch.sub(a, b, alpha=-0.5), x, y)
    check(lambda a, b: torch.rsub(a, b, alpha=3), x, y)
    check(lambda a: 2.0 - a, x)
    check(lambda a: 3 / a, x)
    check(lambda a: a * True, x)
    check(lambda a: torch.add(a, 2, alpha=3), integers((3, 4)))


def test_mixed_dtype_promotion() -> None:
    check(lambda a, b: a + b, integers((4,), dtype=torch.int8), integers((4,), dtype=torch.int64))
    check(lambda a, b: a * b, integers((4,)), uniform((4,), -1, 1))
    check(lambda a, b: a / b, integers((4,), 1, 9, dtype=torch.int32), integers((4,), 1, 9, dtype=torch.int32))
    check(lambda a, b: a + b, uniform((4,), -1, 1, torch.bfloat16), uniform((4,), -1, 1, torch.float16))
    check(lambda a: a + 200, torch.tensor([100, 3, 255], dtype=torch.uint8))
    check(lambda a: a << 9, torch.tensor([1, -3, 5], dtype=torch.int8))
    check(lambda a: a >> 9, torch.tensor([1, -3, 5], dtype=torch.int8))
    check(lambda a: a // -1, torch.tensor([-128, 3], dtype=torch.int8))
    check(lambda a, b: (a & b, a | b, a ^ b, ~a, a + b, a * b, a.int() ** b.int()),
          torch.rand(6) > 0.5, torch.rand(6) > 0.5)


def test_division_semantics() -> None:
    a = torch.tensor([-7.0, -3.5, -0.0, 0.0, 2.5, 7.0, NAN, INF, -INF, 5.0, 1.0, -1.0])
    b = torch.tensor([2.0, -2.0, 3.0, -3.0, -0.5, 0.0, 1.0, 2.0, -INF, INF, 0.0, -0.0])
    for mode in (None, "trunc", "floor"):
        check(lambda x, y, m=mode: torch.div(x, y, rounding_mode=m), a, b, equal_nan=True)
    for fn in (torch.remainder, torch.fmod, torch.floor_divide):
        check(fn, a, b, equal_nan=True)
    i = integers((40,), -20, 20)
    j = integers((40,), 1, 7) * (integers((40,), 0, 2) * 2 - 1)
    for mode in (None, "trunc", "floor"):
        check(lambda x, y, m=mode: torch.div(x, y, rounding_mode=m), i, j)
    check(torch.remainder, i, j)
    check(torch.fmod, i, j)
    check(lambda x: torch.remainder(x, -3), i)
    check(lambda x: torch.remainder(5, x), j)
    check(lambda x, y: torch.div(x, y, rounding_mode="trunc"), i.reshape(4, 10), j[:10])


def test_pow_semantics() -> None:
    i = integers((30,), -4, 5)
    check(torch.pow, i, integers((30,), -3, 5))
    check(lambda x: x**3, i)
    check(lambda x: x**0.5, i.abs())
    check(lambda x: 2**x, i.abs())
    check(lambda x: x**2, torch.tensor([NAN, -INF, -2.0, 0.0]), equal_nan=True)
    check(torch.pow, torch.tensor([0.0, -2.0, 0.0, 4.0]), torch.tensor([-1.0, 0.5, 0.0, -0.5]), equal_nan=True)


def test_rounding_semantics() -> None:
    check(torch.round, torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, -2.5]))
    check(lambda x: torch.round(x, decimals=1), torch.tensor([0.25, 0.35, 1.45, -0.25, 123.456]))
    check(lambda x: torch.round(x, decimals=-1), torch.tensor([15.0, 25.0, -35.0, 123.456]))
    check(lambda x: (torch.floor(x), torch.ceil(x), torch.trunc(x), torch.frac(x)), uniform((20,), -5, 5))


def test_nan_and_inf_semantics() -> None:
    x = torch.tensor([-7.0, -0.0, 0.0, 2.5, NAN, INF, -INF])
    y = torch.tensor([NAN, 1.0, -1.0, NAN, 2.0, INF, -INF])
    for fn in (torch.maximum, torch.minimum, torch.fmax, torch.fmin, torch.copysign, torch.atan2,
               torch.logaddexp, torch.hypot, torch.heaviside):
        check(fn, x, y, equal_nan=True)
    for fn in (torch.sign, torch.isnan, torch.isinf, torch.isfinite, torch.isposinf, torch.isneginf,
               torch.signbit, torch.nan_to_num, torch.angle, torch.digamma, torch.sinc):
        check(fn, x, equal_nan=True)
    check(lambda a: torch.nan_to_num(a, 1.0, 2.0, -2.0), x)
    check(torch.nan_to_num, x.bfloat16())
    check(torch.nan_to_num, x.half())
    check(lambda a: torch.clamp(a, -1.0, 1.0), x, equal_nan=True)
    check(lambda a: torch.clamp(a, 1.0, -1.0), x, equal_nan=True)
    check(lambda a: torch.clamp(a, min=NAN), x, equal_nan=True)
    check(torch.xlogy, torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([NAN, 0.0, 0.0, 3.0]), equal_nan=True)
    check(torch.special.entr, torch.tensor([-1.0, 0.0, 0.5, INF, NAN]), equal_nan=True)
    check(torch.lgamma, torch.tensor([-0.5, -1.5, -2.5, 0.0, 1.0, 3.3]))
    check(torch.erfinv, torch.tensor([-1.0, 1.0, 0.999, -0.5, 2.0]), equal_nan=True)


def test_clamp_variants() -> None:
    x = uniform((4, 5), -3, 3)
    check(lambda a: torch.clamp(a, -1, 1), x)
    check(lambda a: torch.clamp(a, min=-0.5), x)
    check(lambda a: torch.clamp(a, max=0.5), x)
    check(lambda a, lo, hi: torch.clamp(a, lo, hi), x, uniform((4, 5), -2, 0), uniform((5,), 0, 2))
    check(lambda a, lo: torch.clamp(a, min=lo), x, uniform((4, 5), -2, 0))
    check(lambda a: torch.clamp_min(a, 0.25), x)
    check(lambda a: torch.clamp_max(a, 0.25), x)
    check(lambda a: torch.clamp(a, 0.5, 2.5), integers((4, 5)))
    check(lambda a: torch.clamp(a, -2, 3), integers((4, 5)))


def test_where_lerp_addc() -> None:
    x, y, w = uniform((4, 5), -3, 3), uniform((4, 5), -3, 3), uniform((4, 5), -0.5, 1.5)
    check(lambda a, b: torch.where(a > 0, a, b), x, y)
    check(lambda a: torch.where(a > 0, a, 0.0), x)
    check(lambda a: torch.where(a > 0, 1.0, -1.0), x)
    check(lambda a, b: torch.where(a > 0, a, b), integers((4, 5)), x)
    check(lambda a, b: torch.lerp(a, b, 0.3), x, y)
    check(lambda a, b: torch.lerp(a, b, 0.8), x, y)
    check(torch.lerp, x, y, w)
    check(lambda a, b, c: torch.addcmul(a, b, c, value=0.5), x, y, w)
    check(lambda a, b, c: torch.addcdiv(a, b, c, value=-2), x, y, w + 2)
    check(lambda a, b, c: torch.addcmul(a, b, c, value=2), integers((4, 5)), integers((4, 5)), integers((4, 5)))


def test_complex() -> None:
    z, w = torch.randn(6, dtype=torch.complex64), torch.randn(6, dtype=torch.complex64)
    check(lambda a, b: (a + b, a - b, a * b, a / b), z, w, atol=1e-5, rtol=1e-5)
    check(lambda a: (a.abs(), a.exp(), a.sqrt(), a.log(), torch.sgn(a), torch.angle(a), a.sin(), a.tanh()),
          z, atol=1e-5, rtol=1e-5)
    check(lambda a, b: (a == b, a != b, torch.isnan(a)), z, w)
    check(torch.logaddexp, z * 3, w * 3, atol=1e-5, rtol=1e-5)
    parts = torch.tensor([NAN, INF, -INF, 1.5])
    check(torch.nan_to_num, torch.complex(parts, parts.flip(0)))


def test_non_contiguous_inputs() -> None:
    x, y = uniform((6, 8), -2, 2), uniform((8, 6), -2, 2)
    check(lambda a, b: torch.atan2(a.t(), b), x, y)
    check(lambda a, b: a[::2, 1::3] * b[1:7:2, ::2].t(), x, y)
    check(lambda a: torch.exp(a[:, 2:5]), x)
    check(lambda a: torch.where(a.t() > 0, a.t(), 0.0), x)
    check(lambda a: torch.sigmoid(a.expand(3, 6, 8)), x)


def test_in_place_variants() -> None:
    x, y = uniform((4, 5), 0.5, 2), uniform((4, 5), 0.5, 2)

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a.add_(b, alpha=2).mul_(b).div_(3).sqrt_().clamp_(0.6, 1.5)
        a[1:3].sin_()
        a.t()[::2].neg_()
        a.lerp_(b, 0.25).addcmul_(b, b, value=0.1)
        torch.pow(a, 2, out=None)
        return a

    check(run, x, y)
    check(lambda a: a.clone().floor_divide_(3).remainder_(4), integers((4, 5)))
    check(lambda a: a.clone().bitwise_left_shift_(2).bitwise_xor_(5), integers((4, 5)))


def test_out_variants() -> None:
    x, y = uniform((4, 5), 0.5, 2), uniform((4, 5), 0.5, 2)
    expected = torch.mul(x, y)
    out = torch.empty(4, 5, device="pjrt")
    torch.mul(*to_device((x, y)), out=out)
    torch.testing.assert_close(out.cpu(), expected)
    grown = torch.empty(0, device="pjrt")
    torch.sin(x.to("pjrt"), out=grown)
    torch.testing.assert_close(grown.cpu(), torch.sin(x))


def test_changing_scalars_do_not_recompile() -> None:
    import torch_pjrt.metrics

    x = uniform((3,), -1, 1)
    check(lambda a: torch.add(a, 0.1, alpha=0.5) * 0.1, x)
    compiles = torch_pjrt.metrics.counters()["compiles"]
    for scalar in (0.2, 0.3, -4.0):
        check(lambda a, s=scalar: torch.add(a, s, alpha=s) * s, x)
    assert torch_pjrt.metrics.counters()["compiles"] == compiles


GRAD_UNARY = {
    "sin": (-3, 3), "exp": (-2, 2), "log": (0.2, 3), "sqrt": (0.2, 3), "rsqrt": (0.2, 3), "sigmoid": (-3, 3),
    "tanh": (-2, 2), "erf": (-2, 2), "erfinv": (-0.8, 0.8), "lgamma": (0.5, 3), "digamma": (0.5, 3),
    "abs": (-2, 2), "reciprocal": (0.5, 2), "atan": (-2, 2), "asin": (-0.8, 0.8), "acosh": (1.2, 3),
    "expm1": (-1, 1), "log1p": (0.1, 2), "i0": (-2, 2), "sinc": (-2, 2), "logit": (0.1, 0.9),
}


def _grad(fn: object) -> object:
    def run(*inputs: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        fn(*leaves).sum().backward()
        return [t.grad for t in leaves]

    return run


@pytest.mark.parametrize("name", sorted(GRAD_UNARY))
def test_gradient_unary(name: str) -> None:
    check(_grad(getattr(torch, name)), uniform((4, 5), *GRAD_UNARY[name]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [
    torch.atan2, torch.hypot, torch.pow, torch.div, torch.maximum, torch.xlogy, torch.copysign,
    lambda a, b: torch.clamp(a, b - 1, b + 1), lambda a, b: torch.where(a > b, a * b, a - b),
    lambda a, b: torch.lerp(a, b, 0.3), lambda a, b: torch.addcdiv(a, a, b, value=0.5),
    lambda a, b: torch.special.xlog1py(a, b), lambda a, b: torch.logaddexp(a, b),
], ids=["atan2", "hypot", "pow", "div", "maximum", "xlogy", "copysign", "clamp", "where", "lerp", "addcdiv",
        "xlog1py", "logaddexp"])
def test_gradient_binary(fn: object) -> None:
    check(_grad(fn), uniform((4, 5), 0.5, 2), uniform((4, 5), 0.5, 2), atol=1e-5, rtol=1e-4)


def test_refs_decompositions_reach_prims() -> None:
    """Running torch._refs on pjrt tensors dispatches the prims themselves."""
    import torch._refs as refs

    x, y = uniform((4, 5), 0.2, 2), uniform((4, 5), 0.2, 2)
    check(lambda a, b: (refs.add(a, b, alpha=2), refs.atan2(a, b), refs.sin(a), refs.where(a > 1, a, b)), x, y)
    check(lambda a: (refs.sum(a, [1]), refs.amax(a, [0]), refs.prod(a), refs.var(a, [0], correction=1)), x,
          atol=1e-5, rtol=1e-5)
    check(lambda a, b: (refs.cat([a, b], 1), refs.permute(a, (1, 0)) * 2, refs.reshape(a, (5, 4)) + 1), x, y)
    check(lambda a: (refs.squeeze(a[:1]), refs.expand(a[:1], (4, 5)) + 0, refs.clamp(a, 0.5, 1.5)), x)
    check(lambda a, b: (refs.div(a, b, rounding_mode="floor"), refs.lerp(a, b, 0.3), refs.cumsum(a, 1)), x, y,
          atol=1e-5, rtol=1e-5)
    check(lambda a, b: refs.div(a, b, rounding_mode="trunc"), integers((6,)), integers((6,), 1, 5))
    check(lambda a: (refs.special.i0e(a), refs.special.erfcx(a), refs.special.i1e(a), refs.special.ndtri(a / 3),
                     refs.special.zeta(a + 1, a), refs.special.log_ndtr(a)), x, atol=1e-5, rtol=1e-5)
    check(lambda a: (refs.special.spherical_bessel_j0(a), refs.exp2(a), refs.frexp(a), refs.special.bessel_j0(a * 20),
                     refs.special.bessel_j1(a * 20)), x, atol=1e-5, rtol=1e-5)
    check(lambda a: refs.fmod(a, 0.3) + refs.remainder(a, -0.3), x, atol=1e-5, rtol=1e-5)


POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
               "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
               "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"]


def _degrees_and_points() -> tuple[torch.Tensor, torch.Tensor]:
    """x includes +-1 and 0; degrees are negative, small and past the trig shortcuts."""
    x = torch.cat([torch.tensor([-1.0, 1.0, 0.0, 0.5]), uniform((20,), -1.2, 1.2)])
    n = torch.cat([torch.tensor([3.0, 4.0, 9.0, 12.0]), integers((20,), -1, 14).float()])
    return x, n


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomials(name: str) -> None:
    check(getattr(torch.special, name), *_degrees_and_points(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["chebyshev_polynomial_u", "legendre_polynomial_p"])
def test_orthogonal_polynomial_variants(name: str) -> None:
    fn = getattr(torch.special, name)
    x, n = _degrees_and_points()
    check(fn, x.double(), n.double(), atol=1e-9, rtol=1e-9)
    check(lambda a: fn(a, 5), x, atol=1e-4, rtol=1e-4)
    check(lambda m: fn(0.3, m), n.abs(), atol=1e-4, rtol=1e-4)


def test_bessel_edges() -> None:
    x = torch.tensor([0.0, -1.0, NAN, INF, 1e-12, 0.5, 8.0, 25.0, 25.5, 700.0, -2.5, -30.0], dtype=torch.float64)
    for fn in (torch.special.bessel_j0, torch.special.bessel_j1, torch.special.bessel_y0, torch.special.bessel_y1,
               torch.special.modified_bessel_k0, torch.special.modified_bessel_k1,
               torch.special.scaled_modified_bessel_k0, torch.special.scaled_modified_bessel_k1, torch.special.airy_ai):
        check(fn, x, atol=1e-9, rtol=1e-5, equal_nan=True)


def test_prims_delegating_to_other_families() -> None:
    """Random draws, FFTs, SVD and as_strided_scatter prims reuse the ATen lowerings of their families."""
    prims = torch.ops.prims
    device = torch.device("pjrt")
    draws = [prims.normal([200, 100], mean=1.0, std=2.0, dtype=torch.float32, device=device, requires_grad=False)
             for _ in range(2)]
    first, second = (d.cpu() for d in draws)
    assert abs(first.mean().item() - 1.0) < 0.1 and abs(first.std().item() - 2.0) < 0.1
    assert (first != second).any()
    u = prims.uniform([20000], low=-1.0, high=3.0, dtype=torch.bfloat16, device=device, stride=[1]).cpu().float()
    assert u.min() >= -1.0 and u.max() <= 3.0 and abs(u.mean().item() - 1.0) < 0.1
    z = torch.randn(4, 6, dtype=torch.complex64)
    check(lambda a: (prims.fft_c2c(a, dim=[1], forward=True), prims.fft_r2c(a.real, dim=[0, 1], onesided=True),
                     prims.fft_c2r(a, dim=[1], last_dim_size=10)), z, atol=1e-4, rtol=1e-4)
    m = torch.randn(5, 3)
    u, s, vh = (t.cpu() for t in prims.svd(m.to("pjrt"), full_matrices=False))
    torch.testing.assert_close(u @ torch.diag(s) @ vh, m, atol=1e-5, rtol=1e-5)
    check(lambda a, b: prims.as_strided_scatter(a, b, [2, 2], [3, 1], 1), uniform((10,), -1, 1), uniform((2, 2), -1, 1))


def test_trigamma_rounds_like_pytorch_near_poles() -> None:
    """float32 trigamma near the negative poles follows PyTorch's formula (its rounding of pi x), forward and
    as digamma's derivative."""
    x = uniform((64,), -9, 6)
    check(lambda a: torch.polygamma(1, a), x, atol=1e-5, rtol=1.3e-6)
    check(_grad(torch.digamma), x, atol=1e-5, rtol=1.3e-6)


def test_erfinv_accurate_near_one() -> None:
    """Within float32 rounding of CPU up to |x| -> 1, where the derivative exp(erfinv(x)^2) magnifies errors."""
    x = torch.cat([uniform((200,), -1, 1), 1 - uniform((100,), 0, 1e-3), -1 + uniform((100,), 0, 1e-3)])
    check(torch.erfinv, x, atol=1e-6, rtol=5e-7)
    check(_grad(torch.erfinv), uniform((200,), -0.999, 0.999), atol=1e-5, rtol=2e-6)
    check(torch.erfinv, torch.cat([uniform((100,), -1, 1, torch.float64), torch.tensor([0.0, -0.0, 1, -1, 2.0])]),
          atol=1e-15, rtol=1e-15, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_cross_rounds_products_like_pytorch(dtype: torch.dtype) -> None:
    make = (lambda s: integers(s, dtype=dtype)) if dtype == torch.int64 else (lambda s: uniform(s, -9, 9, dtype))
    check(lambda a, b: torch.linalg.cross(a, b), make((40, 3)), make((40, 3)), atol=0, rtol=0)
    check(lambda a, b: torch.cross(a, b, dim=1), make((4, 3, 5)), make((1, 3, 5)), atol=0, rtol=0)


def _bessel_series(order: int, x: float) -> float:
    """J_n or Y_n (order 0 or 1 with Y for order 1) by their power series in 60-digit decimals: the reference
    for float64, where PyTorch's own values are off by ~3e-7 past |x| = 5."""
    from decimal import Decimal, getcontext

    getcontext().prec = 60
    half = Decimal(abs(x)) / 2
    harmonic = [Decimal(0)]
    for k in range(1, 100):
        harmonic.append(harmonic[-1] + Decimal(1) / k)
    j0 = j1 = y_sum = Decimal(0)
    for k in range(90):
        j0 += (-1) ** k * half ** (2 * k) / math.factorial(k) ** 2
        term = half ** (2 * k + 1) / (math.factorial(k) * math.factorial(k + 1))
        j1 += (-1) ** k * term
        y_sum += (-1) ** k * (harmonic[k] + harmonic[k + 1]) * term
    if order == 0:
        return float(j0)
    pi = Decimal("3.141592653589793238462643383279502884197169399375105820974944")
    gamma = Decimal("0.577215664901532860606512090082402431042159335939923598805767")
    return float(2 / pi * (half.ln() + gamma) * j1 - 1 / (pi * half) - y_sum / pi)


def test_bessel_j0_y1_float64_against_series() -> None:
    x = uniform((24,), 0.5, 12, torch.float64)
    j0 = torch.special.bessel_j0(x.to("pjrt")).cpu()
    y1 = torch.special.bessel_y1(x.to("pjrt")).cpu()
    expected_j0 = torch.tensor([_bessel_series(0, v) for v in x.tolist()], dtype=torch.float64)
    expected_y1 = torch.tensor([_bessel_series(1, v) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(j0, expected_j0, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(y1, expected_y1, atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_division_by_a_broadcast_divisor_rounds_once(mode: str) -> None:
    """XLA would multiply by the reciprocal (one ulp off in most float32 quotients); CPU divides."""
    x, column = uniform((256, 64), -3, 3), uniform((256, 1), 0.5, 2)

    def divide(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (a / 127.5, a / b, torch.div(a, b[0, 0]), torch.ops.prims.div(a, 127.5), a / b.expand_as(a),
                a / b.t().expand(64, 256).t())

    expected = divide(x, column)
    if mode == "compiled":
        actual = torch.compile(divide, backend="pjrt", fullgraph=True)(*to_device((x, column)))
    else:
        with torch.pjrt.set_eager_mode("defer_and_fuse" if mode == "fused" else "defer_never"):
            actual = divide(*to_device((x, column)))
    for a, e in zip(actual, expected):
        assert torch.equal(a.cpu().view(torch.int32), e.view(torch.int32))
