"""Third-party libraries that name devices themselves: teach them "pjrt" when they load.

safetensors' Rust core only accepts the device names it knows, so `load_file(path,
device="pjrt")` is wrapped to load on CPU and move each tensor (one transfer per tensor).

Hugging Face `generate()` on pjrt marks the prompt's length dynamic (input_ids and attention_mask,
dim 1, buckets 64, 128, ... up to the model's max_position_embeddings): prompts of new lengths and
the KV cache growing by one token then reuse the programs of their bucket instead of compiling per
length, with no line of the user's code. Marks never change values; `TORCH_PJRT_DYNAMIC_GENERATE=0` turns this off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

import torch

from torch_pjrt import envvars


def _is_pjrt(device: Any) -> bool:
    try:
        return torch.device(device).type == "pjrt"
    except (RuntimeError, TypeError):
        return False


def _patch_safetensors(module: Any) -> None:
    original = module.load_file
    if getattr(original, "_pjrt_aware", False):
        return

    @functools.wraps(original)
    def load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> dict[str, torch.Tensor]:
        if not _is_pjrt(device):
            return original(filename, device=device, **kwargs)
        return {name: tensor.to(device) for name, tensor in original(filename, device="cpu", **kwargs).items()}

    load_file._pjrt_aware = True
    module.load_file = load_file


def _patch_generate(module: Any) -> None:
    mixin = module.GenerationMixin
    original = mixin.generate
    if getattr(original, "_pjrt_aware", False):
        return

    @functools.wraps(original)
    def generate(self: Any, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        if envvars.flag("TORCH_PJRT_DYNAMIC_GENERATE"):
            _mark_prompt(self, inputs if inputs is not None else kwargs.get("input_ids"), kwargs.get("attention_mask"))
        return original(self, inputs, *args, **kwargs)

    generate._pjrt_aware = True
    mixin.generate = generate


GENERATE_SMALLEST_BUCKET = 64


def _mark_prompt(model: Any, *tensors: Any) -> None:
    from torch_pjrt.eager import dynamic

    bound = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 0
    # Powers of two from 64: a short prompt's padding is cheap, and every prompt under 64 shares a bucket.
    buckets = dynamic.ladder(GENERATE_SMALLEST_BUCKET, bound) if bound > GENERATE_SMALLEST_BUCKET else bound
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "pjrt" and tensor.dim() == 2:
            try:
                dynamic.mark_eager(tensor, 1, buckets)
            except ValueError:
                continue  # a view of another tensor: left exact


PATCHES = {"safetensors.torch": _patch_safetensors, "transformers.generation.utils": _patch_generate}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Any) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
                return spec
        return None


def install() -> None:
    """Patch already-imported libraries now and the others as they are imported (cheap)."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
