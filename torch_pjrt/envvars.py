"""Every environment variable torch_pjrt reads, registered once with its default and meaning.

Readers ask this module (`flag`, `value`), so the table below is the whole list; the README's
table of variables names each of them (tests/test_device.py checks it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple


class Variable(NamedTuple):
    default: str
    meaning: str


VARIABLES: dict[str, Variable] = {
    "TORCH_PJRT_PLATFORM": Variable("", "which PJRT platform: cpu, cuda or tpu (default: the best one jaxlib finds)"),
    "TORCH_PJRT_CPU_DEVICES": Variable("", "N CPU devices (pjrt:0..N-1) on the CPU platform"),
    "TORCH_PJRT_EAGER_MODE": Variable("", "defer_never (default), defer_never_and_launch_blocking, defer_and_fuse"),
    "TORCH_PJRT_LAUNCH_BLOCKING": Variable("0", "1: wait for every op"),
    "TORCH_PJRT_CPU_FALLBACK": Variable("0", "1: run ops with no lowering on CPU instead of raising"),
    "TORCH_PJRT_CACHE_DIR": Variable("", "persistent cache folder (default ~/.cache/torch_pjrt; 0 disables)"),
    "TORCH_PJRT_FUSE_MAX_NODES": Variable("1000", "ops recorded before fused mode flushes on its own"),
    "TORCH_PJRT_DEBUG_RECOMPILE": Variable("0", "1: print why a fused program recompiled, and every op that "
                                                "ran at true sizes on dynamic tensors"),
    "TORCH_PJRT_RECOMPILE_BUDGET": Variable("8", "compiles of one torch.compile graph for distinct shapes before "
                                                 "the warning"),
    "TORCH_PJRT_NATIVE_DISPATCH": Variable("1", "0: every eager op runs its Python kernel (no native cache hits; "
                                                "for debugging and bisecting)"),
    "TORCH_PJRT_NATIVE_GRAPH_CALL": Variable("1", "0: every torch.compile graph call runs its Python path (no native "
                                                  "replay; for debugging and bisecting)"),
    "TORCH_PJRT_DYNAMIC_GENERATE": Variable("1", "0: Hugging Face generate() on pjrt leaves the prompt length "
                                                 "unmarked (it is marked dynamic by default)"),
    "TORCH_PJRT_DEVICE_CHECKS": Variable("1", "0: no device-side checks of indices and values (XLA clamps out-of-range "
                                              "indices silently, as other XLA bridges do)"),
    "TORCH_PJRT_ACCELERATE": Variable("1", "0: accelerate and transformers' Trainer keep the CPU where they find no "
                                           "other accelerator (pjrt is picked by default)"),
    "TORCH_PJRT_PROFILE_JAX_DIR": Variable("", "a folder: a torch profiler window that records pjrt also runs jax's "
                                               "profiler into it (TensorBoard/XProf), named in the Chrome trace"),
    "TORCH_PJRT_FLASH_ATTENTION": Variable("0", "1: scaled_dot_product_attention on pjrt tensors runs the Pallas flash "
                                                "attention kernel where it applies (no mask, no dropout)"),
    "TORCH_PJRT_PAGED_ATTENTION": Variable("0", "1: the vLLM plugin's attention reads the paged KV cache with the "
                                                "Pallas paged-attention kernel instead of gathering it with torch ops"),
    "TORCH_PJRT_DISTRIBUTED": Variable("auto", "the c10d backend pjrt's engine: auto (jax's multi-process runtime, "
                                               "collectives inside XLA programs, where torchrun launched the process; "
                                               "else gloo over host copies), xla, or host"),
    "TORCH_PJRT_COORDINATOR": Variable("", "host:port of jax's distributed runtime coordinator (default MASTER_ADDR "
                                           "and MASTER_PORT + 1)"),
    "TORCH_PJRT_VLLM_SAMPLING": Variable("auto", "where the vLLM plugin runs vLLM's sampler: device, host, or auto "
                                                 "(host on jaxlib's CPU client, whose sorts and argmax are slower than "
                                                 "torch's on the same cores; the device elsewhere)"),
    "TORCH_PJRT_VLLM_ASYNC_SCHEDULING": Variable("1", "0: the vLLM plugin turns vLLM's async scheduling off (by "
                                                      "default it keeps it where vLLM does, as on GPUs: the engine "
                                                      "schedules step N+1 while the device runs step N; "
                                                      "speculative decoding turns it off)"),
}


def value(name: str) -> str:
    """The variable's value, or its registered default where it is unset or empty (as `VAR= cmd` leaves it)."""
    return os.environ.get(name) or VARIABLES[name].default


def flag(name: str) -> bool:
    """A variable read as on/off: unset or empty means its default, "0" means off."""
    return value(name).strip() not in ("", "0")


class Switch:
    """An on/off setting: the innermost `scoped` block of the calling thread, else its variable."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._local = threading.local()

    def enabled(self) -> bool:
        forced = getattr(self._local, "enabled", None)
        return flag(self.name) if forced is None else forced

    @contextlib.contextmanager
    def scoped(self, enabled: bool) -> Iterator[None]:
        previous = getattr(self._local, "enabled", None)
        self._local.enabled = enabled
        try:
            yield
        finally:
            self._local.enabled = previous
