"""Third-party libraries that name devices themselves: teach them "pjrt" when they load.

safetensors' Rust core only accepts the device names it knows, so `load_file(path,
device="pjrt")` is wrapped to load on CPU and move each tensor (one transfer per tensor).

Hugging Face `generate()` on pjrt marks the prompt's length dynamic (input_ids and attention_mask,
dim 1, buckets 64, 128, ... up to the model's max_position_embeddings): prompts of new lengths and
the KV cache growing by one token then reuse the programs of their bucket instead of compiling per
length, with no line of the user's code. The prompt starts in the bucket that also holds the tokens
generate() may add, so a generation never moves to a larger bucket halfway. Marks never change values;
`TORCH_PJRT_DYNAMIC_GENERATE=0` turns this off. generate()'s check whether to stop reads its answer a token late
(as Hugging Face does on mps), so the host records a token while the previous token's program runs.

accelerate (and so `transformers.Trainer`) looks for an accelerator in a fixed list of device
types and trains on the CPU when none is found. `accelerator_device` is the one answer to "is pjrt
the accelerator": where accelerate (or Trainer) would settle on the CPU without being asked to,
it gets pjrt instead, and a launched process group uses the c10d backend "pjrt". Autocast follows
the device type; fp16 gets a GradScaler on pjrt; RNG checkpoints gain the pjrt generator states.
`cpu=True`, `use_cpu=True` and `TORCH_PJRT_ACCELERATE=0` keep the CPU.

PyTorch Lightning gets the accelerator "pjrt" (lightning.py). PyPI's torchvision (a CUDA build) imports
on the CPU torch without its C++ ops (torchvision.py).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from torch_pjrt import envvars
from torch_pjrt.integrations import lightning, torchvision


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
            prompt = inputs if inputs is not None else kwargs.get("input_ids")
            _mark_prompt(self, _longest_sequence(self, prompt, kwargs), prompt, kwargs.get("attention_mask"))
        return original(self, inputs, *args, **kwargs)

    generate._pjrt_aware = True
    mixin.generate = generate
    if hasattr(module, "DeferredStopCheck"):  # (transformers 5.x)
        module.DeferredStopCheck = _stop_check_a_step_late_on_pjrt(module.DeferredStopCheck)


def _stop_check_a_step_late_on_pjrt(hugging_faces: type) -> type:
    """generate()'s stop check, which reads whether every sequence has finished after each token, reads on pjrt
    the previous token's answer instead, so the host records token n+1 while token n's program runs. Hugging
    Face defers it that way on mps (an asynchronous copy to the host and an event); the extra token a late
    stop decodes is undone by its caller, as there. Not where the caller returns the cache (its extra entry)."""

    class DeferredStopCheck(hugging_faces):
        replaced = hugging_faces  # (for bench/generate_tokens.py's row that reads after each token)

        @staticmethod
        def is_supported(device: torch.device, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
            if device.type == "pjrt":
                return not (cache_is_returned or is_assistant)
            return hugging_faces.is_supported(device, cache, cache_is_returned, is_assistant)

        def __new__(cls, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if input_ids.device.type == "pjrt":
                return LateStopCheck(*args, **kwargs)
            return super().__new__(cls)

    return DeferredStopCheck


class LateStopCheck:
    """Whether generate() should stop, answered for the token before the last one (see
    _stop_check_a_step_late_on_pjrt); a streamer gets each token a step late as well."""

    def __init__(self, max_length: int | None, cache: Any, cache_is_returned: bool, streamer: Any = None) -> None:
        self.max_length, self.streamer = max_length, streamer
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stop_reported = False

    def __call__(self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
        from torch_pjrt.eager import fusion

        finished = unfinished_sequences.max() == 0
        fusion.flush("stop check")  # this token's program starts before the host reads the previous token's answer
        previous, self.previous = self.previous, (finished, tokens)
        if previous is not None:
            if self.streamer is not None:
                self.streamer.put(previous[1].cpu())
            self.stop_reported = bool(previous[0])
        return self.stop_reported or (self.max_length is not None and length >= self.max_length)

    def finish(self) -> int:
        """How many decoded tokens the caller undoes: the one decoded after the stop, if the stop came late."""
        if self.streamer is not None and not self.stop_reported and self.previous is not None:
            self.streamer.put(self.previous[1].cpu())
        return 1 if self.stop_reported else 0


GENERATE_SMALLEST_BUCKET = 64


def _longest_sequence(model: Any, prompt: Any, kwargs: dict[str, Any]) -> int:
    """The most tokens generate() may hold: the prompt and max_new_tokens, else max_length (its arguments first,
    then the generation config it was given, then the model's)."""
    length = prompt.shape[-1] if isinstance(prompt, torch.Tensor) and prompt.dim() else 0
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is not None:
        return length + new
    return max(length, kwargs.get("max_length", getattr(config, "max_length", None)) or 0)


def _mark_prompt(model: Any, longest: int, *tensors: Any) -> None:
    from torch_pjrt.eager import dynamic

    bound = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 0
    # Powers of two from 64: a short prompt's padding is cheap, and every prompt under 64 shares a bucket.
    # Buckets too small for the whole generation are left out: crossing into the next one halfway would
    # compile that bucket's programs in the middle of a generation.
    buckets = bound
    if bound > GENERATE_SMALLEST_BUCKET:
        ladder = dynamic.ladder(GENERATE_SMALLEST_BUCKET, bound)
        buckets = tuple(size for size in ladder if size >= longest) or ladder
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "pjrt" and tensor.dim() == 2:
            try:
                dynamic.mark_eager(tensor, 1, buckets)
            except ValueError:
                continue  # a view of another tensor: left exact


def accelerator_device() -> torch.device | None:
    """The pjrt device accelerate should train on, or None where pjrt is not to be the accelerator."""
    _run_deferred_patches()
    if not envvars.flag("TORCH_PJRT_ACCELERATE") or not torch.pjrt.is_available():
        return None
    return torch.device("pjrt", torch.pjrt.current_device())


def _patch_accelerate_state(module: Any) -> None:
    state_class = module.PartialState
    original_default = state_class.default_device
    if getattr(original_default.fget, "_pjrt_aware", False):
        return

    def default_device(self: Any) -> torch.device:
        found = original_default.fget(self)
        pjrt = accelerator_device() if found.type == "cpu" else None
        return found if pjrt is None else pjrt

    default_device._pjrt_aware = True
    state_class.default_device = property(default_device, doc=original_default.__doc__)

    original_prepare = state_class._prepare_backend

    @functools.wraps(original_prepare)
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, distributed_type = original_prepare(self, cpu, sagemaker_dp, backend)
        launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
        if chosen is None and launched and not cpu and accelerator_device() is not None:
            # MULTI_GPU is accelerate's generic "one accelerator per process, DDP" path; set_device below
            # replaces its CUDA device lookup for our backend.
            return backend or "pjrt", module.DistributedType.MULTI_GPU
        return chosen, distributed_type

    state_class._prepare_backend = _prepare_backend

    original_set_device = state_class.set_device

    @functools.wraps(original_set_device)
    def set_device(self: Any) -> None:
        if self.device is None and self.backend == "pjrt":
            self.device = torch.device("pjrt", self.local_process_index % torch.pjrt.device_count())
            torch.pjrt.set_device(self.device)
            return
        original_set_device(self)

    state_class.set_device = set_device


# accelerate's list of the devices fp16 mixed precision may run on: a literal inside
# Accelerator.__init__, read by nothing else, so the code object's constant is the one place to add pjrt.
_FP16_DEVICES = ("xpu", "cuda", "npu", "xla", "mlu", "musa", "hpu", "sdaa", "mps")


def _patch_accelerator(module: Any) -> None:
    """`mixed_precision="fp16"` on pjrt: accepted, with a GradScaler on pjrt instead of a disabled CUDA one."""
    accelerator_class = module.Accelerator
    init_code = accelerator_class.__init__.__code__
    if _FP16_DEVICES in init_code.co_consts:
        constants = tuple((*c, "pjrt") if c == _FP16_DEVICES else c for c in init_code.co_consts)
        accelerator_class.__init__.__code__ = init_code.replace(co_consts=constants)

    original_scaler = module.get_grad_scaler
    if getattr(original_scaler, "_pjrt_aware", False):
        return

    @functools.wraps(original_scaler)
    def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
        # accelerate's last resort is a CUDA scaler, which disables itself (warning) without CUDA: an unscaled fp16 run.
        with warnings.catch_warnings():
            if accelerator_device() is not None:
                warnings.filterwarnings("ignore", "torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
            scaler = original_scaler(distributed_type, **kwargs)
        if (getattr(scaler, "_device", None) == "cuda" and not torch.cuda.is_available()
                and accelerator_device() is not None):
            return torch.amp.GradScaler("pjrt", **kwargs)
        return scaler

    get_grad_scaler._pjrt_aware = True
    module.get_grad_scaler = get_grad_scaler


def _rng_file(folder: Any, process_index: int | None) -> Path:
    name = "pjrt_rng_state.pth" if process_index is None else f"pjrt_rng_state_{process_index}.pth"
    return Path(folder) / name


def _save_rng(folder: Any, process_index: int | None) -> None:
    """Next to the library's own RNG file: the states of every pjrt device's generator."""
    if torch.pjrt.is_initialized():
        os.makedirs(folder, exist_ok=True)
        torch.save(torch.pjrt.get_rng_state_all(), _rng_file(folder, process_index))


def _load_rng(folder: Any, process_index: int | None) -> None:
    path = _rng_file(folder, process_index)
    if path.is_file():
        torch.pjrt.set_rng_state_all(torch.load(path, weights_only=True))


def _patch_accelerate_checkpointing(module: Any) -> None:
    original_save = module.save_accelerator_state
    if getattr(original_save, "_pjrt_aware", False):
        return
    original_load = module.load_accelerator_state
    save_signature = inspect.signature(original_save)
    load_signature = inspect.signature(original_load)

    @functools.wraps(original_save)
    def save_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        output_dir = original_save(*args, **kwargs)
        _save_rng(output_dir, save_signature.bind(*args, **kwargs).arguments["process_index"])
        return output_dir

    @functools.wraps(original_load)
    def load_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        overrides = original_load(*args, **kwargs)
        bound = load_signature.bind(*args, **kwargs).arguments
        _load_rng(bound["input_dir"], bound["process_index"])
        return overrides

    save_accelerator_state._pjrt_aware = True
    # accelerate.accelerator imports both by name: if it is already loaded, it holds the originals.
    for holder in (module, sys.modules.get("accelerate.accelerator")):
        if holder is not None:
            holder.save_accelerator_state = save_accelerator_state
            holder.load_accelerator_state = load_accelerator_state


def _patch_training_args(module: Any) -> None:
    arguments = module.TrainingArguments
    original = arguments.__dict__["_setup_devices"].func
    if getattr(original, "_pjrt_aware", False):
        return
    original_bf16_check = module.is_torch_bf16_gpu_available

    def is_torch_bf16_gpu_available() -> bool:
        """`bf16=True` is refused unless an accelerator supports it; pjrt autocasts to bfloat16 on every platform."""
        return original_bf16_check() or accelerator_device() is not None

    module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available

    @functools.wraps(original)
    def _setup_devices(self: Any) -> torch.device:
        # Trainer asks accelerate's PartialState, then, for a single process, its own fixed list again.
        found = original(self)
        state = getattr(self, "distributed_state", None)
        state_device = getattr(state, "device", None)
        if found.type == "cpu" and not self.use_cpu and state_device is not None and state_device.type == "pjrt":
            torch.pjrt.set_device(state_device)
            return state_device
        return found

    _setup_devices._pjrt_aware = True
    cached = functools.cached_property(_setup_devices)
    cached.__set_name__(arguments, "_setup_devices")
    arguments._setup_devices = cached


def _patch_trainer(module: Any) -> None:
    trainer = module.Trainer
    original_save = trainer._save_rng_state
    if getattr(original_save, "_pjrt_aware", False):
        return
    original_load = trainer._load_rng_state

    def process_index(self: Any) -> int | None:
        return self.args.process_index if self.args.world_size > 1 else None

    @functools.wraps(original_save)
    def _save_rng_state(self: Any, output_dir: str) -> None:
        original_save(self, output_dir)
        _save_rng(output_dir, process_index(self))

    @functools.wraps(original_load)
    def _load_rng_state(self: Any, checkpoint: str | None) -> None:
        original_load(self, checkpoint)
        if checkpoint is not None:
            _load_rng(checkpoint, process_index(self))

    _save_rng_state._pjrt_aware = True
    trainer._save_rng_state = _save_rng_state
    trainer._load_rng_state = _load_rng_state


PATCHES = {
    "safetensors.torch": _patch_safetensors,
    "transformers.generation.utils": _patch_generate,
    "accelerate.state": _patch_accelerate_state,
    "accelerate.accelerator": _patch_accelerator,
    "accelerate.checkpointing": _patch_accelerate_checkpointing,
    "transformers.training_args": _patch_training_args,
    "transformers.trainer": _patch_trainer,
    "pytorch_lightning.accelerators": lightning.register_accelerator,
    "pytorch_lightning.trainer.connectors.accelerator_connector": lightning.patch_connector,
    "pytorch_lightning.strategies.ddp": lightning.patch_ddp,
    "torchvision.extension": torchvision.define_missing_ops,
}


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
        if _deferred:
            _run_deferred_patches()
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


# Modules that were still being imported when install() ran (`import accelerate` imports torch, and
# so registers the device, halfway through accelerate.accelerator): patched once they are complete,
# at the next import anywhere or the first accelerate device query, whichever comes first.
_deferred: list[str] = []


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _run_deferred_patches() -> None:
    for name in list(_deferred):
        if not _initializing(sys.modules[name]):
            _deferred.remove(name)
            PATCHES[name](sys.modules[name])


def install() -> None:
    """Patch already-imported libraries now and the others as they are imported (cheap)."""
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        if _initializing(module):
            _deferred.append(name)
        else:
            patch(module)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
