"""Dtype conversions as PyTorch's CPU kernels make them: the one cast every lowering and every
result (graph.conform) goes through.

XLA's convert agrees with PyTorch everywhere but float8, where PyTorch CPU
- converts from any dtype through float32 (so a float64 or int64 value is rounded twice), and to
  any dtype through float32;
- saturates float8_e4m3fn: inf and anything beyond +-448 become +-448 (XLA gives NaN);
- gives float8_e4m3fn/float8_e5m2 NaN as 0x7F with the sign kept (XLA: other payloads);
- rounds float8_e8m0fnu by its own rule: the float32 exponent, plus one when the mantissa is
  at least half (ties up for normal numbers), the sign ignored, NaN and inf as 0xFF;
- turns each float8 NaN encoding into its own NaN pattern of the wider float types.
The NaN patterns of the last rule are read from PyTorch itself, once, when this module loads.
Out-of-range float8 -> integer conversions follow pjrt's float32 -> integer rule (XLA saturates;
C++ leaves them undefined).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.runtime import checks

_FLOAT_TARGETS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SIGN_KEPT_NAN = (torch.float8_e4m3fn, torch.float8_e5m2)
_E4M3FN_MAX = 448.0
_FLOAT32_SMALLEST_NORMAL = 2.0 ** -126


def _nan_results(source: torch.dtype, target: torch.dtype) -> list[tuple[int, Any]]:
    """Each NaN bit pattern of a float8 dtype and the value PyTorch CPU converts it to."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = patterns.view(source)
    nan = values.float().isnan()
    return list(zip(patterns[nan].tolist(), storage.host_array(values[nan].to(target))))


_NAN_RESULTS = {(s, t): _nan_results(s, t) for s in storage.FLOAT8_DTYPES for t in _FLOAT_TARGETS}


def convert(array: Any, dtype: torch.dtype) -> Any:
    """An array converted to a torch dtype bit for bit as PyTorch CPU converts it."""
    array = jnp.asarray(array)
    source = storage.torch_dtype(array.dtype)
    if source is dtype:
        return array
    if dtype in storage.FLOAT8_DTYPES:
        return _to_float8(_float32(array, source), dtype)
    if source in storage.FLOAT8_DTYPES:
        return _from_float8(array, source, dtype)
    if dtype is torch.bool:
        return array != 0
    return array.astype(storage.numpy_dtype(dtype))


# A number no dtype but double holds: what CPU's own fill is asked to take to read its overflow message.
_LARGEST_DOUBLE = float.fromhex("0x1.fffffffffffffp+1023")


@dataclasses.dataclass(frozen=True)
class _FitRule:
    """Which numbers a dtype takes from a Scalar (Scalar.to<T>()), as CPU checks them, and CPU's message."""

    message: str
    lowest: int | float  # an integer type's bounds stay ints: 2**63 - 1 as a float would round to 2**63
    highest: int | float
    takes_infinity: bool
    unsigned: bool


@functools.cache
def _fit_rule(dtype: torch.dtype, one_element: bool) -> _FitRule | None:
    """The rule read from PyTorch CPU itself (its fill_ raises for a number that does not fit); None where
    every number fits (bool, double, and a one-element fill of a half type, which CPU makes unchecked)."""
    probe = torch.zeros(1 if one_element else 2, dtype=dtype)
    try:
        probe.fill_(_LARGEST_DOUBLE)
    except RuntimeError as error:
        message = str(error)
    else:
        return None
    try:
        probe.fill_(float("inf"))
        takes_infinity = True
    except RuntimeError:
        takes_infinity = False
    if dtype.is_floating_point or dtype.is_complex:
        info = torch.finfo(dtype)
        return _FitRule(message, float(info.min), float(info.max), takes_infinity, False)
    info = torch.iinfo(dtype)
    return _FitRule(message, int(info.min), int(info.max), takes_infinity, not dtype.is_signed)


def _does_not_fit(value: Any, rule: _FitRule) -> Any:
    """Where `value` (a number, or a traced array) is out of `dtype`'s range as c10's overflow check says."""
    xp = np if isinstance(value, (int, float, np.ndarray, np.generic)) else jnp
    value = xp.asarray(value) if xp is jnp else np.asarray(value, dtype=object if isinstance(value, int) else None)
    # a Python int is compared exactly; a traced array against float bounds (an int bound past its type overflows)
    exact = value.dtype == object
    lowest, highest = (rule.lowest, rule.highest) if exact else (float(rule.lowest), float(rule.highest))
    if not exact and np.issubdtype(value.dtype, np.floating):
        outside = (value < lowest) | (value > highest)
        return outside & xp.isfinite(value) if rule.takes_infinity else outside | xp.isnan(value)
    if rule.unsigned:
        # a negative integer wraps (two's complement) when its magnitude fits, as in c10 (no negation: -(-2**63)
        # overflows an int64)
        return (value > highest) | (value < -highest)
    return (value < lowest) | (value > highest)


def beyond_int64(value: Any) -> bool:
    """A Python int no int64 holds: PyTorch takes one in [2**63, 2**64) as a uint64 Scalar (one past that range
    it refuses before any op runs). jax cannot take it as a program argument."""
    return type(value) is int and not -(2 ** 63) <= value < 2 ** 63


# Targets whose overflow a traced value is not checked for: beyond their range a number becomes inf where CPU
# raises, and a check would make every float masked_fill and full (attention masks) hand a code to the host.
_WIDE_FLOATS = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})


def fitted(value: Any, dtype: torch.dtype, op: str, filled: int | None = None) -> Any:
    """A Scalar argument converted to `dtype` as Scalar.to<T>() converts it (fill, full, masked_fill): a value
    the dtype cannot hold raises CPU's error, at once for a number known while tracing, by a device-side check
    (raised when the host next waits) for a traced one going into an integer or half type (not into a wider float,
    see _WIDE_FLOATS, nor into its own dtype). A bool never overflows. `filled`: the element count of a fill."""
    rule = _fit_rule(dtype, filled == 1)
    if rule is None or isinstance(value, bool) or getattr(value, "dtype", None) == jnp.bool_:
        return convert(value, dtype)
    if isinstance(value, (int, float)):
        if bool(_does_not_fit(value, rule)):
            raise RuntimeError(rule.message)
    elif dtype not in _WIDE_FLOATS and value.dtype != storage.numpy_dtype(dtype):
        checks.fail_if(_does_not_fit(value, rule), op, rule.message)
    return convert(value, dtype)


def _float32(array: Any, source: torch.dtype) -> Any:
    """float32 as a C++ cast makes it; float64 subnormal results kept (XLA's CPU convert flushes them)."""
    if source is not torch.float64:
        return convert(array, torch.float32)
    # below the smallest normal float32 the result is k * 2^-149, k the nearest integer (ties to even)
    steps = jnp.round(jnp.abs(array) * 2.0 ** 149).astype(jnp.uint32)
    subnormal_bits = steps | jnp.where(jnp.signbit(array), jnp.uint32(1 << 31), jnp.uint32(0))
    subnormal = jax.lax.bitcast_convert_type(subnormal_bits, jnp.float32)
    return jnp.where(jnp.abs(array) < _FLOAT32_SMALLEST_NORMAL, subnormal, array.astype(jnp.float32))


def _to_float8(x: Any, dtype: torch.dtype) -> Any:
    """float32 -> float8 by PyTorch's rules (module docstring)."""
    target = storage.numpy_dtype(dtype)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    if dtype is torch.float8_e8m0fnu:
        exponent = (bits >> 23) & 0xFF
        half_or_more = ((bits >> 22) & 1) == 1
        round_up = half_or_more & (((bits & 0x3FFFFF) != 0) | (exponent > 0))
        code = jnp.where(exponent == 0xFF, exponent, exponent + round_up.astype(jnp.uint32))
        return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), target)
    if dtype is torch.float8_e4m3fn:
        x = jnp.clip(x, -_E4M3FN_MAX, _E4M3FN_MAX)
    result = x.astype(target)
    if dtype in _SIGN_KEPT_NAN:
        nan = ((bits >> 24) & 0x80).astype(jnp.uint8) | jnp.uint8(0x7F)
        result = _replaced(result, [(jnp.isnan(x), nan)])
    return result


def _replaced(result: Any, replacements: list[tuple[Any, Any]]) -> Any:
    """`result` with the elements where each mask holds replaced by those bits; selected as integers,
    since XLA may carry a float select through another float type and lose a NaN's sign or payload."""
    unsigned = jnp.dtype(f"uint{8 * result.dtype.itemsize}")
    bits = jax.lax.bitcast_convert_type(result, unsigned)
    for mask, replacement in replacements:
        bits = jnp.where(mask, jnp.asarray(replacement).astype(unsigned), bits)
    return jax.lax.bitcast_convert_type(bits, result.dtype)


def _from_float8(array: Any, source: torch.dtype, dtype: torch.dtype) -> Any:
    """float8 -> any dtype: exact through XLA but for NaN patterns; integers and bool through float32."""
    if dtype not in _FLOAT_TARGETS:
        return convert(array.astype(jnp.float32), dtype)
    bits = jax.lax.bitcast_convert_type(array, jnp.uint8)
    nans = [(bits == pattern, np.asarray(value).view(f"uint{8 * value.itemsize}"))
            for pattern, value in _NAN_RESULTS[(source, dtype)]]
    return _replaced(array.astype(storage.numpy_dtype(dtype)), nans)
