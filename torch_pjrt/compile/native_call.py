"""A compiled graph's call replayed natively (csrc/graph_call.cpp) for a signature Python has run once.

The Python path (backend.CompiledGraph._run) builds the program, reads each input's storage, batches the
CPU inputs and wraps the outputs; for a signature it has run, `plan` describes all of that to a native
GraphPlan, which then checks a call's inputs against it and replays it without our Python code around
the program call (the AdamW step's 145 inputs: argument loop, batching and lookup were 1.4 of its 2.3 ms).
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from torch_pjrt import envvars, storage
from torch_pjrt.runtime import client

# csrc/graph_call.cpp's kinds of inputs and outputs
DEVICE_INPUT, HOST_INPUT, STATIC_INPUT = 0, 1, 2
DEVICE_OUTPUT, EAGER_OUTPUT, CONSTANT_OUTPUT = 0, 1, 2


@functools.cache
def module() -> ModuleType | None:
    """torch_pjrt._graph_call, a second module in torch_pjrt._hooks' library (so both share the storages'
    links and the address allocator); None where that library is not built, predates it, or
    TORCH_PJRT_NATIVE_GRAPH_CALL=0."""
    if not envvars.flag("TORCH_PJRT_NATIVE_GRAPH_CALL"):
        return None
    try:
        hooks = importlib.import_module("torch_pjrt._hooks")
        loader = importlib.machinery.ExtensionFileLoader("torch_pjrt._graph_call", hooks.__file__)
        spec = importlib.util.spec_from_loader(loader.name, loader)
        if spec is None:
            return None
        found = importlib.util.module_from_spec(spec)
        loader.exec_module(found)
        return found
    except ImportError:
        return None


def call_key(args: tuple) -> int:
    """A summary of a call's inputs equal to the signature_key of every plan that can replay it (the module is
    there: only a graph with plans asks)."""
    return module().call_key(args)


def plan(signature: Sequence[Any], slot_shapes: Sequence[tuple[int, ...]], slot_dtypes: Sequence[torch.dtype],
         written: Sequence[int], outputs: Sequence[Any], layouts: Sequence[Any], device: torch.device,
         call: Callable[..., Any], next_key: Callable[[], Any] | None, eager_part: Callable[..., Any] | None,
         issue_checks: Callable[[Any], None]) -> Any | None:
    """The native replay of one signature's call, or None where it has a part only Python runs (CPU results,
    padded outputs, a CPU dtype numpy lacks) or the native module is not there.

    `slot_shapes`/`slot_dtypes`: each storage slot's array shape and dtype in the call just run; `outputs` and
    `layouts`: the graph's backend.Output descriptions and the traced program's layout of each."""
    native = module()
    if native is None:
        return None
    inputs: list[tuple] = []
    groups: dict[torch.dtype, int] = {}
    sizes: list[int] = []
    seen: set[int] = set()
    for entry in signature:
        if entry[0] == "pjrt":
            _, slot, view, _ = entry
            inputs.append((DEVICE_INPUT, slot, slot not in seen, view.dtype, view.sizes, view.strides, view.offset,
                           view.conj, view.neg))
            seen.add(slot)
        elif entry[0] == "host":
            _, shape, dtype = entry
            if dtype not in storage.TORCH_TO_NUMPY:
                return None
            group = groups.setdefault(dtype, len(groups))
            if group == len(sizes):
                sizes.append(0)
            inputs.append((HOST_INPUT, group, sizes[group], dtype, shape))
            sizes[group] += int(np.prod(shape, dtype=np.int64))
        elif entry[0] == "static":
            inputs.append((STATIC_INPUT, entry[1]))
        else:
            return None
    described = []
    for out, layout in zip(outputs, layouts):
        if out.computed_eagerly:
            described.append((EAGER_OUTPUT,))
        elif layout is None:
            if isinstance(out.constant, torch.SymInt):
                return None
            described.append((CONSTANT_OUTPUT, out.constant))
        elif layout[0] in ("host", "block"):
            return None
        else:
            described.append((DEVICE_OUTPUT, *layout))
    slots = list(zip(slot_dtypes, slot_shapes))
    return native.GraphPlan(inputs, slots, list(zip(groups, sizes)), list(written), described, device.index, device,
                            client.array_type(), storage.DeviceStorage, call, next_key, eager_part, issue_checks)
