"""The fused optimizer steps (`torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)`): one op per parameter group.

Each lowering computes what PyTorch's fused CPU and CUDA kernels compute, item by item over the lists: the
gradient unscaled by grad_scale (and written back, as those kernels write it), negated under `maximize`,
the update in the parameter's opmath type (float32 for the half types), and nothing at all where found_inf
is 1 (the kernels' skip: parameters, state and gradients keep their values). The step counts
(state_steps) are incremented by the optimizer before the call and read here; the scalar coefficients are
taken in float64 as the kernels take them in double. A lowering returns the functional op's lists (params,
grads, then the state lists), which the in-place ops write back.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from torch_pjrt import _torch_private
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


def _no_metadata_change(*args: Any, **kwargs: Any) -> None:
    """The meta kernel of an in-place fused step: it returns nothing and changes no tensor's metadata."""


# PyTorch gives only _fused_adam(w)_.default a meta kernel; the eager dispatch and torch.compile's fake tensors run
# the others' too (an Adam with a tensor lr, SGD, Adagrad).
_META_LIBRARY = torch.library.Library("aten", "IMPL")
for _packet in (aten._fused_adam_, aten._fused_adamw_, aten._fused_sgd_, aten._fused_adagrad_):
    for _overload in (getattr(_packet, name) for name in _packet.overloads()):
        if not _torch_private.has_kernel(_overload.name(), "Meta"):
            _META_LIBRARY.impl(_overload, _no_metadata_change, "Meta")


def _opmath(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _double(value: Any) -> Any:
    """A float argument, a traced number or a 1-element tensor (lr, grad_scale, a step) as a float64 scalar."""
    return jnp.asarray(value, jnp.float64).reshape(())


def _is_zero(value: Any) -> bool:
    """A number known while tracing to be 0 (weight_decay, momentum): the kernels skip its term."""
    return isinstance(value, (int, float)) and value == 0


def _unscaled(grad: Any, grad_scale: Any, maximize: bool) -> tuple[Any, Any]:
    """The gradient to store back (divided by grad_scale) and the one the update uses (negated to maximize)."""
    if grad_scale is None:
        stored, used = grad, grad.astype(_opmath(grad.dtype))
    else:
        used = grad.astype(_opmath(grad.dtype)) / grad_scale.reshape(()).astype(_opmath(grad.dtype))
        stored = used.astype(grad.dtype)
    return stored, -used if maximize else used


def _skipped_where_inf(found_inf: Any, new: tuple[list[Any], ...], old: tuple[list[Any], ...]) -> tuple:
    """The kernels return before touching anything when found_inf is 1: each list keeps its old values there."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1
    return tuple([jnp.where(skip, o, n) for n, o in zip(new_list, old_list)] for new_list, old_list in zip(new, old))


def _adam(self: list[Any], grads: list[Any], exp_avgs: list[Any], exp_avg_sqs: list[Any], max_exp_avg_sqs: list[Any],
          state_steps: list[Any], *, lr: Any, beta1: Any, beta2: Any, weight_decay: Any, eps: Any, amsgrad: bool,
          maximize: bool, grad_scale: Any = None, found_inf: Any = None, decoupled: bool) -> tuple[list[Any], ...]:
    """Adam (weight decay added to the gradient) or, `decoupled`, AdamW (the parameter shrunk by lr * weight_decay
    before the update)."""
    lr, beta1, beta2, eps = _double(lr), _double(beta1), _double(beta2), _double(eps)
    decay = None if _is_zero(weight_decay) else _double(weight_decay)
    new: tuple[list[Any], ...] = ([], [], [], [], [])
    for i, (param, grad, exp_avg, exp_avg_sq, step) in enumerate(zip(self, grads, exp_avgs, exp_avg_sqs,
                                                                     state_steps)):
        opmath = _opmath(param.dtype)
        stored, grad_used = _unscaled(grad, grad_scale, maximize)
        value = param.astype(opmath)
        if decay is not None and decoupled:
            value = value * (1 - lr * decay).astype(opmath)
        elif decay is not None:
            grad_used = grad_used + value * decay.astype(opmath)
        step = _double(step)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** step)
        # exp_avg.lerp_(grad, 1 - beta1), as the kernels take it
        average = exp_avg.astype(opmath)
        average = average + (1 - beta1).astype(opmath) * (grad_used - average)
        square = exp_avg_sq.astype(opmath) * beta2.astype(opmath) + (1 - beta2).astype(opmath) * grad_used * grad_used
        if amsgrad:
            square_used = jnp.maximum(max_exp_avg_sqs[i].astype(opmath), square)
            new[4].append(square_used.astype(max_exp_avg_sqs[i].dtype))
        else:
            square_used = square
        denominator = jnp.sqrt(square_used) / bias_correction2_sqrt.astype(opmath) + eps.astype(opmath)
        value = value - (lr / bias_correction1).astype(opmath) * average / denominator
        for column, result, like in ((0, value, param), (1, stored, grad), (2, average, exp_avg),
                                     (3, square, exp_avg_sq)):
            new[column].append(result.astype(like.dtype))
    old = (self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [])
    results = _skipped_where_inf(found_inf, new, old)
    return results if amsgrad else (*results[:4], max_exp_avg_sqs)


@register(aten._fused_adam, traced_floats=True)
def _fused_adam(*args: Any, **kwargs: Any) -> tuple[list[Any], ...]:
    return _adam(*args, **kwargs, decoupled=False)


@register(aten._fused_adamw, traced_floats=True)
def _fused_adamw(*args: Any, **kwargs: Any) -> tuple[list[Any], ...]:
    return _adam(*args, **kwargs, decoupled=True)


@register(aten._fused_sgd, traced_floats=True)
def _fused_sgd(self: list[Any], grads: list[Any], momentum_buffer_list: list[Any], *, weight_decay: float,
               momentum: float, lr: Any, dampening: float, nesterov: bool, maximize: bool, is_first_step: bool,
               grad_scale: Any = None, found_inf: Any = None) -> tuple[list[Any], ...]:
    """SGD; momentum 0 comes with no buffers (the optimizer passes an empty list), and the first step with
    momentum sets each buffer to the gradient."""
    lr = _double(lr)
    decay = None if _is_zero(weight_decay) else _double(weight_decay)
    with_momentum = bool(momentum_buffer_list)
    new: tuple[list[Any], ...] = ([], [], [])
    for i, (param, grad) in enumerate(zip(self, grads)):
        opmath = _opmath(param.dtype)
        stored, grad_used = _unscaled(grad, grad_scale, maximize)
        value = param.astype(opmath)
        if decay is not None:
            grad_used = grad_used + value * decay.astype(opmath)
        if with_momentum:
            factor = _double(momentum).astype(opmath)
            buffer = grad_used
            if not is_first_step:
                buffer = momentum_buffer_list[i].astype(opmath) * factor + grad_used * (
                    1 - _double(dampening)).astype(opmath)
            new[2].append(buffer.astype(momentum_buffer_list[i].dtype))
            grad_used = grad_used + buffer * factor if nesterov else buffer
        new[0].append((value - grad_used * lr.astype(opmath)).astype(param.dtype))
        new[1].append(stored)
    return _skipped_where_inf(found_inf, new, (self, grads, momentum_buffer_list))


def _adagrad(self: list[Any], grads: list[Any], state_sums: list[Any], state_steps: list[Any], lr: Any,
             lr_decay: float, weight_decay: float, eps: float, maximize: bool, grad_scale: Any,
             found_inf: Any) -> tuple[list[Any], ...]:
    lr, lr_decay, eps = _double(lr), _double(lr_decay), _double(eps)
    decay = None if _is_zero(weight_decay) else _double(weight_decay)
    new: tuple[list[Any], ...] = ([], [], [])
    for param, grad, state_sum, step in zip(self, grads, state_sums, state_steps):
        opmath = _opmath(param.dtype)
        stored, grad_used = _unscaled(grad, grad_scale, maximize)
        value = param.astype(opmath)
        if decay is not None:
            grad_used = grad_used + value * decay.astype(opmath)
        step_lr = lr / (1 + (_double(step) - 1) * lr_decay)
        total = state_sum.astype(opmath) + grad_used * grad_used
        value = value - step_lr.astype(opmath) * grad_used / (jnp.sqrt(total) + eps.astype(opmath))
        new[0].append(value.astype(param.dtype))
        new[1].append(stored)
        new[2].append(total.astype(state_sum.dtype))
    return _skipped_where_inf(found_inf, new, (self, grads, state_sums))


@register(aten._fused_adagrad.default, traced_floats=True)
def _fused_adagrad(self: list[Any], grads: list[Any], state_sums: list[Any], state_steps: list[Any], *, lr: Any,
                   lr_decay: float, weight_decay: float, eps: float, maximize: bool, grad_scale: Any = None,
                   found_inf: Any = None) -> tuple[list[Any], ...]:
    """Adagrad; this overload's schema also lists the step counts among its results (the kernel leaves them)."""
    return (*_adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
                      found_inf), state_steps)


@register(aten._fused_adagrad.tensor_lr, traced_floats=True)
def _fused_adagrad_tensor_lr(self: list[Any], grads: list[Any], state_sums: list[Any], state_steps: list[Any], *,
                             lr: Any, lr_decay: float, weight_decay: float, eps: float, maximize: bool,
                             grad_scale: Any = None, found_inf: Any = None) -> tuple[list[Any], ...]:
    return _adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
                    found_inf)
