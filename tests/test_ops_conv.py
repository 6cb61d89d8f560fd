"""Convolutions on pjrt against CPU: ranks, groups, stride, dilation, padding, transposed, backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import assert_same, check
from torch.nn import functional as F  # noqa: N812

TOL = {"atol": 1e-4, "rtol": 1e-4}


def check_grad(fn: Any, *inputs: torch.Tensor, **tolerances: Any) -> None:
    """Forward and input gradients of fn (for a random cotangent) on pjrt match CPU."""
    cpu = [x.detach().clone().requires_grad_() for x in inputs]
    dev = [x.detach().to("pjrt").requires_grad_() for x in inputs]
    expected, actual = fn(*cpu), fn(*dev)
    assert_same(actual, expected, **tolerances)
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent.to("pjrt"))
    assert_same([d.grad for d in dev], [c.grad for c in cpu], **tolerances)


CONVS = [
    # (fn, input shape, weight shape, kwargs)
    (F.conv1d, (2, 4, 17), (6, 4, 5), {"stride": 3, "padding": 2}),
    (F.conv1d, (4, 11), (4, 2, 3), {"groups": 2, "dilation": 2}),
    (F.conv2d, (2, 4, 9, 10), (6, 2, 3, 3), {"stride": 2, "padding": 1, "dilation": 2, "groups": 2}),
    (F.conv2d, (2, 3, 8, 8), (4, 3, 2, 3), {"stride": (2, 1), "padding": (1, 0)}),
    (F.conv2d, (1, 3, 7, 7), (6, 3, 4, 4), {"padding": "same"}),
    (F.conv2d, (2, 4, 7, 7), (4, 1, 3, 3), {"groups": 4, "padding": "valid"}),
    (F.conv3d, (2, 4, 5, 6, 7), (8, 1, 3, 2, 3), {"stride": (1, 2, 1), "padding": (1, 0, 2), "groups": 4}),
    (F.conv_transpose1d, (2, 4, 5), (4, 3, 3), {"stride": 3, "padding": 4}),
    (F.conv_transpose2d, (2, 4, 5, 5), (4, 3, 3, 3),
     {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "dilation": 2}),
    (F.conv_transpose2d, (2, 3, 4, 6), (3, 2, 2, 3), {"stride": (2, 3), "output_padding": (1, 2)}),
    (F.conv_transpose3d, (1, 2, 3, 4, 3), (2, 3, 3, 2, 2), {"stride": 2, "padding": 1}),
]


@pytest.mark.parametrize("fn,input_shape,weight_shape,kwargs", CONVS)
def test_conv_forward_backward(fn: Any, input_shape: tuple, weight_shape: tuple, kwargs: dict) -> None:
    transposed = "transpose" in fn.__name__
    groups = kwargs.get("groups", 1)
    out_channels = weight_shape[1] * groups if transposed else weight_shape[0]
    x, w, b = torch.randn(input_shape), torch.randn(weight_shape), torch.randn(out_channels)
    check_grad(lambda x_, w_, b_: fn(x_, w_, b_, **kwargs), x, w, b, **TOL)


@pytest.mark.parametrize("padding_mode", ["reflect", "circular", "replicate", "zeros"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_conv_module_padding_modes(padding_mode: str, rank: int) -> None:
    conv_cls = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[rank]
    conv = conv_cls(2, 3, 3, padding=1, stride=2 if rank == 2 else 1, padding_mode=padding_mode)
    x = torch.randn((2, 2) + (5,) * rank)
    check_grad(lambda x_, w_, b_: torch.func.functional_call(conv, {"weight": w_, "bias": b_}, (x_,)),
               x, conv.weight.detach(), conv.bias.detach(), **TOL)


def test_conv_without_bias_and_weight_only_grad() -> None:
    x, w = torch.randn(2, 3, 6, 6), torch.randn(5, 3, 3, 3)
    w_cpu, w_dev = w.clone().requires_grad_(), w.to("pjrt").requires_grad_()
    expected = F.conv2d(x, w_cpu, stride=2)
    actual = F.conv2d(x.to("pjrt"), w_dev, stride=2)
    assert_same(actual, expected, **TOL)
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent.to("pjrt"))
    assert_same(w_dev.grad, w_cpu.grad, **TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_conv_dtypes(dtype: torch.dtype) -> None:
    tol = {"atol": 5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-10, "rtol": 1e-10}
    check(lambda x, w, b: F.conv2d(x, w, b, padding=1), torch.randn(2, 3, 6, 6, dtype=dtype),
          torch.randn(4, 3, 3, 3, dtype=dtype), torch.randn(4, dtype=dtype), **tol)


def test_conv_non_contiguous_input() -> None:
    x = torch.randn(2, 8, 9, 3).permute(0, 3, 1, 2)[:, :, ::2]
    check(lambda x_, w: F.conv2d(x_, w), x, torch.randn(4, 3, 2, 2), **TOL)


def test_convolution_backward_output_mask() -> None:
    """Outputs not asked for come back as None."""
    x, w, g = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(2, 4, 4, 4)

    def run(g_: torch.Tensor, x_: torch.Tensor, w_: torch.Tensor) -> Any:
        return torch.ops.aten.convolution_backward(g_, x_, w_, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])

    result = check(run, g, x, w, **TOL)
    assert result[0] is None and result[2] is None


def test_slow_conv_transpose2d() -> None:
    """The backend-specific transposed conv (it has a meta kernel, so it can be called directly)."""
    check(lambda x, w, b: torch.ops.aten.slow_conv_transpose2d(x, w, [3, 2], b, [2, 1], [1, 0], [1, 0], [1, 2]),
          torch.randn(2, 4, 5, 6), torch.randn(4, 3, 3, 2), torch.randn(3), **TOL)
