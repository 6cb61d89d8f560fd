"""Dynamo's packages and AOTAutograd's cache holding the pjrt backend's work, so a warm process skips tracing.

A compiled function's own Dynamo frames (the function and its resume functions, with their guards and
graphs) are kept in `dynamo/` of TORCH_PJRT_CACHE_DIR (under a folder named by our code's digest, keyed
by the function's name, line and bytecode): a fresh process with a filled folder runs them behind their
stored guards without Dynamo tracing them; a frame whose guards fail (another shape, another model) is
traced and added. Frames of library code it calls (an optimizer's step) are traced in every process, and
AOTAutograd finds their forward and backward graphs in `aotautograd/` (keyed by PyTorch on Dynamo's graph,
its inputs, the versions and AOTAutograd's settings, under the same digest's folder) instead of tracing
them again. A stored entry holds each compiled graph as its FX graph with its nodes' values
described (dtype, shape, strides, offset, device); loading it builds the backend's compiled graph
afresh, whose programs and executables then come from our own store as in any warm process. Graphs
with symbolic sizes are not stored (their guards and buckets are the backend's per process); nor is
anything when the cache folder is off. Dynamo's packages need torch 2.13; before it Dynamo traces in
every process.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torch_pjrt import _torch_private
from torch_pjrt.runtime import client, disk_store, metrics

# The compiled graph a loaded entry is built into: set by `aot_cache` for the backend call it wraps.
_making: list[Callable[[torch.fx.GraphModule], Callable[..., Any]]] = []
# Non-empty while a Dynamo package is written: the graphs pickled into it are not AOTAutograd's cache writes.
_package_writes: list[bool] = []


class StoredGraph(_torch_private.output_code_base()):
    """A compiled graph as AOTAutograd's cache stores it: pickled as its FX graph and fake values."""

    def __init__(self, gm: torch.fx.GraphModule, compiled: Callable[..., Any]) -> None:
        self.gm = gm
        self.compiled = compiled
        self._boxed_call = True  # an instance attribute, so Dynamo's disable() wrapper copies it

    def __call__(self, args: list[Any]) -> Any:
        return self.compiled(*args)

    def __copy__(self) -> StoredGraph:
        # AOTAutograd copies an entry's result before saving it: the copy shares the compiled graph.
        return StoredGraph(self.gm, self.compiled)

    def __deepcopy__(self, memo: dict[int, Any]) -> StoredGraph:
        # A Dynamo package's record of the entry is a deep copy: sharing too, not a pickled copy loaded (which
        # would count as a cache hit and build the compiled graph again).
        return self.__copy__()

    def __getstate__(self) -> dict[str, Any]:
        if not _package_writes:
            metrics.bump("aot_cache_writes")
        return {"graph": _torch_private.pickle_graph(self.gm, keep=lambda key: key == "stack_trace"),
                "values": [_described(node.meta.get("val")) for node in self.gm.graph.nodes],
                "options": {"recompile_budget": self.compiled.recompile_budget}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.gm = _torch_private.unpickle_graph(state["graph"])
        mode, made = _torch_private.fake_mode(), {}
        for node, value in zip(self.gm.graph.nodes, state["values"]):
            node.meta["val"] = _rebuilt(value, mode, made)
        if _making:
            self.compiled = _making[-1](self.gm)
        else:  # loaded with a Dynamo package (caching precompile, torch.compiler.load_cache_artifacts): no backend call
            from torch_pjrt.compile.backend import CompiledGraph

            self.compiled = CompiledGraph(self.gm, **state["options"])
        self._boxed_call = True
        metrics.bump("aot_cache_hits")

    def prepare_for_serialization(self) -> None:
        """Nothing to drop: pickling keeps only the graph."""

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """Nothing to do after loading: the graph's programs are found or traced at its first call."""

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """No Triton kernels here."""


def _described(value: Any) -> Any:
    """A node's value as plain data: a tensor's dtype, shape, strides, offset and device (what the backend reads
    of a traced value; the fake tensors themselves take seconds to unpickle)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(), value.storage_offset(), str(value.device))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_described(item) for item in value])
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return ("plain", value)
    raise TypeError(f"torch_pjrt: a graph value of type {type(value).__name__} is not stored in AOTAutograd's cache.")


def _rebuilt(described: Any, mode: Any, made: dict[tuple, torch.Tensor]) -> Any:
    """`_described`'s value again, a tensor as a fake tensor of `mode`; equal descriptions share the one fake tensor
    in `made`, as the backend reads only what they describe (the GPT step's 1,426 values are 69 distinct ones: their
    fake tensors took 37 ms of a warm first step, now 5)."""
    kind, *fields = described
    if kind == "plain":
        return fields[0]
    if kind in ("list", "tuple"):
        items = [_rebuilt(item, mode, made) for item in fields[0]]
        return items if kind == "list" else tuple(items)
    found = made.get(described)
    if found is None:
        found = made[described] = _fake(fields, mode)
    return found


def _fake(fields: list[Any], mode: Any) -> torch.Tensor:
    dtype, shape, stride, offset, device = fields
    if offset == 0:
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    else:
        extent = offset + (0 if 0 in shape else 1 + sum((size - 1) * step for size, step in zip(shape, stride)))
        meta = torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    return _torch_private.fake_tensor(mode, meta, torch.device(device))


def code_folder_name() -> str:
    """The folder of `aotautograd/` this version of torch_pjrt's code reads and writes."""
    return disk_store.code_version()[:16]


def _folder(kind: str = "aotautograd") -> str | None:
    """This code version's folder of `kind` (`aotautograd` or `dynamo`) in the cache folder, None when it is off."""
    root = client.cache_dir()
    return None if root is None else os.path.join(root, kind, code_folder_name())


@contextlib.contextmanager
def _writing_package() -> Iterator[None]:
    _package_writes.append(True)
    try:
        yield
    finally:
        _package_writes.pop()


if _torch_private.dynamo_packages_supported():  # torch 2.13; on older torch Dynamo traces every process
    _torch_private.dynamo_packages_for("pjrt", functools.partial(_folder, "dynamo"), metrics.bump, _writing_package)


def _static(example_inputs: Sequence[Any]) -> bool:
    def symbolic(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
        return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))

    return not any(symbolic(value) for value in example_inputs)


@contextlib.contextmanager
def aot_cache(
    example_inputs: Sequence[Any], make: Callable[[torch.fx.GraphModule], Callable[..., Any]]
) -> Iterator[Callable[[torch.fx.GraphModule, Sequence[Any]], Any]]:
    """The AOTAutograd compiler for one backend call, which `make`s each graph's compiled form; within
    it AOTAutograd looks the graphs up in our cache folder and stores them there (when storable)."""
    folder = _folder()
    if folder is None or not _static(example_inputs):
        from functorch.compile import make_boxed_func

        yield lambda gm, _: make_boxed_func(make(gm))
        return
    compiler = _torch_private.serializable_aot_compiler(StoredGraph, lambda gm, _: StoredGraph(gm, make(gm)))
    _making.append(make)
    try:
        with _torch_source_key_kept(), _torch_private.aot_autograd_cache(folder):
            yield compiler
    finally:
        _making.pop()


@contextlib.contextmanager
def _torch_source_key_kept() -> Iterator[None]:
    """PyTorch's digest of its source files, which AOTAutograd's cache keys hold, read from our cache folder
    instead of hashing torch's files again in every process. It is stored per torch install (version and
    folder: `disk_store.torch_install`), not per version of our code."""
    name = hashlib.sha256(disk_store.torch_install().encode()).hexdigest()
    with disk_store.counted_as("torch_source_key"):
        stored = disk_store.read("torch_source_key", name)
    if stored is not None:
        with _torch_private.torch_source_key_given(stored):
            yield
        return
    yield
    with disk_store.counted_as("torch_source_key"):
        disk_store.write("torch_source_key", name, _torch_private.torch_source_key())

