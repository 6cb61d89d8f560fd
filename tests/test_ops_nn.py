"""Neural-network ops on pjrt against CPU: activations, norms, pooling, interpolation, embedding,
padding, losses, dropout and attention, forward and backward."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support import assert_same, check, to_device
from torch.nn import functional as F  # noqa: N812
from torch.utils import _pytree as pytree

TOL = {"atol": 1e-4, "rtol": 1e-4}
aten = torch.ops.aten


def check_grad(fn: Any, *inputs: Any, grads: tuple[int, ...] | None = None, **tolerances: Any) -> None:
    """Forward and gradients (for a random cotangent) of fn on pjrt match CPU.

    grads: positions of the inputs to differentiate (default: every floating-point tensor).
    """
    tolerances = tolerances or TOL
    if grads is None:
        grads = tuple(i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point())
    cpu = [x.detach().clone().requires_grad_(i in grads) if isinstance(x, torch.Tensor) else x
           for i, x in enumerate(inputs)]
    dev = [x.detach().to("pjrt").requires_grad_(i in grads) if isinstance(x, torch.Tensor) else x
           for i, x in enumerate(inputs)]
    expected, actual = fn(*cpu), fn(*dev)
    assert_same(actual, expected, **tolerances)
    outputs = [o for o in pytree.tree_leaves(expected) if isinstance(o, torch.Tensor) and o.requires_grad]
    actual_outputs = [o for o in pytree.tree_leaves(actual) if isinstance(o, torch.Tensor) and o.requires_grad]
    cotangents = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, cotangents)
    torch.autograd.backward(actual_outputs, [c.to("pjrt") for c in cotangents])
    assert_same([dev[i].grad for i in grads], [cpu[i].grad for i in grads], **tolerances)


# --- activations -------------------------------------------------------------------------------

ACTIVATIONS = [
    F.relu, F.relu6, lambda x: F.hardtanh(x, -0.5, 0.7), lambda x: F.threshold(x, 0.1, -2.0),
    lambda x: F.leaky_relu(x, 0.2), lambda x: F.elu(x, 1.3), F.celu, F.selu, F.gelu,
    lambda x: F.gelu(x, approximate="tanh"), F.silu, F.mish, lambda x: F.softplus(x, 2.0, 1.5), F.hardsigmoid,
    F.hardswish, lambda x: F.glu(x, 1), F.logsigmoid, torch.sigmoid, lambda x: F.softshrink(x, 0.7),
    lambda x: F.hardshrink(x, 0.7), lambda x: F.rrelu(x, training=False),
]


@pytest.mark.parametrize("fn", ACTIVATIONS, ids=lambda f: getattr(f, "__name__", "fn"))
def test_activation_forward_backward(fn: Any) -> None:
    x = torch.randn(6, 8) * 4
    check_grad(fn, x)


def test_rrelu_training_draws_slopes() -> None:
    x = torch.randn(100, 50).to("pjrt").requires_grad_()
    y = F.rrelu(x, 0.1, 0.3, training=True)
    ratio = (y / x).detach().cpu()
    negative = x.detach().cpu() < 0
    assert 0.1 <= ratio[negative].min() and ratio[negative].max() <= 0.3 and ratio[negative].std() > 0.03
    assert torch.equal(ratio[~negative], torch.ones_like(ratio[~negative]))
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad.cpu(), ratio, **TOL)


def test_prelu_forward_backward() -> None:
    check_grad(F.prelu, torch.randn(3, 4, 5), torch.rand(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_activation_dtypes(dtype: torch.dtype) -> None:
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-10, "rtol": 1e-10}
    x = torch.randn(5, 6, dtype=dtype) * 3
    check(lambda t: (F.gelu(t), F.silu(t), F.elu(t), F.relu(t)), x, **tol)


def test_activation_in_place_and_non_contiguous() -> None:
    x = torch.randn(6, 8).t()[::2]
    check(lambda t: F.relu(t.clone(), inplace=True), x, **TOL)
    check(lambda t: F.leaky_relu_(t.clone(), 0.3), x, **TOL)
    check(lambda t: F.hardtanh(t, -0.2, 0.2), x, **TOL)
    check(lambda t: F.elu(t.clone().t(), inplace=True), torch.randn(8, 6), **TOL)


def test_activation_out_variant() -> None:
    check(lambda t: aten.gelu.out(t, approximate="tanh", out=torch.empty_like(t)), torch.randn(4, 5), **TOL)


def test_relu_integer_input() -> None:
    check(torch.relu, torch.randint(-5, 5, (4, 5)))


# --- normalization -------------------------------------------------------------------------------


def test_layer_norm() -> None:
    check_grad(lambda x, w, b: F.layer_norm(x, (5, 6), w, b, eps=1e-3), torch.randn(3, 4, 5, 6) * 2 + 1,
               torch.randn(5, 6), torch.randn(5, 6))
    check_grad(lambda x: F.layer_norm(x, (6,)), torch.randn(4, 6))


def test_group_norm() -> None:
    check_grad(lambda x, w, b: F.group_norm(x, 3, w, b), torch.randn(2, 6, 4, 5) * 3, torch.randn(6),
               torch.randn(6))
    check_grad(lambda x: F.group_norm(x, 2), torch.randn(3, 4, 7))


def test_layer_norm_bfloat16() -> None:
    check(lambda x, w: F.layer_norm(x, (8,), w), torch.randn(4, 8, dtype=torch.bfloat16),
          torch.randn(8, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 5), (2, 3, 4, 5)])
def test_batch_norm_eval(shape: tuple) -> None:
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    check_grad(lambda x, w, b: F.batch_norm(x, mean.to(x.device), var.to(x.device), w, b, training=False),
               torch.randn(shape), torch.randn(3), torch.randn(3))


def test_batch_norm_train_without_running_stats() -> None:
    check_grad(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), torch.randn(4, 3, 5) * 2 + 1,
               torch.randn(3), torch.randn(3))


def test_batch_norm_train_updates_running_stats() -> None:
    module = torch.nn.BatchNorm2d(3, momentum=0.3)
    device_module = torch.nn.BatchNorm2d(3, momentum=0.3).to("pjrt")
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    for _ in range(2):
        expected, actual = module(x), device_module(x.to("pjrt"))
        assert_same(actual, expected, **TOL)
    assert_same([device_module.running_mean, device_module.running_var],
                [module.running_mean, module.running_var], **TOL)


def test_native_batch_norm_legit_functional_updates() -> None:
    """The functional op returns the new running statistics (unbiased variance, like PyTorch)."""
    x, mean, var = torch.randn(6, 3, 4) * 2, torch.randn(3), torch.rand(3) + 0.5
    check(lambda x_, m, v: aten._native_batch_norm_legit_functional(x_, None, None, m, v, True, 0.2, 1e-5),
          x, mean, var, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_batch_norm_saved_statistics_follow_meta(dtype: torch.dtype) -> None:
    """Saved statistics have the shapes and dtypes of PyTorch's meta kernels (CUDA's convention: float32 for half
    inputs, per-channel in eval mode, where CPU returns empty tensors), so eager agrees with torch.compile; the
    normalized output matches CPU."""
    x, weight = torch.randn(4, 3, 5, dtype=dtype), torch.randn(3, dtype=dtype)
    mean, var = torch.randn(3).to(dtype), (torch.rand(3) + 0.5).to(dtype)
    for training in (False, True):
        args = (x, weight, weight, mean, var, training, 0.1, 1e-5)
        meta = aten.native_batch_norm(*to_device(args, "meta"))
        out = aten.native_batch_norm(*to_device(args))
        assert [(o.shape, o.dtype) for o in out] == [(m.shape, m.dtype) for m in meta]
        assert_same(out[0], aten.native_batch_norm(*args)[0], atol=1e-2, rtol=1e-2)
        if not training:
            assert_same(out[1:], (mean.float(), var.float().add(1e-5).rsqrt()), **TOL)


def test_native_batch_norm_legit_in_place() -> None:
    x, mean, var = torch.randn(6, 3, 4) * 2, torch.randn(3), torch.rand(3) + 0.5

    def run(x_: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> Any:
        m, v = m.clone(), v.clone()
        out = aten._native_batch_norm_legit(x_, None, None, m, v, True, 0.2, 1e-5)
        return out, m, v

    check(run, x, mean, var, **TOL)


# --- pooling --------------------------------------------------------------------------------------

POOLS = [
    lambda x: F.max_pool2d(x, 3, 2, 1),
    lambda x: F.max_pool2d(x, (2, 3), (2, 1), (1, 1), dilation=(2, 1), ceil_mode=True),
    lambda x: F.max_pool1d(x.flatten(2), 3, 2, ceil_mode=True),
    lambda x: F.max_pool3d(x.unsqueeze(1), 2, (1, 2, 2), 1),
    lambda x: F.avg_pool2d(x, 3, 2, 1),
    lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    lambda x: F.avg_pool2d(x, 2, 3, ceil_mode=True, divisor_override=3),
    lambda x: F.avg_pool1d(x.flatten(2), 4, 3, 2),
    lambda x: F.avg_pool3d(x.unsqueeze(1), 2, 2, 1, ceil_mode=True),
    lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
    lambda x: F.adaptive_avg_pool1d(x.flatten(2), 5),
    lambda x: F.adaptive_avg_pool3d(x.unsqueeze(1), (2, 3, 2)),
    lambda x: F.adaptive_max_pool2d(x, (3, 2)),
    lambda x: F.adaptive_max_pool1d(x.flatten(2), 4),
]


@pytest.mark.parametrize("index", range(len(POOLS)))
def test_pooling_forward_backward(index: int) -> None:
    check_grad(POOLS[index], torch.randn(2, 3, 7, 9))


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.adaptive_avg_pool1d(x, 5), (0, 8, 8)),
    (lambda x: F.adaptive_avg_pool2d(x, (5, 3)), (0, 3, 7, 8)),
    (lambda x: F.adaptive_avg_pool3d(x, (2, 5, 3)), (0, 2, 3, 7, 8)),
    (lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=2), (0, 1, 5, 5)),
])
def test_window_ops_on_empty_batch(fn: Any, shape: tuple) -> None:
    """A zero-size batch gives a zero-size result (the window reshape must not divide by zero)."""
    check_grad(fn, torch.randn(shape))


def test_max_pool_indices_and_unbatched() -> None:
    x = torch.randn(3, 8, 8)
    check(lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), x)
    check(lambda t: F.adaptive_max_pool2d(t, 3, return_indices=True), x)
    check(lambda t: F.max_pool2d(t, 2), torch.randint(-50, 50, (2, 6, 6)))


@pytest.mark.parametrize("rank,shape,kernel,output", [
    (2, (2, 3, 9, 9), (3, 2), (4, 5)), (2, (3, 7, 8), 2, (5, 3)), (2, (2, 3, 9, 9), 6, (2, 3)), (2, (0, 2, 6, 6), 2, 3),
    (3, (2, 3, 7, 8, 9), (2, 3, 2), (4, 4, 5)), (3, (3, 6, 7, 8), 2, (3, 4, 5)),
])
def test_fractional_max_pool(rank: int, shape: tuple, kernel: Any, output: Any) -> None:
    """Given the same random samples, windows, maxima and indices match CPU (2-D samples list W before H)."""
    pool = F.fractional_max_pool3d if rank == 3 else F.fractional_max_pool2d
    batch = shape[0] if len(shape) == rank + 2 else 1
    samples = torch.rand(batch, shape[-rank - 1], rank, dtype=torch.float64)
    check_grad(lambda a, u: pool(a, kernel, output_size=output, return_indices=True, _random_samples=u),
               torch.randn(shape, dtype=torch.float64), samples, grads=(0,))


# --- interpolation ----------------------------------------------------------------------------------

INTERPOLATIONS = [
    ((2, 3, 7), {"size": 12}),
    ((2, 3, 7), {"scale_factor": 1.7, "mode": "nearest-exact"}),
    ((2, 3, 5, 7), {"scale_factor": 2}),
    ((2, 3, 5, 7), {"size": (3, 4)}),
    ((2, 3, 4, 3, 5), {"scale_factor": (2, 1.5, 0.6)}),
    ((2, 3, 7), {"size": 10, "mode": "linear"}),
    ((2, 3, 7), {"scale_factor": 0.7, "mode": "linear", "align_corners": True}),
    ((2, 3, 5, 7), {"scale_factor": 1.5, "mode": "bilinear"}),
    ((2, 3, 5, 7), {"size": (9, 4), "mode": "bilinear", "align_corners": True}),
    ((2, 3, 5, 7), {"size": (8, 11), "mode": "bicubic"}),
    ((2, 3, 5, 7), {"scale_factor": 0.6, "mode": "bicubic", "align_corners": True}),
    ((1, 2, 3, 4, 5), {"scale_factor": 1.5, "mode": "trilinear"}),
    ((1, 2, 3, 4, 5), {"size": (5, 2, 6), "mode": "trilinear", "align_corners": True}),
    ((2, 3, 13, 11), {"scale_factor": 0.4, "mode": "bilinear", "antialias": True}),
    ((2, 3, 8, 11), {"size": (17, 5), "mode": "bilinear", "antialias": True, "align_corners": True}),
    ((2, 3, 13, 11), {"scale_factor": 0.3, "mode": "bicubic", "antialias": True}),
]


@pytest.mark.parametrize("shape,kwargs", INTERPOLATIONS, ids=lambda v: str(v))
def test_interpolate_forward_backward(shape: tuple, kwargs: dict) -> None:
    check_grad(lambda x: F.interpolate(x, **kwargs), torch.randn(shape))


@pytest.mark.parametrize("shape,kwargs", [
    ((2, 3, 7, 7), {"kernel_size": 3, "padding": 1, "stride": 2}),
    ((3, 7, 8), {"kernel_size": (2, 3), "dilation": (2, 1), "padding": (0, 1), "stride": (1, 2)}),
])
def test_unfold_fold(shape: tuple, kwargs: dict) -> None:
    check_grad(lambda x: F.unfold(x, **kwargs), torch.randn(shape))
    columns = F.unfold(torch.randn(shape), **kwargs)
    check_grad(lambda c: F.fold(c, shape[-2:], **kwargs), torch.randn(columns.shape))


def _grid(batch: tuple, sizes: tuple, align: bool) -> torch.Tensor:
    """A random sampling grid whose pixel coordinates stay 0.1 away from integers and half-integers,
    where bilinear gradients and nearest values jump and reflection folds: rounding cannot pick a side.
    `sizes` are the spatial sizes in grid order (width, height[, depth]); coordinates reach outside."""
    coords = []
    for n in sizes:
        whole = torch.randint(-2, n + 1, batch).float()
        x = whole + 0.1 + 0.3 * torch.rand(batch) + 0.5 * torch.randint(0, 2, batch)
        coords.append(x * 2 / (n - 1) - 1 if align else (2 * x + 1) / n - 1)
    return torch.stack(coords, -1)


@pytest.mark.parametrize("mode,padding_mode", [("bilinear", "zeros"), ("bilinear", "reflection"),
                                               ("nearest", "border"), ("bicubic", "reflection")])
def test_grid_sample(mode: str, padding_mode: str) -> None:
    align = padding_mode != "border"
    check_grad(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align),
               torch.randn(2, 3, 5, 6), _grid((2, 4, 7), (6, 5), align), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("mode,padding_mode", [("bilinear", "zeros"), ("bilinear", "border"),
                                               ("bilinear", "reflection"), ("nearest", "zeros")])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_3d(mode: str, padding_mode: str, align: bool) -> None:
    check_grad(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=align),
               torch.randn(2, 3, 4, 5, 6), _grid((2, 3, 4, 5), (6, 5, 4), align), atol=1e-4, rtol=1e-3)


# --- embedding and padding --------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (2, False), (1, True)])
def test_embedding_forward_backward(padding_idx: int | None, scale: bool) -> None:
    indices = torch.randint(0, 6, (3, 5))
    check_grad(lambda w, i: F.embedding(i, w, padding_idx=padding_idx, scale_grad_by_freq=scale),
               torch.randn(6, 4), indices)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode: str) -> None:
    weight, indices, offsets = torch.randn(10, 4), torch.randint(0, 10, (12,)), torch.tensor([0, 3, 3, 7])
    check_grad(lambda w, i, o: F.embedding_bag(i, w, o, mode=mode), weight, indices, offsets)
    check_grad(lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=int(indices[0]),
                                               include_last_offset=True), weight, indices, torch.tensor([0, 3, 7, 12]))
    check_grad(lambda w, i: F.embedding_bag(i, w, mode=mode), weight, indices.reshape(3, 4))


def test_embedding_bag_per_sample_weights() -> None:
    check_grad(lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p), torch.randn(10, 4),
               torch.randint(0, 10, (12,)), torch.tensor([0, 3, 3, 7]), torch.rand(12), grads=(0, 3))


PADS = [
    ((2, 3, 6), (2, 1), "constant"),
    ((2, 3, 6, 5), (-1, 2, 1, -2), "constant"),
    ((2, 3, 6), (2, 3), "reflect"),
    ((3, 6, 5), (1, 2, 3, 0), "reflect"),
    ((1, 2, 4, 4, 4), (1, 1, 2, 0, 0, 3), "reflect"),
    ((2, 3, 6), (3, 1), "replicate"),
    ((2, 3, 6, 5), (1, 2, 3, 4), "replicate"),
    ((1, 2, 4, 4, 4), (1, 1, 2, 0, 0, 3), "replicate"),
    ((2, 3, 4, 4), (-4, 5, 0, 0), "replicate"),
    ((2, 3, 4, 4), (5, -4, -4, 3), "replicate"),
]


@pytest.mark.parametrize("shape,pad,mode", PADS, ids=lambda v: str(v))
def test_pad_forward_backward(shape: tuple, pad: tuple, mode: str) -> None:
    kwargs = {"value": 1.5} if mode == "constant" else {}
    check_grad(lambda x: F.pad(x, pad, mode=mode, **kwargs), torch.randn(shape))


def test_constant_pad_integer_and_bool() -> None:
    check(lambda x: F.pad(x, (1, 2), value=7), torch.randint(0, 9, (2, 3)))
    check(lambda x: F.pad(x, (1, 1, 0, 1)), torch.rand(2, 3) > 0.5)


# --- losses ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ignore_index_label_smoothing(reduction: str) -> None:
    target = torch.randint(0, 5, (6,))
    target[1] = -100
    weight = torch.rand(5) + 0.5
    check_grad(lambda x, t, w: F.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1),
               torch.randn(6, 5) * 2, target, weight, grads=(0,))
    target[1:3] = 3
    check_grad(lambda x, t: F.cross_entropy(x, t, ignore_index=3, reduction=reduction), torch.randn(6, 5), target)


def test_cross_entropy_spatial_and_nll() -> None:
    target = torch.randint(0, 4, (2, 3, 5))
    target[0, 1, 2] = 2
    check_grad(lambda x, t: F.cross_entropy(x, t, ignore_index=2, label_smoothing=0.2), torch.randn(2, 4, 3, 5),
               target)
    check_grad(lambda x, t, w: F.nll_loss(x, t, w), torch.randn(2, 4, 3, 5), target, torch.rand(4), grads=(0,))
    check_grad(lambda x, t: F.nll_loss(x, t, reduction="sum"), torch.randn(4), torch.tensor(2))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses(reduction: str) -> None:
    x, y = torch.randn(4, 5) * 2, torch.randn(4, 5)
    check_grad(lambda a, b: F.mse_loss(a, b, reduction=reduction), x, y, grads=(0,))
    check_grad(lambda a, b: F.l1_loss(a, b, reduction=reduction), x, y, grads=(0,))
    check_grad(lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.5), x, y, grads=(0,))
    check_grad(lambda a, b: F.huber_loss(a, b, reduction=reduction, delta=0.7), x, y, grads=(0,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy(reduction: str) -> None:
    p, t, w = torch.rand(4, 5) * 0.98 + 0.01, torch.rand(4, 5), torch.rand(4, 5)
    check_grad(lambda a, b, c: F.binary_cross_entropy(a, b, c, reduction=reduction), p, t, w, grads=(0,))
    logits, pos = torch.randn(4, 5) * 3, torch.rand(5) + 0.5
    check_grad(lambda a, b, c: F.binary_cross_entropy_with_logits(a, b, reduction=reduction, pos_weight=c),
               logits, t, pos, grads=(0,))
    check_grad(lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=reduction), logits, t, grads=(0,))


# --- dropout and attention ------------------------------------------------------------------------------


def test_dropout_statistics_and_backward() -> None:
    x = (torch.rand(200, 100) + 1).to("pjrt").requires_grad_()
    y = F.dropout(x, 0.3)
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.7) < 0.02
    nonzero = y.detach().cpu()[y.detach().cpu() != 0]
    torch.testing.assert_close(nonzero, (x.detach().cpu() / 0.7)[y.detach().cpu() != 0])
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad.cpu(), (y.detach().cpu() != 0).float() / 0.7)
    again = F.dropout(x, 0.3)
    assert not torch.equal(again.detach().cpu() != 0, y.detach().cpu() != 0), "a fixed key"
    check(lambda t: F.dropout(t, 0.3, training=False), torch.randn(4, 5))


def test_native_dropout_backward() -> None:
    mask = torch.rand(4, 5) > 0.4
    check(lambda g, m: aten.native_dropout_backward(g, m, 1.7), torch.randn(4, 5), mask, **TOL)


def _causal_mask(q: int, k: int) -> torch.Tensor:
    return torch.ones(q, k, dtype=torch.bool).tril()


SDPA_CASES = [
    {},
    {"is_causal": True},
    {"scale": 0.3},
    {"mask": "bool"},
    {"mask": "float"},
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_scaled_dot_product_attention(case: dict) -> None:
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4)
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(5, 6) > 0.3
        mask[:, 0] = True
    elif case.get("mask") == "float":
        mask = torch.randn(2, 1, 5, 6)
    if case.get("is_causal"):
        k, v = k[:, :, :5], v[:, :, :5]

    def attention(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        m = None if mask is None else mask.to(q_.device)
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=m, is_causal=case.get("is_causal", False),
                                              scale=case.get("scale"))

    check_grad(attention, q, k, v)


def test_scaled_dot_product_attention_dropout() -> None:
    q = torch.randn(1, 2, 16, 8).to("pjrt").requires_grad_()
    out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    out.sum().backward()
    assert out.shape == (1, 2, 16, 8) and torch.isfinite(q.grad.cpu()).all()


def test_scaled_dot_product_attention_grouped_query() -> None:
    check_grad(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
               torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))


def test_safe_softmax_fully_masked_rows() -> None:
    x = torch.randn(3, 4)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    check(lambda t: aten._safe_softmax(t, -1), x, **TOL)
    check(lambda t: aten._safe_softmax(t, 0, torch.float64), x, **TOL)


# --- dtypes and layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_nn_dtypes(dtype: torch.dtype) -> None:
    tol = {"atol": 3e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-10, "rtol": 1e-10}
    x = torch.randn(2, 3, 6, 7, dtype=dtype)

    def ops(t: torch.Tensor) -> tuple:
        return (F.max_pool2d(t, 2), F.avg_pool2d(t, 3, 2, 1), F.adaptive_avg_pool2d(t, 3),
                F.interpolate(t, scale_factor=1.5, mode="bilinear"), F.interpolate(t, size=(4, 9)),
                F.group_norm(t, 3), F.pad(t, (1, 2, 2, 1), mode="reflect"), F.softplus(t), F.hardswish(t))

    check(ops, x, **tol)


def test_nn_non_contiguous_inputs() -> None:
    x = torch.randn(2, 7, 9, 3).permute(0, 3, 1, 2)[..., ::2]

    def ops(t: torch.Tensor) -> tuple:
        return (F.max_pool2d(t, 2, 1), F.avg_pool2d(t, 2), F.layer_norm(t, (5,)),
                F.interpolate(t, scale_factor=2, mode="bicubic"), F.pad(t, (1, 1, 0, 2), mode="replicate"))

    check(ops, x, **TOL)


def test_losses_bfloat16() -> None:
    x, y = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    target = torch.randint(0, 5, (4,))
    check(lambda a, b, t: (F.mse_loss(a, b), F.cross_entropy(a, t), F.smooth_l1_loss(a, b)), x, y, target,
          atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_soft_margin_loss_half_overflows_like_cpu(reduction: str) -> None:
    """exp(-x t) is stored in float16 by PyTorch: large margins give inf (and NaN gradients), not a finite loss."""
    x = torch.tensor([-12.0, 0.5, 3.0, 11.5, -0.25], dtype=torch.float16)
    t = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float16)
    check(lambda a, b: F.soft_margin_loss(a, b, reduction=reduction), x, t, atol=1e-3, rtol=2e-3)
    grad = torch.rand(5 if reduction == "none" else (), dtype=torch.float16)
    check(lambda g, a, b: aten.soft_margin_loss_backward(g, a, b, {"none": 0, "mean": 1, "sum": 2}[reduction]),
          grad, x, t, atol=1e-3, rtol=2e-3, equal_nan=True)
    check_grad(lambda a, b: F.soft_margin_loss(a, b, reduction=reduction), torch.randn(4, 5),
               torch.randn(4, 5).sign(), grads=(0,))


@pytest.mark.parametrize("p,weighted", [(1, False), (2, True)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multi_margin_loss(p: int, weighted: bool, reduction: str) -> None:
    """Integer inputs put some margin terms exactly at 0, where PyTorch passes no gradient."""
    x, target = torch.randint(-2, 3, (6, 5)).float(), torch.randint(0, 5, (6,))
    weight = torch.rand(5) + 0.5 if weighted else None
    check_grad(lambda a, t, w: F.multi_margin_loss(a, t, p=p, margin=1.0, weight=w, reduction=reduction), x, target,
               weight, grads=(0,))
    check_grad(lambda a, t: F.multi_margin_loss(a, t, p=p, margin=0.5), torch.randn(5), target[0])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_multilabel_margin_loss(reduction: str) -> None:
    """Labels before the first -1 are targets (a repeated label counts twice); ties at the margin pass no gradient."""
    x = torch.randint(-2, 3, (4, 5)).float()
    target = torch.tensor([[3, 0, -1, 1, 2], [1, 1, 4, -1, 0], [-1, 2, 2, 2, 2], [0, 1, 2, 3, 4]])
    check_grad(lambda a, t: F.multilabel_margin_loss(a, t, reduction=reduction), x, target)
    check_grad(lambda a, t: F.multilabel_margin_loss(a, t), torch.randn(5), target[0])


@pytest.mark.parametrize("p", [0, 0.5, 1, 2, 3.5, float("inf")])
def test_pdist(p: float) -> None:
    """A repeated row (zero distance, zero differences) passes no gradient, as in PyTorch's kernels."""
    x = torch.randn(5, 4, dtype=torch.float64)
    x[3] = x[1]
    check_grad(lambda a: F.pdist(a, p), x)


@pytest.mark.parametrize("concatenated,as_tensors", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("reduction,zero_infinity", [("none", False), ("mean", True), ("sum", True)])
def test_ctc_loss(concatenated: bool, as_tensors: bool, reduction: str, zero_infinity: bool) -> None:
    """Repeated labels, an empty target, a short input (an impossible alignment: an inf loss and NaN gradients as
    on CPU, or 0 with zero_infinity) and inputs shorter than the batch's longest; lengths as lists and tensors."""
    log_probs = torch.randn(12, 5, 6, dtype=torch.float64).log_softmax(2)
    targets = torch.tensor([[1, 1, 2, 3], [4, 5, 5, 5], [2, 0, 0, 0], [3, 4, 3, 4], [1, 2, 3, 4]])
    input_lengths, target_lengths = [12, 10, 7, 12, 3], [4, 4, 0, 4, 4]
    if concatenated:
        targets = torch.cat([row[:n] for row, n in zip(targets, target_lengths)])
    if as_tensors:
        input_lengths, target_lengths = torch.tensor(input_lengths), torch.tensor(target_lengths)
    check_grad(lambda lp, t: F.ctc_loss(lp, t, input_lengths, target_lengths, reduction=reduction,
                                        zero_infinity=zero_infinity), log_probs, targets, grads=(0,),
               equal_nan=True, **TOL)


def test_ctc_loss_float32_and_blank() -> None:
    log_probs = torch.randn(30, 4, 8).log_softmax(2)
    targets = torch.randint(0, 7, (4, 9))
    check_grad(lambda lp, t: F.ctc_loss(lp, t, [30, 28, 30, 25], [9, 5, 7, 1], blank=7), log_probs, targets,
               grads=(0,))


# --- modules that reach several of these ops --------------------------------------------------------


def check_module(module: torch.nn.Module, *inputs: torch.Tensor, **tolerances: Any) -> torch.nn.Module:
    """Output and parameter gradients of a module on pjrt match CPU; returns the pjrt copy."""
    device_module = copy.deepcopy(module).to("pjrt")
    expected, actual = module(*inputs), device_module(*to_device(inputs))
    expected, actual = pytree.tree_leaves(expected)[0], pytree.tree_leaves(actual)[0]
    assert_same(actual, expected, **(tolerances or TOL))
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent.to("pjrt"))
    assert_same([p.grad for p in device_module.parameters()], [p.grad for p in module.parameters()],
                **(tolerances or TOL))
    return device_module


def test_instance_norm_running_stats() -> None:
    module = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
    x = torch.randn(2, 3, 5, 5) * 2 + 1
    device_module = check_module(module, x)
    assert_same([device_module.running_mean, device_module.running_var], [module.running_mean, module.running_var],
                **TOL)


def test_embedding_max_norm_renormalizes_rows() -> None:
    module = torch.nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        module.weight.mul_(3)
    device_module = check_module(module, torch.randint(0, 10, (3, 4)))
    assert_same(device_module.weight.detach(), module.weight.detach(), **TOL)


@pytest.mark.parametrize("grads", [(0,), (1,)])
def test_grid_sample_partial_gradients(grads: tuple) -> None:
    check_grad(lambda x, g: F.grid_sample(x, g, align_corners=False), torch.randn(1, 2, 4, 5),
               _grid((1, 3, 3), (5, 4), False), grads=grads)


def test_max_pool_ties_nan_and_infinities() -> None:
    """Indices follow PyTorch: the first maximum wins a tie, a NaN always wins, -inf windows still pick inside."""
    x = torch.randint(0, 3, (2, 2, 7, 7)).float()
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, :3, :3] = float("-inf")
    check(lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True), x, equal_nan=True)
    check(lambda t: F.max_pool2d(t, 2, 2, ceil_mode=True, return_indices=True), x, equal_nan=True)
    check(lambda t: F.max_pool3d(t, 2, 1, return_indices=True), x, equal_nan=True)
    x[0, 0, 1, 2] = float("nan")
    check(lambda t: F.adaptive_max_pool2d(t, (3, 2), return_indices=True), x, equal_nan=True)


def test_group_norm_on_an_empty_batch() -> None:
    check(lambda x, w, b: torch.native_group_norm(x, w, b, 0, 2, 1, 1, 1e-5)[0], torch.randn(0, 2), torch.randn(2),
          torch.randn(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_attention_with_score_mod_and_block_mask(monkeypatch: pytest.MonkeyPatch,
                                                                dtype: torch.dtype) -> None:
    """flex_attention inside torch.compile is a higher-order op with its score and mask functions as
    subgraphs; forward and backward must equal PyTorch's eager dense kernels on CPU. PyTorch's eager entry
    refuses a CPU backward, so the CPU reference alone runs without that check, once the device has started
    (a device start inside the patch would wrap the patch, and undoing it would drop pjrt's hook). In
    bfloat16 the dense kernels' constants (-inf) are bfloat16 tensors."""
    from torch.nn.attention import flex_attention as flex

    bias = torch.randn(4)

    def causal(batch: Any, head: Any, q_index: Any, kv_index: Any) -> Any:
        return q_index >= kv_index

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_bias: torch.Tensor, mask: Any) -> Any:
        def score(s: Any, batch: Any, head: Any, q_index: Any, kv_index: Any) -> Any:
            return s + head_bias[head] * (q_index - kv_index)

        return flex.flex_attention(q, k, v, score_mod=score, block_mask=mask)

    inputs = [torch.randn(2, 4, 32, 16, dtype=dtype, requires_grad=True) for _ in range(3)]
    on_device = [t.detach().to("pjrt").requires_grad_() for t in inputs]
    with monkeypatch.context() as cpu_backward:
        cpu_backward.setattr(flex, "_validate_device", lambda query, key, value: None)
        expected = attend(*inputs, bias, flex.create_block_mask(causal, 2, None, 32, 32, device="cpu"))
    expected.backward(torch.ones_like(expected))
    mask = flex.create_block_mask(causal, 2, None, 32, 32, device="pjrt")
    torch._dynamo.reset()
    actual = torch.compile(attend, backend="pjrt", fullgraph=True)(*on_device, bias.to("pjrt"), mask)
    actual.backward(torch.ones_like(actual))
    tolerances = TOL if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert_same(actual, expected, **tolerances)
    for device_input, cpu_input in zip(on_device, inputs):
        assert_same(device_input.grad, cpu_input.grad, **tolerances)


def test_weight_norm_forward_backward() -> None:
    """torch.nn.utils.weight_norm's backward (aten._weight_norm_interface_backward: CPU/CUDA kernels only)."""
    v, g = torch.randn(6, 4, 3), torch.rand(6, 1, 1) + 0.5
    check_grad(lambda v, g: torch._weight_norm(v, g, 0), v, g)
    check_grad(lambda v, g: torch._weight_norm(v, g, 2), torch.randn(5, 4, 3), torch.rand(1, 1, 3) + 0.5)
