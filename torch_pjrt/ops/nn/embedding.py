"""Embedding and embedding_bag, with device-side checks on the ids."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from torch_pjrt.ops.indexing import OUT_OF_RANGE, check_index
from torch_pjrt.ops.nn.common import _up
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import checks

aten = torch.ops.aten


@register(aten.embedding.default)
def embedding(weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> Any:
    check_index(indices, weight.shape[0], "aten::embedding", OUT_OF_RANGE)
    return jnp.take(weight, indices, axis=0)


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output: Any, indices: Any, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool) -> Any:
    """Rows of padding_idx get no gradient; with scale_grad_by_freq each row is divided by its count."""
    index = indices.reshape(-1)
    grad = _up(grad_output).reshape(index.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp.where((index == padding_idx)[:, None], 0, grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[index].add(1)
        grad = grad / counts[index][:, None]
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[index].add(grad)


@register(aten.embedding_renorm.default)
def embedding_renorm(self: Any, indices: Any, max_norm: float, norm_type: float) -> Any:
    """Rows named by indices whose p-norm exceeds max_norm are scaled down to it (nn.Embedding(max_norm=))."""
    rows = _up(self)
    norms = jnp.sum(jnp.abs(rows) ** norm_type, axis=1) ** (1.0 / norm_type)
    named = jnp.zeros((self.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scale = jnp.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1)
    return rows * scale[:, None]


MODE_SUM, MODE_MEAN, MODE_MAX = 0, 1, 2


def _bag_ids(indices: Any, offsets: Any, num_bags: int) -> Any:
    """The bag each index belongs to: the last offset at or before its position."""
    positions = jnp.arange(indices.shape[0])
    return jnp.clip(jnp.searchsorted(offsets, positions, side="right") - 1, 0, max(num_bags - 1, 0))


def _kept(indices: Any, padding_idx: int) -> Any:
    return indices != padding_idx if padding_idx >= 0 else jnp.ones(indices.shape, jnp.bool_)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(weight: Any, indices: Any, offsets: Any, scale_grad_by_freq: bool = False, mode: int = MODE_SUM,
                   sparse: bool = False, per_sample_weights: Any = None, include_last_offset: bool = False,
                   padding_idx: int = -1) -> tuple:
    """(output, offset2bag, bag_size, max_indices); padding_idx entries count for nothing, empty bags are 0."""
    message = ("embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {{value}}"
               if mode == MODE_MAX else
               "Index {{position}} of input takes value {{value}} which is not in the valid range [0, {size})")
    check_index(indices, weight.shape[0], "aten::embedding_bag", message, RuntimeError)
    if offsets.shape[0]:
        # CPU's message ends with how it prints the 0-dim offset tensor
        printed = "torch.IntTensor" if offsets.dtype == jnp.int32 else "torch.LongTensor"
        checks.fail_if(offsets[0] != 0, "aten::embedding_bag", "offsets[0] has to be 0, i.e., the first sequence in "
                       "the mini-batch has to start from position 0. However, got {value}\n[ " + printed + "{{}} ]",
                       RuntimeError, value=offsets[0])
    num_bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bags = _bag_ids(indices, offsets, num_bags)
    keep = _kept(indices, padding_idx)
    bag_size = jax.ops.segment_sum(keep.astype(jnp.int64), bags, num_segments=offsets.shape[0])
    rows = _up(jnp.take(weight, indices, axis=0))
    if mode == MODE_MAX:
        masked = jnp.where(keep[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, bags, num_segments=num_bags)
        first = jnp.where(masked == best[bags], jnp.arange(indices.shape[0])[:, None], indices.shape[0])
        chosen = jax.ops.segment_min(first, bags, num_segments=num_bags)
        empty = (bag_size[:num_bags] == 0)[:, None]
        max_indices = jnp.where(empty, -1, jnp.take(indices, jnp.clip(chosen, 0, indices.shape[0] - 1)))
        return jnp.where(empty, 0, best), bags, bag_size, max_indices
    if per_sample_weights is not None:
        rows = rows * _up(per_sample_weights)[:, None]
    total = jax.ops.segment_sum(jnp.where(keep[:, None], rows, 0), bags, num_segments=num_bags)
    if mode == MODE_MEAN:
        total = total / jnp.maximum(bag_size[:num_bags], 1)[:, None]
    return total, bags, bag_size, jnp.zeros((0,), jnp.int64)


def _bag_grad(grad: Any, indices: Any, bags: Any, maximum_indices: Any, num_weights: int, scale_grad_by_freq: bool,
              mode: int, per_sample_weights: Any, padding_idx: int) -> Any:
    g = _up(grad)
    dim = g.shape[1]
    if mode == MODE_MAX:
        valid = maximum_indices >= 0
        rows = jnp.where(valid, maximum_indices, 0)
        columns = jnp.broadcast_to(jnp.arange(dim), rows.shape)
        return jnp.zeros((num_weights, dim), g.dtype).at[rows, columns].add(jnp.where(valid, g, 0))
    keep = _kept(indices, padding_idx)
    per_index = g[bags]
    if mode == MODE_MEAN:
        sizes = jax.ops.segment_sum(keep.astype(g.dtype), bags, num_segments=g.shape[0])
        per_index = per_index / jnp.maximum(sizes, 1)[bags][:, None]
    if per_sample_weights is not None:
        per_index = per_index * _up(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[indices].add(1)
        per_index = per_index / counts[indices][:, None]
    return jnp.zeros((num_weights, dim), g.dtype).at[indices].add(jnp.where(keep[:, None], per_index, 0))


@register(aten._embedding_bag_backward.default)
def _embedding_bag_backward(grad: Any, indices: Any, offsets: Any, offset2bag: Any, bag_size: Any,
                            maximum_indices: Any, num_weights: int, scale_grad_by_freq: bool, mode: int,
                            sparse: bool, per_sample_weights: Any, padding_idx: int = -1) -> Any:
    """The gradient is dense even for sparse=True (pjrt has no sparse layout)."""
    bags = _bag_ids(indices, offsets, grad.shape[0])
    return _bag_grad(grad, indices, bags, maximum_indices, num_weights, scale_grad_by_freq, mode, per_sample_weights,
                     padding_idx)


@register(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(grad: Any, indices: Any, offset2bag: Any, bag_size: Any, maximum_indices: Any,
                                  num_weights: int, scale_grad_by_freq: bool, mode: int, per_sample_weights: Any,
                                  padding_idx: int = -1) -> Any:
    return _bag_grad(grad, indices, offset2bag, maximum_indices, num_weights, scale_grad_by_freq, mode,
                     per_sample_weights, padding_idx)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad: Any, weight: Any, indices: Any, offsets: Any, offset2bag: Any,
                                               mode: int, padding_idx: int = -1) -> Any:
    if mode != MODE_SUM:
        raise NotImplementedError("embedding_bag per_sample_weights are only defined for mode='sum'.")
    bags = _bag_ids(indices, offsets, grad.shape[0])
    products = jnp.sum(_up(grad)[bags] * _up(jnp.take(weight, indices, axis=0)), axis=1)
    return jnp.where(_kept(indices, padding_idx), products, 0)


