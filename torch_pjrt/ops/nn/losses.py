"""Loss functions and their backward ops; target values are checked on the device as CPU checks them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_pjrt.ops.nn.common import MEAN, _reduce, _up, _vjp
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten


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


