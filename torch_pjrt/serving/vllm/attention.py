"""vLLM attention on pjrt: a paged KV cache held in pjrt tensors, read and written with torch ops.

Each layer's cache is vLLM's `[num_blocks, num_kv_heads, block_size, 2 * head_size]` tensor; a token's
key and value share one row of it (key in the first half, value in the second). One step's batch mixes
prefills, chunked prefills and decodes: every query token writes its key and value at its slot
(`slot_mapping`), then gathers its request's keys and values through the block table and attends to the
positions at or before its own (within its layer's sliding window, if it has one). The host builds the
index tensors once per step (on CPU, from vLLM's host-side metadata) and ships them in two transfers (the
integer indices, with the rows vLLM samples from, and the boolean masks); the layers then run only device ops.

The key/value length is padded to a power of two (at least one block), so decode steps of growing
length reuse one set of programs per bucket instead of compiling per length. On vLLM's compile path the
attention is traced into the model's one graph (the platform's `opaque_attention_op()` is False): the
index tensors' token and context dimensions are marked dynamic, so the graph is traced once and compiled
per (token, context) bucket, and the layers write and read the whole cache buffer (one graph input,
written in place) rather than each their own view of it. The torch-op path
gathers each token's context: O(query tokens x padded context) of memory per layer. With
TORCH_PJRT_PAGED_ATTENTION=1 (or inside `kernels.paged.switch.scoped(True)`) the attention
reads the cache through the block tables with the Pallas kernel `torch_pjrt.kernels.paged_attention`
instead, which takes the whole cache buffer and gathers nothing (layers with a sliding window still
gather: the kernel attends to the whole context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from torch_pjrt import _torch_private
from torch_pjrt.kernels import paged
from torch_pjrt.storage import storage_of

logger = init_logger(__name__)


def _pjrt_device() -> torch.device:
    return torch.device("pjrt", torch.pjrt.current_device())


@dataclass
class PjrtAttentionMetadata:
    """One step's attention indices, on the pjrt device (built once per step, shared by the layers)."""

    num_actual_tokens: int
    """Token rows of the step, padding included (padded_token_count of the real tokens)."""
    slot_blocks: torch.Tensor
    """(tokens,) cache block each token's key/value is written to."""
    slot_offsets: torch.Tensor
    """(tokens,) row inside that block."""
    context_blocks: torch.Tensor
    """(tokens, padded context) cache block holding each context position of the token's request."""
    context_offsets: torch.Tensor
    """(padded context,) row inside the block for each context position."""
    visible: torch.Tensor
    """(tokens, padded context) bool: the context position is at or before the token (causal)."""
    block_tables: torch.Tensor | None = None
    """(tokens, padded context / block size) int32: the blocks of each token's request, for the kernel."""
    context_lengths: torch.Tensor | None = None
    """(tokens,) int32: the context positions each token sees (its position + 1), for the kernel."""
    visible_in_window: dict[int, torch.Tensor] = field(default_factory=dict)
    """Sliding window W -> `visible` narrowed to the token's last W positions, for the windowed layers."""
    sampled_rows: torch.Tensor | None = None
    """(padded_token_count(requests),) each request's last token row, the last repeated as padding: the rows
    vLLM samples from when it verifies no drafts (the runner checks them against its own, sampled_rows_host)."""
    sampled_rows_host: np.ndarray | None = None


def padded_context_length(max_seq_len: int, block_size: int, max_context: int) -> int:
    """The key/value length one step gathers: a power of two, at least one block, at most the table's reach."""
    length = max(block_size, 1 << max(0, int(max_seq_len) - 1).bit_length())
    return min(length, max_context)


def padded_token_count(tokens: int) -> int:
    """The token rows one step runs: a power of two (at least 8), so prompts of new lengths reuse programs."""
    return max(8, 1 << max(0, tokens - 1).bit_length())


class PjrtAttentionMetadataBuilder(AttentionMetadataBuilder[PjrtAttentionMetadata]):
    """Turns vLLM's host-side batch description into the device index tensors of PjrtAttentionMetadata."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        self.sliding_windows = sorted({window for layer in layers.values()
                                       if (window := getattr(layer.impl, "sliding_window", None))})

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PjrtAttentionMetadata:
        meta = common_attn_metadata
        query_start = meta.query_start_loc_cpu.numpy().astype(np.int64)
        tokens = int(query_start[meta.num_reqs])
        seq_lens = meta.seq_lens.cpu().numpy().astype(np.int64)[: meta.num_reqs]
        query_lens = np.diff(query_start[: meta.num_reqs + 1])
        request_of_token = np.repeat(np.arange(meta.num_reqs), query_lens)
        # A request's query tokens are its last `query_len` positions.
        first_position = np.repeat(seq_lens - query_lens, query_lens)
        positions = first_position + np.arange(tokens) - np.repeat(query_start[: meta.num_reqs], query_lens)

        block_table = meta.block_table_tensor.cpu().numpy().astype(np.int64)[: meta.num_reqs]
        context = padded_context_length(int(seq_lens.max()), self.block_size, block_table.shape[1] * self.block_size)
        context_positions = np.arange(context)
        # vLLM's dummy runs (the compile path's warm-up) give every slot as -1: those write the null block
        slots = np.maximum(meta.slot_mapping.cpu().numpy().astype(np.int64)[:tokens], 0)

        # Rows past the real tokens (the runner pads the batch to padded_token_count) write to and read
        # from block 0, vLLM's null block, which no request owns, and see only its first row.
        padded = padded_token_count(tokens)
        context_blocks = np.zeros((padded, context), np.int64)
        context_blocks[:tokens] = block_table[request_of_token][:, context_positions // self.block_size]
        visible = np.zeros((padded, context), bool)
        visible[:tokens] = context_positions[None, :] <= positions[:, None]
        visible[tokens:, 0] = True
        padded_slots = np.zeros(padded, np.int64)
        padded_slots[:tokens] = slots

        # A layer with sliding window W sees the last W positions up to its own (vLLM's and Hugging Face's
        # rule); the blocks vLLM frees behind the window read as the null block and are masked out here.
        masks = [visible]
        for window in self.sliding_windows:
            in_window = visible.copy()
            in_window[:tokens] &= context_positions[None, :] > positions[:, None] - window
            masks.append(in_window)
        last_rows = query_start[1: meta.num_reqs + 1] - 1
        row_padding = padded_token_count(meta.num_reqs) - meta.num_reqs
        sampled_rows = np.concatenate([last_rows, last_rows[-1:].repeat(row_padding)])
        arrays = [padded_slots // self.block_size, padded_slots % self.block_size, context_blocks,
                  context_positions % self.block_size, sampled_rows]
        if paged.switch.enabled():
            lengths = np.ones(padded, np.int64)
            lengths[:tokens] = positions + 1
            arrays += [context_blocks[:, :: self.block_size], lengths]
        indices = _to_device_at_once(arrays, np.int64)
        visible_masks = _to_device_at_once(masks, np.bool_)
        kernel_indices = {}
        if paged.switch.enabled():
            kernel_indices = dict(block_tables=indices[5].to(torch.int32), context_lengths=indices[6].to(torch.int32))
        # the compile path traces the graph once: every length here is one of its symbols, never a constant
        for tensor in (*indices, *visible_masks, *kernel_indices.values()):
            _torch_private.mark_dynamic(tensor, list(range(tensor.dim())))
        return PjrtAttentionMetadata(
            num_actual_tokens=padded,
            slot_blocks=indices[0],
            slot_offsets=indices[1],
            context_blocks=indices[2],
            context_offsets=indices[3],
            visible=visible_masks[0],
            visible_in_window=dict(zip(self.sliding_windows, visible_masks[1:])),
            sampled_rows=indices[4],
            sampled_rows_host=sampled_rows,
            **kernel_indices,
        )


def _to_device_at_once(arrays: list[np.ndarray], dtype: type) -> list[torch.Tensor]:
    """The arrays on the pjrt device as views of one buffer: one host-to-device transfer, not one each
    (each costs about 0.1 ms on jaxlib's CPU client, a step ships 5 or more)."""
    packed = np.concatenate([np.asarray(array, dtype).ravel() for array in arrays])
    whole = torch.from_numpy(packed).to(_pjrt_device())
    parts = whole.split([array.size for array in arrays])
    return [part.view(array.shape) for part, array in zip(parts, arrays)]


class PjrtAttentionImpl(AttentionImpl[PjrtAttentionMetadata]):
    """Decoder self-attention over the paged cache, sliding windows included; refuses what it would not
    honour (ALiBi, sinks, other attention types, quantized caches)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "attention sinks": sinks is not None,
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            f"KV cache dtype {kv_cache_dtype!r}": kv_cache_dtype != "auto",
        }
        refused = [what for what, present in unsupported.items() if present]
        if refused:
            raise NotImplementedError(f"the pjrt attention backend does not support {', '.join(refused)} yet")
        self.num_heads = num_heads
        self.sliding_window = sliding_window
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or 0.0
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.cache_buffer: torch.Tensor | None = None
        self.layer_in_buffer = 0
        self.layer_index: torch.Tensor | None = None

    def bind_cache_buffer(self, buffer: torch.Tensor, layer: int) -> None:
        """Read and write this layer's cache as `layer` of the whole buffer (layers, *cache shape)."""
        self.cache_buffer, self.layer_in_buffer = buffer, layer
        self.layer_index = torch.tensor([layer], device=buffer.device)

    @_torch_private.traced_by_dynamo
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PjrtAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the pjrt attention backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache bound yet
            return output
        tokens = attn_metadata.slot_blocks.shape[0]  # (a traced graph's symbol, where num_actual_tokens is not)
        heads, kv_heads, size = self.num_heads, self.num_kv_heads, self.head_size
        kv_head_index = torch.arange(kv_heads, device=kv_cache.device)
        buffer = self.cache_buffer
        if self.kv_sharing_target_layer_name is None:
            rows = torch.cat([key[:tokens], value[:tokens]], -1).view(tokens, kv_heads, 2 * size)
            at = (attn_metadata.slot_blocks[:, None], kv_head_index[None, :], attn_metadata.slot_offsets[:, None])
            if buffer is None:
                kv_cache.index_put_(at, rows.to(kv_cache.dtype))
            else:
                buffer.index_put_((self.layer_index, *at), rows.to(buffer.dtype))
        # the kernel attends to the whole context: windowed layers gather with torch ops
        if buffer is not None and attn_metadata.block_tables is not None and self.sliding_window is None:
            attended = paged.paged_attention(
                query[:tokens].view(tokens, heads, size), buffer, attn_metadata.block_tables,
                attn_metadata.context_lengths, layer=self.layer_in_buffer, scale=self.scale,
                soft_cap=self.logits_soft_cap)
            output[:tokens].copy_(attended.reshape(output[:tokens].shape))
            return output
        visible = (attn_metadata.visible if self.sliding_window is None
                   else attn_metadata.visible_in_window[self.sliding_window])
        attended = paged.gathered_attention(
            query[:tokens].view(tokens, heads, size), kv_cache if buffer is None else buffer,
            attn_metadata.context_blocks, attn_metadata.context_offsets, visible, scale=self.scale,
            soft_cap=self.logits_soft_cap, layer=self.layer_index)
        output[:tokens].copy_(attended.reshape(output[:tokens].shape).to(output.dtype))
        return output


def bind_cache_buffers(layers: dict[str, Any], caches: dict[str, torch.Tensor]) -> None:
    """Each pjrt attention layer's cache read and written through its whole buffer, one tensor per buffer
    (a compiled graph takes it as one input, which it writes in place)."""
    buffers: dict[int, torch.Tensor] = {}
    for name, cache in caches.items():
        impl = getattr(layers.get(name), "impl", None)
        whole = _layers_of(cache) if isinstance(impl, PjrtAttentionImpl) else None
        if whole is not None:
            buffer = buffers.setdefault(cache.untyped_storage().data_ptr(), whole[0])
            impl.bind_cache_buffer(buffer, whole[1])


def _layers_of(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The cache's whole buffer as (layers, *cache.shape) and the cache's layer in it; None (with a warning,
    once) when the layers do not tile a buffer of the cache's dtype."""
    per_layer = cache.numel()
    nbytes = cache.untyped_storage().nbytes()
    fits = (cache.is_contiguous() and storage_of(cache).dtype == cache.dtype and per_layer
            and cache.storage_offset() % per_layer == 0 and nbytes % (per_layer * cache.element_size()) == 0)
    if not fits:
        if not _warned:
            logger.warning("the layers' KV caches do not tile one buffer of their dtype (cache %s, offset %d): "
                           "each layer writes its own view (copied in a compiled graph) and the paged-attention "
                           "kernel is not used",
                           tuple(cache.shape), cache.storage_offset())
            _warned.append(True)
        return None
    layers = nbytes // (per_layer * cache.element_size())
    whole = cache.as_strided((layers, *cache.shape), (per_layer, *cache.stride()), 0)
    return whole, cache.storage_offset() // per_layer


_warned: list[bool] = []


class PjrtAttentionBackend(AttentionBackend):
    """vLLM's view of the pjrt attention: names the builder and impl, and what they accept."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PjrtAttentionImpl]:
        return PjrtAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PjrtAttentionMetadataBuilder]:
        return PjrtAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
