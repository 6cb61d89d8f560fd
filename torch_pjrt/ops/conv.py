"""Convolution and transposed convolution, forward and backward.

One forward (XLA's general dilated convolution) serves every rank, group count and the
transposed case; the backward is its jax vjp, so both always agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.registry import register

aten = torch.ops.aten

_SPATIAL = "DHW"


def _dimension_numbers(rank: int) -> tuple[str, str, str]:
    spatial = _SPATIAL[-rank:]
    return "NC" + spatial, "OI" + spatial, "NC" + spatial


def _accumulation(dtype: Any) -> tuple[Any, Any]:
    """Half types accumulate in float32, like PyTorch's CPU kernels; float32 at full precision."""
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32, jax.lax.Precision.DEFAULT
    return None, jax.lax.Precision.HIGHEST


def _expand(values: Sequence[int], rank: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in values)
    return values * rank if len(values) == 1 else values


def _transposed_weight(weight: Any, groups: int) -> Any:
    """(Cin, Cout/g, k...) -> (Cout, Cin/g, k...) spatially flipped: the forward conv a transposed conv is."""
    c_in, c_out_g, *kernel = weight.shape
    w = weight.reshape(groups, c_in // groups, c_out_g, *kernel)
    w = jnp.swapaxes(w, 1, 2).reshape(groups * c_out_g, c_in // groups, *kernel)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def _conv(x: Any, weight: Any, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
          transposed: bool, output_padding: Sequence[int], groups: int) -> Any:
    """The convolution without bias, for an input with a batch dimension."""
    rank = x.ndim - 2
    stride, padding, dilation = _expand(stride, rank), _expand(padding, rank), _expand(dilation, rank)
    preferred, precision = _accumulation(x.dtype)
    if transposed:
        output_padding = _expand(output_padding, rank)
        kernel = weight.shape[2:]
        pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
                for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
        w = _transposed_weight(weight, groups)
        strides, lhs_dilation = (1,) * rank, stride
    else:
        pads = [(p, p) for p in padding]
        w, strides, lhs_dilation = weight, stride, (1,) * rank
    out = jax.lax.conv_general_dilated(
        x, w.astype(x.dtype), window_strides=strides, padding=pads, lhs_dilation=lhs_dilation,
        rhs_dilation=dilation, dimension_numbers=_dimension_numbers(rank), feature_group_count=groups,
        precision=precision, preferred_element_type=preferred,
    )
    return out.astype(x.dtype)


def _with_bias(out: Any, bias: Any) -> Any:
    if bias is None:
        return out
    return out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))


@register(aten.convolution.default, aten.convolution_overrideable.default)
def convolution(input: Any, weight: Any, bias: Any, stride: Sequence[int], padding: Sequence[int],
                dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int) -> Any:
    unbatched = input.ndim == weight.ndim - 1
    x = input[None] if unbatched else input
    out = _with_bias(_conv(x, weight, stride, padding, dilation, transposed, output_padding, groups), bias)
    return out[0] if unbatched else out


@register(aten._convolution.default)
def _convolution(input: Any, weight: Any, bias: Any, stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
                 *_flags: bool) -> Any:
    return convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@register(aten.convolution_backward.default, wants_meta=True)
def convolution_backward(grad_output: Any, input: Any, weight: Any, bias_sizes: Sequence[int] | None,
                         stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int, output_mask: Sequence[bool], *,
                         out_meta: Sequence[Any] | None = None) -> tuple:
    """Input and weight gradients are the vjp of the forward; outputs not asked for are None.

    Which outputs are asked for is what PyTorch's meta kernel returns (else output_mask).
    """
    wanted = output_mask if out_meta is None else [m is not None for m in out_meta]
    unbatched = input.ndim == weight.ndim - 1
    x = input[None] if unbatched else input
    g = grad_output[None] if unbatched else grad_output

    def forward(x_: Any, w_: Any) -> Any:
        return _conv(x_, w_, stride, padding, dilation, transposed, output_padding, groups)

    grad_input = grad_weight = grad_bias = None
    if wanted[0] or wanted[1]:
        _, vjp = jax.vjp(forward, x, weight)
        gx, gw = vjp(g.astype(x.dtype))
        if wanted[0]:
            grad_input = gx[0] if unbatched else gx
        if wanted[1]:
            grad_weight = gw
    if wanted[2]:
        axes = tuple(i for i in range(g.ndim) if i != 1)
        grad_bias = jnp.sum(g.astype(jnp.promote_types(g.dtype, jnp.float32)), axis=axes)
    return grad_input, grad_weight, grad_bias


@register(aten.convolution_backward_overrideable.default, wants_meta=True)
def convolution_backward_overrideable(grad_output: Any, input: Any, weight: Any, stride: Sequence[int],
                                      padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                                      output_padding: Sequence[int], groups: int, output_mask: Sequence[bool], *,
                                      out_meta: Sequence[Any] | None = None) -> tuple:
    return convolution_backward(grad_output, input, weight, None, stride, padding, dilation, transposed,
                                output_padding, groups, output_mask, out_meta=out_meta)


@register(aten.slow_conv_transpose2d.default)
def slow_conv_transpose2d(input: Any, weight: Any, kernel_size: Sequence[int], bias: Any = None,
                          stride: Sequence[int] = (1,), padding: Sequence[int] = (0,),
                          output_padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,)) -> Any:
    return convolution(input, weight, bias, stride, padding, dilation, True, output_padding, 1)
