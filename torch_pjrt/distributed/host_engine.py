"""The host engine of c10d's "pjrt" backend: collectives on pjrt tensors over gloo, through host copies.

Used where jax's multi-process runtime cannot run them (no torchrun environment, a dtype or
collective XLA does not carry, CPU tensors, send/recv).

Every collective stages its pjrt tensors on the host (`.cpu()`, a sync point in fused mode,
reached in the same program order on every rank), runs the same collective on an internal
gloo group, and copies the results back into the pjrt tensors in place (through views).
CPU tensors go to gloo untouched, so one group serves `cpu:gloo,pjrt:pjrt`.

Collectives complete before they return: an `async_op=True` handle is already done, so
`work.wait()` is honoured trivially and errors (timeouts, a peer that died) raise at the call.
Send and receive are the exception: they return a Work in flight (`PointToPoint`), as pipeline
schedules need.
Cost: one device->host and one host->device copy per tensor, plus gloo's TCP transport.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.utils import _pytree as pytree

from torch_pjrt.runtime.startup import NAME

RedOpType = dist.ReduceOp.RedOpType
# Reductions gloo lacks, done as a SUM on the host plus a local step.
SUM_BASED = (RedOpType.AVG, RedOpType.PREMUL_SUM)
RELEASE_WAIT_S, RELEASE_POLL_S = 5.0, 1e-5


# --- host staging --------------------------------------------------------------------------------


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type == NAME


def _stage(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host tensors gloo can use in place of `tensors` (CPU ones are used as they are)."""
    return [t.cpu() if _on_device(t) else t for t in tensors]


def _write_back(targets: Sequence[torch.Tensor], staged: Sequence[torch.Tensor]) -> None:
    """Copy results into the caller's tensors, below autograd as c10d's own backends write them.

    (A pipeline stage receives into a leaf that requires grad; an in-place copy under autograd
    would raise.)
    """
    with torch.no_grad():
        for target, host in zip(targets, staged, strict=True):
            if target is not host:
                target.copy_(host)


def _write_back_flat(targets: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write consecutive pieces of one flat host buffer into `targets`."""
    pieces = flat.split([t.numel() for t in targets])
    _write_back(targets, [piece.view(t.shape) for t, piece in zip(targets, pieces, strict=True)])


def _await_release(tensors: Sequence[torch.Tensor], counts: Sequence[int]) -> None:
    """Wait (GIL released) until gloo's worker dropped its references to `tensors`.

    Dropping them needs the GIL; a gloo group destroyed while its worker still holds one (e.g. at
    exit, under the GIL) would join that worker forever.
    """
    deadline = time.monotonic() + RELEASE_WAIT_S
    while any(t._use_count() > n for t, n in zip(tensors, counts)) and time.monotonic() < deadline:
        time.sleep(RELEASE_POLL_S)


def _done(result: Any) -> dist.Work:
    """A finished Work whose future holds `result` (a tensor list, as c10d expects)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _flatten_lists(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _stage_lists(lists: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [_stage(inner) for inner in lists]


class PointToPoint(dist.Work):
    """A send or receive in flight on gloo, completed by `wait` (then a receive lands in its tensors).

    Unlike the collectives these do not complete before they return: gloo's send waits until the
    peer posts the matching receive, so two ranks that each send before they receive in one
    `batch_isend_irecv` (1F1B's steady state) would deadlock. A failure (timeout, dead peer)
    raises from `wait`, at every call.
    """

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor], host: list[torch.Tensor], receive: bool) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._tensors, self._host, self._receive = tensors, host, receive

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._work is not None:
            self._work.wait(timeout)
            self._work = None
            if self._receive:
                _write_back(self._tensors, self._host)
        return True

    def is_completed(self) -> bool:
        """Whether it is done; a finished receive is written back first, so its tensors are ready."""
        if self._work is not None and self._work.is_completed():
            self.wait()
        return self._work is None

    def get_future(self) -> torch.futures.Future:
        """A finished future of the tensors; getting it completes the operation (it cannot run later)."""
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._tensors)
        return future


# --- reductions --------------------------------------------------------------------------------


def _op_type(op: dist.ReduceOp) -> Any:
    return op.op if isinstance(op, dist.ReduceOp) else op


def _prepare(op: dist.ReduceOp, tensors: Sequence[torch.Tensor]) -> dist.ReduceOp:
    """The op to give gloo; PREMUL_SUM scales the local inputs first."""
    kind = _op_type(op)
    if kind == RedOpType.PREMUL_SUM:
        factor = op.factor
        for t in tensors:
            t.mul_(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return dist.ReduceOp.SUM if kind in SUM_BASED else op


def _finish(op: dist.ReduceOp, tensors: Sequence[torch.Tensor], size: int) -> None:
    """AVG is a SUM divided by the group size (integer dtypes truncate, like NCCL)."""
    if _op_type(op) != RedOpType.AVG:
        return
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(size)
        else:
            t.copy_(torch.div(t, size, rounding_mode="trunc"))


def _with_op(options: Any, op: dist.ReduceOp) -> Any:
    copy = type(options)()
    for field in ("rootRank", "rootTensor", "timeout"):
        if hasattr(options, field):
            setattr(copy, field, getattr(options, field))
    copy.reduceOp = op
    return copy


def _private_copies(staged: list[torch.Tensor], originals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host inputs that reductions may scale without touching a caller's CPU tensor."""
    return [s.clone() if s is o else s for s, o in zip(staged, originals, strict=True)]


# --- the engine -------------------------------------------------------------------------------


class HostCollectives:
    """The collectives of one c10d group for pjrt (and CPU) tensors, transported by gloo."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("pjrt-gloo/", store), rank, size, timeout)
        self._rank, self._size = rank, size

    @property
    def gloo(self) -> dist.ProcessGroupGloo:
        return self._gloo

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _run(self, method: str, *args: Any) -> None:
        """Run one gloo collective to completion, and until gloo's thread has let go of its tensors."""
        held = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        before = [t._use_count() for t in held]
        getattr(self._gloo, method)(*args).wait()
        _await_release(held, before)

    def _reduce_like(
        self, method: str, tensors: Sequence[torch.Tensor], options: Any, *extra: Any
    ) -> list[torch.Tensor]:
        """Run a reducing gloo collective in place on host copies of `tensors`; returns them."""
        host = _stage(tensors)
        if _op_type(options.reduceOp) in SUM_BASED:
            host = _private_copies(host, tensors)
        op = _prepare(options.reduceOp, host)
        self._run(method, *extra, host, _with_op(options, op))
        _finish(options.reduceOp, host, self.size())
        return host

    # -- reductions

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        _write_back(tensors, self._reduce_like("allreduce", tensors, opts))
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """One host buffer per dtype, one gloo allreduce each."""
        opts = opts or dist.AllreduceCoalescedOptions()
        single = dist.AllreduceOptions()
        single.reduceOp, single.timeout = opts.reduceOp, opts.timeout
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().cpu().reshape(-1) for t in group])
            (flat,) = self._reduce_like("allreduce", [flat], single)
            _write_back_flat(group, flat)
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        host = self._reduce_like("reduce", tensors, opts)
        if self.rank() == opts.rootRank:
            _write_back(tensors, host)
        return _done(tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        (host_input,) = _private_copies([input.detach().cpu().contiguous()], [input])
        host_output = torch.empty(output.shape, dtype=output.dtype)
        op = _prepare(opts.reduceOp, [host_input])
        self._run("_reduce_scatter_base", host_output, host_input, _with_op(opts, op))
        _finish(opts.reduceOp, [host_output], self.size())
        _write_back([output], [host_output])
        return _done([output])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        for output, inputs in zip(outputs, input_lists, strict=True):
            flat = torch.empty(output.numel(), dtype=output.dtype)
            self._reduce_scatter_base(flat, torch.cat([t.detach().cpu().reshape(-1) for t in inputs]), opts)
            _write_back([output], [flat.view(output.shape)])
        return _done(outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.BroadcastOptions()
        host = _stage(tensors)
        self._run("broadcast", host, opts)
        if self.rank() != opts.rootRank:
            _write_back(tensors, host)
        return _done(tensors)

    def _into_lists(self, name: str, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                    opts: Any) -> dist.Work:
        """A collective that fills lists of output tensors (allgather, gather) through host copies."""
        host_outputs = _stage_lists(output_lists)
        self._run(name, host_outputs, _stage(inputs), opts)
        _write_back(_flatten_lists(output_lists), _flatten_lists(host_outputs))
        return _done(output_lists)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._into_lists("allgather", output_lists, inputs, opts or dist.AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or dist.AllgatherOptions()
        host_output, host_input = _stage([output])[0].contiguous(), _stage([input])[0].contiguous()
        # gloo takes the inputs concatenated along dim 0; like NCCL, any output of the right size is
        # accepted (flat, or stacked on a new dim), written through a view of that form
        gathered = host_output
        if host_output.numel() == host_input.numel() * self.size():
            rows = self.size() * host_input.shape[0] if host_input.dim() else self.size()
            gathered = host_output.view(rows, *host_input.shape[1:])
        self._run("_allgather_base", gathered, host_input, opts)
        _write_back([output], [host_output])
        return _done([output])

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._into_lists("gather", output_lists, inputs, opts or dist.GatherOptions())

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        host_outputs = _stage(outputs)
        host_inputs = _stage_lists(input_lists)
        self._run("scatter", host_outputs, host_inputs, opts)
        _write_back(outputs, host_outputs)
        return _done(outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        opts = opts or dist.AllToAllOptions()
        host_output, host_input = _stage([output])[0].contiguous(), _stage([input])[0].contiguous()
        self._run("alltoall_base", host_output, host_input, output_split_sizes, input_split_sizes, opts)
        _write_back([output], [host_output])
        return _done([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Through one all_to_all_single of the flattened tensors (gloo has no list form)."""
        flat_in = torch.cat([t.detach().cpu().reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype)
        self.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs], opts)
        _write_back_flat(outputs, flat_out)
        return _done(outputs)

    # -- point to point and barrier

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Start a gloo send of host copies; the returned Work completes it (see `PointToPoint`)."""
        host = [t.contiguous() for t in _stage(tensors)]
        return PointToPoint(self._gloo.send(host, dst, tag), tensors, host, receive=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Start a gloo receive into host buffers; the returned Work's `wait` writes them back."""
        host = [torch.empty(t.shape, dtype=t.dtype) if _on_device(t) else t for t in tensors]
        return PointToPoint(self._gloo.recv(host, src, tag), tensors, host, receive=True)

    def barrier(self, opts: Any = None) -> dist.Work:
        self._run("barrier", opts or dist.BarrierOptions())
        return _done([])

