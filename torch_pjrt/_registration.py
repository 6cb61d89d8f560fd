"""Registering the pjrt device with PyTorch.

`register()` is cheap and runs at `import torch` (autoload): it names the device, installs
`torch.pjrt` and a catch-all PrivateUse1 kernel. The first op on a pjrt tensor reaches
that catch-all, which calls `initialize()` (jax, every kernel) and re-runs the op.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import torch

from torch_pjrt import _torch_private, envvars
from torch_pjrt.runtime import disk_store, startup

NAME = startup.NAME
# Device queues the autograd engine is told about before the real device count is known.
ENGINE_DEVICES = 8


def _cpu_devices() -> int:
    requested = os.environ.get("TORCH_PJRT_CPU_DEVICES", "")
    return int(requested) if requested.isdigit() else 1
_lock = threading.RLock()
_state: dict[str, Any] = {"registered": False, "libraries": []}


class _Hooks(_torch_private.hooks_base()):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index: int) -> bool:
        return startup.started()

    def is_built(self) -> bool:
        return True


class _Guard(_torch_private.guard_base()):
    def type_(self) -> Any:
        return _torch_private.privateuse1_device_type()


def registered() -> bool:
    return _state["registered"]


def initialized() -> bool:
    return startup.started()


def register() -> None:
    """Make "pjrt" a PyTorch device (idempotent, cheap, no jax)."""
    with _lock:
        if _state["registered"]:
            return
        from torch_pjrt import amp, device, distributed, integrations, module_moves, native, profiler, serialization
        from torch_pjrt.compile import default_backend
        from torch_pjrt.eager import fallback, modes

        modes.load_from_environment()
        startup.install_starter(initialize)
        # The native guard must exist before autograd first runs: its engine sizes its device
        # queues once, so it is told an upper bound now and the real count later.
        native.install(_cpu_devices(), max(_cpu_devices(), ENGINE_DEVICES))
        _torch_private.setup_backend(NAME, device.build_module(), _Hooks(), _Guard())
        device.guard_empty_host_cache()
        _state["libraries"].append(_torch_private.library_fallback(fallback.catch_all, "PrivateUse1"))
        serialization.register()
        integrations.install()
        module_moves.install()
        profiler.install()
        default_backend.install()
        distributed.register()
        _state["libraries"].extend(amp.register())
        _state["registered"] = True


def initialize() -> None:
    """Load jax, pick the platform and register every kernel (first device use)."""
    if startup.started():
        return
    with _lock:
        if startup.started():
            return
        register()
        with _collector_paused():
            from torch_pjrt import native
            from torch_pjrt.eager import kernels
            from torch_pjrt.ops import registry
            from torch_pjrt.runtime import client, programs

            native.set_device_count(len(client.devices()))
            # (the stored executables the last process of this entry point used load while Dynamo imports)
            programs.start_preload()
            # PyTorch imports Dynamo at a process's first op anyway (a meta kernel's or decomposition's lazy
            # torch._dynamo.disable, the optimizer's first step); here it is loaded with the collector paused
            # and frozen with the rest, instead of later, where full collections walked its objects.
            _import_on_a_thread_of_its_own("torch._dynamo")
            _torch_private.dynamo_skip_our_packages()
            key, stored = _known_registration()
            known, counterparts = stored if stored is not None else (None, {})
            registry.counterparts_known(counterparts)
            libraries, found = kernels.register_all(known)
            _state["libraries"].extend(libraries)
            if key is not None and stored is None:
                with disk_store.counted_as("registration"):
                    disk_store.write("registration", key, pickle.dumps((found, registry.counterparts_found())))
            _torch_private.flex_attention_accepts(NAME)
            if envvars.flag("TORCH_PJRT_FLASH_ATTENTION"):
                from torch_pjrt.kernels import attention

                attention.install()
            programs.hold_preload()
        startup.mark_started()


def _known_registration() -> tuple[str | None, Any]:
    """The cache folder's key for what registration finds in torch's dispatcher and schemas (the same in every
    process of the same code and torch), and what the last such process found, if stored: the kernels'
    registration and each mutating op's functional counterpart by name. With it, the start registers every kernel
    without searching 2,400 overloads, reading their schemas and searching 1,200 ops' counterparts again."""
    if not disk_store.enabled():
        return None, None
    digest = disk_store.entry_digest()
    digest.update(disk_store.torch_install().encode())
    key = digest.hexdigest()
    with disk_store.counted_as("registration"):
        stored = disk_store.read("registration", key)
    return key, None if stored is None else pickle.loads(stored)


def _import_on_a_thread_of_its_own(module: str) -> None:
    """Import a module on a short-lived thread. torch._dynamo's import leaves a reference cycle through
    torch.fx.wrap's frame, which holds every frame under it, and their locals, until a collection: imported
    from the caller's stack, the frames of the user's function that started the device were frozen below
    with the rest and its locals never freed; on a thread of its own, the cycle holds only that thread's."""
    failures: list[BaseException] = []

    def load() -> None:
        try:
            importlib.import_module(module)
        except BaseException as error:  # re-raised on the caller's thread
            failures.append(error)

    thread = threading.Thread(target=load, name=f"torch-pjrt import {module}")
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Start the device without Python's cyclic garbage collector, then keep every object then alive out of
    its later collections (gc.freeze). The start imports jax and Dynamo and builds the lowering table, about
    280,000 objects that live as long as the process, and each full collection meanwhile walked every object of
    the process: 3 of them took 0.8 s of a warm fused first step (load 8). A program that needs cyclic
    garbage made before the device's start collected calls gc.unfreeze()."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def libraries() -> list[torch.library.Library]:
    return _state["libraries"]
