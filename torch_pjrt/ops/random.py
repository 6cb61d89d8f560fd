"""Random ops: every lowering takes `rng`, a jax PRNG key derived from the device's seed and counter.

Floating samples are drawn in float32 (float64 for double tensors) and cast, so float16
and bfloat16 tensors get the same distribution as float32 ones, rounded. Complex tensors
sample their real and imaginary parts separately, as PyTorch's view_as_real does.
Range and parameter checks that PyTorch's CPU kernels make (and its meta kernels skip)
are made here on the static arguments; checks on tensor contents cannot be made in a
traced program and are documented where they apply.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.ops.factories import dtype_of, is_integral, jax_dtype, scalar_type_name, torch_dtype
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten


# --- shared helpers ---------------------------------------------------------------------------


def _draw_dtype(dtype: Any) -> Any:
    """The real type samples are drawn in: float64 for double (and complex128), else float32."""
    dtype = np.dtype(dtype)
    return jnp.float64 if dtype in (np.float64, np.complex128) else jnp.float32


def _floating(self: Any, name: str) -> Any:
    """The jax dtype of a tensor that must hold floating values (PyTorch's continuous distributions)."""
    dtype = dtype_of(self)
    if not dtype.is_floating_point:
        raise RuntimeError(f'"{name}" not implemented for {dtype}: it needs a floating point tensor.')
    return self.dtype


def _uniform01(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return jax.random.uniform(key, shape, _draw_dtype(dtype))


def _as_complex(sample: Any, dtype: Any) -> Any:
    """Pairs along a trailing axis of 2 read as (real, imaginary), like view_as_real."""
    return jax.lax.complex(sample[..., 0], sample[..., 1]).astype(dtype)


def _uniform(key: Any, shape: tuple[int, ...], dtype: Any, low: Any, high: Any) -> Any:
    draw = _draw_dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _as_complex(jax.random.uniform(key, (*shape, 2), draw, low, high), dtype)
    return jax.random.uniform(key, shape, draw, low, high).astype(dtype)


def _normal(key: Any, shape: tuple[int, ...], dtype: Any, mean: Any, std: Any) -> Any:
    """Complex: std splits between the parts; a number mean shifts both parts (normal_ on view_as_real),
    a tensor mean is added as a complex value (normal(mean, ...) adds it after drawing)."""
    draw = _draw_dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        noise = _as_complex(jax.random.normal(key, (*shape, 2), draw), dtype) * (std / math.sqrt(2))
        return (noise + (mean * (1 + 1j) if isinstance(mean, (int, float)) else mean)).astype(dtype)
    return (jax.random.normal(key, shape, draw) * std + mean).astype(dtype)


def _digits(dtype: torch.dtype) -> int:
    """Mantissa bits of a floating type, the implicit one included (24 for float32)."""
    return int(jnp.finfo(storage.numpy_dtype(dtype)).nmant) + 1


def _dtype_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """The integers a dtype holds exactly: [min, max] for integers, [-2^digits, 2^digits] for floats."""
    if dtype == torch.bool:
        return 0, 1
    if is_integral(dtype):
        info = torch.iinfo(dtype)
        return info.min, info.max
    limit = 2 ** _digits(dtype)
    return -limit, limit


def _check_range(dtype: torch.dtype, low: int, high: int) -> None:
    """PyTorch's checks of random_(from, to): from < to, both within what the dtype holds exactly
    (for floating types PyTorch only warns, and so do we)."""
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    smallest, largest = _dtype_bounds(dtype)
    for name, value in (("from", low), ("to - 1", high - 1)):
        if smallest <= value <= largest:
            continue
        if not dtype.is_floating_point:
            raise RuntimeError(f"{name} is out of bounds for {dtype}")
        warnings.warn(
            f"{name} is out of bounds [-(2^{_digits(dtype)}), 2^{_digits(dtype)}]: {dtype} cannot hold every "
            "integer of this range, so the draws are rounded (and kept within [from, to)).",
            stacklevel=2,
        )


def _representable(n: int, digits: int, up: bool) -> int:
    """The nearest integer above (up) or below n that a float with `digits` significant bits holds."""
    magnitude = abs(n)
    shift = max(magnitude.bit_length() - digits, 0)
    if up == (n >= 0):
        magnitude += (1 << shift) - 1
    magnitude = magnitude >> shift << shift
    return magnitude if n >= 0 else -magnitude


def _integers(key: Any, shape: tuple[int, ...], low: Any, span: Any) -> Any:
    """int64 low + (64 random bits mod span), in wrapping arithmetic; span 0 means all 2^64 values."""
    bits = jax.random.bits(key, shape, jnp.uint64)
    span = jnp.uint64(span) if isinstance(span, int) else jnp.asarray(span).astype(jnp.uint64)
    offset = jnp.where(span == 0, bits, bits % jnp.maximum(span, 1))
    return jax.lax.bitcast_convert_type(jnp.asarray(low).astype(jnp.int64).astype(jnp.uint64) + offset, jnp.int64)


def _random_ints(key: Any, shape: tuple[int, ...], dtype: torch.dtype, low: int, high: int) -> Any:
    """Uniform integers in [low, high) (static bounds, checked like PyTorch).

    A floating type that cannot hold every integer of the range gets draws clipped, before
    rounding, to the representable integers inside it, so no value rounds out of [low, high).
    """
    _check_range(dtype, low, high)
    values = _integers(key, shape, low, (high - low) % 2**64)
    if dtype.is_floating_point:
        digits = _digits(dtype)
        inside = _representable(low, digits, up=True), _representable(high - 1, digits, up=False)
        if inside != (low, high - 1):
            values = jnp.clip(values, *inside)
    return values.astype(storage.numpy_dtype(dtype))


# --- uniform, normal and their relatives --------------------------------------------------------


@register(aten.uniform.default, random=True)
def uniform(self: Any, low: float = 0.0, high: float = 1.0, *, generator: Any = None, rng: Any) -> Any:
    dtype = dtype_of(self)
    if not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f'"check_uniform_bounds" not implemented for {dtype}')
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low} > to={high}")
    return _uniform(rng, self.shape, self.dtype, low, high)


@register(aten.rand.default, aten.rand.generator, random=True)
def rand(size: Any, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _uniform(rng, tuple(size), jax_dtype(dtype), 0.0, 1.0)


@register(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(self: Any, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _uniform(rng, self.shape, jax_dtype(dtype, dtype_of(self)), 0.0, 1.0)


def _check_std(std: float) -> None:
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")


@register(aten.normal_functional.default, random=True)
def normal_functional(self: Any, mean: float = 0.0, std: float = 1.0, *, generator: Any = None, rng: Any) -> Any:
    _check_std(std)
    return _normal(rng, self.shape, self.dtype, mean, std)


@register(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean: Any, std: float = 1.0, *, generator: Any = None, rng: Any) -> Any:
    _check_std(std)
    return _normal(rng, mean.shape, mean.dtype, mean, std)


@register(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean: float, std: Any, *, generator: Any = None, rng: Any) -> Any:
    """The std >= 0 check on the tensor's contents is not made (a traced program cannot raise)."""
    return _normal(rng, std.shape, std.dtype, mean, std)


@register(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean: Any, std: Any, *, generator: Any = None, rng: Any) -> Any:
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return _normal(rng, shape, jnp.result_type(mean, std), mean, std)


@register(aten.normal.float_float, random=True)
def normal_float_float(mean: float, std: float, size: Any, *, generator: Any = None, dtype: Any = None,
                       rng: Any, **_: Any) -> Any:
    _check_std(std)
    return _normal(rng, tuple(size), jax_dtype(dtype), mean, std)


@register(aten.randn.default, aten.randn.generator, random=True)
def randn(size: Any, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _normal(rng, tuple(size), jax_dtype(dtype), 0.0, 1.0)


@register(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(self: Any, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _normal(rng, self.shape, jax_dtype(dtype, dtype_of(self)), 0.0, 1.0)


@register(aten.log_normal.default, random=True)
def log_normal(self: Any, mean: float = 1.0, std: float = 2.0, *, generator: Any = None, rng: Any) -> Any:
    dtype = _floating(self, "log_normal_cpu")
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")
    return jnp.exp(jax.random.normal(rng, self.shape, _draw_dtype(dtype)) * std + mean).astype(dtype)


@register(aten.exponential.default, random=True)
def exponential(self: Any, lambd: float = 1.0, *, generator: Any = None, rng: Any) -> Any:
    dtype = _floating(self, "exponential_cpu")
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return (jax.random.exponential(rng, self.shape, _draw_dtype(dtype)) / lambd).astype(dtype)


@register(aten.geometric.default, random=True)
def geometric(self: Any, p: float, *, generator: Any = None, rng: Any) -> Any:
    """Trials up to the first success: ceil(log(u) / log(1 - p)) for u in (0, 1], at least 1."""
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    draw = _draw_dtype(self.dtype)
    u = 1 - _uniform01(rng, self.shape, draw)
    trials = jnp.ceil(jnp.log(u) / jnp.log1p(jnp.asarray(-p, draw)))
    return jnp.maximum(trials, 1).astype(self.dtype)


@register(aten.cauchy.default, random=True)
def cauchy(self: Any, median: float = 0.0, sigma: float = 1.0, *, generator: Any = None, rng: Any) -> Any:
    dtype = _floating(self, "cauchy_cpu")
    return (median + sigma * jax.random.cauchy(rng, self.shape, _draw_dtype(dtype))).astype(dtype)


# --- integers -----------------------------------------------------------------------------------


def _default_range(dtype: torch.dtype, low: int) -> tuple[int, int]:
    """random_(from) with no `to`: up to the dtype's largest value (2^digits for floats), inclusive."""
    if low == -(2**63):
        return low, 2**63
    return low, _dtype_bounds(dtype)[1] + 1


@register(aten.random.default, random=True)
def random(self: Any, *, generator: Any = None, rng: Any) -> Any:
    dtype = dtype_of(self)
    return _random_ints(rng, self.shape, dtype, *_default_range(dtype, 0))


@register(getattr(aten.random, "from"), random=True)
def random_from(self: Any, low: int, high: int | None, *, generator: Any = None, rng: Any) -> Any:
    dtype = dtype_of(self)
    low, high = _default_range(dtype, low) if high is None else (low, high)
    return _random_ints(rng, self.shape, dtype, low, high)


@register(aten.random.to, random=True)
def random_to(self: Any, high: int, *, generator: Any = None, rng: Any) -> Any:
    return _random_ints(rng, self.shape, dtype_of(self), 0, high)


@register(aten.randint.default, aten.randint.generator, random=True)
def randint(high: int, size: Any, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _random_ints(rng, tuple(size), torch_dtype(dtype, torch.int64), 0, high)


@register(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(low: int, high: int, size: Any, *, generator: Any = None, dtype: Any = None, rng: Any,
                **_: Any) -> Any:
    return _random_ints(rng, tuple(size), torch_dtype(dtype, torch.int64), low, high)


@register(aten.randint_like.default, aten.randint_like.generator, random=True)
def randint_like(self: Any, high: int, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _random_ints(rng, self.shape, torch_dtype(dtype, dtype_of(self)), 0, high)


@register(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(self: Any, low: int, high: int, *, generator: Any = None, dtype: Any = None, rng: Any,
                     **_: Any) -> Any:
    return _random_ints(rng, self.shape, torch_dtype(dtype, dtype_of(self)), low, high)


@register(aten.randint_like.Tensor, aten.randint_like.Tensor_generator, random=True)
def randint_like_tensor(self: Any, high: Any, *, generator: Any = None, dtype: Any = None, rng: Any,
                        **_: Any) -> Any:
    """A traced bound: high <= 0 is not reported (a traced program cannot raise)."""
    values = _integers(rng, self.shape, 0, jnp.maximum(high, 1))
    return values.astype(jax_dtype(dtype, dtype_of(self)))


def _randperm(key: Any, n: int, dtype: torch.dtype) -> Any:
    largest = _dtype_bounds(dtype)[1]
    if n < 0:
        raise RuntimeError(f"n must be non-negative, got{n}")
    if n - 1 > largest:
        raise RuntimeError(f"n cannot be greater than {largest + 1} for {dtype} type.")
    return jax.random.permutation(key, n).astype(storage.numpy_dtype(dtype))


@register(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(n: int, *, generator: Any = None, dtype: Any = None, rng: Any, **_: Any) -> Any:
    return _randperm(rng, n, torch_dtype(dtype, torch.int64))


@register(aten.randperm.generator_out, random=True)
def randperm_out(n: int, *, generator: Any = None, out: Any, rng: Any) -> Any:
    return _randperm(rng, n, dtype_of(out))


# --- bernoulli, multinomial ----------------------------------------------------------------------


def _bernoulli(key: Any, shape: tuple[int, ...], p: Any, dtype: Any) -> Any:
    return (_uniform01(key, shape, getattr(p, "dtype", dtype)) < p).astype(dtype)


BERNOULLI_RANGE = ("Expected p_in >= 0 && p_in <= 1 to be true, but got false.  (Could this error message be "
                   "improved?  If so, please report an enhancement request to PyTorch.)")


def _check_probability(p: Any, op: str) -> None:
    checks.fail_if(~((p >= 0) & (p <= 1)), op, BERNOULLI_RANGE)


@register(aten.bernoulli.default, random=True)
def bernoulli(self: Any, *, generator: Any = None, rng: Any) -> Any:
    _check_probability(self, "aten::bernoulli")
    return _bernoulli(rng, self.shape, self, self.dtype)


@register(aten.bernoulli.p, random=True)
def bernoulli_p(self: Any, p: float = 0.5, *, generator: Any = None, rng: Any) -> Any:
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return _bernoulli(rng, self.shape, p, self.dtype)


@register(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(self: Any, p: Any, *, generator: Any = None, rng: Any) -> Any:
    _check_probability(p, "aten::bernoulli")
    return _bernoulli(rng, self.shape, jnp.broadcast_to(p, self.shape), self.dtype)


def _with_replacement(key: Any, probs: Any, num_samples: int) -> Any:
    """Inverse CDF: a uniform draw scaled by the row total, located in the cumulative sums."""
    cdf = jnp.cumsum(probs, axis=-1)
    u = _uniform01(key, (*probs.shape[:-1], num_samples), probs.dtype) * cdf[..., -1:]
    index = jax.vmap(lambda row, draws: jnp.searchsorted(row, draws, side="right"))(
        cdf.reshape(-1, cdf.shape[-1]), u.reshape(-1, num_samples)
    ).reshape(u.shape)
    positive = probs > 0
    last = probs.shape[-1] - 1 - jnp.argmax(positive[..., ::-1], axis=-1, keepdims=True)
    return jnp.minimum(index, last)


def _without_replacement(key: Any, probs: Any, num_samples: int) -> Any:
    """Gumbel top-k: the k largest log p + Gumbel noise, in order, are a draw without replacement."""
    noise = jax.random.gumbel(key, probs.shape, probs.dtype)
    return jax.lax.top_k(jnp.log(probs) + noise, num_samples)[1]


@register(aten.multinomial.default, random=True)
def multinomial(self: Any, num_samples: int, replacement: bool = False, *, generator: Any = None, rng: Any) -> Any:
    """Rows must hold non-negative finite weights with a positive sum (device-side checks, as on CPU)."""
    if not jnp.issubdtype(self.dtype, jnp.floating):
        name = scalar_type_name(dtype_of(self))
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {name}")
    if self.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if self.shape[-1] == 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    probs = self.astype(_draw_dtype(self.dtype))
    checks.fail_if(~jnp.isfinite(probs) | (probs < 0), "aten::multinomial",
                   "probability tensor contains either `inf`, `nan` or element < 0")
    checks.fail_if(jnp.sum(probs, axis=-1) <= 0, "aten::multinomial",
                   "invalid multinomial distribution (sum of probabilities <= 0)")
    sample = _with_replacement if replacement else _without_replacement
    return sample(rng, probs, num_samples).astype(jnp.int64)


# --- counts and gamma family --------------------------------------------------------------------


@register(aten.poisson.default, random=True)
def poisson(self: Any, generator: Any = None, *, rng: Any) -> Any:
    rates = self.astype(_draw_dtype(self.dtype))
    return jax.random.poisson(rng, rates, self.shape, jnp.int64).astype(self.dtype)


@register(aten.binomial.default, random=True)
def binomial(count: Any, prob: Any, generator: Any = None, *, rng: Any) -> Any:
    draw = _draw_dtype(count.dtype)
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    return jax.random.binomial(rng, count.astype(draw), prob.astype(draw), shape, draw).astype(count.dtype)


def _gamma(key: Any, alpha: Any) -> Any:
    return jax.random.gamma(key, alpha.astype(_draw_dtype(alpha.dtype)), alpha.shape)


@register(aten._standard_gamma.default, random=True)
def _standard_gamma(self: Any, generator: Any = None, *, rng: Any) -> Any:
    return _gamma(rng, self).astype(self.dtype)


@register(aten._sample_dirichlet.default, random=True)
def _sample_dirichlet(self: Any, generator: Any = None, *, rng: Any) -> Any:
    """Gamma draws normalised along the last dimension."""
    draws = _gamma(rng, self)
    return (draws / jnp.sum(draws, axis=-1, keepdims=True)).astype(self.dtype)
