"""Elementwise math, comparisons, logic, bitwise ops, where/clamp/lerp, special functions.

Operands are first brought to PyTorch's *computation* dtype (its type promotion, with
float16/bfloat16/float8 computed in float32 like PyTorch's opmath); the caller casts the result
to the dtype PyTorch's meta kernel gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND
from torch._prims_common import elementwise_dtypes

from torch_pjrt import storage
from torch_pjrt.ops import casts
from torch_pjrt.ops.factories import not_implemented_for
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten

_PYTHON_SAMPLE = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}


def _stand_in(value: Any) -> Any:
    """What PyTorch's promotion sees for an operand: a number for weak scalars, else a meta tensor."""
    if isinstance(value, (bool, int, float, complex)):
        return value
    dtype = np.dtype(value.dtype)
    if value.ndim == 0 and jax.typeof(value).weak_type:
        return _PYTHON_SAMPLE["f" if dtype.name == "bfloat16" else dtype.kind]
    return torch.empty(() if value.ndim == 0 else (0,), dtype=storage.torch_dtype(dtype), device="meta")


def promote(*args: Any, kind: KIND = KIND.DEFAULT, exact: bool = False) -> list[Any]:
    """Operands cast to PyTorch's computation dtype (its result dtype when `exact`); None stays."""
    samples = [_stand_in(a) for a in args if a is not None]
    computation, result = elementwise_dtypes(*samples, type_promotion_kind=kind)
    if computation in storage.FLOAT8_DTYPES:
        computation = torch.float32  # PyTorch CPU computes its few float8 ops (mul, abs) in float32
    dtype = storage.numpy_dtype(result if exact else computation)
    # a uint64 Scalar goes into an integer computation as c10 converts it: two's complement, unchecked (int64 +
    # 2**63 is -2**63 on CPU); a float computation keeps its value
    wraps = dtype.kind in "iu"
    return [None if a is None else jnp.asarray(a - 2 ** 64 if wraps and casts.beyond_int64(a) else a, dtype)
            for a in args]


def is_integral(x: Any) -> bool:
    return np.dtype(x.dtype).kind in "biu"


def is_complex(x: Any) -> bool:
    return np.dtype(x.dtype).kind == "c"


def _unary(fn: Callable, kind: KIND) -> Callable:
    def lowering(self: Any) -> Any:
        (x,) = promote(self, kind=kind)
        return fn(x)

    lowering.__name__ = getattr(fn, "__name__", "unary")
    return lowering


def _binary(fn: Callable, kind: KIND) -> Callable:
    def lowering(self: Any, other: Any) -> Any:
        return fn(*promote(self, other, kind=kind))

    lowering.__name__ = getattr(fn, "__name__", "binary")
    return lowering


# --- arithmetic --------------------------------------------------------------------------------


@register(aten.add.Tensor, aten.add.Scalar)
def add(self: Any, other: Any, alpha: Any = 1) -> Any:
    a, b, alpha = promote(self, other, alpha)
    return a + alpha * b


@register(aten.sub.Tensor, aten.sub.Scalar)
def sub(self: Any, other: Any, alpha: Any = 1) -> Any:
    a, b, alpha = promote(self, other, alpha)
    return a - alpha * b


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self: Any, other: Any, alpha: Any = 1) -> Any:
    return sub(other, self, alpha)


@register(aten.mul.Tensor, aten.mul.Scalar)
def mul(self: Any, other: Any) -> Any:
    a, b = promote(self, other)
    if a.dtype == np.bool_:
        return a & b
    return a * b


def _check_divisor(a: Any, b: Any, op: str) -> None:
    """CPU's integer kernels raise on a zero divisor (a device-side check: the divisor is data)."""
    if is_integral(a):
        checks.fail_if(jnp.broadcast_arrays(a, b)[1] == 0, op, "ZeroDivisionError")


def _trunc_divide(a: Any, b: Any, op: str = "aten::div") -> Any:
    if is_integral(a):
        _check_divisor(a, b, op)
        return jax.lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.trunc(a / b)


def _floor_divide(a: Any, b: Any, op: str = "aten::div") -> Any:
    """Python's floor division; floats follow PyTorch's fmod-based formula (exact quotients)."""
    if is_integral(a):
        _check_divisor(a, b, op)
        return jnp.floor_divide(a, b)
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floored = jnp.floor(div)
    floored = jnp.where(div - floored > 0.5, floored + 1, floored)
    floored = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floored)
    return jnp.where(b == 0, a / b, floored)


def true_divide(a: Any, b: Any) -> Any:
    """a / b rounded once, as CPU divides. XLA's algebraic simplifier turns a division by a broadcast divisor
    (a scalar, a size-1 dimension, an expanded view read inside the same program) into a multiplication by its
    reciprocal, one ulp off in most float32 quotients (and so off by one step after quantization rounding); a
    barrier on every floating divisor keeps the division, since a broadcast may come from the divisor's producer."""
    if not is_integral(b):
        b = jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))))
    return a / b


@register(aten.div.Tensor, aten.div.Scalar)
def div(self: Any, other: Any) -> Any:
    return true_divide(*promote(self, other, kind=KIND.INT_TO_FLOAT))


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(self: Any, other: Any, *, rounding_mode: str | None = None) -> Any:
    if rounding_mode is None:
        return div(self, other)
    a, b = promote(self, other)
    if rounding_mode == "trunc":
        return _trunc_divide(a, b)
    if rounding_mode == "floor":
        return _floor_divide(a, b)
    raise NotImplementedError(f"div: unknown rounding_mode {rounding_mode!r}")


@register(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(self: Any, other: Any) -> Any:
    return _floor_divide(*promote(self, other), op="aten::floor_divide")


@register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(self: Any, other: Any) -> Any:
    """The remainder takes the divisor's sign (Python's %)."""
    a, b = promote(self, other)
    _check_divisor(a, b, "aten::remainder")
    mod = jnp.fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@register(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(self: Any, other: Any) -> Any:
    a, b = promote(self, other)
    _check_divisor(a, b, "aten::fmod")
    return jnp.fmod(a, b)


def _integer_power(base: Any, exponent: Any) -> Any:
    """Integer powers; negative exponents give 0 except for bases 1 and -1 (as PyTorch)."""
    positive = jnp.power(base, jnp.maximum(exponent, 0))
    odd = (exponent % 2) != 0
    one = jnp.ones_like(positive)
    negative = jnp.where(base == 1, one, jnp.where(base == -1, jnp.where(odd, -one, one), 0 * one))
    return jnp.where(exponent < 0, negative, positive)


@register(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow(self: Any, exponent: Any) -> Any:  # noqa: A001
    a, b = promote(self, exponent)
    if a.dtype == np.bool_:
        return a | ~b
    if is_integral(a):
        return _integer_power(a, b)
    return jnp.power(a, b)


@register(aten.neg.default)
def neg(self: Any) -> Any:
    return -self


@register(aten.abs.default)
def abs(self: Any) -> Any:  # noqa: A001
    if self.dtype == np.bool_:
        return self
    return jnp.abs(self)


@register(aten.sign.default)
def sign(self: Any) -> Any:
    """NaN maps to 0, as PyTorch's (0 < x) - (x < 0)."""
    if self.dtype == np.bool_:
        return self
    return jnp.where(jnp.isnan(self), 0, jnp.sign(self)) if not is_integral(self) else jnp.sign(self)


@register(aten.sgn.default)
def sgn(self: Any) -> Any:
    if not is_complex(self):
        return sign(self)
    magnitude = jnp.abs(self)
    return jnp.where(magnitude == 0, 0, self / jnp.where(magnitude == 0, 1, magnitude))


@register(aten.square.default)
def square(self: Any) -> Any:
    (x,) = promote(self, kind=KIND.BOOL_TO_LONG)
    return x * x


def _float_rounding(fn: Callable, kernel: str) -> Callable:
    """Integers round to themselves; CPU has no kernel for bools (nor, for frac, any integer)."""
    def lowering(self: Any) -> Any:
        if self.dtype == np.bool_ or (fn is _frac and is_integral(self)):
            raise not_implemented_for(kernel, self)
        return self if is_integral(self) else fn(self)

    lowering.__name__ = fn.__name__
    return lowering


def _frac(x: Any) -> Any:
    return x - jnp.trunc(x)


for _op, (_fn, _kernel) in {
    aten.floor.default: (jnp.floor, "floor_vml_cpu"), aten.ceil.default: (jnp.ceil, "ceil_vml_cpu"),
    aten.round.default: (jnp.round, "round_vml_cpu"), aten.trunc.default: (jnp.trunc, "trunc_vml_cpu"),
    aten.frac.default: (_frac, "frac_cpu"),
}.items():
    register(_op)(_float_rounding(_fn, _kernel))


@register(aten.round.decimals)
def round_decimals(self: Any, *, decimals: int = 0) -> Any:
    """Half to even at 10**-decimals, scaled the way PyTorch does it."""
    if is_integral(self):
        raise not_implemented_for("round_vml_cpu" if decimals == 0 else "round_cpu", self)
    (x,) = promote(self)
    if decimals == 0:
        return jnp.round(x)
    if decimals > 0:
        scale = 10.0**decimals
        return jnp.round(x * scale) / scale
    scale = 10.0 ** (-decimals)
    return jnp.round(x / scale) * scale


def rounded_like(x: Any, dtype: Any) -> Any:
    """x (computed in float32) rounded to a half-precision dtype's format and kept in float32: the
    rounding PyTorch does between ops, which XLA may otherwise skip inside a fusion."""
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
        return x
    info = jnp.finfo(dtype)
    reduced = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    # reduce_precision flushes what falls below the format's normal range to zero, where PyTorch keeps
    # the format's subnormals: round those to their grid, a power of two apart (scaling by it is exact).
    # bfloat16's subnormals are float32's own, which XLA's CPU runtime flushes in every op anyway.
    exponent = int(info.minexp) - int(info.nmant)
    if exponent < int(jnp.finfo(jnp.float32).minexp):
        return reduced
    subnormal = jnp.round(x * float(2.0 ** -exponent)) * float(2.0 ** exponent)
    return jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, reduced)


@register(aten.linalg_cross.default)
def linalg_cross(self: Any, other: Any, *, dim: int = -1) -> Any:
    """a_i b_j - a_j b_i with each product rounded to the result dtype first, as PyTorch's kernel does."""
    result = np.result_type(*promote(self, other, exact=True))
    a, b = jnp.broadcast_arrays(*promote(self, other))
    axis = dim % a.ndim

    def product(i: int, j: int) -> Any:
        return rounded_like(jax.lax.index_in_dim(a, i, axis) * jax.lax.index_in_dim(b, j, axis), result)

    parts = [product(1, 2) - product(2, 1), product(2, 0) - product(0, 2), product(0, 1) - product(1, 0)]
    return jnp.concatenate(parts, axis)


# --- transcendental and special functions ----------------------------------------------------


def _rsqrt(x: Any) -> Any:
    return jax.lax.rsqrt(x)


def _exp2(x: Any) -> Any:
    return jnp.exp2(x)


def _sigmoid(x: Any) -> Any:
    return jax.nn.sigmoid(x)


def _digamma(x: Any) -> Any:
    """PyTorch: digamma(+-0) = -+inf."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jax.lax.digamma(x))


def _erfinv(y: Any) -> Any:
    """XLA's erfinv (up to 6e-6 off in float32 near +-1) refined by one Newton step. Past |x| = 1 the
    residual is taken on erfc against 1 - |y| (exact), where erf's rounding near 1 would swamp it."""
    x = jss.erfinv(y)
    magnitude = jnp.abs(x)
    residual = jnp.where(magnitude > 0.5, jnp.sign(y) * (jss.erfc(magnitude) - (1 - jnp.abs(y))), y - jss.erf(x))
    step = residual / (2 / math.sqrt(math.pi) * jnp.exp(-x * x))
    return jnp.where(jnp.isfinite(x) & (y != 0), x + step, x)


def _i0(x: Any) -> Any:
    return jss.i0(x)


def _deg2rad(x: Any) -> Any:
    return x * (math.pi / 180)


def _rad2deg(x: Any) -> Any:
    return x * (180 / math.pi)


def _reciprocal(x: Any) -> Any:
    return 1 / x


def _entr(x: Any) -> Any:
    """-x log x, with 0 at 0, -inf below 0 and NaN kept."""
    positive = -x * jnp.log(jnp.where(x > 0, x, 1))
    return jnp.where(jnp.isnan(x), x, jnp.where(x > 0, positive, jnp.where(x == 0, 0.0, -jnp.inf)))


def _angle(x: Any) -> Any:
    if is_complex(x):
        return jnp.angle(x)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, math.pi, 0.0))


FLOAT_UNARY: dict[Any, Callable] = {
    aten.sqrt.default: jnp.sqrt, aten.rsqrt.default: _rsqrt, aten.exp.default: jnp.exp,
    aten.exp2.default: _exp2, aten.expm1.default: jnp.expm1, aten.log.default: jnp.log,
    aten.log2.default: jnp.log2, aten.log10.default: jnp.log10, aten.log1p.default: jnp.log1p,
    aten.sin.default: jnp.sin, aten.cos.default: jnp.cos, aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin, aten.acos.default: jnp.arccos, aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh, aten.cosh.default: jnp.cosh, aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh, aten.acosh.default: jnp.arccosh, aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: _sigmoid, aten.erf.default: jss.erf, aten.erfc.default: jss.erfc,
    aten.erfinv.default: _erfinv, aten.lgamma.default: jax.lax.lgamma, aten.digamma.default: _digamma,
    aten.i0.default: _i0, aten.special_i0e.default: jss.i0e, aten.special_i1.default: jss.i1,
    aten.special_i1e.default: jss.i1e, aten.special_ndtri.default: jss.ndtri, aten.special_ndtr.default: jss.ndtr,
    aten.special_log_ndtr.default: jss.log_ndtr, aten.special_erfcx.default: jss.erfcx,
    aten.special_entr.default: _entr, aten.special_modified_bessel_i0.default: _i0,
    aten.special_modified_bessel_i1.default: jss.i1, aten.deg2rad.default: _deg2rad,
    aten.rad2deg.default: _rad2deg, aten.sinc.default: jnp.sinc, aten.reciprocal.default: _reciprocal,
    aten.angle.default: _angle,
}

for _op, _fn in FLOAT_UNARY.items():
    register(_op)(_unary(_fn, KIND.INT_TO_FLOAT))


@register(aten.conj_physical.default, aten._conj_physical.default)
def conj_physical(self: Any) -> Any:
    return jnp.conj(self) if is_complex(self) else self


@register(aten.logit.default)
def logit(self: Any, eps: float | None = None) -> Any:
    (x,) = promote(self, kind=KIND.INT_TO_FLOAT)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


def _cot_derivative(n: int) -> list[float]:
    """Coefficients (in powers of c = cot(pi x)) of pi^-n d^n/dx^n cot(pi x), from d/dx c = -pi (1 + c^2)."""
    coefficients = [0.0, 1.0]
    for _ in range(n):
        derivative = [k * coefficients[k] for k in range(1, len(coefficients))] + [0.0, 0.0]
        coefficients = [-(derivative[k] + (derivative[k - 2] if k >= 2 else 0.0)) for k in range(len(derivative))]
    return coefficients


_BERNOULLI = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6, -3617 / 510, 43867 / 798, -174611 / 330)


def _polygamma_positive(n: int, x: Any) -> Any:
    """psi_n(x), x > 0, n >= 1: shift by 10 + n with the recurrence, then the asymptotic series
    (Bernoulli terms to B_20), all terms of one sign so float32 keeps full precision."""
    shift = 10 + n
    sign = (-1) ** (n + 1)
    head = sum(1 / (x + k) ** (n + 1) for k in range(shift)) * math.factorial(n)
    z = x + shift
    tail = math.factorial(n - 1) / z**n + math.factorial(n) / (2 * z ** (n + 1))
    for k, bernoulli in enumerate(_BERNOULLI, start=1):
        tail = tail + bernoulli * math.factorial(2 * k + n - 1) / math.factorial(2 * k) / z ** (2 * k + n)
    return sign * (head + tail)


_POLYGAMMA_SHIFT_LIMIT = 10_000


def _polygamma_shifted(n: int, x: Any) -> Any:
    """psi_n(x) for -10^4 < x <= 0: psi_n(x + m) plus the recurrence terms (-1)^(n+1) n! / (x + k)^(n+1),
    k < m = ceil(-x) + 1; x + k is exact, so values near the poles stay accurate (unlike reflection)."""
    steps = jnp.where(x <= 0, jnp.ceil(-x) + 1, 0).astype(np.int32)

    def add(k: Any, total: Any) -> Any:
        return total + jnp.where(k < steps, 1 / (x + k.astype(x.dtype)) ** (n + 1), 0)

    terms = jax.lax.fori_loop(0, jnp.max(steps, initial=0), add, jnp.zeros_like(x))
    return _polygamma_positive(n, x + steps.astype(x.dtype)) + (-1) ** (n + 1) * math.factorial(n) * terms


def _trigamma(x: Any) -> Any:
    """psi_1 by PyTorch's own formula: reflection through sin(pi x) below 1/2, six recurrence steps, then
    the asymptotic series. pi x rounds in the computation dtype, so near the poles float32 loses digits
    exactly as on CPU and CUDA (the reference the device is held to)."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(math.pi * x)
    correction = jnp.where(reflect, -(math.pi * math.pi) / (sin_pi_x * sin_pi_x), 0)
    z = jnp.where(reflect, 1 - x, x)
    series = jnp.zeros_like(x)
    for _ in range(6):
        series = series + 1 / (z * z)
        z = z + 1
    inverse_square = 1 / (z * z)
    tail = (1 + 1 / (2 * z) + inverse_square * (1 / 6 - inverse_square * (1 / 30 - inverse_square * (1 / 42)))) / z
    return jnp.where(reflect, -1, 1) * (correction + series + tail)


@register(aten.polygamma.default)
def polygamma(n: int, self: Any) -> Any:
    """n >= 2: x <= -10^4 by reflection: psi_n(x) = (-1)^n psi_n(1 - x) - pi^(n+1) d^n cot(pi x) / pi^n.
    Non-positive integers are poles (PyTorch: (-1)^(n+1) inf for n >= 2)."""
    (x,) = promote(self, kind=KIND.INT_TO_FLOAT)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    positive = _polygamma_positive(n, jnp.where(x > 0, x, 1 - x))
    cot = 1 / jnp.tan(math.pi * x)
    polynomial = sum(coefficient * cot**k for k, coefficient in enumerate(_cot_derivative(n)) if coefficient)
    reflected = (-1) ** n * positive - math.pi ** (n + 1) * polynomial
    near = (x <= 0) & (x > -_POLYGAMMA_SHIFT_LIMIT)
    shifted = _polygamma_shifted(n, jnp.where(near, x, 0.5))
    value = jnp.where(x > 0, positive, jnp.where(near, shifted, reflected))
    pole = (x <= 0) & (x == jnp.floor(x))
    return jnp.where(pole & (n >= 2), (-1) ** (n + 1) * jnp.inf, value)


@register(aten.mvlgamma.default)
def mvlgamma(self: Any, p: int) -> Any:
    """Sum of lgamma(x - i/2); PyTorch's check that x > (p-1)/2 is data-dependent and not made."""
    (x,) = promote(self, kind=KIND.INT_TO_FLOAT)
    terms = sum(jax.lax.lgamma(x - i / 2) for i in range(p))
    return terms + p * (p - 1) / 4 * math.log(math.pi)


def _xlogy(x: Any, y: Any) -> Any:
    """0 where x == 0 unless y is NaN."""
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, 0, x * jnp.log(y)))


def _xlog1py(x: Any, y: Any) -> Any:
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, 0, x * jnp.log1p(y)))


def _zeta(x: Any, q: Any) -> Any:
    """Hurwitz zeta with PyTorch's domain: a pole at x = 1 and at q in 0, -1, ...; NaN for x < 1."""
    value = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, jss.zeta(x, q))
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, value))


def logaddexp(x: Any, y: Any) -> Any:
    """log(e^x + e^y); complex operands as PyTorch: pivot on the larger real part, principal log1p."""
    if not is_complex(x):
        return jnp.logaddexp(x, y)
    swap = jnp.real(y) < jnp.real(x)
    low, high = jnp.where(swap, y, x), jnp.where(swap, x, y)
    value = jnp.log1p(jnp.exp(low - high)) + high
    infinite = ~jnp.isfinite(jnp.real(low)) & (jnp.real(low) == jnp.real(high))
    value = jnp.where(infinite, jnp.where(jnp.real(low) < 0, high, jnp.log(jnp.exp(low) + jnp.exp(high))), value)
    return jnp.where(jnp.isnan(jnp.real(low)) | jnp.isnan(jnp.imag(low)), complex(math.nan, math.nan), value)


FLOAT_BINARY: dict[Any, Callable] = {
    aten.atan2.default: jnp.arctan2, aten.hypot.default: jnp.hypot,
    aten.copysign.Tensor: jnp.copysign, aten.copysign.Scalar: jnp.copysign,
    aten.logaddexp.default: logaddexp, aten.logaddexp2.default: jnp.logaddexp2,
    aten.xlogy.Tensor: _xlogy, aten.xlogy.Scalar_Other: _xlogy, aten.xlogy.Scalar_Self: _xlogy,
    aten.special_xlog1py.default: _xlog1py, aten.special_xlog1py.other_scalar: _xlog1py,
    aten.special_xlog1py.self_scalar: _xlog1py, aten.special_zeta.default: _zeta,
    aten.special_zeta.other_scalar: _zeta, aten.special_zeta.self_scalar: _zeta,
    aten.igamma.default: jss.gammainc, aten.igammac.default: jss.gammaincc,
}

for _op, _fn in FLOAT_BINARY.items():
    register(_op)(_binary(_fn, KIND.INT_TO_FLOAT))


@register(aten.nextafter.default)
def nextafter(self: Any, other: Any) -> Any:
    """In the tensors' own dtype: the next representable value is dtype-specific."""
    return jnp.nextafter(*promote(self, other, exact=True))


@register(aten.heaviside.default)
def heaviside(self: Any, values: Any) -> Any:
    x, v = promote(self, values, exact=True)
    return jnp.where(x == 0, v, (x > 0).astype(v.dtype))


@register(aten.gcd.default)
def gcd(self: Any, other: Any) -> Any:
    return jnp.gcd(*promote(self, other))


@register(aten.lcm.default)
def lcm(self: Any, other: Any) -> Any:
    return jnp.lcm(*promote(self, other))


# --- Bessel functions J0, J1, Y0, Y1, K0, K1 ------------------------------------------------------------

_J_NODES = 64
_J_SWITCH = 25.0
_K_NODES = 256


def _node_sum(count: int, term: Callable, like: Any) -> Any:
    """sum_k term(k) for k < count, looped so no (elements x nodes) array is materialised."""
    return jax.lax.fori_loop(0, count, lambda k, total: total + term(k.astype(like.dtype)), jnp.zeros_like(like))


def _bessel_j_small(order: int, x: Any) -> Any:
    """J_n(x) = mean over a period of cos(n t - x sin t): the trapezoidal rule is exact up to
    J_{n+64}(x), negligible below the switch point."""
    step = 2 * math.pi / _J_NODES
    return _node_sum(_J_NODES, lambda k: jnp.cos(order * k * step - x * jnp.sin(k * step)), x) / _J_NODES


def _hankel(order: float, x: Any, second_kind: bool) -> Any:
    """Hankel's asymptotic expansion of J_n or Y_n, accurate to double precision past the switch point."""
    mu = 4.0 * order * order
    z = jnp.where(jnp.abs(x) > _J_SWITCH, jnp.abs(x), _J_SWITCH)
    p, q, term = jnp.zeros_like(z), jnp.zeros_like(z), jnp.ones_like(z)
    for k in range(12):
        if k % 2 == 0:
            p = p + (-1) ** (k // 2) * term
        else:
            q = q + (-1) ** (k // 2) * term
        term = term * (mu - (2 * k + 1) ** 2) / ((k + 1) * 8 * z)
    chi = z - (order / 2 + 0.25) * math.pi
    if second_kind:
        return jnp.sqrt(2 / (math.pi * z)) * (p * jnp.sin(chi) + q * jnp.cos(chi))
    value = jnp.sqrt(2 / (math.pi * z)) * (p * jnp.cos(chi) - q * jnp.sin(chi))
    return value if order % 2 == 0 else jnp.sign(x) * value


def _bessel_j(order: int) -> Callable:
    def bessel(x: Any) -> Any:
        small = _bessel_j_small(order, jnp.where(jnp.abs(x) > _J_SWITCH, 0, x))
        return jnp.where(jnp.abs(x) > _J_SWITCH, _hankel(order, x, False), small)

    bessel.__name__ = f"bessel_j{order}"
    return bessel


_Y_SERIES_LIMIT = 0.5
_Y_SERIES_TERMS = 12
_GAUSS_NODES, _GAUSS_WEIGHTS = np.polynomial.legendre.leggauss(64)


def _bessel_y_series(order: int, x: Any) -> Any:
    """The ascending series (log term times J_n plus a harmonic-number series): free of cancellation
    for small x only."""
    half = x / 2
    log_term = 2 / math.pi * (jnp.log(half) + (np.euler_gamma if order == 0 else 0)) * _bessel_j(order)(x)
    total, power, harmonic = jnp.zeros_like(x), jnp.ones_like(x) * (1.0 if order == 0 else half), 0.0
    for k in range(_Y_SERIES_TERMS):
        if order == 0:
            if k > 0:
                total = total + (-1) ** (k + 1) * harmonic * power
            power = power * half * half / ((k + 1) ** 2)
        else:
            total = total + (-1) ** k * (2 * harmonic + 1 / (k + 1) - 2 * np.euler_gamma) * power
            power = power * half * half / ((k + 1) * (k + 2))
        harmonic += 1 / (k + 1)
    if order == 0:
        return log_term + 2 / math.pi * total
    return log_term - 2 / (math.pi * x) - total / math.pi


def _bessel_y_integral(order: int, x: Any) -> Any:
    """Y_n(x) = (1/pi) int_0^pi sin(x sin t - n t) dt - (1/pi) int_0^inf (e^{nt} + (-1)^n e^{-nt}) e^{-x sinh t} dt,
    both by 64-point Gauss-Legendre; the second is cut where x sinh t = 50 (x > 0.5)."""
    nodes, weights = jnp.asarray(_GAUSS_NODES, x.dtype), jnp.asarray(_GAUSS_WEIGHTS, x.dtype)
    cut = jnp.arcsinh(50 / x)

    def term(k: Any) -> Any:
        index = k.astype(np.int32)
        theta, t = (nodes[index] + 1) * (math.pi / 2), (nodes[index] + 1) * (cut / 2)
        oscillating = jnp.sin(x * jnp.sin(theta) - order * theta) * (math.pi / 2)
        decaying = (jnp.exp(order * t) + (-1) ** order * jnp.exp(-order * t)) * jnp.exp(-x * jnp.sinh(t)) * (cut / 2)
        return weights[index] * (oscillating - decaying)

    return _node_sum(len(_GAUSS_NODES), term, x) / math.pi


def _bessel_y(order: int) -> Callable:
    def bessel(x: Any) -> Any:
        series = _bessel_y_series(order, jnp.where((x > 0) & (x <= _Y_SERIES_LIMIT), x, 1.0))
        middle = _bessel_y_integral(order, jnp.where((x > _Y_SERIES_LIMIT) & (x <= _J_SWITCH), x, 10.0))
        value = jnp.where(x <= _Y_SERIES_LIMIT, series, jnp.where(x <= _J_SWITCH, middle, _hankel(order, x, True)))
        return jnp.where(x > 0, value, jnp.where(x == 0, -jnp.inf, jnp.nan))

    bessel.__name__ = f"bessel_y{order}"
    return bessel


def _bessel_k_scaled(order: float, x: Any) -> Any:
    """exp(x) K_n(x) = int_0^inf exp(-x (cosh t - 1)) cosh(n t) dt for x > 0.

    The integrand is even and analytic, so the trapezoidal rule converges geometrically; the
    step shrinks like 1/sqrt(x) to resolve the Gaussian peak of large x. Below 1e-9 the
    leading terms of the small-x expansion are exact to double precision."""
    safe = jnp.where(x > 1e-9, x, 1.0)
    step = jnp.minimum(0.1, 0.5 / jnp.sqrt(safe))

    def term(k: Any) -> Any:
        t = k * step
        weight = jnp.where(k == 0, 0.5, 1.0)
        return weight * jnp.exp(-2 * safe * jnp.sinh(t / 2) ** 2) * jnp.cosh(order * t)

    integral = _node_sum(_K_NODES, term, safe) * step
    tiny = -(jnp.log(x / 2) + np.euler_gamma) if order == 0 else 1 / x
    value = jnp.where(x > 1e-9, integral, tiny * jnp.exp(x))
    value = jnp.where(x == jnp.inf, 0, value)
    return jnp.where(x > 0, value, jnp.where(x == 0, jnp.inf, jnp.nan))


def _bessel_k(order: int, scaled: bool) -> Callable:
    def bessel(x: Any) -> Any:
        value = _bessel_k_scaled(order, x)
        return value if scaled else value * jnp.exp(-x)

    bessel.__name__ = f"{'scaled_' if scaled else ''}bessel_k{order}"
    return bessel


def _bessel_j_fractional(order: float, z: Any) -> Any:
    """J_nu(z), z > 0: (1/pi) int_0^pi cos(nu t - z sin t) dt - (sin(nu pi)/pi) int_0^inf e^{-z sinh t - nu t} dt
    by Gauss-Legendre up to the switch point, Hankel's expansion past it."""
    nodes, weights = jnp.asarray(_GAUSS_NODES, z.dtype), jnp.asarray(_GAUSS_WEIGHTS, z.dtype)
    near = jnp.where(z <= _J_SWITCH, z, 1.0)
    cut = jnp.arcsinh(50 / near)

    def term(k: Any) -> Any:
        index = k.astype(np.int32)
        theta, t = (nodes[index] + 1) * (math.pi / 2), (nodes[index] + 1) * (cut / 2)
        oscillating = jnp.cos(order * theta - near * jnp.sin(theta)) * (math.pi / 2)
        decaying = math.sin(order * math.pi) * jnp.exp(-near * jnp.sinh(t) - order * t) * (cut / 2)
        return weights[index] * (oscillating - decaying)

    integral = _node_sum(len(_GAUSS_NODES), term, near) / math.pi
    return jnp.where(z <= _J_SWITCH, integral, _hankel(order, z, False))


_AIRY_C1 = 1 / (3 ** (2 / 3) * math.gamma(2 / 3))
_AIRY_C2 = 1 / (3 ** (1 / 3) * math.gamma(1 / 3))
_AIRY_SERIES = (-2.0, 0.5)


def _airy_series(x: Any) -> Any:
    """Maclaurin series Ai = c1 f - c2 g, free of cancellation on [-2, 0.5]."""
    cube = x * x * x
    f_term, g_term = jnp.ones_like(x), x
    f_sum, g_sum = f_term, g_term
    for k in range(25):
        f_term = f_term * cube / ((3 * k + 2) * (3 * k + 3))
        g_term = g_term * cube / ((3 * k + 3) * (3 * k + 4))
        f_sum, g_sum = f_sum + f_term, g_sum + g_term
    return _AIRY_C1 * f_sum - _AIRY_C2 * g_sum


def airy_ai(x: Any) -> Any:
    """Series near 0; K_{1/3} to the right and J_{+-1/3} to the left of it (zeta = 2/3 |x|^{3/2}).
    PyTorch gives NaN at both infinities."""
    low, high = _AIRY_SERIES
    series = _airy_series(jnp.clip(x, low, high))
    right = jnp.where(x > high, x, 1.0)
    zeta = 2 / 3 * right ** 1.5
    decaying = jnp.sqrt(right / 3) / math.pi * jnp.exp(-zeta) * _bessel_k_scaled(1 / 3, zeta)
    left = jnp.where(x < low, -x, 4.0)
    zeta = 2 / 3 * left ** 1.5
    oscillating = jnp.sqrt(left) / 3 * (_bessel_j_fractional(1 / 3, zeta) + _bessel_j_fractional(-1 / 3, zeta))
    value = jnp.where(x > high, decaying, jnp.where(x < low, oscillating, series))
    return jnp.where(jnp.isinf(x), jnp.nan, value)


for _op, _fn in {
    aten.special_bessel_j0.default: _bessel_j(0), aten.special_bessel_j1.default: _bessel_j(1),
    aten.special_bessel_y0.default: _bessel_y(0), aten.special_bessel_y1.default: _bessel_y(1),
    aten.special_modified_bessel_k0.default: _bessel_k(0, False),
    aten.special_modified_bessel_k1.default: _bessel_k(1, False),
    aten.special_scaled_modified_bessel_k0.default: _bessel_k(0, True),
    aten.special_scaled_modified_bessel_k1.default: _bessel_k(1, True), aten.special_airy_ai.default: airy_ai,
}.items():
    register(_op)(_unary(_fn, KIND.INT_TO_FLOAT))


# --- orthogonal polynomials (degree n given per element) ----------------------------------------


def _three_term(x: Any, n: Any, first: Any, second: Any, step: Callable) -> Any:
    """P_n(x) from P_0, P_1 and P_{j+1} = step(j, P_j, P_{j-1}), run up to the largest n present."""

    def body(state: tuple) -> tuple:
        j, previous, current, result = state
        following = step(j, current, previous)
        return j + 1, current, following, jnp.where(n == j + 1, following, result)

    start = (jnp.asarray(1, n.dtype), first, second, jnp.where(n == 0, first, second))
    last = jnp.max(n, initial=0)
    result = jax.lax.while_loop(lambda state: state[0] < last, body, start)[3]
    return jnp.where(n < 0, 0, result)


def _polynomial_operands(x: Any, n: Any) -> tuple[Any, Any, Any]:
    """x in the computation dtype, n truncated to int64, both broadcast; plus arccos(x) for the trig forms."""
    x, n = promote(x, n, kind=KIND.INT_TO_FLOAT)
    x, n = jnp.broadcast_arrays(x, jnp.trunc(n).astype(np.int64))
    return x, n, jnp.arccos(jnp.clip(x, -1, 1))


def _alternating(n: Any, value: Any) -> Any:
    return jnp.where(n % 2 == 0, value, -value)


def chebyshev_t(x: Any, n: Any) -> Any:
    x, n, theta = _polynomial_operands(x, n)
    result = _three_term(x, n, jnp.ones_like(x), x, lambda j, q, p: (x + x) * q - p)
    result = jnp.where((n > 6) & (jnp.abs(x) < 1), jnp.cos(n * theta), result)
    return jnp.where((jnp.abs(x) == 1) & (n >= 0), jnp.where(x > 0, 1, _alternating(n, 1)), result)


def chebyshev_u(x: Any, n: Any) -> Any:
    x, n, theta = _polynomial_operands(x, n)
    result = _three_term(x, n, jnp.ones_like(x), x + x, lambda j, q, p: (x + x) * q - p)
    sine = jnp.sin(theta)
    trig = jnp.where(sine != 0, jnp.sin((n + 1) * theta) / jnp.where(sine != 0, sine, 1),
                     (n + 1) * jnp.cos((n + 1) * theta) / x)
    result = jnp.where((n > 8) & (jnp.abs(x) < 1), trig, result)
    return jnp.where((jnp.abs(x) == 1) & (n >= 0), jnp.where(x > 0, n + 1, _alternating(n, n + 1)), result)


def chebyshev_v(x: Any, n: Any) -> Any:
    x, n, theta = _polynomial_operands(x, n)
    result = _three_term(x, n, jnp.ones_like(x), x + x - 1, lambda j, q, p: (x + x) * q - p)
    trig = jnp.cos((n + 0.5) * theta) / jnp.cos(theta / 2)
    result = jnp.where((n > 8) & (jnp.abs(x) < 1), trig, result)
    return jnp.where((jnp.abs(x) == 1) & (n >= 0), jnp.where(x > 0, 1, _alternating(n, n + n + 1)), result)


def chebyshev_w(x: Any, n: Any) -> Any:
    x, n, theta = _polynomial_operands(x, n)
    result = _three_term(x, n, jnp.ones_like(x), x + x + 1, lambda j, q, p: (x + x) * q - p)
    half = jnp.sin(theta / 2)
    trig = jnp.sin((n + 0.5) * theta) / jnp.where(half != 0, half, 1)
    result = jnp.where((n > 8) & (jnp.abs(x) < 1) & (half != 0), trig, result)
    return jnp.where((jnp.abs(x) == 1) & (n >= 0), jnp.where(x > 0, n + n + 1, _alternating(n, 1)), result)


def _shifted(polynomial: Callable) -> Callable:
    def shifted(x: Any, n: Any) -> Any:
        x, n = promote(x, n, kind=KIND.INT_TO_FLOAT)
        return polynomial(x + x - 1, n)

    shifted.__name__ = f"shifted_{polynomial.__name__}"
    return shifted


def hermite_h(x: Any, n: Any) -> Any:
    x, n, _ = _polynomial_operands(x, n)
    return _three_term(x, n, jnp.ones_like(x), x + x, lambda j, q, p: (x + x) * q - (j + j) * p)


def hermite_he(x: Any, n: Any) -> Any:
    x, n, _ = _polynomial_operands(x, n)
    return _three_term(x, n, jnp.ones_like(x), x, lambda j, q, p: x * q - j * p)


def laguerre_l(x: Any, n: Any) -> Any:
    x, n, _ = _polynomial_operands(x, n)
    return _three_term(x, n, jnp.ones_like(x), 1 - x, lambda j, q, p: ((j + j + 1 - x) * q - j * p) / (j + 1))


def legendre_p(x: Any, n: Any) -> Any:
    x, n, _ = _polynomial_operands(x, n)
    return _three_term(x, n, jnp.ones_like(x), x, lambda j, q, p: ((j + j + 1) * x * q - j * p) / (j + 1))


for _name, _fn in {
    "chebyshev_polynomial_t": chebyshev_t, "chebyshev_polynomial_u": chebyshev_u,
    "chebyshev_polynomial_v": chebyshev_v, "chebyshev_polynomial_w": chebyshev_w,
    "shifted_chebyshev_polynomial_t": _shifted(chebyshev_t), "shifted_chebyshev_polynomial_u": _shifted(chebyshev_u),
    "shifted_chebyshev_polynomial_v": _shifted(chebyshev_v), "shifted_chebyshev_polynomial_w": _shifted(chebyshev_w),
    "hermite_polynomial_h": hermite_h, "hermite_polynomial_he": hermite_he, "laguerre_polynomial_l": laguerre_l,
    "legendre_polynomial_p": legendre_p,
}.items():
    _packet = getattr(aten, f"special_{_name}")
    register(_packet.default, _packet.x_scalar, _packet.n_scalar)(_fn)


# --- comparisons, predicates, logic and bits --------------------------------------------------


def _compare(fn: Callable) -> Callable:
    return _binary(fn, KIND.ALWAYS_BOOL)


for _packet, _fn in {
    aten.eq: jnp.equal, aten.ne: jnp.not_equal, aten.lt: jnp.less, aten.le: jnp.less_equal,
    aten.gt: jnp.greater, aten.ge: jnp.greater_equal,
}.items():
    register(_packet.Tensor, _packet.Scalar)(_compare(_fn))


def _truth(x: Any) -> Any:
    return jnp.asarray(x) != 0


@register(aten.logical_and.default)
def logical_and(self: Any, other: Any) -> Any:
    return _truth(self) & _truth(other)


@register(aten.logical_or.default)
def logical_or(self: Any, other: Any) -> Any:
    return _truth(self) | _truth(other)


@register(aten.logical_xor.default)
def logical_xor(self: Any, other: Any) -> Any:
    return _truth(self) ^ _truth(other)


@register(aten.logical_not.default)
def logical_not(self: Any) -> Any:
    return ~_truth(self)


@register(aten.isnan.default)
def isnan(self: Any) -> Any:
    return jnp.isnan(self) if not is_integral(self) else jnp.zeros(self.shape, bool)


@register(aten.isinf.default)
def isinf(self: Any) -> Any:
    return jnp.isinf(self) if not is_integral(self) else jnp.zeros(self.shape, bool)


@register(aten.isfinite.default)
def isfinite(self: Any) -> Any:
    return jnp.isfinite(self) if not is_integral(self) else jnp.ones(self.shape, bool)


@register(aten.isposinf.default)
def isposinf(self: Any) -> Any:
    return self == jnp.inf if not is_integral(self) else jnp.zeros(self.shape, bool)


@register(aten.isneginf.default)
def isneginf(self: Any) -> Any:
    return self == -jnp.inf if not is_integral(self) else jnp.zeros(self.shape, bool)


@register(aten.signbit.default)
def signbit(self: Any) -> Any:
    return jnp.signbit(self) if not is_integral(self) else self < 0


@register(aten.nan_to_num.default)
def nan_to_num(self: Any, nan: float | None = None, posinf: float | None = None, neginf: float | None = None) -> Any:
    """Defaults are the extremes of the tensor's own dtype; complex parts are replaced separately."""
    if is_integral(self):
        return self
    if is_complex(self):
        return jax.lax.complex(nan_to_num(jnp.real(self), nan, posinf, neginf),
                               nan_to_num(jnp.imag(self), nan, posinf, neginf))
    info = jnp.finfo(self.dtype)
    x = jnp.where(jnp.isnan(self), 0.0 if nan is None else nan, self)
    x = jnp.where(x == jnp.inf, info.max if posinf is None else posinf, x)
    return jnp.where(x == -jnp.inf, info.min if neginf is None else neginf, x).astype(self.dtype)


def _bitwise(fn: Callable, kernel: str) -> Callable:
    """Integers and bools only: CPU has no kernel for floating operands (their promoted dtype named)."""
    def lowering(self: Any, other: Any) -> Any:
        (common, _) = promote(self, other, exact=True)
        if not is_integral(common):
            raise not_implemented_for(kernel, common)
        return fn(*promote(self, other))

    lowering.__name__ = fn.__name__
    return lowering


for _packets, (_fn, _kernel) in {
    (aten.bitwise_and, aten.__and__): (jnp.bitwise_and, "bitwise_and_cpu"),
    (aten.bitwise_or, aten.__or__): (jnp.bitwise_or, "bitwise_or_cpu"),
    (aten.bitwise_xor, aten.__xor__): (jnp.bitwise_xor, "bitwise_xor_cpu"),
    (aten.bitwise_left_shift, aten.__lshift__): (jnp.left_shift, "lshift_cpu"),
    (aten.bitwise_right_shift, aten.__rshift__): (jnp.right_shift, "rshift_cpu"),
}.items():
    register(*[getattr(_packet, name) for _packet in _packets
               for name in ("Tensor", "Scalar", "Scalar_Tensor", "Tensor_Scalar") if name in _packet.overloads()])(
        _bitwise(_fn, _kernel))


@register(aten.bitwise_not.default)
def bitwise_not(self: Any) -> Any:
    if not is_integral(self):
        raise not_implemented_for("bitwise_not_cpu", self)
    return ~self


# --- selection, bounds and blends ---------------------------------------------------------------


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition: Any, self: Any, other: Any) -> Any:
    a, b = promote(self, other, exact=True)
    return jnp.where(_truth(condition), a, b)


@register(aten.clamp.default, aten.clamp.Tensor)
def clamp(self: Any, min: Any = None, max: Any = None) -> Any:  # noqa: A002
    """NaN in the input or a bound propagates; min > max gives max (as PyTorch)."""
    x, low, high = promote(self, min, max, exact=True)
    if low is not None:
        x = jnp.maximum(x, low)
    if high is not None:
        x = jnp.minimum(x, high)
    return x


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self: Any, min: Any) -> Any:  # noqa: A002
    return clamp(self, min, None)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self: Any, max: Any) -> Any:  # noqa: A002
    return clamp(self, None, max)


@register(aten.maximum.default)
def maximum(self: Any, other: Any) -> Any:
    return jnp.maximum(*promote(self, other, exact=True))


@register(aten.minimum.default)
def minimum(self: Any, other: Any) -> Any:
    return jnp.minimum(*promote(self, other, exact=True))


@register(aten.fmax.default)
def fmax(self: Any, other: Any) -> Any:
    return jnp.fmax(*promote(self, other, exact=True))


@register(aten.fmin.default)
def fmin(self: Any, other: Any) -> Any:
    return jnp.fmin(*promote(self, other, exact=True))


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self: Any, end: Any, weight: Any) -> Any:
    """PyTorch's two-sided formula: exact at both ends."""
    start, stop, w = promote(self, end, weight)
    diff = stop - start
    return jnp.where(jnp.abs(w) < 0.5, start + w * diff, stop - diff * (1 - w))


@register(aten.addcmul.default)
def addcmul(self: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Any:
    x, a, b, v = promote(self, tensor1, tensor2, value)
    return x + v * a * b


@register(aten.addcdiv.default)
def addcdiv(self: Any, tensor1: Any, tensor2: Any, *, value: Any = 1) -> Any:
    x, a, b, v = promote(self, tensor1, tensor2, value)
    return x + v * (a / b)


# --- backward ops ----------------------------------------------------------------------------


@register(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output: Any, output: Any) -> Any:
    g, y = promote(grad_output, output)
    return g * jnp.conj((1 - y) * y)


@register(aten.tanh_backward.default)
def tanh_backward(grad_output: Any, output: Any) -> Any:
    g, y = promote(grad_output, output)
    return g * jnp.conj(1 - y * y)


@register(aten.logit_backward.default)
def logit_backward(grad_output: Any, self: Any, eps: float | None = None) -> Any:
    g, x = promote(grad_output, self)
    grad = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.nan, grad)
    return jnp.where((x < eps) | (x > 1 - eps), 0, grad)
