"""vLLM's worker and model runner for pjrt: vLLM's CPU runner with the model and KV cache on the device.

vLLM's CPU runner keeps the step's bookkeeping (input batch, block tables, sampling state) in host
tensors; this runner reuses all of it and moves only what the model and the sampler read: token ids and
positions reach the device in the attention backend's one transfer a step, with its index tensors (padded
to a power-of-two token count, which bounds the programs compiled), and the sampled rows' gather and the
lm head run with the forward (the rows' indices ride in the attention metadata's transfer): on the compile
path, in the step's one program (StepProgram); in eager modes, as one fused program right after the
forward. When vLLM's sampler would only take the argmax (greedy, no logprobs, penalties or acting logits
processors) only the token ids the program took come back;
otherwise vLLM's sampler runs where TORCH_PJRT_VLLM_SAMPLING says: on the device (its per-request tensors
copied there once per change of the batch) or on the host, as on vLLM's CPU platform, with the sampled
rows' logits brought back.
Under vLLM's async scheduling (the platform's default; TORCH_PJRT_VLLM_ASYNC_SCHEDULING=0 turns it off) a
step returns before its tokens reach the host (TokensCopiedLater), and the next step takes the ids of the
requests it continues from the previous step's tokens on the device (the attention metadata names their rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import torch
from torch.overrides import TorchFunctionMode
from vllm import envs as vllm_envs
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, set_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
from vllm.utils.mem_constants import GiB_bytes
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SamplerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_model_runner import _set_global_compilation_settings as set_global_compilation_settings
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

from torch_pjrt import _torch_private, envvars
from torch_pjrt.eager import dispatch, kernels
from torch_pjrt.eager.modes import EagerMode
from torch_pjrt.serving.vllm.attention import (
    PjrtAttentionMetadata,
    PjrtAttentionMetadataBuilder,
    bind_cache_buffers,
    padded_token_count,
)
from torch_pjrt.serving.vllm.moe import register_fused_moe_method

logger = init_logger(__name__)
# tokens of the compile path's warm-up batch: the smallest token bucket
WARM_UP_TOKENS = 8


class PjrtModelRunner(CPUModelRunner):
    """Runs the model and holds its KV cache on `model_device` (a pjrt device); everything else on the host."""

    def __init__(self, vllm_config: Any, model_device: torch.device) -> None:
        super().__init__(vllm_config, torch.device("cpu"))
        self.model_device = model_device
        self.samples_on_device = samples_on_device(model_device)
        if self.samples_on_device and vllm_config.speculative_config is not None:
            # vLLM's rejection sampler is Triton kernels, whose stand-ins here are vLLM's C++ CPU kernels:
            # they read host memory, so they must be given host tensors.
            logger.warning("Speculative decoding on pjrt samples on the host: vLLM's rejection sampler runs "
                           "its CPU kernels, which read host memory (TORCH_PJRT_VLLM_SAMPLING is not honoured).")
            self.samples_on_device = False
        self._sampling_metadata_copy: tuple[SamplingMetadata, SamplingMetadata] | None = None
        # the sampled positions' true count while their logits are computed padded (see _prepare_inputs)
        self._sampled_rows: int | None = None
        # this step's padded sampled positions, while _model_forward may sample them in one program
        self._step_logits_indices: torch.Tensor | None = None
        self._step_sampled_in_program: SampledInProgram | None = None
        self._step_has_grammar = False
        # (vLLM's sampling metadata, whether its own fields leave its sampler an argmax): see _only_argmax_samples
        self._argmax_fields: tuple[SamplingMetadata, bool] | None = None
        self._compute_logits: Any = None
        # the compile path's one program a step (StepProgram), where one rank runs the whole model: vLLM's call
        # of it (the first traces it), then its compiled code called directly (StepProgram.compiled_forward)
        self._step: Any = None
        self._step_program: StepProgram | None = None
        self._step_compiled: Any = None
        # the last greedy program's tokens on the device, padded to its bucket (async scheduling reads them)
        self._padded_device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        # under async scheduling, the previous step's sampled tokens on the device this step's ids take rows of
        self._carried_from: torch.Tensor | None = None
        # under async scheduling, the step program's stand-in for them when the previous step's tokens reached
        # the host (made at the warm-up)
        self._no_previous_tokens: torch.Tensor | None = None
        if self.samples_on_device:
            # vLLM's logits processors keep their per-request tensors on the device they are built for
            custom = tuple(vllm_config.model_config.logits_processors or ())
            self.input_batch.logitsprocs = build_logitsprocs(
                vllm_config, model_device, False, self.is_pooling_model, custom
            )

    @contextlib.contextmanager
    def _on_model_device(self) -> Iterator[None]:
        """vLLM allocates caches and loads weights on `self.device`: point it at pjrt for that span."""
        host = self.device
        self.device = self.model_device
        try:
            yield
        finally:
            self.device = host

    def load_model(self, load_dummy_weights: bool = False) -> None:
        register_fused_moe_method()  # before the model's layers are built
        with self._on_model_device():
            super().load_model(load_dummy_weights)
        compute_logits = self.model.compute_logits
        self._compute_logits = compute_logits

        def compute_logits_where_sampled(hidden_states: torch.Tensor) -> torch.Tensor | None:
            if self._step_sampled_in_program is not None:
                # _model_forward computed this step's logits (or tokens) already; hidden_states is its stand-in
                return self._step_sampled_in_program.logits
            logits = compute_logits(hidden_states.to(self.model_device))
            rows, self._sampled_rows = self._sampled_rows, None
            if logits is None:
                return None
            if not self.samples_on_device:
                logits = logits.cpu()  # whole: a narrowed device view would compile a slice per row count
            # the rows _prepare_inputs padded the sampled positions with, dropped
            return logits if rows is None else logits[:rows]

        self.model.compute_logits = compute_logits_where_sampled
        one_rank = self.parallel_config.tensor_parallel_size == 1 and self.parallel_config.pipeline_parallel_size == 1
        if self.compilation_config.mode == CompilationMode.VLLM_COMPILE and one_rank and not self.is_pooling_model:
            # its frame is torch_pjrt's, which Dynamo skips (dynamo_skip_our_packages) unless told otherwise: made
            # so, vLLM's torch.compile compiles StepProgram.forward's own frame, whose Dynamo code vLLM's bytecode
            # hook then runs directly each step (no torch.compile call, no guards); its first call, traced so,
            # makes that code
            with set_current_vllm_config(self.vllm_config), _torch_private.dynamo_traces_our_code():
                step = StepProgram(vllm_config=self.vllm_config, model=self.model, compute_logits=compute_logits)
            self._step, self._step_program = _torch_private.traced_by_dynamo(step.__call__), step

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        """vLLM's sampling, given the batch's sampling metadata on the device when the logits are there; the
        greedy tokens the step's program chose when _model_forward found vLLM's sampler would only take argmax."""
        sampled, self._step_sampled_in_program = self._step_sampled_in_program, None
        if sampled is not None and sampled.tokens is not None:
            tokens = sampled.tokens.unsqueeze(-1)
            if sampled.padded_tokens is not None:
                self._padded_device_tokens = (sampled.padded_tokens, tokens)
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        if not self.samples_on_device:
            return super()._sample(logits, spec_decode_metadata)
        host = self.input_batch.sampling_metadata
        self.input_batch.sampling_metadata = self._sampling_metadata_on_device(host)
        try:
            return super()._sample(logits, spec_decode_metadata)
        finally:
            self.input_batch.sampling_metadata = host

    def _get_prompt_logprobs_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Prompt logprobs are gathered beside the logits: vLLM puts the prompt's token ids on `self.device`."""
        if not self.samples_on_device:
            return super()._get_prompt_logprobs_dict(*args, **kwargs)
        with self._on_model_device():
            return super()._get_prompt_logprobs_dict(*args, **kwargs)

    def _sampling_metadata_on_device(self, host: SamplingMetadata) -> SamplingMetadata:
        """The metadata with its tensors on the device, copied once for each one vLLM builds.

        vLLM builds a new metadata object whenever the batch changes (requests added, finished or
        moved) and reuses it, tensors unchanged, on the steps between.
        """
        if self._sampling_metadata_copy is None or self._sampling_metadata_copy[0] is not host:
            tensors = {
                field.name: value.to(self.model_device, non_blocking=True)
                for field in dataclasses.fields(host)
                if isinstance(value := getattr(host, field.name), torch.Tensor)
            }
            self._sampling_metadata_copy = (host, dataclasses.replace(host, **tensors))
        return self._sampling_metadata_copy[1]

    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: contextlib.AbstractContextManager | None = None,
    ) -> dict[str, torch.Tensor]:
        """vLLM's cache views, on one buffer allocated once in the layers' dtype (see BackingInLayersDtype)."""

        @contextlib.contextmanager
        def allocation() -> Iterator[None]:
            with kv_cache_allocation_context or contextlib.nullcontext(), BackingInLayersDtype(kv_cache_config):
                yield

        with self._on_model_device():
            caches = super().initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes, allocation())
        bind_cache_buffers(self.compilation_config.static_forward_context, caches)
        return caches

    def warming_up_model(self) -> None:
        """The compile path's one trace, on a small dummy batch with attention metadata: vLLM's CPU runner
        traces its profiling run, which has none, and the attention traced then would be skipped for good
        (vLLM keeps no guards). The batch's token and context lengths are the graph's symbols. vLLM's dummy
        run hands the model the runner's host token ids and positions: they go to the device first, as a
        step's do, or Dynamo would trace host inputs against device weights. It runs the step program (or,
        with several ranks, the forward and the programs after it), so a first request in that bucket, greedy
        or sampled, compiles nothing."""
        if self.compilation_config.mode == CompilationMode.NONE:
            return
        model = self.model
        self.model = InputsOnDevice(model, self._warm_up_inputs, functools.partial(self._warm_up_forward, model))
        if self.use_async_scheduling:  # the carried tokens' program too, in the smallest buckets
            self._carry_tokens((np.zeros(0, np.int64), np.zeros(0, np.int64)))
            self._no_previous_tokens = torch.zeros(padded_token_count(1), dtype=torch.int32, device=self.model_device)
            self._carried_from = self._no_previous_tokens
        try:
            with set_global_compilation_settings(self.vllm_config):
                self._dummy_run(min(WARM_UP_TOKENS, self.max_num_tokens), force_attention=True)
        finally:
            self.model = model
        for builder in self._pjrt_attention_builders():  # traced: no step's tensors are read by Dynamo again
            builder.marks_dynamic = False

    def _on_device_padded(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A model input on the device, its token dimension padded as the attention metadata pads it."""
        if t is None:
            return None
        padding = padded_token_count(t.shape[0]) - t.shape[0]
        if padding:
            t = torch.cat([t, t.new_zeros((padding, *t.shape[1:]))])
        return t.to(self.model_device, non_blocking=True)

    def _inputs_on_device(self, input_ids: torch.Tensor | None, positions: torch.Tensor | None,
                          metadata: PjrtAttentionMetadata | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's token ids and positions on the device: those the step's attention `metadata` shipped when
        they equal them (no transfer, and the views a step's graph is called with), else moved as int64 ids (the
        shipped ids' dtype: the compiled graph may have been traced with those)."""
        shipped = _shipped_with_attention(input_ids, positions, metadata)
        if shipped is not None:
            return shipped
        to_device = self._on_device_padded
        return to_device(None if input_ids is None else input_ids.long()), to_device(positions)

    def _warm_up_inputs(self, input_ids: torch.Tensor | None,
                        positions: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The warm-up batch's token ids and positions as a step's graph is called with them: the views of the
        attention metadata's transfer. (The dummy batch's own positions, zeros, differ from those the metadata
        computes, and separately moved inputs made the graph compile again for a first request in the same
        buckets; the dummy's values matter to no one.)"""
        meta = _step_attention_metadata()
        if meta is not None and input_ids is not None and meta.num_actual_tokens == padded_token_count(
                input_ids.shape[0]):
            if self._step_program_runs(meta, meta.token_ids, None):
                return meta.token_ids, meta.positions
            return self._with_carried_tokens(meta.token_ids, meta), meta.positions
        return self._inputs_on_device(input_ids, positions, meta)

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        metadata = _step_attention_metadata()  # (looked up once a step: each lookup walks the layers' dict)
        input_ids, positions = self._inputs_on_device(input_ids, positions, metadata)
        inputs_embeds = self._on_device_padded(inputs_embeds)
        logits_indices, self._step_logits_indices = self._step_logits_indices, None
        if self._step_program_runs(metadata, input_ids, inputs_embeds):
            assert metadata is not None
            hidden_states, logits, tokens = self._run_step(metadata, input_ids, positions, intermediate_tensors,
                                                           inputs_embeds, **model_kwargs)
            rows = self._rows_vllm_samples(metadata, logits_indices)
            greedy = rows is not None and self._only_argmax_samples()
            sampled = None if rows is None else self._sampled(*((None, tokens) if greedy else (logits, None)), rows)
        else:
            input_ids = self._with_carried_tokens(input_ids, metadata)
            hidden_states = super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                                   **model_kwargs)
            sampled = self._sample_in_program(hidden_states, metadata, logits_indices)
        if sampled is None:
            return hidden_states
        self._step_sampled_in_program, self._sampled_rows = sampled, None
        # vLLM gathers the sampled rows of what this returns before compute_logits: a zero-width host stand-in
        # makes that gather free (compute_logits_where_sampled then returns the logits computed here)
        return torch.empty((hidden_states.shape[0], 0))

    def _run_step(self, metadata: PjrtAttentionMetadata, input_ids: torch.Tensor | None, positions: torch.Tensor,
                  intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                  **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step program on this step's inputs, called alike at the warm-up (its one trace) and every step.
        Under async scheduling it also takes the previous step's tokens on the device and the rows the step's
        ids take from them (see _with_carried_tokens): every step, so the one trace has them."""
        assert self._step is not None
        carried: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if self.use_async_scheduling:
            previous, self._carried_from = self._carried_from, None
            if previous is None:  # the previous step's tokens reached the host: no row takes one
                previous = self._no_previous_tokens
            carried = (metadata.token_sources, previous)
        step = self._step_compiled or self._step
        outputs = step(input_ids, positions, metadata.sampled_rows, *carried, intermediate_tensors, inputs_embeds,
                       **model_kwargs)
        if self._step_compiled is None and self._step_program is not None:
            self._step_compiled = self._step_program.compiled_forward()
        return outputs

    def _step_program_runs(self, metadata: PjrtAttentionMetadata | None, input_ids: torch.Tensor | None,
                           inputs_embeds: torch.Tensor | None) -> bool:
        """Whether the step program runs the step of attention `metadata`: on the compile path with one rank,
        the step's token count the metadata's (whose sampled rows the program gathers)."""
        tokens = input_ids if input_ids is not None else inputs_embeds
        return not (self._step is None or metadata is None or tokens is None or metadata.sampled_rows is None
                    or tokens.shape[0] != metadata.num_actual_tokens)

    def _prepare_input_ids(self, scheduler_output: Any, num_reqs: int, total_num_scheduled_tokens: int,
                           cu_num_tokens: np.ndarray) -> None:
        """vLLM's input ids; under async scheduling, when the previous step's sampled tokens are still on the
        device, the rows of the requests continuing from it are named to the attention builders (see
        _with_carried_tokens) instead of vLLM's scatter, which writes the runner's host buffer."""
        previous = self.input_batch.prev_sampled_token_ids
        if previous is None or previous.device.type == "cpu":
            super()._prepare_input_ids(scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
            if self.use_async_scheduling:  # every step ships the same parts: one program per bucket
                self._carry_tokens((np.zeros(0, np.int64), np.zeros(0, np.int64)))
            return
        if scheduler_output.scheduled_spec_decode_tokens:
            raise NotImplementedError("async scheduling with draft tokens is not supported on pjrt; pass "
                                      "async_scheduling=False")
        earlier = self.prev_positions.np[:num_reqs]
        continuing = np.flatnonzero(earlier >= 0)
        self._carry_tokens((cu_num_tokens[continuing] - 1, earlier[continuing]))
        padded, issued = self._padded_device_tokens or (None, None)
        self._carried_from = padded if issued is previous else previous[:, 0]

    def _carry_tokens(self, carried: tuple[np.ndarray, np.ndarray]) -> None:
        """Names this step's (token rows, their rows in the previous step's tokens) to the attention builders."""
        for builder in self._pjrt_attention_builders():
            builder.carried_tokens = carried

    def _pjrt_attention_builders(self) -> Iterator[PjrtAttentionMetadataBuilder]:
        """The pjrt attention metadata builders of the runner's attention groups."""
        for group in self._attn_group_iterator():
            for builder in group.metadata_builders:
                if isinstance(builder, PjrtAttentionMetadataBuilder):
                    yield builder

    def _with_carried_tokens(self, input_ids: torch.Tensor | None,
                             metadata: PjrtAttentionMetadata | None) -> torch.Tensor | None:
        """The step's token ids with the rows the previous step sampled taken from its tokens on the device,
        in one program (async scheduling: the host has not seen those tokens yet), where no step program runs
        (which takes them in its own program, _run_step); `metadata` is the step's attention metadata."""
        previous, self._carried_from = self._carried_from, None
        if previous is None or input_ids is None or metadata is None or metadata.token_sources is None:
            return input_ids
        sources = metadata.token_sources[: input_ids.shape[0]]
        with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
            carried = torch.where(sources >= 0, previous.to(input_ids.dtype)[sources.clamp(min=0)], input_ids)
            if input_ids is not metadata.token_ids:
                return carried
            # in place: the graph is called with the shipped views, as the warm-up traced it
            input_ids.copy_(carried)
        return input_ids

    def _get_or_create_async_output_copy_stream(self) -> None:
        """No copy stream on pjrt: TokensCopiedLater copies when the engine asks for the step's output."""
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        """vLLM's sampling step; under async scheduling its output is a TokensCopiedLater."""
        if not self.use_async_scheduling:
            return super().sample_tokens(grammar_output)
        cuda_output = gpu_model_runner.AsyncGPUModelRunnerOutput
        gpu_model_runner.AsyncGPUModelRunnerOutput = self._tokens_copied_later
        try:
            return super().sample_tokens(grammar_output)
        finally:
            gpu_model_runner.AsyncGPUModelRunnerOutput = cuda_output

    def _tokens_copied_later(self, *args: Any, **kwargs: Any) -> TokensCopiedLater:
        """The step's TokensCopiedLater, given the greedy program's padded tokens this step's _sample issued, and
        whether vLLM's input batch keeps its host tensor of them (where a logits processor reads output ids)."""
        kept = bool(self.input_batch.sampling_metadata.output_token_ids)
        return TokensCopiedLater(*args, padded=self._padded_device_tokens, host_tensor_kept=kept, **kwargs)

    def initialize_metadata_builders(self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int]) -> None:
        """The pjrt attention builders ship the step's token ids with their indices (one transfer a step), and mark
        their tensors dynamic only where a graph is traced (see warming_up_model)."""
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        for builder in self._pjrt_attention_builders():
            builder.token_ids = self.input_ids.cpu
            builder.marks_dynamic = self.compilation_config.mode != CompilationMode.NONE

    def _sample_in_program(self, hidden_states: Any, metadata: PjrtAttentionMetadata | None,
                           logits_indices: torch.Tensor | None) -> SampledInProgram | None:
        """The step's sampled rows' logits, and their greedy tokens when vLLM's sampler would only take their
        argmax, in one program after the forward's, the rows' indices from the attention metadata's transfer:
        only the tokens (or the sampled rows' logits) come back to the host. None where vLLM reads the hidden
        states itself (drafts, prompt logprobs, pooling) or the metadata's rows are not vLLM's."""
        if not isinstance(hidden_states, torch.Tensor):
            return None
        rows = None if metadata is None else self._rows_vllm_samples(metadata, logits_indices)
        if rows is None:
            return None
        return self._sampled_rows_program(hidden_states, metadata, rows, self._only_argmax_samples())

    def _rows_vllm_samples(self, metadata: PjrtAttentionMetadata, logits_indices: torch.Tensor | None) -> int | None:
        """How many of the metadata's sampled rows vLLM samples from (the rest pad them to a bucket); None when
        they are not the rows vLLM gathers (drafts, prompt logprobs, pooling read the hidden states)."""
        if logits_indices is None or metadata.sampled_rows_host is None \
                or not _same_values(metadata.sampled_rows_host, logits_indices.numpy()):
            return None
        return self._sampled_rows or logits_indices.shape[0]

    def _sampled_rows_program(self, hidden_states: torch.Tensor, metadata: PjrtAttentionMetadata, rows: int,
                              greedy: bool) -> SampledInProgram:
        """The metadata's sampled rows' logits (their first `rows`), or their argmax when `greedy`, as one
        fused program (the eager path's; the compile path's step program computes both)."""
        with torch.pjrt.set_eager_mode(EagerMode.DEFER_AND_FUSE):
            logits = self._compute_logits(hidden_states[metadata.sampled_rows])
            tokens = logits.argmax(-1).to(torch.int32) if greedy else None
        # dispatched as the mode's context closed
        return self._sampled(None if greedy else logits, tokens, rows)

    def _sampled(self, logits: torch.Tensor | None, tokens: torch.Tensor | None, rows: int) -> SampledInProgram:
        """The first `rows` of the device's greedy `tokens` (on the host; under async scheduling, copied when the
        engine asks) or else of the sampled rows' `logits`, where vLLM's sampler reads them."""
        # read with the eager layer's copy to the host itself, without .cpu()'s dispatch to it
        if tokens is not None:
            if not self.use_async_scheduling:
                return SampledInProgram(logits=None, tokens=kernels.to_cpu(tokens)[:rows])
            # the padded tokens themselves where no row pads them (a view of their rows is an op dispatched)
            issued = tokens if rows == tokens.shape[0] else tokens[:rows]
            return SampledInProgram(logits=None, tokens=issued, padded_tokens=tokens)
        assert logits is not None
        if not self.samples_on_device:
            logits = kernels.to_cpu(logits)
        return SampledInProgram(logits=logits[:rows], tokens=None)

    def _warm_up_forward(self, model: torch.nn.Module, **inputs: Any) -> Any:
        """The warm-up batch's programs, as a step of that batch runs them (see warming_up_model): the step
        program; or, where there is none, the forward and the fused programs after it, the greedy one and the
        one that brings the sampled rows' logits back for vLLM's sampler (a temperature, logprobs, penalties)."""
        metadata = _step_attention_metadata()
        if self._step_program_runs(metadata, inputs.get("input_ids"), inputs.get("inputs_embeds")):
            assert metadata is not None
            return self._run_step(metadata, **inputs)[0]
        hidden_states = model(**inputs)
        if isinstance(hidden_states, torch.Tensor) and metadata is not None and metadata.sampled_rows is not None:
            for greedy in (True, False):
                self._sampled_rows_program(hidden_states, metadata, metadata.sampled_rows.shape[0], greedy=greedy)
        return hidden_states

    def _only_argmax_samples(self) -> bool:
        """Whether vLLM's sampler, given this batch's metadata, would return its logits' argmax and nothing
        else: all greedy, no logprobs, no penalties, bad words, allowed-token masks or logits processors that
        act (vLLM's min-tokens and logit-bias ones when they hold no request), no grammar, no NaN counts."""
        metadata = self.input_batch.sampling_metadata
        # its own fields (and vLLM's NaN-count setting, ~4 us a read) are checked once per metadata: vLLM's input
        # batch makes a new one whenever its requests change (refresh_metadata); the processors' and the step's
        # state are read each step
        if self._argmax_fields is None or self._argmax_fields[0] is not metadata:
            argmax = (metadata.all_greedy and metadata.max_num_logprobs is None and not metadata.logprob_token_ids
                      and metadata.allowed_token_ids_mask is None and not metadata.bad_words_token_ids
                      and metadata.no_penalties and not vllm_envs.VLLM_COMPUTE_NANS_IN_LOGITS)
            self._argmax_fields = (metadata, argmax)
        holder = metadata.thinking_budget_state_holder
        return (self._argmax_fields[1] and (holder is None or not holder.has_tracked_requests())
                and all(_holds_no_request(processor) for processor in metadata.logitsprocs.non_argmax_invariant)
                and not self._step_has_grammar)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: Any) -> tuple[Any, ...]:
        """vLLM's inputs, the positions whose logits are sampled padded to a bucket (padded_token_count) by
        repeating the last: the logits' programs outside the model's graph (the rows' gather, the lm head)
        then compile once per bucket, not once per request count; the padded rows are dropped before sampling."""
        logits_indices, spec_decode_metadata, *rest = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        rows = logits_indices.shape[0]
        padding = padded_token_count(rows) - rows
        self._sampled_rows = None
        plain = spec_decode_metadata is None and not self.cache_config.kv_sharing_fast_prefill
        if plain and padding:
            self._sampled_rows = rows
            logits_indices = torch.cat([logits_indices, logits_indices[-1:].expand(padding)])
        hidden_states_read = (self.speculative_config is not None or self.num_prompt_logprobs
                              or self.is_pooling_model or self.use_aux_hidden_state_outputs)
        one_rank = self.parallel_config.tensor_parallel_size == 1 and self.parallel_config.pipeline_parallel_size == 1
        self._step_logits_indices = logits_indices if plain and one_rank and not hidden_states_read else None
        self._step_has_grammar = bool(getattr(scheduler_output, "has_structured_output_requests", True))
        return (logits_indices, spec_decode_metadata, *rest)


def _step_attention_metadata() -> PjrtAttentionMetadata | None:
    """This step's pjrt attention metadata (any layer's: they share it), or None."""
    return next((m for m in (get_forward_context().attn_metadata or {}).values()
                 if isinstance(m, PjrtAttentionMetadata)), None)


def _shipped_with_attention(input_ids: torch.Tensor | None, positions: torch.Tensor | None,
                            meta: PjrtAttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's token ids and positions already on the device in its attention metadata `meta`, when what it
    shipped equals them (None otherwise: multimodal positions, ids changed after the build, no metadata)."""
    if input_ids is None or positions is None or positions.dim() != 1:
        return None
    tokens = input_ids.shape[0]
    if meta is None or meta.num_actual_tokens != padded_token_count(tokens):
        return None
    if not (_same_values(meta.token_ids_host[:tokens], input_ids.numpy())
            and _same_values(meta.positions_host[:tokens], positions.numpy())):
        return None
    return meta.token_ids, meta.positions


def _same_values(shipped: np.ndarray, given: np.ndarray) -> bool:
    """Whether a 1-D host array the attention metadata shipped holds `given`'s values: their bytes compared, `given`
    cast to the shipped dtype where that cast is exact (vLLM's int32 token ids against the shipped int64), ~3-4 us
    for a step's 32 values against np.array_equal's 8-10 (three compares a step)."""
    exact = given.dtype.kind == shipped.dtype.kind == "i" and given.itemsize <= shipped.itemsize
    if not exact or shipped.shape != given.shape:
        return np.array_equal(shipped, given)
    return shipped.tobytes() == given.astype(shipped.dtype, copy=False).tobytes()


class InputsOnDevice:
    """The model as vLLM's dummy run calls it: its token ids and positions on the device first (`to_device`: as
    a step's forward takes them), then run by `forward` inside the run's forward context (where the step's
    attention metadata is); every other attribute the model's."""

    def __init__(self, model: torch.nn.Module, to_device: Any, forward: Any) -> None:
        self.model, self.to_device, self.forward = model, to_device, forward

    def __call__(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        input_ids, positions = self.to_device(input_ids, positions)
        return self.forward(input_ids=input_ids, positions=positions, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "sampled_rows": 0, "token_sources": 0,
                                         "previous_tokens": 0, "inputs_embeds": 0})
class StepProgram(torch.nn.Module):
    """A greedy decoding step as one program on vLLM's compile path (as vLLM's TPU runner compiles its step):
    the model's forward, the sampled rows' gather, the lm head and their argmax, traced once by vLLM's Dynamo
    wrapper (guards dropped; the model's own compiled wrapper is inlined) and compiled by the pjrt backend per
    (token, context, sampled rows) bucket. It returns the hidden states (for what vLLM reads of them), the
    sampled rows' logits (for vLLM's sampler) and their greedy tokens: one launch and one wait a step, the
    runner bringing back only what the batch's sampling needs. Under vLLM's async scheduling it first takes
    the ids of the rows `token_sources` names from `previous_tokens` (the previous step's, still on the device)
    in the same program, not in a fused program of its own before it."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", model: torch.nn.Module, compute_logits: Any) -> None:
        super().__init__()
        self.model, self.compute_logits = model, compute_logits

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, sampled_rows: torch.Tensor,
                token_sources: torch.Tensor | None = None, previous_tokens: torch.Tensor | None = None,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if token_sources is not None and previous_tokens is not None and input_ids is not None:
            # async scheduling: the rows continuing a request take the previous step's token, still on the device
            taken = previous_tokens.to(input_ids.dtype)[token_sources.clamp(min=0)]
            input_ids = torch.where(token_sources >= 0, taken, input_ids)
        hidden_states = self.model(input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                                   inputs_embeds=inputs_embeds, **model_kwargs)
        logits = self.compute_logits(hidden_states[sampled_rows])
        return hidden_states, logits, logits.argmax(-1).to(torch.int32)

    def compiled_forward(self) -> Callable[..., Any] | None:
        """This module's Dynamo-compiled forward as a method of its own, once vLLM's wrapper has traced it; None
        before, or where vLLM keeps no such code (VLLM_USE_BYTECODE_HOOK=0).

        It is the code vLLM's wrapper runs every step after its one trace (guards dropped), which it reaches
        through its dispatch (the compile checks, a swap of forward's code object in and out) and, here,
        Dynamo's config patch that let it trace our frame: ~85 of the ~400 us of engine-thread CPU a call
        took at 32 requests. The forward context (attention metadata, KV cache) is the runner's, set around
        the call, as vLLM's wrapper leaves it. It reads its globals without Dynamo's `disable` wrappers (see
        _undisabled_globals)."""
        code = getattr(self, "_compiled_bytecode", None)
        if code is None:
            return None
        forward = type(self).forward
        # Dynamo's code keeps the original's arguments, cells and free variables: it runs as the function would
        compiled = types.FunctionType(code, _undisabled_globals(code, forward.__globals__), forward.__name__,
                                      forward.__defaults__, forward.__closure__)
        compiled.__kwdefaults__ = forward.__kwdefaults__
        return types.MethodType(compiled, self)


def _undisabled_globals(code: types.CodeType, module_globals: dict[str, Any]) -> dict[str, Any]:
    """The globals Dynamo's `code` runs with, its `disable`-wrapped ones unwrapped: the graph's call and the
    helpers it calls before it (call_size, call_storage_offset, the stream's and profiler's) reset Dynamo's
    frame evaluation around each call, for when they run inside a Dynamo frame. Called directly, as the step
    is, none is on: the 14 wrappers a step cost ~20 of ~125 us a call (32 requests, warm, in process)."""
    found = dict(module_globals)
    for name in code.co_names:
        value = found.get(name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("torch._dynamo"):
            # Dynamo's helper modules, imported into the code's globals: only the names the code reads
            found[name] = types.SimpleNamespace(**{
                read: _torch_private.dynamo_undisabled(getattr(value, read)) for read in code.co_names
                if hasattr(value, read)})
        elif callable(value):
            found[name] = _torch_private.dynamo_undisabled(value)
    return found


@dataclasses.dataclass
class SampledInProgram:
    """A step's sampling done in the program after the forward: the sampled rows' logits (on the host where
    vLLM samples there), or, when vLLM's sampler would only take their argmax, the greedy tokens on the host."""

    logits: torch.Tensor | None
    tokens: torch.Tensor | None
    padded_tokens: torch.Tensor | None = None
    """Under async scheduling, the greedy tokens on the device with the bucket's padding rows (`tokens` is a
    view of their first rows): the next step takes its carried ids from these, one program per bucket."""


class TokensCopiedLater(AsyncModelRunnerOutput):
    """A step's output handed back before its sampled tokens reach the host (vLLM's async scheduling): the
    engine schedules the next step while the device runs this one. It stands in for vLLM's CUDA-stream
    version (same arguments); the tokens are read when the engine, or a logits processor reading earlier
    output ids (through `async_copy_ready_event`), first asks for them."""

    def __init__(self, model_runner_output: ModelRunnerOutput, sampled_token_ids: torch.Tensor,
                 logprobs_tensors: Any, invalid_req_indices: list[int], async_output_copy_stream: Any = None,
                 vocab_size: int = 0, check_ep_fault: bool = False, num_nans: torch.Tensor | None = None, *,
                 padded: tuple[torch.Tensor, torch.Tensor] | None = None, host_tensor_kept: bool = True) -> None:
        if check_ep_fault:
            raise NotImplementedError("expert-parallel fault checks are not supported on pjrt")
        self._output, self._invalid_req_indices, self._vocab_size = model_runner_output, invalid_req_indices, vocab_size
        self._sampled_token_ids: torch.Tensor | None = sampled_token_ids
        # (the greedy program's padded tokens, the view of their first rows it issued): the runner's
        # _padded_device_tokens
        self._padded = padded
        self._logprobs_tensors, self._num_nans = logprobs_tensors, num_nans
        self._host_tokens: np.ndarray | None = None
        self._copied = False
        # vLLM's input batch keeps it for logits processors that read earlier output ids (filled by synchronize);
        # where none reads them (`host_tensor_kept` False: the batch keeps None) it is made only if synchronize is
        # called (a torch.empty a step, 12-19 us in the run, spared)
        self._host_tensor_shape = (sampled_token_ids.shape, sampled_token_ids.dtype)
        self.sampled_token_ids_cpu: torch.Tensor | None = self._host_tensor() if host_tensor_kept else None
        self.async_copy_ready_event = self

    def _tokens_on_host(self) -> np.ndarray:
        """The step's tokens as a host array, read once (waiting for the step's programs): where they are the
        first rows of the greedy program's padded tokens, those are read whole and cut on the host (reading the
        rows' view itself runs a program first). No host tensor is made: the engine takes them as lists."""
        if self._host_tokens is None:
            tokens, self._sampled_token_ids = self._sampled_token_ids, None
            assert tokens is not None
            padded, self._padded = self._padded, None
            if padded is not None and padded[1] is tokens:
                self._host_tokens = dispatch.read_to_host(padded[0])[: tokens.shape[0]].reshape(tokens.shape)
            elif tokens.device.type == "cpu":  # sampled on the host (vLLM's sampler, where the logits came back)
                self._host_tokens = tokens.numpy().copy()  # (vLLM may reuse its buffer)
            else:
                self._host_tokens = dispatch.read_to_host(tokens)
        return self._host_tokens

    def _host_tensor(self) -> torch.Tensor:
        shape, dtype = self._host_tensor_shape
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Waits for the step's programs and copies its tokens into `sampled_token_ids_cpu` (once)."""
        if not self._copied:
            if self.sampled_token_ids_cpu is None:
                self.sampled_token_ids_cpu = self._host_tensor()
            self.sampled_token_ids_cpu.numpy()[...] = self._tokens_on_host()
            self._copied = True

    def get_output(self) -> ModelRunnerOutput:
        tokens = self._tokens_on_host()
        logprobs = self._logprobs_tensors.to_cpu_nonblocking() if self._logprobs_tensors is not None else None
        if tokens.shape[-1] == 1:
            valid = tokens.tolist()
            for index in self._invalid_req_indices:
                valid[index].clear()
            logprobs_lists = logprobs.tolists() if logprobs is not None else None
        else:
            self.synchronize()
            valid, logprobs_lists = RejectionSampler.parse_output(
                self.sampled_token_ids_cpu, self._vocab_size, self._invalid_req_indices, logprobs_tensors=logprobs)
        output = self._output
        output.sampled_token_ids, output.logprobs = valid, logprobs_lists
        if self._num_nans is not None:
            output.num_nans_in_logits = gpu_model_runner.nans_to_dict(self._num_nans.tolist(), output.req_id_to_index)
        return output


def _holds_no_request(processor: Any) -> bool:
    """vLLM's min-tokens and logit-bias processors change no logits while they hold no request; any other
    processor may."""
    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    return False


def samples_on_device(device: torch.device) -> bool:
    """Where TORCH_PJRT_VLLM_SAMPLING puts vLLM's sampler; `auto` keeps it on the host on jaxlib's CPU client.

    There the device is the host's own cores, and XLA's CPU sort (top-k, top-p) and argmax are slower than
    torch's: bench/sampling.py, 16 requests x 32000 tokens, top-k/top-p 184 ms fused on the device against
    36 ms on the host, greedy 1.93 against 1.10 ms.
    """
    place = envvars.value("TORCH_PJRT_VLLM_SAMPLING").strip().lower() or "auto"
    if place not in ("auto", "device", "host"):
        raise ValueError(f"TORCH_PJRT_VLLM_SAMPLING={place!r} is not one of auto, device, host; set one of those")
    if place == "auto":
        return torch.pjrt.get_device_properties(device).platform != "cpu"
    return place == "device"


def layers_cache_dtype(kv_cache_config: KVCacheConfig) -> torch.dtype | None:
    """The one dtype all layers view the KV cache as; None if they differ or a layer keeps vLLM's raw bytes."""
    dtypes = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for layer_spec in spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else (spec,):
            dtype = getattr(layer_spec, "dtype", None)
            if not layer_spec.has_layer_views or dtype is None:
                return None
            dtypes.add(dtype)
    return dtypes.pop() if len(dtypes) == 1 else None


class BackingInLayersDtype(TorchFunctionMode):
    """Makes vLLM's int8 KV cache backing buffer an int8 view of a buffer of the layers' dtype.

    vLLM's `allocate_kv_cache` allocates one `torch.zeros(size, dtype=torch.int8)` and views each layer's
    part of it as the cache dtype. Made here instead of that int8 buffer, the layers' views are views of
    one buffer of their own dtype, allocated once: a kernel that takes the whole buffer
    (kernels.paged_attention) gets it as it is, where a reinterpreted int8 buffer could make XLA copy every
    layer's cache before the kernel's custom call. With layers of several dtypes vLLM's buffer is left as
    it is (reads and writes through its views run in place).
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        super().__init__()
        sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
        self.nbytes = sizes.pop() if len(sizes) == 1 else None
        dtype = layers_cache_dtype(kv_cache_config)
        whole_elements = dtype is not None and self.nbytes is not None and self.nbytes % dtype.itemsize == 0
        self.dtype = dtype if whole_elements else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        asked = func is torch.zeros and kwargs.get("dtype") is torch.int8 and tuple(args) == (self.nbytes,)
        if asked and self.dtype is not None:
            buffer = torch.zeros(self.nbytes // self.dtype.itemsize, dtype=self.dtype, device=kwargs.get("device"))
            return buffer.view(torch.int8)
        return func(*args, **kwargs)


class PjrtWorker(CPUWorker):
    """vLLM's CPU worker lifecycle (warm-up, no sleep mode) around a pjrt device and a pjrt model runner.

    The CPU worker's own start (binding host memory nodes) does not apply. The KV cache is sized as vLLM's
    CPU platform sizes it on jaxlib's CPU client, whose device memory is the host's, and from the device
    memory PJRT reports on other platforms.
    """

    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        Worker.__init__(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)

    def init_device(self) -> None:
        self.device = torch.device("pjrt", self.local_rank)
        torch.pjrt.set_device(self.device)
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, current_platform.dist_backend
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = PjrtModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self) -> Any:
        """The compile path's trace at start-up, on the bound KV cache: vLLM's CPU worker runs it from
        determine_available_memory, which this worker overrides, so without this Dynamo traced the graph at
        the first request (on a server: one short prompt, its trace paid by that request)."""
        if self.model_runner.kv_caches:
            self.model_runner.warming_up_model()
        return super().compile_or_warm_up_model()

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        """No sleep-mode memory pool on pjrt: weights and caches come from the device's own allocator."""
        return contextlib.nullcontext()

    def determine_available_memory(self) -> int:
        """The KV cache's bytes: on jaxlib's CPU client as vLLM's CPU platform sizes it, elsewhere from the
        device's memory as PJRT reports it."""
        if torch.pjrt.get_device_properties(self.device).platform == "cpu":
            return self._kv_cache_bytes_in_host_memory()
        return self._kv_cache_bytes_in_device_memory()

    def _kv_cache_bytes_in_host_memory(self) -> int:
        """vLLM CPU's sizing: VLLM_CPU_KVCACHE_SPACE GiB when set (it overrides `kv_cache_memory_bytes`, as on
        vLLM's CPU platform), else `kv_cache_memory_bytes`, else `gpu_memory_utilization` of the host's memory
        node less what this process holds (its resident memory: the weights are in it)."""
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
        explicit = int(space) * GiB_bytes if space else self.cache_config.kv_cache_memory_bytes
        node = get_allowed_cpu_list()[0].numa_node
        memory = get_memory_node_info(node)
        where = f"memory node {node} ({format_gib(memory.available_memory)}/{format_gib(memory.total_memory)} GiB"
        if explicit is not None:
            if explicit > memory.available_memory:
                raise ValueError(
                    f"The KV cache asked for ({format_gib(explicit)} GiB) is more than is available on {where}); "
                    "decrease kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE, or free host memory."
                )
            return explicit
        requested = math.ceil(memory.total_memory * self.cache_config.gpu_memory_utilization)
        held = psutil.Process(os.getpid()).memory_info().rss
        budget = requested - held
        share = (f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} of {where}) less the "
                 f"{format_gib(held)} GiB this process holds leaves {format_gib(budget)} GiB for the KV cache")
        if budget <= 0:
            raise ValueError(f"{share}; raise gpu_memory_utilization, or set VLLM_CPU_KVCACHE_SPACE or "
                             "kv_cache_memory_bytes.")
        if budget > memory.available_memory:
            raise ValueError(f"{share}, more than is available; lower gpu_memory_utilization, or set "
                             "VLLM_CPU_KVCACHE_SPACE or kv_cache_memory_bytes.")
        logger.info("KV cache in host memory: %s GiB (%s of node %d's %s GiB, less %s GiB held)", format_gib(budget),
                    self.cache_config.gpu_memory_utilization, node, format_gib(memory.total_memory), format_gib(held))
        return budget

    def _kv_cache_bytes_in_device_memory(self) -> int:
        """`kv_cache_memory_bytes` when given, else `gpu_memory_utilization` of the device's memory less the
        bytes pjrt tensors hold (the weights)."""
        free, total = torch.pjrt.mem_get_info(self.device)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            if explicit > free:
                raise ValueError(
                    f"The KV cache asked for ({format_gib(explicit)} GiB) is more than pjrt device {self.device} has "
                    f"free ({format_gib(free)}/{format_gib(total)} GiB); decrease kv_cache_memory_bytes."
                )
            return explicit
        held = torch.pjrt.memory_allocated(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - held
        share = (f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} of pjrt device {self.device} "
                 f"({format_gib(free)}/{format_gib(total)} GiB free) less the {format_gib(held)} GiB pjrt tensors "
                 f"hold leaves {format_gib(budget)} GiB for the KV cache")
        if budget <= 0:
            raise ValueError(f"{share}; raise gpu_memory_utilization or set kv_cache_memory_bytes.")
        if budget > free:
            raise ValueError(f"{share}, more than is free; lower gpu_memory_utilization or set kv_cache_memory_bytes.")
        logger.info("KV cache on %s: %s GiB", self.device, format_gib(budget))
        return budget
