"""Layer, group and batch norm, forward and backward (backwards are vjps of the forward); weight norm's backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.graph import decomposed
from torch_pjrt.ops.nn.common import _channel_shape, _masked, _up
from torch_pjrt.ops.registry import LOWERINGS, Lowering, register

aten = torch.ops.aten


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


# weight_norm's backward has CPU and CUDA kernels only; its differentiable twin computes the same two gradients in
# composite ops (PyTorch runs it for double backward), so its graph is the lowering.
LOWERINGS[aten._weight_norm_interface_backward.default] = Lowering(
    decomposed(aten._weight_norm_interface_backward.default, aten._weight_norm_differentiable_backward.default),
    static_scalars=True)
