"""Recurrent cells: the fused LSTM cell kernel and its backward.

On a non-CPU device PyTorch's RNN modules and cells do the matrix products themselves and hand
the gate pre-activations to `_thnn_fused_lstm_cell`, which returns the new state plus a workspace
that its backward reads; the workspace layout is private to these lowerings. Plain tanh/relu RNNs
need nothing here: their cells are compositions PyTorch decomposes.

PyTorch's meta kernel of the LSTM cell reads `.device` of the optional biases even when they are
None (every `bias=False` LSTM), so this module registers one that does not.
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


def _check_cell_sizes(input_gates: torch.Tensor, hidden_gates: torch.Tensor, input_bias: torch.Tensor | None,
                      hidden_bias: torch.Tensor | None, gate_count: int, state: torch.Tensor) -> None:
    """The size and device checks of PyTorch's fused cell kernels, with the biases optional."""
    torch._check(input_gates.ndim == 2, lambda: f"{input_gates.ndim} != 2")
    torch._check(input_gates.shape == hidden_gates.shape, lambda: f"{input_gates.shape} != {hidden_gates.shape}")
    gates_size = input_gates.size(1)
    torch._check((input_bias is None) == (hidden_bias is None), lambda: "expected both biases or neither")
    if input_bias is not None:
        torch._check(input_bias.ndim == 1, lambda: f"{input_bias.ndim} != 1")
        torch._check(input_bias.numel() == gates_size, lambda: f"{input_bias.numel()} != {gates_size}")
        torch._check(input_bias.shape == hidden_bias.shape, lambda: f"{input_bias.shape} != {hidden_bias.shape}")
    torch._check(state.ndim == 2, lambda: f"{state.ndim} != 2")
    expected = input_gates.size(0) * gates_size // gate_count
    torch._check(state.numel() == expected, lambda: f"{state.numel()} != {expected}")
    others = [t for t in (hidden_gates, input_bias, hidden_bias, state) if t is not None]
    torch._check(all(t.device == input_gates.device for t in others), lambda: "expected all inputs to be same device")


@torch.library.register_fake("aten::_thnn_fused_lstm_cell")
def _thnn_fused_lstm_cell_meta(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
                               input_bias: torch.Tensor | None = None,
                               hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(hy, cy, workspace) shaped as PyTorch's meta kernel says, which this replaces for bias=False."""
    _check_cell_sizes(input_gates, hidden_gates, input_bias, hidden_bias, LSTM_GATES, cx)
    return cx.new_empty(cx.shape), cx.new_empty(cx.shape), input_gates.new_empty(input_gates.shape)


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
