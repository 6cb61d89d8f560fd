"""Dropout and scaled dot-product attention."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt import storage
from torch_pjrt.ops.nn.common import _up, _vjp
from torch_pjrt.ops.registry import register

aten = torch.ops.aten


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


# --- scaled_dot_product_attention as one op -------------------------------------------------------
# PyTorch's scaled_dot_product_attention asks a backend which route to take (its `_fused_sdp_choice`
# stub); the native dispatch (csrc/dispatch.cpp) answers "overrideable" for pjrt tensors where these
# ops apply and runs `_scaled_dot_product_fused_attention_overrideable` and its backward as the two
# ops below, so attention is one recorded op instead of the math composite's scale, matmul, mask,
# softmax and matmul (and a key/value copy per group for grouped-query attention). Their results
# are PyTorch's math route's: scores in float32 for half types, masked rows all zeros.

_LIBRARY = torch.library.Library("torch_pjrt", "FRAGMENT")
_LIBRARY.define("fused_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool is_causal, "
                "float? scale) -> (Tensor output, Tensor logsumexp)")
_LIBRARY.define("fused_attention_backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, "
                "Tensor? attn_bias, bool[4] grad_input_mask, bool is_causal, float? scale) -> "
                "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_bias)")
fused_attention_op = torch.ops.torch_pjrt.fused_attention.default
fused_attention_backward_op = torch.ops.torch_pjrt.fused_attention_backward.default


@torch.library.register_fake("torch_pjrt::fused_attention", lib=_LIBRARY)
def _fused_attention_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any,
                          is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    output = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return output, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("torch_pjrt::fused_attention_backward", lib=_LIBRARY)
def _fused_attention_backward_meta(grad_output: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attn_bias: Any, grad_input_mask: list[bool],
                                   is_causal: bool, scale: float | None) -> tuple[Any, ...]:
    wanted = (query, key, value, attn_bias if attn_bias is not None and attn_bias.is_floating_point() else None)
    return tuple(t.new_empty(t.shape) if t is not None and asked else None
                 for t, asked in zip(wanted, grad_input_mask))


def _attention_scores(query: Any, key: Any, attn_bias: Any, is_causal: bool, scale: float | None) -> Any:
    """query @ key^T * scale with the causal mask and the bias (bool: keep where True; float: added), in
    the compute dtype; key has as many heads as query or a divisor of them (each serves a group)."""
    query, key = _up(query), _up(key)
    if key.shape[-3] != query.shape[-3]:
        key = jnp.repeat(key, query.shape[-3] // key.shape[-3], axis=-3)
    scale = 1.0 / (query.shape[-1] ** 0.5) if scale is None else scale
    scores = jnp.einsum("...qd,...kd->...qk", query * scale, key)
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones(scores.shape[-2:], jnp.bool_)), scores, -jnp.inf)
    if attn_bias is not None:
        scores = jnp.where(attn_bias, scores, -jnp.inf) if attn_bias.dtype == jnp.bool_ else scores + attn_bias
    return scores


def _attention(query: Any, key: Any, value: Any, attn_bias: Any, is_causal: bool,
               scale: float | None) -> tuple[Any, Any]:
    scores = _attention_scores(query, key, attn_bias, is_causal, scale)
    value = _up(value)
    if value.shape[-3] != scores.shape[-3]:
        value = jnp.repeat(value, scores.shape[-3] // value.shape[-3], axis=-3)
    # a row with every key masked gives zeros (and zero gradients: its softmax is taken of zeros)
    masked = jnp.all(scores == -jnp.inf, axis=-1, keepdims=True)
    weights = jnp.where(masked, 0, jax.nn.softmax(jnp.where(masked, 0, scores), axis=-1))
    output = jnp.einsum("...qk,...kd->...qd", weights, value)
    return output.astype(query.dtype), jax.nn.logsumexp(scores, axis=-1).astype(jnp.float32)


@register(fused_attention_op)
def fused_attention(query: Any, key: Any, value: Any, attn_bias: Any, is_causal: bool,
                    scale: float | None) -> tuple[Any, Any]:
    return _attention(query, key, value, attn_bias, is_causal, scale)


@register(fused_attention_backward_op)
def fused_attention_backward(grad_output: Any, query: Any, key: Any, value: Any, attn_bias: Any,
                             grad_input_mask: list[bool], is_causal: bool, scale: float | None) -> tuple[Any, ...]:
    """The gradients asked for (None for the others, and for a bool mask), as the vjp of the forward."""
    differentiable_bias = attn_bias is not None and attn_bias.dtype != jnp.bool_

    def forward(q: Any, k: Any, v: Any, bias: Any) -> Any:
        return _attention(q, k, v, bias if differentiable_bias else attn_bias, is_causal, scale)[0]

    grads = _vjp(forward, grad_output, query, key, value, attn_bias if differentiable_bias else jnp.zeros(()))
    return tuple(grad.astype(primal.dtype) if asked and primal is not None else None
                 for grad, primal, asked in zip(grads, (query, key, value, attn_bias if differentiable_bias else None),
                                                grad_input_mask))
