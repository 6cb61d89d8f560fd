"""Compile ahead of traffic: run a model once per input size it will meet, so the first request of each
size finds its programs compiled (and a restarted server finds them in the persistent cache).

A server meets a few sizes (bucketed batch and sequence lengths): each bucket costs one XLA compile per
program the first time it is met, a latency spike on a live request. `warmup` builds an input of every
size from the example (its values tiled, so token ids stay valid), carries the example's dynamic-size
marks over (Dynamo's and the eager padding's), and runs the function on each without autograd.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from torch_pjrt import _torch_private, storage
from torch_pjrt.eager import dynamic
from torch_pjrt.runtime import metrics


class WarmedSize(NamedTuple):
    """One input size run: its sizes per (argument, dim), the programs it compiled and its seconds."""

    sizes: dict[tuple[int, int], int]
    programs_compiled: int
    seconds: float


def warmup(fn: Callable[..., Any], *args: Any, sizes: Mapping[tuple[int, int], Sequence[int]] | None = None,
           **kwargs: Any) -> list[WarmedSize]:
    """Run `fn(*args, **kwargs)` for every combination of `sizes` ({(argument index, dim): [sizes]}; none:
    the example as given) under torch.no_grad, and wait for the device. Returns what each size compiled.

    `fn` is whatever the server calls: a module in strict or fused eager, or a torch.compile'd function."""
    combinations = [dict(zip(sizes, chosen)) for chosen in itertools.product(*sizes.values())] if sizes else [{}]
    for (index, dim) in (sizes or {}):
        if not (0 <= index < len(args)) or not isinstance(args[index], torch.Tensor):
            raise ValueError(f"torch_pjrt.warmup: sizes names argument {index}, which is not a tensor argument; "
                             f"use the index of a tensor among the {len(args)} positional arguments.")
        if not -args[index].dim() <= dim < args[index].dim():
            raise ValueError(f"torch_pjrt.warmup: argument {index} has {args[index].dim()} dims, no dim {dim}.")
    done = []
    for chosen in combinations:
        inputs = list(args)
        for index in {index for index, _ in chosen}:
            dims = {dim % args[index].dim(): size for (i, dim), size in chosen.items() if i == index}
            inputs[index] = _resized(args[index], dims)
        before = metrics.counters_now("compiles")
        start = time.perf_counter()
        with torch.no_grad():
            # held until the device is done: a fused program returns only the results still referenced
            result = fn(*inputs, **kwargs)
        devices = {t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "pjrt"}
        # dropped before it runs, as a server drops a request's inputs: a fused program donates dead buffers
        del inputs
        for index in devices:
            torch.pjrt.synchronize(index)
        done.append(WarmedSize(chosen, int(metrics.counters_now("compiles") - before), time.perf_counter() - start))
        del result
    return done


def _resized(example: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """The example's values tiled (or cut) to the sizes in `dims`, on its device, with its dynamic marks.

    Built on the host and moved: resizing on pjrt would compile programs of its own for every size."""
    values = example.detach().cpu()
    for dim, size in dims.items():
        if values.shape[dim] == 0:
            raise ValueError(f"torch_pjrt.warmup: dim {dim} of an example argument is empty; give it at least one "
                             "element to tile.")
        repeats = -(-size // values.shape[dim])
        values = torch.cat([values] * repeats, dim).narrow(dim, 0, size)
    values = values.contiguous()
    _torch_private.copy_dynamo_marks(example, values)
    for dim, bound in _eager_bounds(example).items():
        dynamic.mark_eager(values, dim, bound)
    return values.to(example.device)


def _eager_bounds(tensor: torch.Tensor) -> dict[int, Any]:
    """The dims of a tensor held padded by eager (torch_pjrt.mark_dynamic) and how each is bucketed."""
    if tensor.device.type == "cpu":
        return dict(getattr(tensor, "_pjrt_dynamic", {}))
    if tensor.device.type != "pjrt":
        return {}
    layout = storage.storage_of(tensor).array
    if not isinstance(layout, storage.Padded) or tuple(layout.shape) != tuple(tensor.shape):
        return {}
    return {dim: bound for dim, bound in enumerate(layout.bounds) if bound is not None}
