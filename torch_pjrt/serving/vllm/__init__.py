"""vLLM on pjrt: the entry points vLLM's plugin loader calls.

`platform_plugin` (group `vllm.platform_plugins`) names the platform class when a pjrt device is
usable; `register` (group `vllm.general_plugins`) runs in every vLLM process and registers the
attention backend. Both import vLLM only when vLLM calls them.
"""

from __future__ import annotations

PLATFORM_CLASS = "torch_pjrt.serving.vllm.platform.PjrtPlatform"
ATTENTION_BACKEND_CLASS = "torch_pjrt.serving.vllm.attention.PjrtAttentionBackend"


def platform_plugin() -> str | None:
    """The platform class path when the pjrt device is registered with PyTorch, else None.

    It does not start the device (jax): vLLM runs this in every process, including the one that then
    starts the engine in a child process, and a started runtime does not survive a fork.
    """
    try:
        import torch

        import torch_pjrt  # noqa: F401  (registers the device when autoload is off)

        return PLATFORM_CLASS if torch._C._get_privateuse1_backend_name() == "pjrt" else None
    except Exception:  # detection must never break vLLM's own platform choice
        return None


def register() -> None:
    """Registers the pjrt attention backend under vLLM's CUSTOM slot, in every vLLM process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND_CLASS)
