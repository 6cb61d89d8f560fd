"""The vLLM `Platform` for pjrt devices: what vLLM asks a device about, answered from torch.pjrt.

vLLM's own CPU platform is not the base class: vLLM branches on `is_cpu()` to call its C++ CPU
kernels, which cannot take pjrt tensors. As an out-of-tree platform (`PlatformEnum.OOT`), vLLM's
custom layers run their torch-op forward (`forward_oot`, i.e. `forward_native`) on the device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from torch_pjrt import envvars
from torch_pjrt.serving import vllm as plugin

logger = init_logger(__name__)

WORKER_CLASS = "torch_pjrt.serving.vllm.worker.PjrtWorker"
COMPILER_CLASS = "torch_pjrt.serving.vllm.compiler.PjrtCompiler"
DEFAULT_BLOCK_SIZE = 16
# vLLM's mixture-of-experts custom ops (the layer's routing and experts, PjrtFusedMoEMethod on pjrt)
EAGER_SPLITTING_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
# what vLLM adds to its default splitting ops (its attention ops) without Inductor's graph partition
VLLM_DEFAULT_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")


class PjrtPlatform(Platform):
    """A pjrt device (whichever PJRT platform torch_pjrt runs on) as seen by vLLM."""

    _enum = PlatformEnum.OOT
    device_name: str = "pjrt"
    device_type: str = "pjrt"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = "pjrt"
    ray_device_key: str = ""
    device_control_env_var: str = "TORCH_PJRT_VISIBLE_DEVICES"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.pjrt.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.pjrt.mem_get_info(device_id)[1]

    @classmethod
    def get_current_memory_usage(cls, device: Any = None) -> float:
        return float(torch.pjrt.memory_allocated(device))

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.pjrt.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.pjrt.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls) -> Any:
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True  # torch_pjrt's native hooks give PyTorch a pinned host allocator

    @classmethod
    def import_kernels(cls) -> None:
        """vLLM's host-side helpers (the CPU runner's) use its CPU kernel library: load the build for this CPU."""
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """The step's bookkeeping runs on the host, as on vLLM's CPU platform: use its C++ stand-ins for Triton."""
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.register_triton_kernel_overrides()

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        """Each attention layer gets its own cache tensor here, so layers sharing an index are fine."""

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("MLA and sparse attention are not supported on pjrt yet")
        if selected_backend is not None and selected_backend.name != "CUSTOM":
            logger.info("Attention backend %s is not available on pjrt; using the pjrt backend.", selected_backend.name)
        return plugin.ATTENTION_BACKEND_CLASS

    @classmethod
    def opaque_attention_op(cls) -> bool:
        """Attention is not an opaque op: vLLM calls it directly, and its compile path traces it into the
        model's graph (one program a step) instead of splitting the graph there."""
        return False

    @classmethod
    def get_compile_backend(cls) -> str:
        """The compiler vLLM's compile path hands the model's graph pieces to."""
        return COMPILER_CLASS

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """One process per device; the model compiled piecewise by the pjrt backend, or eager with enforce_eager."""
        from vllm.config import CompilationMode, CUDAGraphMode

        if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            # jax's runtime threads do not survive fork: engine and worker processes must be spawned.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        scheduler_config = vllm_config.scheduler_config
        scheduler_config.async_scheduling = _async_scheduling(vllm_config)
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLASS
        parallel_config.disable_custom_all_reduce = True
        compilation_config = vllm_config.compilation_config
        compilation_config.cudagraph_capture_sizes = []
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        model_config = vllm_config.model_config
        if model_config is not None and model_config.enforce_eager:
            compilation_config.mode = CompilationMode.NONE
        elif compilation_config.mode not in (CompilationMode.NONE, CompilationMode.VLLM_COMPILE):
            logger.warning("pjrt compiles with vLLM's piecewise compile path (mode VLLM_COMPILE), not mode %s.",
                           compilation_config.mode.name)
            compilation_config.mode = CompilationMode.VLLM_COMPILE
        if compilation_config.mode == CompilationMode.VLLM_COMPILE:
            # any name but "inductor" or "eager" makes vLLM ask get_compile_backend() for its compiler
            compilation_config.backend = "pjrt"
            # vLLM's AOT compile stores the compiled model as Inductor artifacts, which pjrt's pieces are not
            # (their programs go to torch_pjrt's own persistent cache); set by hand, it is left alone.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            if compilation_config.compile_sizes is None:
                compilation_config.compile_sizes = []  # one piece per range of token counts, none per size
            _split_at_eager_ops(compilation_config)
            _no_fusion_passes(compilation_config.pass_config)


def _async_scheduling(vllm_config: Any) -> bool:
    """Whether vLLM's async scheduling stays on: where vLLM turned it on (its default, unless the user or a
    feature ruled it out) and TORCH_PJRT_VLLM_ASYNC_SCHEDULING is not 0, except with speculative decoding,
    whose draft tokens the pjrt runner does not carry on the device. Turned off for that, it warns only when
    the variable asked for async scheduling explicitly; else the log says so at info level."""
    if not vllm_config.scheduler_config.async_scheduling or not envvars.flag("TORCH_PJRT_VLLM_ASYNC_SCHEDULING"):
        return False
    if vllm_config.speculative_config is None:
        return True
    reason = ("vLLM's async scheduling is off with speculative decoding on pjrt: the pjrt runner carries no draft "
              "tokens on the device, so steps are scheduled synchronously.")
    if os.environ.get("TORCH_PJRT_VLLM_ASYNC_SCHEDULING"):  # set, and not empty (empty reads as the default)
        logger.warning("TORCH_PJRT_VLLM_ASYNC_SCHEDULING=%s is not honoured: %s",
                       os.environ["TORCH_PJRT_VLLM_ASYNC_SCHEDULING"], reason)
    else:
        logger.info(reason)
    return False


def _split_at_eager_ops(compilation_config: Any) -> None:
    """Graphs split at vLLM's MoE ops, which run eagerly between the compiled pieces (the pjrt backend cannot
    run vLLM's Python custom ops inside an XLA program), and at vLLM's default splitting ops, its attention
    ops, which do not occur here: attention is called directly and traced (opaque_attention_op)."""
    if compilation_config.splitting_ops is None:  # vLLM fills in its default after this hook: the same here
        compilation_config.splitting_ops = [*compilation_config._attention_ops, *VLLM_DEFAULT_CACHE_UPDATE_OPS]
    for op in EAGER_SPLITTING_OPS:
        if op not in compilation_config.splitting_ops:
            compilation_config.splitting_ops.append(op)


def _no_fusion_passes(pass_config: Any) -> None:
    """vLLM's graph fusion passes rewrite to CUDA and ROCm kernels; XLA fuses the pieces itself."""
    for field in dataclasses.fields(pass_config):
        switch = getattr(pass_config, field.name)
        if field.name.startswith(("fuse_", "enable_")) and (switch is None or isinstance(switch, bool)):
            setattr(pass_config, field.name, False)
