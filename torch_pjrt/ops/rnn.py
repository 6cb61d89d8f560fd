"""Recurrent cells: the fused LSTM and GRU cell kernels and their backwards.

On a non-CPU device PyTorch's RNN modules and cells do the matrix products themselves and hand
the gate pre-activations to `_thnn_fused_{lstm,gru}_cell`, which returns the new state plus a
workspace that its backward reads; the workspace layout is private to these lowerings. Plain
tanh/relu RNNs need nothing here: their cells are compositions PyTorch decomposes.

PyTorch ships no meta kernel for the GRU ops, and its LSTM one reads `.device` of the optional
biases even when they are None (every `bias=False` LSTM), so this module registers both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.nn.common import _up
from torch_pjrt.ops.registry import register

aten = torch.ops.aten

LSTM_GATES, GRU_GATES = 4, 3
# GRU workspace: the gates r, z, n, the previous state and the hidden part of n's pre-activation.
GRU_WORKSPACE_PARTS = 5


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


@torch.library.register_fake("aten::_thnn_fused_gru_cell")
def _thnn_fused_gru_cell_meta(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
                              input_bias: torch.Tensor | None = None,
                              hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hy, workspace); the workspace is (batch, 5 * hidden), as in PyTorch's CUDA kernel."""
    _check_cell_sizes(input_gates, hidden_gates, input_bias, hidden_bias, GRU_GATES, hx)
    return hx.new_empty(hx.shape), hx.new_empty((hx.size(0), hx.size(1) * GRU_WORKSPACE_PARTS))


@register(aten._thnn_fused_gru_cell.default)
def _thnn_fused_gru_cell(input_gates: Any, hidden_gates: Any, hx: Any, input_bias: Any = None,
                         hidden_bias: Any = None) -> tuple:
    """(hy, workspace) for gate pre-activations ordered [r, z, n]; the reset gate r scales only the
    hidden part of n, so the two halves stay apart."""
    input_gates, hidden_gates = _up(input_gates), _up(hidden_gates)
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    input_r, input_z, input_n = jnp.split(input_gates, GRU_GATES, axis=1)
    hidden_r, hidden_z, hidden_n = jnp.split(hidden_gates, GRU_GATES, axis=1)
    r = jax.nn.sigmoid(input_r + hidden_r)
    z = jax.nn.sigmoid(input_z + hidden_z)
    n = jnp.tanh(input_n + r * hidden_n)
    return n + z * (hx - n), jnp.concatenate([r, z, n, _up(hx), hidden_n], axis=1)


@torch.library.register_fake("aten::_thnn_fused_gru_cell_backward")
def _thnn_fused_gru_cell_backward_meta(grad_hy: torch.Tensor, workspace: torch.Tensor,
                                       has_bias: bool) -> tuple[torch.Tensor | None, ...]:
    """Gradients of the input and hidden gate pre-activations, of hx, and of the two biases."""
    torch._check(grad_hy.ndim == 2, lambda: f"{grad_hy.ndim} != 2")
    batch, hidden = grad_hy.shape
    gates = (batch, GRU_GATES * hidden)
    torch._check(workspace.shape == (batch, GRU_WORKSPACE_PARTS * hidden),
                 lambda: f"{workspace.shape} != {(batch, GRU_WORKSPACE_PARTS * hidden)}")
    bias_grads = (grad_hy.new_empty(gates[1]), grad_hy.new_empty(gates[1])) if has_bias else (None, None)
    return grad_hy.new_empty(gates), grad_hy.new_empty(gates), grad_hy.new_empty(grad_hy.shape), *bias_grads


@register(aten._thnn_fused_gru_cell_backward.default)
def _thnn_fused_gru_cell_backward(grad_hy: Any, workspace: Any, has_bias: bool) -> tuple:
    """What `_thnn_fused_gru_cell`'s autograd formula calls when no graph of the backward is wanted
    (with create_graph PyTorch uses its composite `_thnn_differentiable_gru_cell_backward`)."""
    r, z, n, hx, hidden_n = jnp.split(_up(workspace), GRU_WORKSPACE_PARTS, axis=1)
    grad_hy = _up(grad_hy)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * hidden_n * r * (1 - r)
    grad_input_gates = jnp.concatenate([grad_r, grad_z, grad_n], axis=1)
    grad_hidden_gates = jnp.concatenate([grad_r, grad_z, grad_n * r], axis=1)
    bias_grads = (jnp.sum(grad_input_gates, axis=0), jnp.sum(grad_hidden_gates, axis=0)) if has_bias else (None, None)
    return grad_input_gates, grad_hidden_gates, grad_hy * z, *bias_grads
