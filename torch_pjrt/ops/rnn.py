"""Recurrent cells: the fused LSTM cell kernel and its backward.

On a non-CPU device PyTorch's RNN modules and cells do the matrix products themselves and hand
the gate pre-activations to `_thnn_fused_lstm_cell`, which returns the new state plus a workspace
that its backward reads; the workspace layout is private to these lowerings. Plain tanh/relu RNNs
need nothing here: their cells are compositions PyTorch decomposes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.nn import _up
from torch_pjrt.ops.registry import register

aten = torch.ops.aten

LSTM_GATES = 4


@register(aten._thnn_fused_lstm_cell.default)
def _thnn_fused_lstm_cell(input_gates: Any, hidden_gates: Any, cx: Any, input_bias: Any = None,
                          hidden_bias: Any = None) -> tuple:
    """(hy, cy, workspace): the workspace keeps the activated gates [i, f, g, o] for the backward."""
    gates = _up(input_gates) + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = jnp.split(gates, LSTM_GATES, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=1)


@register(aten._thnn_fused_lstm_cell_backward_impl.default)
def _thnn_fused_lstm_cell_backward_impl(grad_hy: Any, grad_cy: Any, cx: Any, cy: Any, workspace: Any,
                                        has_bias: bool) -> tuple:
    """(grad of the pre-activation gates, grad_cx, grad of the bias); a missing grad_hy/grad_cy is zero."""
    i, f, g, o = jnp.split(_up(workspace), LSTM_GATES, axis=1)
    tanh_cy = jnp.tanh(_up(cy))
    grad_hy = 0 if grad_hy is None else _up(grad_hy)
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + (0 if grad_cy is None else _up(grad_cy))
    grads = jnp.concatenate([grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                             grad_hy * tanh_cy * o * (1 - o)], axis=1)
    return grads, grad_c * f, jnp.sum(grads, axis=0) if has_bias else None
