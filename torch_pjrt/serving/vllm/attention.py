"""vLLM attention on pjrt: a paged KV cache held in pjrt tensors, read and written with torch ops.

Each layer's cache is vLLM's `[num_blocks, num_kv_heads, block_size, 2 * head_size]` tensor; a token's
key and value share one row of it (key in the first half, value in the second). One step's batch mixes
prefills, chunked prefills and decodes: every query token writes its key and value at its slot
(`slot_mapping`), then gathers its request's keys and values through the block table and attends to the
positions at or before its own (within its layer's sliding window, if it has one). The host ships one
small integer array a step (each token's id, slot, position and its request's block table row: the model's
token ids and positions are taken from it, so a step has one host-to-device transfer); the context's
masks are computed from it on the device (inside the program on the compile path), and the attention
gathers the context a page at a time through the block table.

The key/value length is padded to a power of two (at least two blocks where the table has them), so
decode steps of growing length reuse one set of programs per bucket instead of compiling per length. On
vLLM's compile path the attention is traced into the model's one graph (the platform's
`opaque_attention_op()` is False): the metadata's token and block-table dimensions are marked dynamic,
so the graph is traced once and compiled per (token, context) bucket, and the layers write and read the
whole cache buffer (one graph input, written in place) rather than each their own view of it. The
torch-op path gathers each token's context: O(query tokens x padded context) of memory per layer. With
TORCH_PJRT_PAGED_ATTENTION=1 (or inside `kernels.paged.switch.scoped(True)`) the attention
reads the cache through the block tables with the Pallas kernel `torch_pjrt.kernels.paged_attention`
instead, which takes the whole cache buffer and gathers nothing (layers with a sliding window still
gather: the kernel attends to the whole context).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from torch_pjrt import _torch_private
from torch_pjrt.eager import modes
from torch_pjrt.eager.modes import EagerMode
from torch_pjrt.kernels import paged
from torch_pjrt.runtime import client
from torch_pjrt.storage import DeviceStorage, new_tensor, storage_of

logger = init_logger(__name__)


def _pjrt_device() -> torch.device:
    return torch.device("pjrt", torch.pjrt.current_device())


@dataclass
class PjrtAttentionMetadata:
    """One step's attention inputs on the pjrt device, shipped in one transfer and shared by the layers.

    What the layers attend over (each token's causal or windowed mask over its pages) is
    computed from these on the device by `visible_of`: inside the compiled program on the compile path,
    once per step in eager mode."""

    num_actual_tokens: int
    """Token rows of the step, padding included (padded_token_count of the real tokens)."""
    token_ids: torch.Tensor
    """(tokens,) the step's input token ids, padding rows 0 (the runner's forward takes them and `positions`
    from here when they equal its own inputs, so a step has one host-to-device transfer)."""
    token_ids_host: np.ndarray
    """The shipped token ids on the host, for that check."""
    positions_host: np.ndarray
    """The shipped positions on the host, for that check."""
    slots: torch.Tensor
    """(tokens,) cache slot (block * block_size + row) each token's key/value is written to."""
    positions: torch.Tensor
    """(tokens,) each token's position in its request; padding rows 0."""
    block_tables: torch.Tensor
    """(tokens, padded context / block size) the blocks of each token's request; padding rows block 0."""
    block_size: int
    kernel: bool
    """Whether the layers without a sliding window attend with paged.paged_attention (paged.switch)."""
    sampled_rows: torch.Tensor | None = None
    """(padded_token_count(requests),) each request's last token row, the last repeated as padding: the rows
    vLLM samples from when it verifies no drafts (the runner checks them against its own, sampled_rows_host)."""
    sampled_rows_host: np.ndarray | None = None
    token_sources: torch.Tensor | None = None
    """(tokens,) under vLLM's async scheduling, for each token row whose id is the previous step's sampled
    token, still on the device, that token's row there; -1 for rows whose id was shipped (None: every row's)."""
    visible: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """Sliding window (None: none) -> `visible_of` it, computed once per step in eager mode."""
    kernel_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    """`kernel_inputs_of` this metadata, computed once per step in eager mode."""


def visible_of(meta: PjrtAttentionMetadata, window: int | None) -> torch.Tensor:
    """(tokens, pages * block_size) bool: the context positions of `meta.block_tables` each token of the step
    sees with sliding window `window`: its request's positions up to its own, the last `window` of them when
    windowed (vLLM's and Hugging Face's rule; the blocks vLLM frees behind the window read as the null block
    and are masked out). Padding rows (position 0, block 0, vLLM's null block, which no request owns) see
    that block's first row."""
    found = meta.visible.get(window)
    if found is not None:
        return found
    pages = meta.block_tables.shape[1]
    context_positions = torch.arange(pages * meta.block_size, device=meta.block_tables.device)
    positions = meta.positions[:, None]
    visible = context_positions[None, :] <= positions
    if window is not None:
        visible = visible & (context_positions[None, :] > positions - window)
    if not torch.compiler.is_compiling():  # a traced graph computes it in the program; eager once per step
        meta.visible[window] = visible
    return visible


def kernel_inputs_of(meta: PjrtAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables and each token's context length (its position + 1) as the int32 paged.paged_attention
    takes: converted once per step in eager mode, shared by the layers (a traced graph converts them in the
    program)."""
    if meta.kernel_inputs is not None:
        return meta.kernel_inputs
    inputs = meta.block_tables.to(torch.int32), (meta.positions + 1).to(torch.int32)
    if not torch.compiler.is_compiling():
        meta.kernel_inputs = inputs
    return inputs


def padded_context_length(max_seq_len: int, block_size: int, max_context: int) -> int:
    """The key/value length one step gathers: a power of two, at least one block, at most the table's reach."""
    length = max(block_size, 1 << max(0, int(max_seq_len) - 1).bit_length())
    return min(length, max_context)


def padded_token_count(tokens: int) -> int:
    """The token rows one step runs: a power of two (at least 8), so prompts of new lengths reuse programs."""
    return max(8, 1 << max(0, tokens - 1).bit_length())


class PjrtAttentionMetadataBuilder(AttentionMetadataBuilder[PjrtAttentionMetadata]):
    """Turns vLLM's host-side batch description into PjrtAttentionMetadata: each token's id, slot, position
    and request's block table, padded, in one host-to-device transfer."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # vLLM hands its builders the runner's host device; the model's is the worker's current pjrt device
        self.model_device = _pjrt_device()
        self.token_ids: torch.Tensor | None = None
        """The runner's host buffer of the step's token ids (PjrtModelRunner sets it), shipped with the rest."""
        self.carried_tokens: tuple[np.ndarray, np.ndarray] | None = None
        """(token rows, their rows in the previous step's sampled tokens) for this step's build, under vLLM's
        async scheduling: the ids of those rows are still on the device (PjrtModelRunner sets it each step)."""
        self.marks_dynamic = True
        """Whether the step's tensors are marked dynamic for Dynamo: until the compile path's one trace is done
        (PjrtModelRunner clears it after its warm-up trace, and where no graph is traced); marking four tensors
        was ~35 of the build's ~300 us of engine-thread CPU at 32 requests."""
        self.kept_views: dict[tuple[int, ...], tuple[DeviceStorage, tuple[torch.Tensor, ...]]] = {}
        """Per layout of the shipped buffer (its parts' sizes and the tables' width), a storage and the step's
        views of it, made once: a later step of that layout puts its array into that storage (see build)."""

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PjrtAttentionMetadata:
        meta = common_attn_metadata
        query_start = meta.query_start_loc_cpu.numpy()[: meta.num_reqs + 1]
        tokens = int(query_start[meta.num_reqs])
        seq_lens = meta.seq_lens.cpu().numpy()[: meta.num_reqs]
        query_lens = query_start[1:] - query_start[:-1]
        request_of_token = np.repeat(np.arange(meta.num_reqs), query_lens)
        # A request's query tokens are its last `query_len` positions: token t of request r (r's query
        # starting at row query_start[r]) is at position seq_len[r] - query_len[r] + t - query_start[r].
        positions = (seq_lens - query_lens - query_start[:-1])[request_of_token] + np.arange(tokens)

        block_table = meta.block_table_tensor.cpu().numpy()[: meta.num_reqs]
        context = padded_context_length(int(seq_lens.max()), self.block_size, block_table.shape[1] * self.block_size)
        # Rows past the real tokens (the runner pads the batch to padded_token_count) write to and read
        # from block 0, vLLM's null block; vLLM's dummy runs (the compile path's warm-up) give every slot
        # as -1: those write the null block too.
        padded = padded_token_count(tokens)
        # At least two pages where the table has them: the compile path traces its one graph at the first
        # step it meets, and Dynamo makes a width of 1 there a constant (a later, wider table would then be
        # read as one page: other tokens than Hugging Face's once a request's context passed a block).
        pages = min(max(2, context // self.block_size), block_table.shape[1])
        rows = padded_token_count(meta.num_reqs) if meta.num_reqs else 0
        carried, self.carried_tokens = self.carried_tokens, None
        # one host buffer, each part a slice of it filled in place, shipped in one transfer
        sizes = [padded, padded, padded, padded * pages, rows] + ([padded] if carried is not None else [])
        shipped = np.zeros(sum(sizes), np.int64)
        ends = list(itertools.accumulate(sizes))
        token_ids, slots, token_positions, tables, sampled_rows, *sources = (
            shipped[end - size: end] for size, end in zip(sizes, ends, strict=True))
        if self.token_ids is not None:
            token_ids[:tokens] = self.token_ids[:tokens].numpy()
        np.maximum(meta.slot_mapping.cpu().numpy()[:tokens], 0, out=slots[:tokens])
        token_positions[:tokens] = positions
        tables = tables.reshape(padded, pages)
        tables[:tokens] = block_table[request_of_token, :pages]
        # each request's last token row, the last repeated as the bucket's padding
        sampled_rows[:meta.num_reqs] = query_start[1: meta.num_reqs + 1] - 1
        sampled_rows[meta.num_reqs:] = sampled_rows[meta.num_reqs - 1] if meta.num_reqs else 0
        if carried is not None:
            sources[0].fill(-1)
            sources[0][carried[0]] = carried[1]
        ids_on_device, slots_on_device, positions_on_device, tables_on_device, rows_on_device, *sources_on_device = (
            self._on_device(shipped, (*sizes, pages)))
        return PjrtAttentionMetadata(num_actual_tokens=padded, token_ids=ids_on_device, token_ids_host=token_ids,
                                     positions_host=token_positions,
                                     slots=slots_on_device, positions=positions_on_device,
                                     block_tables=tables_on_device, block_size=self.block_size,
                                     kernel=paged.switch.enabled(), sampled_rows=rows_on_device,
                                     sampled_rows_host=sampled_rows,
                                     token_sources=sources_on_device[0] if sources_on_device else None)

    def _on_device(self, shipped: np.ndarray, layout: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The shipped buffer put on the device (torch's .to() ends in the same put, after its dispatch) as the
        step's parts: views of one storage, split by `layout` (the parts' sizes, then the tables' width).

        Once the compile path's one trace is done, and outside fused recording (whose graph may read a storage
        after the next step's build), the views made for a layout are kept and a later step's array is put
        into their storage: no tensor wrapped and no views made a step, which cost ~40-70 of the build's
        ~200 us of engine-thread CPU at 32 requests. A step's program reads its arrays when it is called, so
        the previous step's, still running under async scheduling, is not affected."""
        array = client.to_device(shipped, self.model_device.index)
        keeps = not self.marks_dynamic and modes.current() is not EagerMode.DEFER_AND_FUSE
        kept = self.kept_views.get(layout) if keeps else None
        if kept is not None:
            kept[0].array = array
            return kept[1]
        *sizes, pages = layout
        on_device = new_tensor(array, torch.int64, self.model_device, shipped.shape)
        parts = on_device.split(sizes)
        views = (*parts[:3], parts[3].view(-1, pages), *parts[4:])
        # the compile path traces the graph once: the token count and the table's width are its symbols
        if self.marks_dynamic:
            for tensor in views[:4]:
                _torch_private.mark_dynamic(tensor, list(range(tensor.dim())))
        elif keeps:
            self.kept_views[layout] = (storage_of(on_device), views)
        return views


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
        tokens = attn_metadata.slots.shape[0]  # (a traced graph's symbol, where num_actual_tokens is not)
        heads, kv_heads, size = self.num_heads, self.num_kv_heads, self.head_size
        kv_head_index = torch.arange(kv_heads, device=kv_cache.device)
        buffer = self.cache_buffer
        if self.kv_sharing_target_layer_name is None:
            rows = torch.cat([key[:tokens], value[:tokens]], -1).view(tokens, kv_heads, 2 * size)
            block_size = attn_metadata.block_size
            slot_blocks = torch.div(attn_metadata.slots, block_size, rounding_mode="floor")
            at = (slot_blocks[:, None], kv_head_index[None, :], (attn_metadata.slots % block_size)[:, None])
            if buffer is None:
                kv_cache.index_put_(at, rows.to(kv_cache.dtype))
            else:
                buffer.index_put_((self.layer_index, *at), rows.to(buffer.dtype))
        # the kernel attends to the whole context: windowed layers gather with torch ops
        if buffer is not None and attn_metadata.kernel and self.sliding_window is None:
            tables, lengths = kernel_inputs_of(attn_metadata)
            attended = paged.paged_attention(
                query[:tokens].view(tokens, heads, size), buffer, tables, lengths, layer=self.layer_in_buffer,
                scale=self.scale, soft_cap=self.logits_soft_cap)
            output[:tokens].copy_(attended.reshape(output[:tokens].shape))
            return output
        attended = paged.gathered_attention(
            query[:tokens].view(tokens, heads, size), kv_cache if buffer is None else buffer,
            attn_metadata.block_tables, visible_of(attn_metadata, self.sliding_window), scale=self.scale,
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
