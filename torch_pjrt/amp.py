"""Autocast for pjrt: the same cast policy as CUDA's autocast, op for op.

PyTorch 2.13 registers no kernel for AutocastPrivateUse1, so without a fallthrough
every op fails inside `torch.autocast("pjrt")`; the listed ops get Python kernels that
cast their floating arguments and re-dispatch below autocast.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_pjrt import _torch_private

KEY = "AutocastPrivateUse1"

# Ops that run in the autocast dtype (CUDA's "lower precision fp" list).
LOWER_PRECISION = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
    "convolution prelu addmm addmv addr matmul einsum mm mv linear addbmm baddbmm bmm chain_matmul "
    "linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell "
    "rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention"
).split()

# Ops that run in float32 (CUDA's "fp32" list).
FLOAT32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
    "layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
    "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss "
    "smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
    "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm "
    "logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d "
    "upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
).split()

# Ops that take float32 unless given a dtype (CUDA's "fp32 set opt dtype" list).
FLOAT32_UNLESS_DTYPE = "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split()

# Ops that run in the widest floating type among their inputs (CUDA's "promote" list).
PROMOTE = (
    "addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot stack cat "
    "vdot index_copy"
).split()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype and value.device.type in ("pjrt", "cpu"):
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _tensors(values: Any) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value))
    return found


def _kernel(op: Any, policy: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower":
            dtype = torch.get_autocast_dtype("pjrt")
        elif policy == "float32":
            dtype = torch.float32
        elif policy == "float32_unless_dtype":
            if kwargs.get("dtype") is not None:
                dtype = None
            else:
                dtype = torch.float32
        else:
            floats = [t.dtype for t in _tensors(list(args) + list(kwargs.values())) if t.is_floating_point()]
            dtype = None if not floats else floats[0]
            for other in floats[1:]:
                dtype = torch.promote_types(dtype, other)
        with _torch_private.exclude_key(KEY):
            if dtype is None:
                return op(*args, **kwargs)
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return kernel


def register() -> list[torch.library.Library]:
    """The autocast fallthrough and cast kernels (cheap: no jax)."""
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, KEY)
    library = torch.library.Library("aten", "IMPL")
    for names, policy in (
        (LOWER_PRECISION, "lower"),
        (FLOAT32, "float32"),
        (FLOAT32_UNLESS_DTYPE, "float32_unless_dtype"),
        (PROMOTE, "promote"),
    ):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if "out" in overload or op._schema.is_mutable:
                    continue
                library.impl(op, _kernel(op, policy), KEY)
    return [fallthrough, library]
