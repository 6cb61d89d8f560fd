"""c10d collectives as XLA programs over the group's devices (jax's multi-process runtime).

The group's mesh has one device per rank (exchanged once through the group's store); a
collective is a program every rank runs over it (`runtime/spmd.py`: psum, all_gather,
psum_scatter, all_to_all on this rank's own array), so the data never leaves the device: gloo
inside XLA on jaxlib's CPU client, NCCL on GPUs, ICI on TPUs. In strict eager the program is
dispatched asynchronously like any op; later ops on the result wait for it through XLA's data
dependencies, as CUDA's streams wait for NCCL, and the Work's future completes when the program
has run (a waiter thread), so `work.wait()` sees its end and an error inside it (a peer that
died, the collective timeout) raises there. In DEFER_AND_FUSE the collective is the last node of
the device's pending graph, which is then dispatched as one program over the mesh (no host sync:
nothing is read or waited for), and the Work is done at once, its result ordered by the programs
that read it (CUDA's stream semantics).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from torch_pjrt import storage
from torch_pjrt.eager import fusion, modes
from torch_pjrt.runtime import client, metrics, spmd
from torch_pjrt.runtime.spmd import AXIS

RedOpType = dist.ReduceOp.RedOpType
# Dtypes jaxlib's collectives carry (gloo on CPU); others take the host engine.
DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})
REDUCTIONS = frozenset({RedOpType.SUM, RedOpType.AVG, RedOpType.MIN, RedOpType.MAX, RedOpType.PRODUCT,
                        RedOpType.PREMUL_SUM})


def reduce_kind(op: Any) -> Any:
    """The RedOpType of a ReduceOp (c10d passes ReduceOp objects, users and functional collectives RedOpTypes)."""
    return op if isinstance(op, RedOpType) else op.op


# --- completion ---------------------------------------------------------------------------------


class _Waiter:
    """One daemon thread that completes Works' futures when their programs' results are ready."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            arrays, future, value = self._jobs.get()
            try:
                client.jax_module().block_until_ready(arrays)
            except Exception as error:  # noqa: BLE001 (handed to the Work: raised by wait())
                future.set_exception(RuntimeError(f"a pjrt collective failed inside its XLA program: {error}"))
                continue
            future.set_result(value)

    def work(self, arrays: list[Any], value: Any) -> dist.Work:
        future: torch.futures.Future = torch.futures.Future()
        arrays = [a for a in arrays if not isinstance(a, storage.PendingArray)]  # fused: ordered by the graph
        if not arrays:
            future.set_result(value)
            return _create_work_from_future(future)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pjrt-collectives", daemon=True)
                self._thread.start()
        self._jobs.put((arrays, future, value))
        return _create_work_from_future(future)


_waiter = _Waiter()


# --- tensors as shards --------------------------------------------------------------------------


def _whole_storage(tensor: torch.Tensor) -> storage.DeviceStorage | None:
    """The tensor's storage when the tensor is all of it, in its dtype and not padded; else None."""
    st = storage.storage_of(tensor)
    view = storage.view_of(tensor)
    whole = view.covers(st.numel) and view.dtype == st.dtype and not isinstance(st.array, storage.Padded)
    return st if whole else None


def _elements(tensor: torch.Tensor) -> Any:
    """A tensor's elements as its storage's value (a device array, or in fused mode a pending one), in
    row-major order; a view is first copied out (an op like any other, recorded in fused mode)."""
    if tensor.numel() == 0:
        return None
    st = _whole_storage(tensor) or storage.storage_of(tensor.clone(memory_format=torch.contiguous_format))
    if st.array is None or not modes.state.fusing:
        return st.materialize()
    return st.array


def _write(tensor: torch.Tensor, array: Any) -> None:
    """Make `tensor` hold `array`'s elements: the storage takes it whole, a view gets it copied in."""
    st = _whole_storage(tensor)
    if st is not None:
        st.array = array
        return
    source = storage.new_tensor(array, tensor.dtype, tensor.device, (tensor.numel(),), numel=tensor.numel())
    tensor.copy_(source.view(tensor.shape))


def supports(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a pjrt tensor of one device in a dtype XLA's collectives carry."""
    if not tensors:
        return False
    first = tensors[0]
    return all(t.device.type == "pjrt" and t.device == first.device and t.dtype in DTYPES for t in tensors)


# --- programs -----------------------------------------------------------------------------------


def _reduce_body(kind: Any, size: int, factor: float | None, scatter: bool = False) -> Callable[[Any], Any]:
    """The block-wise reduction across ranks of one ReduceOp, or with `scatter` this rank's part of it
    (AVG truncates integers, like NCCL; bool reduces as logical or/and)."""
    jax = client.jax_module()
    lax, jnp = jax.lax, jax.numpy

    def part(x: Any) -> Any:
        length = x.shape[0] // size
        return lax.dynamic_slice_in_dim(x, lax.axis_index(AXIS) * length, length) if scatter else x

    def summed(x: Any) -> Any:
        return lax.psum_scatter(x, AXIS, tiled=True) if scatter else lax.psum(x, AXIS)

    def reduce(x: Any) -> Any:
        if x.dtype == jnp.bool_:
            either = lax.pmin if kind in (RedOpType.MIN, RedOpType.PRODUCT) else lax.pmax
            return part(either(x.astype(jnp.uint8), AXIS).astype(jnp.bool_))
        if kind == RedOpType.MAX:
            return part(lax.pmax(x, AXIS))
        if kind == RedOpType.MIN:
            return part(lax.pmin(x, AXIS))
        if kind == RedOpType.PRODUCT:
            return part(jnp.prod(lax.all_gather(x, AXIS), axis=0).astype(x.dtype))
        if kind == RedOpType.PREMUL_SUM:
            return summed(x * jnp.asarray(factor, x.dtype))
        total = summed(x)
        if kind != RedOpType.AVG:
            return total
        if jnp.issubdtype(x.dtype, jnp.integer):
            return lax.div(total, jnp.asarray(size, x.dtype))
        return total / jnp.asarray(size, x.dtype)

    return reduce


def collective_body(kind: str, size: int, *options: Any) -> Callable[[Any], Any]:
    """One collective on this rank's block (rows along dimension 0) inside a program over the mesh axis:
    what the eager engine's programs and compiled graphs' collective nodes both run."""
    lax = client.jax_module().lax
    if kind == "all_reduce":
        return _reduce_body(*options)
    if kind == "reduce_scatter":
        return _reduce_body(*options, scatter=True)
    if kind == "broadcast":
        (root,) = options
        return lambda x: lax.all_gather(x, AXIS)[root]
    if kind == "all_gather":
        return lambda x: lax.all_gather(x, AXIS, tiled=True)
    if kind == "all_to_all":
        return lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    if kind == "scatter":
        (root,) = options
        return lambda x: lax.all_to_all(x, AXIS, 0, 0, tiled=True).reshape(size, -1)[root]
    raise AssertionError(f"no collective named {kind!r}")


# Collectives that see the elements as one flat row (their blocks split along it); the rest keep the shape.
FLAT_KINDS = frozenset({"reduce_scatter", "all_to_all", "scatter"})


class CollectiveEntry:
    """One collective over one mesh, as a program node: `fn` (array in, results out) is what a fused
    program records and what `program`, the collective run by itself, runs."""

    checks = ()

    def __init__(self, mesh: Any, kind: str, *options: Any) -> None:
        body = collective_body(kind, mesh.devices.size, *options)
        flat = kind in FLAT_KINDS

        def fn(x: Any) -> tuple[Any]:
            return (body(x.reshape(-1) if flat or not x.ndim else x),)

        self.mesh, self.fn = mesh, fn
        self.program = spmd.MeshProgram(fn, mesh, f"collective[{kind}]")


@functools.lru_cache(maxsize=512)
def _entry(mesh: Any, kind: str, *options: Any) -> CollectiveEntry:
    return CollectiveEntry(mesh, kind, *options)


# --- the engine ---------------------------------------------------------------------------------


class XlaCollectives:
    """The collectives of one c10d group as XLA programs over its ranks' devices."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self._store = dist.PrefixStore("pjrt-xla/", store)
        self._rank, self._size = rank, size
        self._mesh: Any = None
        self._index: int | None = None
        self._checked: set[str] = set()
        self._checks = 0

    def mesh(self, index: int) -> Any:
        """The group's mesh: each rank's device, exchanged once through the store on the first collective."""
        if self._mesh is not None:
            if index != self._index:
                raise RuntimeError(
                    f"this rank's collectives in this group ran on pjrt:{self._index} and now get a pjrt:{index} "
                    "tensor; keep each rank's collectives of one group on one device (torch.pjrt.set_device)."
                )
            return self._mesh
        jax = client.jax_module()
        device = client.device_for(index)
        self._store.set(f"device/{self._rank}", str(device.id))
        ids = [int(self._store.get(f"device/{r}")) for r in range(self._size)]
        by_id = {d.id: d for d in jax.devices(device.platform)}
        self._mesh = jax.sharding.Mesh(np.array([by_id[i] for i in ids]), (AXIS,))
        self._index = index
        return self._mesh

    def _run(self, kind: str, tensor: torch.Tensor, *options: Any) -> Any:
        """This rank's result of the collective of `tensor`'s elements: run now (asynchronously), or recorded
        into its device's pending graph in fused mode, which then runs as one program over the mesh."""
        index = tensor.device.index
        entry = _entry(self.mesh(index), kind, *options)
        self._check_peers(kind, tuple(tensor.shape), tensor.dtype, options)
        value = _elements(tensor)
        metrics.bump("collectives_xla")
        if modes.state.fusing:
            (result,) = fusion.graph(index).record_on_mesh(entry, [value], 1)
            return result
        with client.out_of_memory_translated((), index):
            (result,) = entry.program.call(value)
        return result

    def _check_peers(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, options: tuple) -> None:
        """The first time this rank runs a collective of this kind, shape and dtype, compare it with every
        peer's through the store: XLA's collectives given other sizes abort the process (gloo) or hang."""
        mine = f"{kind}{list(options)} of {str(dtype).replace('torch.', '')}{list(shape)}"
        if mine in self._checked:
            return
        key = f"check/{self._checks}"
        self._checks += 1
        self._store.set(f"{key}/{self._rank}", mine)
        for peer in range(self._size):
            try:
                theirs = self._store.get(f"{key}/{peer}").decode()
            except RuntimeError as error:  # the store's timeout (DistStoreError is a RuntimeError)
                raise RuntimeError(
                    f"rank {peer} of this pjrt group did not reach this rank's {mine} within the timeout ({error}); "
                    "every rank must call the same collectives with tensors of the same shape and dtype."
                ) from None
            if theirs != mine:
                raise ValueError(
                    f"this pjrt collective got tensors of another shape or dtype on rank {peer}: this rank "
                    f"{self._rank} has {mine}, rank {peer} has {theirs}; pass the same shapes on every rank."
                )
        self._checked.add(mine)

    def _reduce_options(self, op: dist.ReduceOp) -> tuple[Any, int, float | None]:
        kind = reduce_kind(op)
        factor = None
        if kind == RedOpType.PREMUL_SUM:
            factor = op.factor.item() if isinstance(op.factor, torch.Tensor) else float(op.factor)
        return kind, self._size, factor

    # -- reductions

    def _each(self, kind: str, tensors: list[torch.Tensor], options: tuple, keep: bool) -> dist.Work:
        """One program per tensor; `keep` says whether this rank takes the result (reduce and broadcast's roots
        do not)."""
        results = []
        for tensor in tensors:
            if not tensor.numel():
                continue
            result = self._run(kind, tensor, *options)
            if keep:
                _write(tensor, result)
            results.append(result)
        return _waiter.work(results, tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._each("all_reduce", tensors, self._reduce_options(opts.reduceOp), keep=True)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """One program per dtype over the tensors' elements concatenated on the device."""
        options = self._reduce_options(opts.reduceOp)
        results = []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype and t.numel()]
            if not group:
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            result = self._run("all_reduce", flat, *options)
            _write(flat, result)
            for t, piece in zip(group, flat.split([t.numel() for t in group]), strict=True):
                t.copy_(piece.view(t.shape))
            results.append(result)
        return _waiter.work(results, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        keep = self._rank == opts.rootRank
        return self._each("all_reduce", tensors, self._reduce_options(opts.reduceOp), keep)

    def _into(self, kind: str, output: torch.Tensor, input: torch.Tensor, *options: Any) -> dist.Work:
        """A collective of `input` whose result `output` takes (all_gather, reduce_scatter, all_to_all)."""
        if input.numel() == 0:
            return _waiter.work([], [output])
        result = self._run(kind, input, *options)
        _write(output, result)
        return _waiter.work([result], [output])

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, not the output's "
                f"{output.numel()} times the group size {self._size}; size the tensors as on CUDA."
            )
        return self._into("reduce_scatter", output, input, *self._reduce_options(opts.reduceOp))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any) -> dist.Work:
        for output, inputs in zip(outputs, input_lists, strict=True):
            self.reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in inputs]), opts)
        return self.settled(outputs)

    # -- data movement

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._each("broadcast", tensors, (opts.rootRank,), keep=self._rank != opts.rootRank)

    def all_gather_tensor(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        if output.numel() != input.numel() * self._size:
            raise ValueError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, not the input's "
                f"{input.numel()} times the group size {self._size}; size the tensors as on CUDA."
            )
        return self._into("all_gather", output, input)

    def _gathered(self, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's `input`, in rank order (one all_gather into a flat buffer)."""
        gathered = torch.empty(self._size * input.numel(), dtype=input.dtype, device=input.device)
        self.all_gather_tensor(gathered, input)
        return gathered.chunk(self._size)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work:
        for outputs, input in zip(output_lists, inputs, strict=True):
            for output, piece in zip(outputs, self._gathered(input), strict=True):
                output.copy_(piece.view(output.shape))
        return self.settled(output_lists)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], root: int) -> dist.Work:
        for input in inputs:
            pieces = self._gathered(input)
            if self._rank == root:
                for output, piece in zip(output_lists[0], pieces, strict=True):
                    output.copy_(piece.view(output.shape))
        return self.settled(output_lists)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], root: int) -> dist.Work:
        for index, output in enumerate(outputs):
            if self._rank == root:
                source = torch.cat([t.reshape(-1) for t in input_lists[index]])
            else:
                source = torch.zeros(self._size * output.numel(), dtype=output.dtype, device=output.device)
            if output.numel():
                _write(output, self._run("scatter", source, root))
        return self.settled(outputs)

    def all_to_all_tensor(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        """Even splits: rank r's r-th block of the flattened input goes to rank r."""
        return self._into("all_to_all", output, input)

    def settled(self, value: Any) -> dist.Work:
        """A Work for results written by collectives above (their programs are ordered before any reader)."""
        return _waiter.work([], value)
