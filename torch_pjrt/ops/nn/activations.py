"""Activations and their backward ops."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.nn.common import _up, _vjp
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


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


