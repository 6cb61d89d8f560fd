"""Neural-network ops: activations, norms, pooling, interpolation, embedding, losses, attention, padding.

Backward ops whose forward is a smooth composition (pads, interpolation, norms, average pooling,
most losses) are the jax vjp of the forward lowering, so forward and backward cannot disagree.
Max pooling keeps a running maximum over kernel offsets (memory O(output)), so its indices (flat
positions in each input plane) follow PyTorch's tie and NaN rules; adaptive pools and im2col gather
their (variable-size) windows explicitly. Trace-time index and weight tables are numpy constants.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt import storage
from torch_pjrt.ops.indexing import OUT_OF_RANGE, check_index
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten

MEAN, SUM = 1, 2


# --- shared helpers ------------------------------------------------------------------------------


def _compute_dtype(x: Any) -> Any:
    """Half types compute in float32, as PyTorch's CPU kernels do."""
    return jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype


def _up(x: Any) -> Any:
    return x.astype(_compute_dtype(x))


def _vjp(fn: Callable, grad: Any, *primals: Any) -> tuple:
    """Gradients of fn at primals for the cotangent grad (cast to fn's output dtype)."""
    out, pullback = jax.vjp(fn, *primals)
    return pullback(jnp.broadcast_to(grad, out.shape).astype(out.dtype))


def _reduce(loss: Any, reduction: int) -> Any:
    if reduction == MEAN:
        return jnp.mean(loss)
    if reduction == SUM:
        return jnp.sum(loss)
    return loss


def _channel_shape(x: Any) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against (N, C, ...) input."""
    return (1, -1) + (1,) * (x.ndim - 2)


# --- activations -------------------------------------------------------------------------------


@register(aten.relu.default)
def relu(self: Any) -> Any:
    return jnp.maximum(self, jnp.zeros((), self.dtype))


@register(aten.hardtanh.default)
def hardtanh(self: Any, min_val: Any = -1, max_val: Any = 1) -> Any:
    return jnp.minimum(jnp.maximum(self, jnp.asarray(min_val, self.dtype)), jnp.asarray(max_val, self.dtype))


@register(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output: Any, self: Any, min_val: Any, max_val: Any) -> Any:
    inside = (self > min_val) & (self < max_val)
    return jnp.where(inside, grad_output, jnp.zeros((), grad_output.dtype))


@register(aten.threshold.default)
def threshold(self: Any, threshold: Any, value: Any) -> Any:
    return jnp.where(self <= threshold, jnp.asarray(value, self.dtype), self)


@register(aten.threshold_backward.default)
def threshold_backward(grad_output: Any, self: Any, threshold: Any) -> Any:
    return jnp.where(self <= threshold, jnp.zeros((), grad_output.dtype), grad_output)


@register(aten.leaky_relu.default)
def leaky_relu(self: Any, negative_slope: Any = 0.01) -> Any:
    return jnp.where(self > 0, self, self * negative_slope)


@register(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output: Any, self: Any, negative_slope: Any, self_is_result: bool) -> Any:
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@register(aten.elu.default)
def elu(self: Any, alpha: Any = 1, scale: Any = 1, input_scale: Any = 1) -> Any:
    x = _up(self)
    negative = alpha * scale * jnp.expm1(x * input_scale)
    return jnp.where(x > 0, x * scale, negative)


@register(aten.elu_backward.default)
def elu_backward(grad_output: Any, alpha: Any, scale: Any, input_scale: Any, is_result: bool,
                 self_or_result: Any) -> Any:
    g, v = _up(grad_output), _up(self_or_result)
    if is_result:
        negative = g * input_scale * (v + alpha * scale)
    else:
        negative = g * input_scale * alpha * scale * jnp.exp(v * input_scale)
    return jnp.where(v <= 0, negative, g * scale)


@register(aten.celu.default)
def celu(self: Any, alpha: Any = 1.0) -> Any:
    return elu(self, alpha, 1.0, 1.0 / alpha)


@register(aten.gelu.default)
def gelu(self: Any, *, approximate: str = "none") -> Any:
    return jax.nn.gelu(_up(self), approximate=approximate == "tanh")


@register(aten.gelu_backward.default)
def gelu_backward(grad_output: Any, self: Any, *, approximate: str = "none") -> Any:
    return _vjp(lambda x: gelu(x, approximate=approximate), _up(grad_output), _up(self))[0]


@register(aten.silu.default)
def silu(self: Any) -> Any:
    x = _up(self)
    return x * jax.nn.sigmoid(x)


@register(aten.mish.default)
def mish(self: Any) -> Any:
    x = _up(self)
    return x * jnp.tanh(jax.nn.softplus(x))


@register(aten.softplus.default)
def softplus(self: Any, beta: Any = 1, threshold: Any = 20) -> Any:
    x = _up(self)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@register(aten.softplus_backward.default)
def softplus_backward(grad_output: Any, self: Any, beta: Any, threshold: Any) -> Any:
    x, g = _up(self), _up(grad_output)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


@register(aten.hardsigmoid.default)
def hardsigmoid(self: Any) -> Any:
    x = _up(self)
    return jnp.clip(x + 3, 0, 6) / 6


@register(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output: Any, self: Any) -> Any:
    return jnp.where((self > -3) & (self < 3), _up(grad_output) / 6, 0)


@register(aten.hardswish.default)
def hardswish(self: Any) -> Any:
    x = _up(self)
    return x * jnp.clip(x + 3, 0, 6) / 6


@register(aten.hardswish_backward.default)
def hardswish_backward(grad_output: Any, self: Any) -> Any:
    x, g = _up(self), _up(grad_output)
    return jnp.where(x < -3, 0, jnp.where(x <= 3, g * (x / 3 + 0.5), g))


@register(aten.glu.default)
def glu(self: Any, dim: int = -1) -> Any:
    a, b = jnp.split(_up(self), 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@register(aten.glu_backward.default)
def glu_backward(grad_output: Any, self: Any, dim: int) -> Any:
    return _vjp(lambda x: glu(x, dim), _up(grad_output), _up(self))[0]


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self: Any) -> tuple:
    """The buffer PyTorch's CPU kernel fills is not needed here; it is returned as zeros."""
    x = _up(self)
    return jax.nn.log_sigmoid(x), jnp.zeros_like(x)


@register(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output: Any, self: Any, buffer: Any) -> Any:
    return _up(grad_output) * jax.nn.sigmoid(-_up(self))


@register(aten._prelu_kernel.default)
def _prelu_kernel(self: Any, weight: Any) -> Any:
    return jnp.where(self > 0, self, weight * self)


@register(aten._prelu_kernel_backward.default)
def _prelu_kernel_backward(grad_output: Any, self: Any, weight: Any) -> tuple:
    """The weight gradient is per element (autograd sums it down to the weight's shape)."""
    positive = self > 0
    return jnp.where(positive, grad_output, weight * grad_output), jnp.where(positive, 0, self * grad_output)


@register(aten.softshrink.default)
def softshrink(self: Any, lambd: Any = 0.5) -> Any:
    return jnp.where(self > lambd, self - lambd, jnp.where(self < -lambd, self + lambd, jnp.zeros((), self.dtype)))


@register(aten.softshrink_backward.default)
def softshrink_backward(grad_output: Any, self: Any, lambd: Any) -> Any:
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_output.dtype), grad_output)


@register(aten.hardshrink.default)
def hardshrink(self: Any, lambd: Any = 0.5) -> Any:
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), self.dtype), self)


@register(aten.hardshrink_backward.default)
def hardshrink_backward(grad_out: Any, self: Any, lambd: Any) -> Any:
    return softshrink_backward(grad_out, self, lambd)


@register(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(self: Any, noise: Any, lower: Any = 0.125, upper: Any = 1 / 3,
                                training: bool = False, generator: Any = None, *, rng: Any) -> tuple:
    """Training draws a slope in [lower, upper) per negative element and returns it as the new noise."""
    if not training:
        return leaky_relu(self, (lower + upper) / 2), noise
    x = _up(self)
    slopes = jax.random.uniform(rng, x.shape, x.dtype) * (upper - lower) + lower
    new_noise = jnp.where(x <= 0, slopes, 1)
    return x * new_noise, new_noise


@register(aten.rrelu_with_noise_backward.default)
def rrelu_with_noise_backward(grad_output: Any, self: Any, noise: Any, lower: Any, upper: Any, training: bool,
                              self_is_result: bool) -> Any:
    """PyTorch treats a (near-)empty slope range as leaky_relu with the middle slope."""
    if training:
        return jnp.where(upper - lower > 1e-6, grad_output * noise,
                         leaky_relu_backward(grad_output, self, (lower + upper) / 2, self_is_result))
    return leaky_relu_backward(grad_output, self, (lower + upper) / 2, self_is_result)


# --- normalization -------------------------------------------------------------------------------


def _moments(x: Any, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """Mean and biased variance over axes (keepdims), in the compute dtype."""
    x = _up(x)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    return mean, jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)


def _normalize(x: Any, axes: tuple[int, ...], eps: float) -> tuple[Any, Any, Any]:
    """(x - mean) * rstd over axes, with mean and rstd kept (keepdims)."""
    mean, var = _moments(x, axes)
    rstd = jax.lax.rsqrt(var + eps)
    return (_up(x) - mean) * rstd, mean, rstd


def _affine(y: Any, weight: Any, bias: Any, shape: tuple[int, ...]) -> Any:
    if weight is not None:
        y = y * _up(weight).reshape(shape)
    if bias is not None:
        y = y + _up(bias).reshape(shape)
    return y


def _masked(values: Sequence[Any], output_mask: Sequence[bool], out_meta: Sequence[Any] | None) -> tuple:
    """Outputs the caller expects: PyTorch's meta kernel decides (some ignore output_mask), else the mask."""
    wanted = output_mask if out_meta is None else [m is not None for m in out_meta]
    return tuple(v if w else None for v, w in zip(values, wanted))


def _normalized_grad(g_hat: Any, x_hat: Any, rstd: Any, axes: tuple[int, ...]) -> Any:
    """Input gradient of (x - mean(x)) * rstd(x) over axes, for the cotangent g_hat of x_hat."""
    mean_g = jnp.mean(g_hat, axis=axes, keepdims=True)
    mean_gx = jnp.mean(g_hat * x_hat, axis=axes, keepdims=True)
    return rstd * (g_hat - mean_g - x_hat * mean_gx)


@register(aten.native_layer_norm.default)
def native_layer_norm(input: Any, normalized_shape: Sequence[int], weight: Any, bias: Any, eps: float) -> tuple:
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    y, mean, rstd = _normalize(input, axes, eps)
    return _affine(y, weight, bias, tuple(normalized_shape)), mean, rstd


@register(aten.native_layer_norm_backward.default, wants_meta=True)
def native_layer_norm_backward(grad_out: Any, input: Any, normalized_shape: Sequence[int], mean: Any, rstd: Any,
                               weight: Any, bias: Any, output_mask: Sequence[bool], *,
                               out_meta: Sequence[Any] | None = None) -> tuple:
    shape = tuple(normalized_shape)
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    batch_axes = tuple(range(input.ndim - len(shape)))
    g = _up(grad_out)
    x_hat = (_up(input) - mean) * rstd
    g_hat = g if weight is None else g * _up(weight)
    grad_input = _normalized_grad(g_hat, x_hat, rstd, axes)
    grads = (grad_input, jnp.sum(g * x_hat, axis=batch_axes), jnp.sum(g, axis=batch_axes))
    return _masked(grads, output_mask, out_meta)


@register(aten.native_group_norm.default)
def native_group_norm(input: Any, weight: Any, bias: Any, n: int, c: int, hxw: int, group: int,
                      eps: float) -> tuple:
    y, mean, rstd = _normalize(input.reshape(n, group, c // group * hxw), (2,), eps)
    out = _affine(y.reshape(input.shape), weight, bias, _channel_shape(input))
    return out, mean.reshape(n, group), rstd.reshape(n, group)


@register(aten.native_group_norm_backward.default, wants_meta=True)
def native_group_norm_backward(grad_out: Any, input: Any, mean: Any, rstd: Any, weight: Any, n: int, c: int,
                               hxw: int, group: int, output_mask: Sequence[bool], *,
                               out_meta: Sequence[Any] | None = None) -> tuple:
    g = _up(grad_out).reshape(n, c, hxw)
    x = _up(input).reshape(n, group, c // group * hxw)
    x_hat = (x - mean[..., None]) * rstd[..., None]
    g_hat = g if weight is None else g * _up(weight).reshape(1, c, 1)
    grad_input = _normalized_grad(g_hat.reshape(n, group, c // group * hxw), x_hat, rstd[..., None], (2,))
    grad_weight = jnp.sum(g * x_hat.reshape(n, c, hxw), axis=(0, 2))
    grad_bias = jnp.sum(g, axis=(0, 2))
    return _masked((grad_input.reshape(input.shape), grad_weight, grad_bias), output_mask, out_meta)


def _batch_norm(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool,
                momentum: Any, eps: float) -> tuple:
    """(out, save_mean, save_invstd, new running_mean, new running_var); eval mode uses the running stats."""
    axes = tuple(i for i in range(input.ndim) if i != 1)
    shape = _channel_shape(input)
    if training:
        mean, var = _moments(input, axes)
        invstd = jax.lax.rsqrt(var + eps)
        y = (_up(input) - mean) * invstd
        mean, var, invstd = mean.reshape(-1), var.reshape(-1), invstd.reshape(-1)
        if running_mean is not None:
            count = input.size // input.shape[1]
            running_mean = (1 - momentum) * _up(running_mean) + momentum * mean
            running_var = (1 - momentum) * _up(running_var) + momentum * var * (count / max(count - 1, 1))
    else:
        mean, invstd = _up(running_mean), jax.lax.rsqrt(_up(running_var) + eps)
        y = (_up(input) - mean.reshape(shape)) * invstd.reshape(shape)
    return _affine(y, weight, bias, shape), mean, invstd, running_mean, running_var


@register(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                                        training: bool, momentum: float, eps: float) -> tuple:
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@register(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input: Any, weight: Any, bias: Any, training: bool, momentum: float,
                                      eps: float) -> tuple:
    if not training:
        raise NotImplementedError("_native_batch_norm_legit.no_stats in eval mode needs running statistics.")
    return _batch_norm(input, weight, bias, None, None, True, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                                         momentum: float, eps: float) -> tuple:
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@register(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                                       momentum: float, eps: float) -> tuple:
    out, mean, invstd, new_mean, new_var = _batch_norm(input, weight, bias, running_mean, running_var, True,
                                                       momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var


@register(aten._batch_norm_no_update.default)
def _batch_norm_no_update(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                          momentum: float, eps: float) -> tuple:
    training = running_mean is None
    out, mean, invstd, _, _ = _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8)


@register(aten.native_batch_norm.default)
def native_batch_norm(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool,
                      momentum: float, eps: float) -> tuple:
    """Eager pjrt routes this op to _native_batch_norm_legit (whose schema declares the running-stat update);
    a graph reaching it in training mode with running statistics cannot express that update."""
    if training and running_mean is not None:
        raise NotImplementedError(
            "torch_pjrt: native_batch_norm in training mode updates running_mean/running_var in place without "
            "declaring it; use _native_batch_norm_legit (its functional form) in graphs."
        )
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]


def _batch_norm_grads(grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any,
                      save_mean: Any, save_invstd: Any, train: bool, eps: float, output_mask: Sequence[bool],
                      out_meta: Sequence[Any] | None) -> tuple:
    axes = tuple(i for i in range(input.ndim) if i != 1)
    shape = _channel_shape(input)
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), jax.lax.rsqrt(_up(running_var) + eps)
    g = _up(grad_out)
    x_hat = (_up(input) - mean.reshape(shape)) * invstd.reshape(shape)
    g_hat = g if weight is None else g * _up(weight).reshape(shape)
    if train:
        grad_input = _normalized_grad(g_hat, x_hat, invstd.reshape(shape), axes)
    else:
        grad_input = g_hat * invstd.reshape(shape)
    return _masked((grad_input, jnp.sum(g * x_hat, axis=axes), jnp.sum(g, axis=axes)), output_mask, out_meta)


@register(aten.native_batch_norm_backward.default, wants_meta=True)
def native_batch_norm_backward(grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any,
                               save_mean: Any, save_invstd: Any, train: bool, eps: float,
                               output_mask: Sequence[bool], *, out_meta: Sequence[Any] | None = None) -> tuple:
    return _batch_norm_grads(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                             eps, output_mask, out_meta)


@register(aten.batch_norm_backward.default, wants_meta=True)
def batch_norm_backward(grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any,
                        save_mean: Any, save_var: Any, update: bool, eps: float, output_mask: Sequence[bool],
                        reserve: Any, *, out_meta: Sequence[Any] | None = None) -> tuple:
    train = update or running_mean is None
    return _batch_norm_grads(grad_out, input, weight, running_mean, running_var, save_mean, save_var, train, eps,
                             output_mask, out_meta)


# --- pooling ---------------------------------------------------------------------------------------


def _expand(values: Sequence[int], rank: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    values = tuple(int(v) for v in values) if values else tuple(default or ())
    return values * rank if len(values) == 1 else values


def _pool_positions(size: int, kernel: int, stride: int, padding: int, dilation: int,
                    ceil_mode: bool) -> np.ndarray:
    """Input positions (out, kernel) each output window reads, PyTorch's output-size rule included."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * dilation - padding


def _adaptive_positions(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (out, widest window) and validity of PyTorch's adaptive windows [floor(o*in/out), ceil(...))."""
    starts = (np.arange(out) * size) // out
    ends = -((-(np.arange(out) + 1) * size) // out)
    widest = int((ends - starts).max())
    positions = starts[:, None] + np.arange(widest)[None, :]
    return positions, positions < ends[:, None]


def _outer(masks: Sequence[np.ndarray]) -> np.ndarray:
    """Combine per-dimension (out, k) arrays into one (o1, k1, o2, k2, ...) boolean array."""
    combined = np.array(True)
    for mask in masks:
        combined = np.logical_and(combined[..., None, None], mask)
    return combined


def _window_layout(array: Any, lead: int, rank: int) -> Any:
    """(..., o1, k1, ..., or, kr) -> (..., o1, ..., or, k1*...*kr)."""
    perm = list(range(lead)) + [lead + 2 * d for d in range(rank)] + [lead + 2 * d + 1 for d in range(rank)]
    array = array.transpose(perm)
    return array.reshape(array.shape[: lead + rank] + (math.prod(array.shape[lead + rank:]),))


def _windows(x: Any, positions: Sequence[np.ndarray], valid: Sequence[np.ndarray], fill: Any) -> Any:
    """Windows over x's trailing dims as (..., *out, K); positions outside valid read fill."""
    rank = len(positions)
    lead = x.ndim - rank
    for d, pos in enumerate(positions):
        axis = lead + 2 * d
        gathered = jnp.take(x, np.clip(pos, 0, x.shape[axis] - 1).reshape(-1), axis=axis)
        x = gathered.reshape(x.shape[:axis] + pos.shape + x.shape[axis + 1:])
    x = jnp.where(_outer(valid), x, jnp.asarray(fill, x.dtype))
    return _window_layout(x, lead, rank)


def _in_bounds(positions: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    return [(p >= 0) & (p < s) for p, s in zip(positions, sizes)]


def _lowest(dtype: Any) -> Any:
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_windows(x: Any, positions: Sequence[np.ndarray], valid: Sequence[np.ndarray]) -> tuple[Any, Any]:
    """Max of each (padded) window and its flat index in the input plane: the first maximum, or the last NaN,
    as PyTorch's kernels choose. One argmax over the window axis, for windows of any size."""
    rank = len(positions)
    sizes = x.shape[-rank:]
    windows = _windows(x, positions, valid, _lowest(x.dtype))
    plane = np.array(0)
    for pos, stride in zip(positions, np.cumprod((1,) + sizes[::-1])[-2::-1]):
        plane = plane[..., None, None] + pos * stride
    return _pick_max(windows, jnp.asarray(_window_layout(plane, 0, rank)))


def _pick_max(windows: Any, flat: Any) -> tuple[Any, Any]:
    """Over the last axis: the first maximum, or the last NaN, as PyTorch's kernels choose; with its flat index."""
    if jnp.issubdtype(windows.dtype, jnp.floating):
        nan = jnp.isnan(windows)
        last_nan = windows.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        choice = jnp.where(jnp.any(nan, -1), last_nan, jnp.argmax(windows, axis=-1))
    else:
        choice = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(flat, windows.shape), choice[..., None], axis=-1)[..., 0]
    return values, indices


def _pool_taps(x: Any, positions: Sequence[np.ndarray], strides: Sequence[int],
               fill: Any) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """For each kernel offset: the strided slice of x it reads (one value per output), which outputs read
    inside the input there, and the flat in-plane index read. Memory stays O(output) per offset."""
    rank = len(positions)
    lead = x.ndim - rank
    sizes = x.shape[lead:]
    before = [max(0, -int(pos.min())) for pos in positions]
    after = [max(0, int(pos.max()) + 1 - size) for pos, size in zip(positions, sizes)]
    padded = jax.lax.pad(x, jnp.asarray(fill, x.dtype), [(0, 0, 0)] * lead + [(b, a, 0) for b, a in zip(before, after)])
    plane_strides = np.cumprod((1,) + tuple(sizes[::-1]))[-2::-1]
    for offset in itertools.product(*(range(pos.shape[1]) for pos in positions)):
        columns = [pos[:, j] for pos, j in zip(positions, offset)]
        start = [0] * lead + [int(c[0]) + b for c, b in zip(columns, before)]
        limit = list(x.shape[:lead]) + [int(c[-1]) + b + 1 for c, b in zip(columns, before)]
        taken = jax.lax.slice(padded, start, limit, [1] * lead + list(strides))
        valid, flat = np.array(True), np.array(0)
        for column, size, plane_stride in zip(columns, sizes, plane_strides):
            valid = valid[..., None] & (column >= 0) & (column < size)
            flat = flat[..., None] + column * plane_stride
        yield taken, valid, flat


def _max_pool(self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
              dilation: Sequence[int], ceil_mode: bool, rank: int) -> tuple:
    """Running max over kernel offsets; ties keep the first, a NaN always wins (as PyTorch's kernels)."""
    kernel = _expand(kernel_size, rank)
    strides = _expand(stride, rank, kernel)
    pads, dilations = _expand(padding, rank), _expand(dilation, rank)
    sizes = self.shape[-rank:]
    positions = [_pool_positions(*args, ceil_mode) for args in zip(sizes, kernel, strides, pads, dilations)]
    out_shape = self.shape[:-rank] + tuple(pos.shape[0] for pos in positions)
    best = jnp.full(out_shape, _lowest(self.dtype), self.dtype)
    index = jnp.full(out_shape, -1, jnp.int64)
    floating = jnp.issubdtype(self.dtype, jnp.floating)
    for value, valid, flat in _pool_taps(self, positions, strides, _lowest(self.dtype)):
        better = (value > best) | (index < 0)
        if floating:
            better = better | jnp.isnan(value)
        better = better & valid
        best = jnp.where(better, value, best)
        index = jnp.where(better, flat, index)
    return best, index


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                            ceil_mode: bool = False) -> tuple:
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                            ceil_mode: bool = False) -> tuple:
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _scatter_to_plane(grad_output: Any, self: Any, indices: Any, rank: int) -> Any:
    """Add each output gradient into the input position its index names (the max-pool backward)."""
    lead = self.shape[:-rank]
    rows = math.prod(lead)
    outputs = math.prod(grad_output.shape[len(lead):])
    g = _up(grad_output).reshape(rows, outputs)
    idx = indices.reshape(rows, outputs)
    grad = jnp.zeros((rows, math.prod(self.shape[-rank:])), g.dtype)
    grad = grad.at[jnp.arange(rows)[:, None], idx].add(g)
    return grad.reshape(self.shape)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


def _window_sums(x: Any, positions: Sequence[np.ndarray], kernel: Sequence[int], strides: Sequence[int]) -> Any:
    """Sum of each (zero-padded) window: one reduce_window, whatever the kernel size."""
    rank = len(positions)
    lead = x.ndim - rank
    before = [max(0, -int(pos.min())) for pos in positions]
    after = [max(0, int(pos.max()) + 1 - size) for pos, size in zip(positions, x.shape[lead:])]
    padded = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * lead + [(b, a, 0) for b, a in zip(before, after)])
    first = [int(pos[0, 0]) + b for pos, b in zip(positions, before)]
    padded = padded[(Ellipsis, *(slice(f, None) for f in first))]
    sums = jax.lax.reduce_window(padded, np.zeros((), x.dtype), jax.lax.add, (1,) * lead + tuple(kernel),
                                 (1,) * lead + tuple(strides), "VALID")
    return sums[(Ellipsis, *(slice(0, pos.shape[0]) for pos in positions))]


def _avg_pool(self: Any, kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
              ceil_mode: bool, count_include_pad: bool, divisor_override: int | None, rank: int) -> Any:
    kernel = _expand(kernel_size, rank)
    strides = _expand(stride, rank, kernel)
    pads = _expand(padding, rank)
    sizes = self.shape[-rank:]
    positions = [_pool_positions(s, k, st, p, 1, ceil_mode) for s, k, st, p in zip(sizes, kernel, strides, pads)]
    total = _window_sums(_up(self), positions, kernel, strides)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:
        counts = [np.minimum(pos[:, 0] + k, s + p) - pos[:, 0] for pos, k, s, p in zip(positions, kernel, sizes, pads)]
    else:
        counts = [v.sum(axis=1) for v in _in_bounds(positions, sizes)]
    divisor = np.array(1)
    for count in counts:
        divisor = divisor[..., None] * count
    return total / jnp.asarray(divisor, total.dtype)


@register(aten.avg_pool2d.default)
def avg_pool2d(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@register(aten.avg_pool3d.default)
def avg_pool3d(self: Any, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None) -> Any:
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@register(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int],
                        padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> Any:
    return _vjp(lambda x: avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override), grad_output, _up(self))[0]


@register(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int], stride: Sequence[int],
                        padding: Sequence[int], ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> Any:
    return _vjp(lambda x: avg_pool3d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                     divisor_override), grad_output, _up(self))[0]


def _adaptive(self: Any, output_size: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rank = len(output_size)
    pairs = [_adaptive_positions(s, int(o)) for s, o in zip(self.shape[-rank:], output_size)]
    return [p for p, _ in pairs], [v for _, v in pairs]


def _adaptive_avg_pool_nd(self: Any, output_size: Sequence[int]) -> Any:
    positions, valid = _adaptive(self, output_size)
    total = jnp.sum(_windows(_up(self), positions, valid, 0), axis=-1)
    divisor = np.array(1)
    for v in valid:
        divisor = divisor[..., None] * v.sum(axis=1)
    return total / jnp.asarray(divisor, total.dtype)


@register(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool(self: Any, output_size: Sequence[int]) -> Any:
    return _adaptive_avg_pool_nd(self, output_size)


@register(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad_output: Any, self: Any) -> Any:
    return _vjp(lambda x: _adaptive_avg_pool_nd(x, grad_output.shape[-2:]), grad_output, _up(self))[0]


@register(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad_output: Any, self: Any) -> Any:
    return _vjp(lambda x: _adaptive_avg_pool_nd(x, grad_output.shape[-3:]), grad_output, _up(self))[0]


@register(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(self: Any, output_size: Sequence[int]) -> tuple:
    return _max_windows(self, *_adaptive(self, output_size))


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output: Any, self: Any, indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


def _fractional_starts(sample: Any, size: int, out: int, kernel: int) -> Any:
    """PyTorch's pseudo-random window starts per plane: int((i + u) a) - int(u a) with a = (size - k) / (out - 1),
    in the samples' dtype; the last window ends at the input's end."""
    i = jnp.arange(out).astype(sample.dtype)
    u = sample[..., None]
    alpha = jnp.asarray(size - kernel, sample.dtype) / (out - 1) if out > 1 else jnp.zeros((), sample.dtype)
    starts = ((i + u) * alpha).astype(jnp.int64) - (u * alpha).astype(jnp.int64)
    return starts.at[..., -1].set(size - kernel)


def _fractional_max_pool(self: Any, kernel_size: Sequence[int], output_size: Sequence[int], random_samples: Any,
                         rank: int) -> tuple:
    """Max over windows at random_samples' starts. A plane's samples name the dims (T, H, W) in 3-D but (W, H)
    in 2-D, as PyTorch's kernels read them."""
    unbatched = self.ndim == rank + 1
    x = self[None] if unbatched else self
    sizes = x.shape[2:]
    if 0 in output_size:
        shape = x.shape[:2] + tuple(int(o) for o in output_size)
        values, indices = jnp.zeros(shape, x.dtype), jnp.zeros(shape, jnp.int64)
    else:
        flat = jnp.zeros(x.shape[:2], jnp.int64)
        for d, (size, out, kernel) in enumerate(zip(sizes, output_size, kernel_size)):
            sample = random_samples[..., rank - 1 - d if rank == 2 else d]
            starts = _fractional_starts(sample, size, int(out), int(kernel))
            positions = starts[..., None] + jnp.arange(int(kernel))
            lead = positions.shape[:2] + (1, 1) * d
            flat = flat[..., None, None] * size + positions.reshape(lead + positions.shape[2:])
        planes = x.reshape(x.shape[:2] + (math.prod(sizes),))
        windows = jnp.take_along_axis(planes, flat.reshape(flat.shape[:2] + (math.prod(flat.shape[2:]),)), axis=2)
        layout = lambda a: _window_layout(a.reshape(flat.shape), 2, rank)
        values, indices = _pick_max(layout(windows), layout(flat))
    return (values[0], indices[0]) if unbatched else (values, indices)


@register(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self: Any, kernel_size: Sequence[int], output_size: Sequence[int],
                          random_samples: Any) -> tuple:
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 2)


@register(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self: Any, kernel_size: Sequence[int], output_size: Sequence[int],
                          random_samples: Any) -> tuple:
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 3)


@register(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                   output_size: Sequence[int], indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 2)


@torch.library.register_fake("aten::fractional_max_pool3d_backward")
def _fractional_max_pool3d_backward_meta(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                         output_size: Sequence[int], indices: Any) -> Any:
    """PyTorch ships no meta kernel for this backward; its result is shaped like the input."""
    return self.new_empty(self.shape)


@register(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output: Any, self: Any, kernel_size: Sequence[int],
                                   output_size: Sequence[int], indices: Any) -> Any:
    return _scatter_to_plane(grad_output, self, indices, 3)


@register(aten.im2col.default)
def im2col(self: Any, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
           stride: Sequence[int]) -> Any:
    """(N, C, H, W) -> (N, C*kh*kw, L): each column one window, channel-major like F.unfold."""
    sizes = self.shape[-2:]
    positions = [_pool_positions(s, k, st, p, d, False)
                 for s, k, d, p, st in zip(sizes, _expand(kernel_size, 2), _expand(dilation, 2),
                                           _expand(padding, 2), _expand(stride, 2))]
    windows = _windows(self, positions, _in_bounds(positions, sizes), 0)
    lead = self.ndim - 2
    columns = jnp.moveaxis(windows, -1, lead)
    rows = self.shape[lead - 1] * columns.shape[lead]
    return columns.reshape(self.shape[:lead - 1] + (rows, math.prod(columns.shape[-2:])))


@register(aten.col2im.default)
def col2im(self: Any, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
           padding: Sequence[int], stride: Sequence[int]) -> Any:
    """The transpose of im2col: overlapping window entries are summed into the image (F.fold)."""
    kernel = math.prod(_expand(kernel_size, 2))
    shape = self.shape[:-2] + (self.shape[-2] // kernel,) + tuple(int(o) for o in output_size)
    return _transpose_of(lambda x: im2col(x, kernel_size, dilation, padding, stride), self, shape)


# --- interpolation --------------------------------------------------------------------------------
# Source positions are computed at trace time in numpy with PyTorch's formulas and precision
# (float32 scales unless the input is float64), then each spatial dim is interpolated in turn.

CUBIC_A = -0.75


def _index_dtype(x: Any) -> Any:
    return np.float64 if x.dtype == jnp.float64 else np.float32


def _scale(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any) -> Any:
    if align_corners:
        return dtype((size - 1) / (out - 1)) if out > 1 else dtype(0)
    if scale is not None and scale > 0:
        return dtype(1.0 / scale)
    return dtype(size / out)


def _nearest_taps(size: int, out: int, scale: float | None, exact: bool) -> list[tuple[np.ndarray, None]]:
    ratio = _scale(size, out, scale, False, np.float32)
    offset = np.float32(0.5) if exact else np.float32(0)
    source = np.floor((np.arange(out, dtype=np.float32) + offset) * ratio).astype(np.int64)
    return [(np.minimum(source, size - 1), None)]


def _source(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any) -> np.ndarray:
    ratio = _scale(size, out, scale, align_corners, dtype)
    index = np.arange(out, dtype=dtype)
    if align_corners:
        return ratio * index
    return ratio * (index + dtype(0.5)) - dtype(0.5)


def _linear_taps(size: int, out: int, scale: float | None, align_corners: bool,
                 dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    source = np.maximum(_source(size, out, scale, align_corners, dtype), dtype(0))
    low = source.astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    frac = (source - low).astype(dtype)
    return [(low, dtype(1) - frac), (high, frac)]


def _cubic_taps(size: int, out: int, scale: float | None, align_corners: bool,
                dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    source = _source(size, out, scale, align_corners, dtype)
    base = np.floor(source)
    t = (source - base).astype(dtype)
    cubic = _cubic_filter(dtype(CUBIC_A))
    weights = [cubic(t + 1), cubic(t), cubic(1 - t), cubic(2 - t)]
    return [(np.clip(base.astype(np.int64) - 1 + j, 0, size - 1), w.astype(dtype)) for j, w in enumerate(weights)]


def _cubic_filter(a: float, xp: Any = np) -> Callable[[Any], Any]:
    """Keys' cubic convolution kernel with parameter a, on numpy (trace-time weights) or jax arrays."""

    def cubic(v: Any) -> Any:
        v = xp.abs(v)
        near = ((a + 2) * v - (a + 3)) * v * v + 1
        far = ((a * v - 5 * a) * v + 8 * a) * v - 4 * a
        return xp.where(v < 1, near, xp.where(v < 2, far, 0))

    return cubic


def _triangle_filter(v: np.ndarray) -> np.ndarray:
    return np.maximum(1 - np.abs(v), 0)


def _antialias_taps(size: int, out: int, scale: float | None, align_corners: bool, dtype: Any, support: int,
                    kernel: Callable[[np.ndarray], np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """PyTorch's antialiased weights: the filter stretched by the downscale factor, normalized per output."""
    ratio = _scale(size, out, scale, align_corners, dtype)
    stretch = max(float(ratio), 1.0)
    reach = support / 2 * stretch
    center = ratio * (np.arange(out, dtype=dtype) + dtype(0.5))
    low = np.maximum((center - reach + 0.5).astype(np.int64), 0)
    count = np.minimum((center + reach + 0.5).astype(np.int64), size) - low
    offsets = np.arange(int(count.max()))
    weights = kernel(((offsets + low[:, None]).astype(dtype) - center[:, None] + dtype(0.5)) / dtype(stretch))
    weights = np.where(offsets < count[:, None], weights, 0).astype(dtype)
    total = weights.sum(axis=1, keepdims=True)
    weights = np.where(total != 0, weights / np.where(total != 0, total, 1), weights)
    return [(np.clip(low + j, 0, size - 1), weights[:, j]) for j in offsets]


def _bilinear_aa_taps(size: int, out: int, scale: float | None, align_corners: bool,
                      dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    return _antialias_taps(size, out, scale, align_corners, dtype, 2, _triangle_filter)


def _bicubic_aa_taps(size: int, out: int, scale: float | None, align_corners: bool,
                     dtype: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    return _antialias_taps(size, out, scale, align_corners, dtype, 4, _cubic_filter(-0.5))


def _interpolate(x: Any, taps_per_dim: Sequence[list[tuple[np.ndarray, np.ndarray | None]]]) -> Any:
    """Apply per-dimension taps (indices, weights) to x's trailing dims, one dimension at a time."""
    rank = len(taps_per_dim)
    for d, taps in enumerate(taps_per_dim):
        axis = x.ndim - rank + d
        shape = (-1,) + (1,) * (x.ndim - axis - 1)
        total = None
        for index, weight in taps:
            term = jnp.take(x, index, axis=axis)
            if weight is not None:
                term = term * jnp.asarray(weight, x.dtype).reshape(shape)
            total = term if total is None else total + term
        x = total
    return x


def _scales(rank: int, values: Sequence[float | None]) -> list[float | None]:
    return list(values) + [None] * (rank - len(values))


def _nearest(x: Any, output_size: Sequence[int], scales: Sequence[float | None], exact: bool) -> Any:
    rank = len(output_size)
    taps = [_nearest_taps(s, int(o), sc, exact)
            for s, o, sc in zip(x.shape[-rank:], output_size, _scales(rank, scales))]
    return _interpolate(x, taps)


def _smooth(x: Any, output_size: Sequence[int], align_corners: bool, scales: Sequence[float | None],
            taps_for: Callable) -> Any:
    rank = len(output_size)
    dtype = _index_dtype(x)
    taps = [taps_for(s, int(o), sc, align_corners, dtype)
            for s, o, sc in zip(x.shape[-rank:], output_size, _scales(rank, scales))]
    return _interpolate(_up(x), taps)


def _transpose_of(forward: Callable, grad_output: Any, input_size: Sequence[int]) -> Any:
    """Backward of a linear resampling: the vjp of its forward, for an input of input_size."""
    return _vjp(forward, grad_output, jnp.zeros(tuple(input_size), _compute_dtype(grad_output)))[0]


@register(aten.upsample_nearest1d.default, aten.upsample_nearest2d.default, aten.upsample_nearest3d.default)
def upsample_nearest(self: Any, output_size: Sequence[int], *scales: float | None) -> Any:
    return _nearest(self, output_size, scales, exact=False)


@register(aten._upsample_nearest_exact1d.default, aten._upsample_nearest_exact2d.default,
          aten._upsample_nearest_exact3d.default)
def _upsample_nearest_exact(self: Any, output_size: Sequence[int], *scales: float | None) -> Any:
    return _nearest(self, output_size, scales, exact=True)


@register(aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
          aten.upsample_nearest3d_backward.default)
def upsample_nearest_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                              *scales: float | None) -> Any:
    return _transpose_of(lambda x: _nearest(x, output_size, scales, exact=False), grad_output, input_size)


@register(aten._upsample_nearest_exact1d_backward.default, aten._upsample_nearest_exact2d_backward.default,
          aten._upsample_nearest_exact3d_backward.default)
def _upsample_nearest_exact_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                     *scales: float | None) -> Any:
    return _transpose_of(lambda x: _nearest(x, output_size, scales, exact=True), grad_output, input_size)


@register(aten.upsample_linear1d.default, aten.upsample_bilinear2d.default, aten.upsample_trilinear3d.default)
def upsample_linear(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _linear_taps)


@register(aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
          aten.upsample_trilinear3d_backward.default)
def upsample_linear_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                             align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _linear_taps), grad_output,
                         input_size)


@register(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self: Any, output_size: Sequence[int], align_corners: bool, *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _cubic_taps)


@register(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _cubic_taps), grad_output,
                         input_size)


@register(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self: Any, output_size: Sequence[int], align_corners: bool,
                            *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _bilinear_aa_taps)


@register(aten._upsample_bilinear2d_aa_backward.default)
def _upsample_bilinear2d_aa_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                     align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _bilinear_aa_taps), grad_output,
                         input_size)


@register(aten._upsample_bicubic2d_aa.default)
def _upsample_bicubic2d_aa(self: Any, output_size: Sequence[int], align_corners: bool,
                           *scales: float | None) -> Any:
    return _smooth(self, output_size, align_corners, scales, _bicubic_aa_taps)


@register(aten._upsample_bicubic2d_aa_backward.default)
def _upsample_bicubic2d_aa_backward(grad_output: Any, output_size: Sequence[int], input_size: Sequence[int],
                                    align_corners: bool, *scales: float | None) -> Any:
    return _transpose_of(lambda x: _smooth(x, output_size, align_corners, scales, _bicubic_aa_taps), grad_output,
                         input_size)


# --- grid sampling ----------------------------------------------------------------------------------

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _unnormalize(coord: Any, size: int, align_corners: bool) -> Any:
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord: Any, twice_low: int, twice_high: int) -> Any:
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinate(coord: Any, size: int, padding_mode: int, align_corners: bool) -> Any:
    """Map a source coordinate into the image for border/reflection padding (zeros leaves it)."""
    if padding_mode == BORDER:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == REFLECTION:
        reflected = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        return jnp.clip(reflected, 0, size - 1)
    return coord


def _sample(input: Any, indices: Sequence[Any], weights: Any) -> Any:
    """Sum over taps (last dim) of weights * input[n, :, i_1, ..., i_r], out-of-bounds taps reading zero.

    indices (one per spatial dim, outermost first) and weights: (N, *out, taps); one gather for all taps.
    """
    n, c, *sizes = input.shape
    inside = jnp.ones(weights.shape, jnp.bool_)
    flat = jnp.zeros(weights.shape, jnp.int64)
    for index, size in zip(indices, sizes):
        inside = inside & (index >= 0) & (index < size)
        flat = flat * size + jnp.clip(index, 0, size - 1)
    values = jnp.take_along_axis(input.reshape(n, c, -1), flat.reshape(n, 1, -1), axis=2)
    values = values.reshape((n, c) + flat.shape[1:])
    return jnp.sum(values * jnp.where(inside, weights, 0)[:, None], axis=-1)


def _grid_coordinates(input: Any, grid: Any, align_corners: bool) -> list[Any]:
    """Source coordinates per spatial dim, outermost first (the grid's last axis lists them innermost first)."""
    sizes = input.shape[2:]
    rank = len(sizes)
    return [_unnormalize(grid[..., rank - 1 - d], size, align_corners) for d, size in enumerate(sizes)]


def _grid_sample_bicubic(input: Any, grid: Any, padding_mode: int, align_corners: bool) -> Any:
    height, width = input.shape[-2:]
    y, x = _grid_coordinates(input, grid, align_corners)
    x0, y0 = jnp.floor(x), jnp.floor(y)
    cubic = _cubic_filter(CUBIC_A, jnp)
    taps = [(j, i) for j in range(4) for i in range(4)]
    iy = jnp.stack([_pad_coordinate(y0 - 1 + j, height, padding_mode, align_corners) for j, _ in taps], -1)
    ix = jnp.stack([_pad_coordinate(x0 - 1 + i, width, padding_mode, align_corners) for _, i in taps], -1)
    weights = jnp.stack([cubic(x - x0 + 1 - i) * cubic(y - y0 + 1 - j) for j, i in taps], -1)
    return _sample(input, [iy.astype(jnp.int64), ix.astype(jnp.int64)], weights)


def _grid_sample(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    """grid_sampler_2d and _3d: (bi/tri)linear over the 2^rank neighbours, or the nearest (half to even)."""
    if interpolation_mode == BICUBIC:
        return _grid_sample_bicubic(input, grid, padding_mode, align_corners)
    coords = [_pad_coordinate(c, size, padding_mode, align_corners)
              for c, size in zip(_grid_coordinates(input, grid, align_corners), input.shape[2:])]
    if interpolation_mode == NEAREST:
        indices = [jnp.round(c).astype(jnp.int64)[..., None] for c in coords]
        return _sample(input, indices, jnp.ones(indices[0].shape, input.dtype))
    lows = [jnp.floor(c) for c in coords]
    fracs = [c - low for c, low in zip(coords, lows)]
    corners = list(itertools.product((0, 1), repeat=len(coords)))
    indices = [jnp.stack([low.astype(jnp.int64) + corner[d] for corner in corners], -1) for d, low in enumerate(lows)]
    weights = jnp.stack([math.prod(f if b else 1 - f for f, b in zip(fracs, corner)) for corner in corners], -1)
    return _sample(input, indices, weights)


@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(input: Any, grid: Any, interpolation_mode: int, padding_mode: int, align_corners: bool) -> Any:
    if interpolation_mode == BICUBIC and input.ndim != 4:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    return _grid_sample(_up(input), _up(grid), interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default, wants_meta=True)
def grid_sampler_backward(grad_output: Any, input: Any, grid: Any, interpolation_mode: int, padding_mode: int,
                          align_corners: bool, output_mask: Sequence[bool], *,
                          out_meta: Sequence[Any] | None = None) -> tuple:
    grads = _vjp(lambda i, g: grid_sampler(i, g, interpolation_mode, padding_mode, align_corners), grad_output,
                 _up(input), _up(grid))
    return _masked(grads, output_mask, out_meta)


# --- padding --------------------------------------------------------------------------------------


def _pad_widths(ndim: int, pad: Sequence[int]) -> list[tuple[int, int]]:
    """PyTorch's pad list (last dim first, (before, after) pairs) as per-dim widths."""
    pairs = [(int(pad[i]), int(pad[i + 1])) for i in range(0, len(pad), 2)]
    return [(0, 0)] * (ndim - len(pairs)) + pairs[::-1]


@register(aten.constant_pad_nd.default)
def constant_pad_nd(self: Any, pad: Sequence[int], value: Any = 0) -> Any:
    """Negative widths crop, as in PyTorch."""
    widths = _pad_widths(self.ndim, pad)
    return jax.lax.pad(self, jnp.asarray(value, self.dtype), [(lo, hi, 0) for lo, hi in widths])


def _mode_pad(self: Any, padding: Sequence[int], mode: str) -> Any:
    widths = _pad_widths(self.ndim, padding)
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        cropped = jax.lax.pad(self, jnp.zeros((), self.dtype),
                              [(min(lo, 0), min(hi, 0), 0) for lo, hi in widths])
        return jnp.pad(cropped, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode=mode)
    return jnp.pad(self, widths, mode=mode)


@register(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(self: Any, padding: Sequence[int]) -> Any:
    return _mode_pad(self, padding, "reflect")


@register(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(self: Any, padding: Sequence[int]) -> Any:
    """Output j reads input clamp(j - before, 0, size - 1), as PyTorch's kernel: a negative width crops first,
    and a dim cropped away entirely still repeats the input's edge (not an empty axis)."""
    for axis, (lo, hi) in enumerate(_pad_widths(self.ndim, padding)):
        if lo or hi:
            size = self.shape[axis]
            self = jnp.take(self, np.clip(np.arange(size + lo + hi) - lo, 0, size - 1), axis=axis)
    return self


@register(aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default,
          aten.reflection_pad3d_backward.default)
def reflection_pad_backward(grad_output: Any, self: Any, padding: Sequence[int]) -> Any:
    return _vjp(lambda x: reflection_pad(x, padding), grad_output, _up(self))[0]


@register(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
          aten.replication_pad3d_backward.default)
def replication_pad_backward(grad_output: Any, self: Any, padding: Sequence[int]) -> Any:
    return _vjp(lambda x: replication_pad(x, padding), grad_output, _up(self))[0]


# --- embedding -------------------------------------------------------------------------------------


@register(aten.embedding.default)
def embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    check_index(indices, weight.shape[0], "aten::embedding", OUT_OF_RANGE)
    return jnp.take(weight, indices, axis=0)


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output: Any, indices: Any, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> Any:
    """Rows of padding_idx get no gradient; with scale_grad_by_freq each row is divided by its count."""
    index = indices.reshape(-1)
    grad = _up(grad_output).reshape(index.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp.where((index == padding_idx)[:, None], 0, grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[index].add(1)
        grad = grad / counts[index][:, None]
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[index].add(grad)


@register(aten.embedding_renorm.default)
def embedding_renorm(self: Any, indices: Any, max_norm: float, norm_type: float) -> Any:
    """Rows named by indices whose p-norm exceeds max_norm are scaled down to it (nn.Embedding(max_norm=))."""
    rows = _up(self)
    norms = jnp.sum(jnp.abs(rows) ** norm_type, axis=1) ** (1.0 / norm_type)
    named = jnp.zeros((self.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scale = jnp.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1)
    return rows * scale[:, None]


MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2


def _bag_ids(indices: Any, offsets: Any, num_bags: int) -> Any:
    """The bag each index belongs to: the last offset at or before its position."""
    positions = jnp.arange(indices.shape[0])
    return jnp.clip(jnp.searchsorted(offsets, positions, side="right") - 1, 0, max(num_bags - 1, 0))


def _kept(indices: Any, padding_idx: int) -> Any:
    return indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, jnp.bool_)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(weight: Any, indices: Any, offsets: Any, scale_grad_by_freq: bool = False, mode: int = MODE_SUM,
                   sparse: bool = False, per_sample_weights: Any = None, include_last_offset: bool = False,
                   padding_idx: int = -1) -> tuple:
    """(output, offset2bag, bag_size, max_indices); padding_idx entries count for nothing, empty bags are 0."""
    message = ("embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {{value}}"
               if mode == MODE_MAX else
               "Index {{position}} of input takes value {{value}} which is not in the valid range [0, {size})")
    check_index(indices, weight.shape[0], "aten::embedding_bag", message, RuntimeError)
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bags = _bag_ids(indices, offsets, num_bags)
    keep = _kept(indices, padding_idx)
    bag_size = jax.ops.segment_sum(keep.astype(jnp.int64), bags, num_segments=offsets.shape[0])
    rows = _up(jnp.take(weight, indices, axis=0))
    if mode == MODE_MAX:
        masked = jnp.where(keep[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, bags, num_segments=num_bags)
        first = jnp.where(masked == best[bags], jnp.arange(indices.shape[0])[:, None], indices.shape[0])
        chosen = jax.ops.segment_min(first, bags, num_segments=num_bags)
        empty = (bag_size[:num_bags] == 0)[:, None]
        max_indices = jnp.where(empty, -1, jnp.take(indices, jnp.clip(chosen, 0, indices.shape[0] - 1)))
        return jnp.where(empty, 0, best), bags, bag_size, max_indices
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    total = jax.ops.segment_sum(jnp.where(keep[:, None], rows, 0), bags, num_segments=num_bags)
    if mode == MODE_MEAN:
        total = total / jnp.maximum(bag_size[:num_bags], 1)[:, None]
    return total, bags, bag_size, jnp.zeros((0,), jnp.int64)


def _bag_grad(grad: Any, indices: Any, bags: Any, maximum_indices: Any, num_weights: int, scale_grad_by_freq: bool,
              mode: int, per_sample_weights: Any, padding_idx: int) -> Any:
    g = _up(grad)
    dim = g.shape[1]
    if mode == MODE_MAX:
        valid = maximum_indices >= 0
        rows = jnp.where(valid, maximum_indices, 0)
        columns = jnp.broadcast_to(jnp.arange(dim), rows.shape)
        return jnp.zeros((num_weights, dim), g.dtype).at[rows, columns].add(jnp.where(valid, g, 0))
    keep = _kept(indices, padding_idx)
    per_index = g[bags]
    if mode == MODE_MEAN:
        sizes = jax.ops.segment_sum(keep.astype(g.dtype), bags, num_segments=g.shape[0])
        per_index = per_index / jnp.maximum(sizes, 1)[bags][:, None]
    if per_sample_weights is not None:
        per_index = per_index * _up(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[indices].add(1)
        per_index = per_index / counts[indices][:, None]
    return jnp.zeros((num_weights, dim), g.dtype).at[indices].add(jnp.where(keep[:, None], per_index, 0))


@register(aten._embedding_bag_backward.default)
def _embedding_bag_backward(grad: Any, indices: Any, offsets: Any, offset2bag: Any, bag_size: Any,
                            maximum_indices: Any, num_weights: int, scale_grad_by_freq: bool, mode: int,
                            sparse: bool, per_sample_weights: Any, padding_idx: int = -1) -> Any:
    """The gradient is dense even for sparse=True (pjrt has no sparse layout)."""
    bags = _bag_ids(indices, offsets, grad.shape[0])
    return _bag_grad(grad, indices, bags, maximum_indices, num_weights, scale_grad_by_freq, mode, per_sample_weights,
                     padding_idx)


@register(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(grad: Any, indices: Any, offset2bag: Any, bag_size: Any, maximum_indices: Any,
                                  num_weights: int, scale_grad_by_freq: bool, mode: int, per_sample_weights: Any,
                                  padding_idx: int = -1) -> Any:
    return _bag_grad(grad, indices, offset2bag, maximum_indices, num_weights, scale_grad_by_freq, mode,
                     per_sample_weights, padding_idx)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad: Any, weight: Any, indices: Any, offsets: Any, offset2bag: Any,
                                               mode: int, padding_idx: int = -1) -> Any:
    if mode != MODE_SUM:
        raise NotImplementedError("embedding_bag per_sample_weights are only defined for mode='sum'.")
    bags = _bag_ids(indices, offsets, grad.shape[0])
    products = jnp.sum(_up(grad)[bags] * _up(jnp.take(weight, indices, axis=0)), axis=1)
    return jnp.where(_kept(indices, padding_idx), products, 0)


# --- losses ----------------------------------------------------------------------------------------


def _nll(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple[Any, Any]:
    """Negative log-likelihood over the class dim (1, or 0 for an unbatched input) and the total weight."""
    log_probs = jnp.moveaxis(_up(self), 0 if self.ndim == 1 else 1, -1)
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    picked = jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]
    w = jnp.ones_like(picked) if weight is None else _up(weight)[safe]
    w = jnp.where(keep, w, 0)
    losses = -picked * w
    total = jnp.sum(w)
    if reduction == MEAN:
        return jnp.sum(losses) / total, total
    return _reduce(losses, reduction), total


def _check_target(self: Any, target: Any, ignore_index: int, op: str) -> None:
    """CPU's check: every target but ignore_index names a class (negative ones too)."""
    classes = self.shape[0 if self.ndim == 1 else 1]
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    checks.fail_if(bad, op, "Target {value} is out of bounds.", IndexError, target)


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> tuple:
    _check_target(self, target, ignore_index, "aten::nll_loss_forward")
    return _nll(self, target, weight, reduction, ignore_index)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output: Any, self: Any, target: Any, weight: Any, reduction: int, ignore_index: int,
                      total_weight: Any) -> Any:
    _check_target(self, target, ignore_index, "aten::nll_loss_backward")
    return _vjp(lambda x: _nll(x, target, weight, reduction, ignore_index)[0], grad_output, _up(self))[0]


@register(aten.mse_loss.default)
def mse_loss(self: Any, target: Any, reduction: int = MEAN) -> Any:
    return _reduce(jnp.square(_up(self) - target), reduction)


@register(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int) -> Any:
    return _vjp(lambda x: mse_loss(x, target, reduction), grad_output, _up(self))[0]


@register(aten.binary_cross_entropy.default)
def binary_cross_entropy(self: Any, target: Any, weight: Any = None, reduction: int = MEAN) -> Any:
    """Logs are clamped at -100, as in PyTorch, so a saturated input gives a finite loss."""
    x, t = _up(self), _up(target)
    # CPU checks element by element, input before target: the first bad element names which
    bad_input, bad_target = ~((x >= 0) & (x <= 1)), ~((t >= 0) & (t <= 1))
    order = jnp.arange(x.size).reshape(x.shape)
    first_target = jnp.min(jnp.where(bad_target, order, x.size), initial=x.size)
    checks.fail_if(bad_input & (order <= first_target), "aten::binary_cross_entropy",
                   "all elements of input should be between 0 and 1")
    checks.fail_if(bad_target, "aten::binary_cross_entropy", "all elements of target should be between 0 and 1")
    loss = -(t * jnp.maximum(jnp.log(x), -100) + (1 - t) * jnp.maximum(jnp.log(1 - x), -100))
    if weight is not None:
        loss = loss * _up(weight)
    return _reduce(loss, reduction)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output: Any, self: Any, target: Any, weight: Any = None,
                                  reduction: int = MEAN) -> Any:
    """PyTorch's formula (x - t) / max(x (1 - x), 1e-12), not the derivative of the clamped logs."""
    x, t = _up(self), _up(target)
    grad = _up(grad_output) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        grad = grad * _up(weight)
    return grad / x.size if reduction == MEAN else grad


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self: Any, target: Any, weight: Any = None, pos_weight: Any = None,
                                     reduction: int = MEAN) -> Any:
    x, t = _up(self), _up(target)
    softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(x))) + jnp.maximum(-x, 0)
    if pos_weight is not None:
        loss = (1 - t) * x + ((_up(pos_weight) - 1) * t + 1) * softplus_neg
    else:
        loss = (1 - t) * x + softplus_neg
    if weight is not None:
        loss = loss * _up(weight)
    return _reduce(loss, reduction)


@register(aten.smooth_l1_loss.default)
def smooth_l1_loss(self: Any, target: Any, reduction: int = MEAN, beta: float = 1.0) -> Any:
    z = jnp.abs(_up(self) - target)
    if beta == 0:
        return _reduce(z, reduction)
    return _reduce(jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta), reduction)


@register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, beta: float) -> Any:
    return _vjp(lambda x: smooth_l1_loss(x, target, reduction, beta), grad_output, _up(self))[0]


def _rounded(value: Any, dtype: Any) -> Any:
    """A half-precision intermediate stored as PyTorch stores it (so it can overflow to inf), computed on in float32."""
    return _up(value.astype(dtype))


@register(aten.soft_margin_loss.default)
def soft_margin_loss(self: Any, target: Any, reduction: int = MEAN) -> Any:
    """PyTorch evaluates log1p(exp(-x * t)) op by op in the input dtype: a half exp overflows to inf, as on CPU."""
    dtype = jnp.result_type(self, target)
    z = _rounded(-_up(self) * _up(target), dtype)
    return _reduce(jnp.log1p(_rounded(jnp.exp(z), dtype)), reduction)


@register(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int) -> Any:
    """-t z / (1 + z) * grad with z = exp(-t x), rounded op by op as PyTorch does (an overflowed z gives NaN)."""
    dtype = jnp.result_type(self, target)
    norm = 1.0 / self.size if reduction == MEAN else 1.0
    t = _up(target)
    z = _rounded(jnp.exp(_rounded(-t * _up(self), dtype)), dtype)
    grad = _rounded(_rounded(t * z, dtype) * -norm, dtype)
    return _rounded(grad / _rounded(z + 1, dtype), dtype) * _up(grad_output)


@register(aten.huber_loss.default)
def huber_loss(self: Any, target: Any, reduction: int = MEAN, delta: float = 1.0) -> Any:
    z = jnp.abs(_up(self) - target)
    return _reduce(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


@register(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int, delta: float) -> Any:
    return _vjp(lambda x: huber_loss(x, target, reduction, delta), grad_output, _up(self))[0]


def _classes(self: Any) -> int:
    """The class count of a margin loss's input (a 0-dim input is one sample of one class)."""
    return self.shape[-1] if self.ndim else 1


def _multi_margin(self: Any, target: Any, p: int, margin: Any, weight: Any, reduction: int) -> Any:
    """Per sample: sum over classes i != y of max(0, margin - x_y + x_i)^p (times weight[y]), over C."""
    classes = _classes(self)
    x = _up(self).reshape(-1, classes)
    t = target.reshape(-1)
    z = margin - jnp.take_along_axis(x, t[:, None], axis=1) + x
    h = jnp.where(z > 0, z, 0)
    h = h * h if p == 2 else h
    if weight is not None:
        h = h * _up(weight)[t][:, None]
    h = jnp.where(jnp.arange(classes) == t[:, None], 0, h)
    return _reduce(jnp.sum(h, axis=1) / classes, reduction)


@register(aten.multi_margin_loss.default, static_scalars=True)
def multi_margin_loss(self: Any, target: Any, p: int = 1, margin: Any = 1, weight: Any = None,
                      reduction: int = MEAN) -> Any:
    if p not in (1, 2):
        raise RuntimeError("only p == 1 and p == 2 supported")
    return _multi_margin(self, target, p, margin, weight, reduction)


@torch.library.register_fake("aten::multi_margin_loss_backward")
def _multi_margin_loss_backward_meta(grad_output: Any, self: Any, target: Any, p: Any, margin: Any,
                                     weight: Any = None, reduction: int = MEAN) -> Any:
    """PyTorch ships no meta kernel for this backward; its result is shaped like the input."""
    return self.new_empty(self.shape)


@register(aten.multi_margin_loss_backward.default, static_scalars=True)
def multi_margin_loss_backward(grad_output: Any, self: Any, target: Any, p: int, margin: Any, weight: Any = None,
                               reduction: int = MEAN) -> Any:
    """The vjp of the forward; a margin term exactly at 0 has no gradient, as in PyTorch's kernel."""
    return _vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), grad_output, _up(self))[0]


def _multilabel_margin(self: Any, target: Any, reduction: int) -> tuple:
    """(loss, is_target): targets are the labels before the first -1 (a repeated label counts again);
    per sample, sum over targets j and non-targets i of max(0, 1 - x_j + x_i), over C."""
    classes = _classes(self)
    x = _up(self).reshape(-1, classes)
    t = target.reshape(-1, classes)
    listed = jnp.cumprod(t >= 0, axis=1).astype(jnp.bool_)
    rows = jnp.arange(x.shape[0])[:, None]
    counts = jnp.zeros(x.shape, x.dtype).at[rows, jnp.where(listed, t, 0)].add(listed.astype(x.dtype))
    is_target = counts > 0
    z = 1 - x[:, :, None] + x[:, None, :]
    h = jnp.where((z > 0) & ~is_target[:, None, :], z, 0)
    loss = jnp.sum(counts[:, :, None] * h, axis=(1, 2)) / classes
    return _reduce(loss, reduction), is_target.astype(x.dtype)


@register(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self: Any, target: Any, reduction: int) -> tuple:
    return _multilabel_margin(self, target, reduction)


@torch.library.register_fake("aten::multilabel_margin_loss_backward")
def _multilabel_margin_loss_backward_meta(grad_output: Any, self: Any, target: Any, reduction: int,
                                          is_target: Any) -> Any:
    """PyTorch ships no meta kernel for this backward; its result is shaped like the input."""
    return self.new_empty(self.shape)


@register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output: Any, self: Any, target: Any, reduction: int,
                                    is_target: Any) -> Any:
    return _vjp(lambda x: _multilabel_margin(x, target, reduction)[0], grad_output, _up(self))[0]


def _log_add(terms: Sequence[Any]) -> Any:
    """log(sum(exp(terms))) shifted by their maximum (0 when all are -inf), summed in order, as PyTorch's CTC."""
    top = terms[0]
    for term in terms[1:]:
        top = jnp.maximum(top, term)
    top = jnp.where(top == -jnp.inf, 0, top)
    total = jnp.exp(terms[0] - top)
    for term in terms[1:]:
        total = total + jnp.exp(term - top)
    return jnp.log(total) + top


def _shifted(values: Any, by: int) -> Any:
    """values[..., s + by] along the last axis, -inf past either end."""
    pad = jnp.full(values.shape[:-1] + (abs(by),), -jnp.inf, values.dtype)
    if by > 0:
        return jnp.concatenate([values[..., by:], pad], axis=-1)
    return jnp.concatenate([pad, values[..., :by]], axis=-1)


def _ctc_labels(targets: Any, target_lengths: Any, states: int, blank: int) -> tuple[Any, Any, Any]:
    """Blank-interleaved labels l' (N, states), the states each sample uses (s <= 2 len), and where a label may
    be reached from two states back (a non-blank differing from the label before it)."""
    width = (states - 1) // 2
    lengths = jnp.asarray(target_lengths, jnp.int64)
    positions = jnp.arange(width)
    if targets.ndim == 2:
        padded = jnp.pad(targets, ((0, 0), (0, max(width - targets.shape[1], 0))))[:, :width]
    else:
        offsets = jnp.cumsum(lengths) - lengths
        padded = targets[jnp.clip(offsets[:, None] + positions, 0, max(targets.shape[0] - 1, 0))]
    padded = jnp.where(positions < lengths[:, None], padded, blank).astype(jnp.int64)
    labels = jnp.full((lengths.shape[0], states), blank, jnp.int64).at[:, 1::2].set(padded)
    used = jnp.arange(states) <= 2 * lengths[:, None]
    skips = (jnp.arange(states) % 2 == 1) & (labels != _shifted_labels(labels))
    return labels, used, skips


def _shifted_labels(labels: Any) -> Any:
    """labels[..., s - 2], with -1 (no label) before the first two states."""
    return jnp.concatenate([jnp.full(labels.shape[:-1] + (2,), -1, labels.dtype), labels[..., :-2]], axis=-1)


def _ctc_emissions(log_probs: Any, labels: Any) -> Any:
    """log_probs[t, n, l'_s] as (T, N, states)."""
    index = jnp.broadcast_to(labels[None], (log_probs.shape[0],) + labels.shape)
    return jnp.take_along_axis(log_probs, index, axis=2)


@register(aten._ctc_loss.default, aten._ctc_loss.Tensor, wants_meta=True)
def _ctc_loss(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, blank: int = 0,
              zero_infinity: bool = False, *, out_meta: Sequence[Any] | None = None) -> tuple:
    """(negative log-likelihood per sample, log_alpha (N, T, 2 max_len + 1)): Graves' forward recursion in log
    space, term by term as PyTorch's CPU kernel; log_alpha is -inf where the kernel leaves it unwritten.
    zero_infinity acts in the backward only (ctc_loss itself zeroes infinite losses), as in PyTorch."""
    steps = log_probs.shape[0]
    states = out_meta[1].shape[2] if out_meta is not None else 2 * int(np.max(target_lengths, initial=0)) + 1
    lengths_in = jnp.asarray(input_lengths, jnp.int64)
    lengths_out = jnp.asarray(target_lengths, jnp.int64)
    labels, used, skips = _ctc_labels(targets, lengths_out, states, blank)
    emit = _ctc_emissions(log_probs, labels)
    first = jnp.where(jnp.arange(states) < jnp.where(lengths_out > 0, 2, 1)[:, None], emit[0], -jnp.inf)

    def step(alpha: Any, t_emit: tuple) -> tuple:
        t, row = t_emit
        two_back = jnp.where(skips, _shifted(alpha, -2), -jnp.inf)
        new = _log_add([alpha, _shifted(alpha, -1), two_back]) + row
        new = jnp.where(used & (t < lengths_in[:, None]), new, -jnp.inf)
        return new, new

    _, rest = jax.lax.scan(step, first, (jnp.arange(1, steps), emit[1:]))
    alphas = jnp.concatenate([first[None], rest], axis=0)
    last = jnp.take_along_axis(alphas, jnp.clip(lengths_in - 1, 0, steps - 1)[None, :, None], axis=0)[0]
    end = jnp.take_along_axis(last, (2 * lengths_out)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(2 * lengths_out - 1, 0)[:, None], axis=1)[:, 0]
    likelihood = jnp.where(lengths_out == 0, end, _log_add([end, before]))
    likelihood = jnp.where(lengths_in == 0, jnp.where(lengths_out == 0, 0, -jnp.inf), likelihood)
    alphas = jnp.where(lengths_in[None, :, None] > 0, alphas, -jnp.inf)
    return -likelihood, jnp.moveaxis(alphas, 0, 1)


@torch.library.register_fake("aten::_ctc_loss_backward.Tensor")
@torch.library.register_fake("aten::_ctc_loss_backward")
def _ctc_loss_backward_meta(grad: Any, log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any,
                            neg_log_likelihood: Any, log_alpha: Any, blank: int, zero_infinity: bool = False) -> Any:
    """PyTorch ships no meta kernel for this backward; the gradient is shaped like log_probs."""
    return log_probs.new_empty(log_probs.shape)


@register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def _ctc_loss_backward(grad: Any, log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any,
                       neg_log_likelihood: Any, log_alpha: Any, blank: int, zero_infinity: bool = False) -> Any:
    """PyTorch's gradient for log_probs: (exp(lp) - exp(log sum_{s: l'_s = c} alpha beta + nll - lp)) * grad, with
    beta the backward recursion; it assumes log_probs are log-softmax outputs, as PyTorch's kernels do. Steps
    past a sample's input length, and (with zero_infinity) impossible samples, get zero."""
    steps, batch, classes = log_probs.shape
    states = log_alpha.shape[2]
    lengths_in = jnp.asarray(input_lengths, jnp.int64)
    lengths_out = jnp.asarray(target_lengths, jnp.int64)
    labels, used, skips = _ctc_labels(targets, lengths_out, states, blank)
    emit = _ctc_emissions(log_probs, labels)
    ahead_skips = _shifted(jnp.where(skips, 0, -jnp.inf).astype(log_probs.dtype), 2)
    ends = (jnp.arange(states) == 2 * lengths_out[:, None]) | (jnp.arange(states) == 2 * lengths_out[:, None] - 1)

    def step(beta: Any, t_emit: tuple) -> tuple:
        t, row = t_emit
        two_ahead = _shifted(beta, 2) + ahead_skips
        new = jnp.where(used, _log_add([beta, _shifted(beta, 1), two_ahead]) + row, -jnp.inf)
        start = jnp.where(ends, row, -jnp.inf)
        new = jnp.where((t == lengths_in - 1)[:, None], start, jnp.where((t < lengths_in - 1)[:, None], new, -jnp.inf))
        return new, new

    init = jnp.full((batch, states), -jnp.inf, log_probs.dtype)
    _, betas = jax.lax.scan(step, init, (jnp.arange(steps), emit), reverse=True)
    both = jnp.moveaxis(log_alpha, 1, 0) + betas
    both = jnp.where(used[None] & (jnp.arange(steps)[:, None, None] < lengths_in[None, :, None]), both, -jnp.inf)
    t_index, n_index = jnp.arange(steps)[:, None], jnp.arange(batch)[None, :]

    def collect(summed: Any, state: Any) -> tuple:
        """Log-add alpha beta of one state into its label's entry (states in descending order, as PyTorch)."""
        label = labels[:, state][None, :]
        current, term = summed[t_index, n_index, label], both[:, :, state]
        top = jnp.maximum(current, term)
        added = jnp.where(current == -jnp.inf, term, jnp.log(jnp.exp(current - top) + jnp.exp(term - top)) + top)
        return summed.at[t_index, n_index, label].set(added), None

    init = jnp.full(log_probs.shape, -jnp.inf, log_probs.dtype)
    collected, _ = jax.lax.scan(collect, init, jnp.arange(states), reverse=True)
    nll = neg_log_likelihood[None, :, None]
    result = (jnp.exp(log_probs) - jnp.exp(collected + nll - log_probs)) * grad[None, :, None]
    keep = jnp.arange(steps)[:, None, None] < lengths_in[None, :, None]
    if zero_infinity:
        keep = keep & (nll != jnp.inf)
    return jnp.where(keep, result, 0)


# --- distances -------------------------------------------------------------------------------------


def _pairs(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Row pairs i < j in pdist's order (row-major upper triangle)."""
    return np.triu_indices(rows, 1)


def _p_norm(diff: Any, p: float) -> Any:
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(diff.dtype)
    if p == math.inf:
        return jnp.max(jnp.abs(diff), axis=-1, initial=0)
    if p == 1:
        return jnp.sum(jnp.abs(diff), axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(jnp.abs(diff) ** p, axis=-1) ** (1 / p)


@register(aten._pdist_forward.default, static_scalars=True)
def _pdist_forward(self: Any, p: float = 2) -> Any:
    """The p-norm distance of every pair of rows i < j (F.pdist)."""
    first, second = _pairs(self.shape[0])
    x = _up(self)
    return _p_norm(x[first] - x[second], p)


@register(aten._pdist_backward.default, static_scalars=True)
def _pdist_backward(grad: Any, self: Any, p: float, pdist: Any) -> Any:
    """PyTorch's per-p formulas: a zero distance (and, for p < 1, a zero difference) passes no gradient; for
    p = inf every coordinate that attains the maximum gets the whole gradient."""
    first, second = _pairs(self.shape[0])
    x = _up(self)
    diff = x[first] - x[second]
    g, dist = _up(grad)[:, None], _up(pdist)[:, None]
    if p == 0:
        pair_grad = jnp.zeros_like(diff)
    elif p == 1:
        pair_grad = g * jnp.sign(diff)
    elif p == math.inf:
        pair_grad = g * jnp.sign(diff) * (jnp.abs(diff) == dist)
    else:
        safe = jnp.where(dist == 0, 1, dist)
        if p == 2:
            pair_grad = g * diff / safe
        elif p < 1:
            safe_diff = jnp.where(diff == 0, 1, jnp.abs(diff))
            pair_grad = jnp.where(diff == 0, 0, g * jnp.sign(diff) * safe_diff ** (p - 1) / safe ** (p - 1))
        else:
            pair_grad = g * diff * jnp.abs(diff) ** (p - 2) / safe ** (p - 1)
        pair_grad = jnp.where(dist == 0, 0, pair_grad)
    return jnp.zeros_like(x).at[first].add(pair_grad).at[second].add(-pair_grad)


# --- dropout and attention -------------------------------------------------------------------------


@register(aten.native_dropout.default, random=True)
def native_dropout(input: Any, p: float, train: bool | None, *, rng: Any) -> tuple:
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(rng, 1.0 - p, input.shape)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return jnp.where(keep, _up(input) * scale, 0), keep


@register(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output: Any, mask: Any, scale: float) -> Any:
    return jnp.where(mask, _up(grad_output) * scale, 0)


@register(aten._safe_softmax.default)
def _safe_softmax(self: Any, dim: int, dtype: Any = None) -> Any:
    """Softmax whose fully masked rows (all -inf, as attention masks make) are zeros, not NaN."""
    x = _up(self if dtype is None else self.astype(storage.numpy_dtype(dtype)))
    out = jax.nn.softmax(x, axis=dim)
    return jnp.where(jnp.all(x == -jnp.inf, axis=dim, keepdims=True), 0, out)
