"""paged_attention: query tokens attending over a paged KV cache, as a Pallas kernel and a PyTorch op.

The cache is one buffer for all layers, `(layers, blocks, kv_heads, block_size, 2 * head_size)`: a
cached token's key fills the first half of its row, its value the second (the layout of vLLM's caches
on pjrt, torch_pjrt.serving.vllm). The op takes the whole buffer and a layer number, so the program's
input is the buffer itself: neither a layer's part nor a gathered context is ever copied out.

One kernel program per (query token, kv head) walks the pages its token's block table names, a few
pages a step, with an online softmax over the steps; the token sees the first `length` positions of its
request. A prefill token is a query token like a decode one (its length is its position + 1), so one
call serves a batch that mixes prefills, chunked prefills and decodes. Grouped-query heads share their
kv head's program. Interpreted on CPU (no Pallas compiler there); on GPU the Triton lowering.

`gathered_attention` is the same attention in torch ops, what runs without the kernel: each token's
padded context is gathered from the layer's cache a page at a time, O(tokens x context) of memory.
"""

from __future__ import annotations

import functools
import math

import jax
import torch
from jax.experimental import pallas as pl

from torch_pjrt import envvars
from torch_pjrt.kernels import jax_ops, page_gather

# cached positions one kernel step reads at most (its pages' rows)
STEP_POSITIONS = 128
# a score that no softmax weight survives, finite so that fully masked steps make no NaN
_MASKED = -0.7 * float(jax.numpy.finfo(jax.numpy.float32).max)

# TORCH_PJRT_PAGED_ATTENTION, or the innermost `scoped` block: the serving plugin's attention runs this op
switch = envvars.Switch("TORCH_PJRT_PAGED_ATTENTION")


def pages_per_step(pages: int, block_size: int) -> int:
    """Pages one kernel step reads: as many as fit STEP_POSITIONS, dividing the block table's width."""
    return math.gcd(pages, max(1, STEP_POSITIONS // block_size))


def _kernel(query_ref, keys_ref, values_ref, table_ref, length_ref, out_ref, *, step_pages: int, scale: float,  # noqa: ANN001
            soft_cap: float) -> None:
    jnp = jax.numpy
    block_size = keys_ref.shape[1]
    span = step_pages * block_size
    size = query_ref.shape[-1]
    query = query_ref[...].astype(jnp.float32) * scale
    length = length_ref[0]
    highest = jax.lax.Precision.HIGHEST

    def step(index, carry):  # noqa: ANN001, ANN202
        out, top, total = carry
        pages = table_ref[pl.ds(index * step_pages, step_pages)]
        keys = keys_ref[pages].reshape(span, size).astype(jnp.float32)
        values = values_ref[pages].reshape(span, size).astype(jnp.float32)
        scores = jnp.dot(query, keys.T, precision=highest, preferred_element_type=jnp.float32)
        if soft_cap:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        seen = index * span + jnp.arange(span) < length
        scores = jnp.where(seen[None, :], scores, _MASKED)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        correction = jnp.exp(top - new_top)
        weights = jnp.exp(scores - new_top[:, None])
        total = correction * total + weights.sum(axis=-1)
        out = correction[:, None] * out + jnp.dot(weights, values, precision=highest,
                                                   preferred_element_type=jnp.float32)
        return out, new_top, total

    rows = query_ref.shape[0]
    start = (jnp.zeros((rows, size), jnp.float32), jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    out, _, total = jax.lax.fori_loop(0, (length + span - 1) // span, step, start)
    out_ref[...] = (out / total[:, None]).astype(out_ref.dtype)


def _paged_attention(query: jax.Array, cache: jax.Array, block_tables: jax.Array, lengths: jax.Array, *,
                     layer: int, scale: float, soft_cap: float = 0.0) -> jax.Array:
    """softmax(q k^T * scale) v of each query token (tokens, heads, head_size) over the first lengths[t]
    positions of its pages block_tables[t] in the cache's layer `layer`; logits capped at soft_cap (0: no cap)."""
    jnp = jax.numpy
    tokens, heads, size = query.shape
    _, blocks, kv_heads, block_size, _ = cache.shape
    group = heads // kv_heads
    # Triton's dots want at least 16 rows a side: a kv head's query heads padded to a power of two from 16
    rows = group if jax_ops.interpret_mode() else max(16, 1 << (group - 1).bit_length())
    grouped = query.reshape(tokens, kv_heads, group, size)
    if rows != group:
        grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    pages = block_tables.shape[1]
    kernel = functools.partial(_kernel, step_pages=pages_per_step(pages, block_size), scale=scale,
                               soft_cap=soft_cap)
    token_heads = pl.BlockSpec((None, None, rows, size), lambda t, h: (t, h, 0, 0))
    # two windows on the one buffer: a row's first half (keys) and its second (values) of kv head h
    keys = pl.BlockSpec((None, blocks, None, block_size, size), lambda t, h: (layer, 0, h, 0, 0))
    values = pl.BlockSpec((None, blocks, None, block_size, size), lambda t, h: (layer, 0, h, 0, 1))
    out = pl.pallas_call(
        kernel,
        grid=(tokens, kv_heads),
        in_specs=[token_heads, keys, values, pl.BlockSpec((None, pages), lambda t, h: (t, 0)),
                  pl.BlockSpec((None, 1), lambda t, h: (t, 0))],
        out_specs=token_heads,
        out_shape=jax.ShapeDtypeStruct(grouped.shape, query.dtype),
        interpret=jax_ops.interpret_mode(),
        name="torch_pjrt_paged_attention",
    )(grouped, cache, cache, block_tables.astype(jnp.int32), lengths.astype(jnp.int32).reshape(tokens, 1))
    return out[:, :, :group].reshape(tokens, heads, size)


def unsupported(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor,
                layer: int) -> str | None:
    """Why the kernel cannot take these inputs, or None when it can."""
    if query.dim() != 3 or cache.dim() != 5 or block_tables.dim() != 2 or lengths.dim() != 1:
        return (f"query must be 3-D (tokens, heads, head_size), cache 5-D (layers, blocks, kv_heads, block_size, "
                f"2 * head_size), block_tables 2-D and lengths 1-D, got {query.dim()}-D, {cache.dim()}-D, "
                f"{block_tables.dim()}-D and {lengths.dim()}-D")
    tokens, heads, size = query.shape
    layers, _, kv_heads, _, row = cache.shape
    if row != 2 * size or heads % kv_heads:
        return (f"the cache's rows must hold a key and a value of head_size {size} and its kv heads divide the "
                f"{heads} query heads, got cache {tuple(cache.shape)}")
    if block_tables.shape[0] != tokens or lengths.shape[0] != tokens:
        return f"block_tables and lengths need a row per query token ({tokens}), got {block_tables.shape[0]} and " \
               f"{lengths.shape[0]}"
    if not 0 <= layer < layers:
        return f"layer {layer} is not one of the cache's {layers} layers"
    if query.dtype != cache.dtype or query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"query and cache must share one of float32, bfloat16, float16, got {query.dtype} and {cache.dtype}"
    return None


def _checked_result(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor, *,
                    layer: int, scale: float, soft_cap: float = 0.0) -> torch.Tensor:
    """The op's fake: refuses what the kernel cannot take, else a result of the query's shape."""
    reason = unsupported(query, cache, block_tables, lengths, layer)
    if reason is not None:
        raise ValueError(f"torch_pjrt.kernels.paged_attention: {reason}.")
    return query.new_empty(query.shape)


# called as paged_attention(query, cache, block_tables, lengths, layer=..., scale=..., soft_cap=...)
paged_attention = jax_ops.define("torch_pjrt::paged_attention", _paged_attention, fake=_checked_result)


def gathered_attention(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                       visible: torch.Tensor, *, scale: float, soft_cap: float = 0.0,
                       layer: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention in torch ops, in float32: query (tokens, heads, head_size) over one layer's cache
    (blocks, kv_heads, block_size, 2 * head_size), token t's context the pages block_tables[t] (context
    position s at row s % block_size of page s // block_size), seen where visible[t, s]. With `layer` (a
    1-element index tensor) the cache is the whole buffer (layers, blocks, ...) and the gathers read that
    layer's pages from it: a compiled program then never copies the layer's part out of the buffer.

    Keys and values come from page_gather.gather_pages, in the (token, kv head, position, head_size) layout
    the batched products read (on jaxlib's CPU client a custom call copying whole rows, where XLA's gathers
    took 778 us of a 2.69 ms vLLM decode step at 32 requests), and the keys are the scores' left operand."""
    tokens, heads, size = query.shape
    kv_heads = cache.shape[-3]
    keys, values = (half.float() for half in page_gather.gather_pages(cache, block_tables, layer))
    grouped = query.view(tokens, kv_heads, heads // kv_heads, size).float()
    # the keys are the product's left operand as gathered; the (small) scores are then turned to (token, kv
    # head, group, position), so that the mask and the softmax run along their rows' last dimension
    scores = torch.einsum("tksd,tkgd->tksg", keys, grouped).transpose(-1, -2) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.einsum("tkgs,tksd->tkgd", scores.softmax(-1), values).reshape(tokens, heads, size)
