"""The "pjrt" c10d backend: one process group, two engines.

- `xla_engine`: collectives as XLA programs over the group's devices, on jax's multi-process
  runtime (started from torchrun's environment, `runtime/multiprocess.py`): no host copies.
- `host_engine`: gloo over host copies, where the runtime is not running (no torchrun
  environment, TORCH_PJRT_DISTRIBUTED=host, jax started before it could join), for CPU tensors,
  dtypes or splits XLA's collectives do not carry, and for send/recv and barrier.

Each call picks its engine from its tensors; `metrics` counts `collectives_xla` and
`collectives_host`, and `engine()` / `torch-pjrt info` say which engine runs and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from torch_pjrt.distributed import host_engine, xla_engine
from torch_pjrt.runtime import client, metrics, multiprocess, spmd
from torch_pjrt.runtime.startup import NAME


def _flat_lists(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _reduction(opts: Any) -> Any:
    return xla_engine.reduce_kind(opts.reduceOp)


class ProcessGroupPjrt(dist.ProcessGroup):
    """A c10d process group for pjrt (and CPU) tensors."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._host = host_engine.HostCollectives(store, rank, size, timeout)
        self._store, self._timeout = store, timeout
        self._xla: xla_engine.XlaCollectives | None = None
        self._xla_decided = False
        self._host_only = False
        # c10d reads the group's name (and bound devices) from its C++ backends: gloo stands in.
        for device in ("cpu", NAME):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, self._host.gloo)

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return NAME

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def use_host_engine(self, host_only: bool = True) -> None:
        """Send this group's collectives through the host engine (to bisect a problem, or compare the two)."""
        self._host_only = host_only

    def program_mesh(self, device_index: int) -> Any:
        """The mesh compiled graphs run their collectives of this group on (XLA engine), or None (host)."""
        engine = self._xla_engine()
        return None if engine is None else engine.mesh(device_index)

    def _xla_engine(self) -> xla_engine.XlaCollectives | None:
        """The group's XLA engine, or None where its ranks are not joined in jax's runtime or the group is
        sent through the host; decided at the first collective (after jax has started)."""
        if not self._xla_decided:
            client.jax_module()
            if multiprocess.joined() or self.size() == 1:
                self._xla = xla_engine.XlaCollectives(self._store, self.rank(), self.size())
            self._xla_decided = True
        return None if self._host_only else self._xla

    def _engine(self, tensors: Sequence[torch.Tensor], usable: bool = True) -> Any:
        """The XLA engine where it can run a collective of `tensors`, else None (the host engine)."""
        engine = self._xla_engine()
        if usable and engine is not None and xla_engine.supports(tensors):
            return engine
        if any(t.device.type == NAME for t in tensors):
            metrics.bump("collectives_host")
        return None

    # -- reductions

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        engine = self._engine(tensors, _reduction(opts) in xla_engine.REDUCTIONS)
        return engine.allreduce(tensors, opts) if engine else self._host.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        engine = self._engine(tensors, _reduction(opts) in xla_engine.REDUCTIONS)
        return engine.allreduce_coalesced(tensors, opts) if engine else self._host.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        engine = self._engine(tensors, _reduction(opts) in xla_engine.REDUCTIONS)
        return engine.reduce(tensors, opts) if engine else self._host.reduce(tensors, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        engine = self._engine([output, input], _reduction(opts) in xla_engine.REDUCTIONS)
        if engine:
            return engine.reduce_scatter_tensor(output, input, opts)
        return self._host._reduce_scatter_base(output, input, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        engine = self._engine([*outputs, *_flat_lists(input_lists)], _reduction(opts) in xla_engine.REDUCTIONS)
        if engine:
            return engine.reduce_scatter(outputs, input_lists, opts)
        return self._host.reduce_scatter(outputs, input_lists, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._last(works, outputs)

    # -- data movement

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.BroadcastOptions()
        engine = self._engine(tensors)
        return engine.broadcast(tensors, opts) if engine else self._host.broadcast(tensors, opts)

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        engine = self._engine([*_flat_lists(output_lists), *inputs])
        if engine:
            return engine.allgather(output_lists, inputs)
        return self._host.allgather(output_lists, inputs, opts or dist.AllgatherOptions())

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        engine = self._engine([output, input])
        if engine:
            return engine.all_gather_tensor(output, input)
        return self._host._allgather_base(output, input, opts or dist.AllgatherOptions())

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._last(works, outputs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        works = [self.allgather([outputs], [input], opts) for outputs, input in zip(output_lists, inputs, strict=True)]
        return self._last(works, output_lists)

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        opts = opts or dist.GatherOptions()
        engine = self._engine([*_flat_lists(output_lists), *inputs])
        if engine:
            return engine.gather(output_lists, inputs, opts.rootRank)
        return self._host.gather(output_lists, inputs, opts)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        engine = self._engine([*outputs, *_flat_lists(input_lists)])
        if engine:
            return engine.scatter(outputs, input_lists, opts.rootRank)
        return self._host.scatter(outputs, input_lists, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        # Explicit splits may differ between ranks, which each decide alone: those go through gloo.
        even = not input_split_sizes and not output_split_sizes and input.numel() == output.numel()
        engine = self._engine([output, input], even)
        if engine:
            return engine.all_to_all_tensor(output, input)
        return self._host.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        even = len({t.numel() for t in [*outputs, *inputs]}) == 1
        engine = self._engine([*outputs, *inputs], even)
        if not engine:
            return self._host.alltoall(outputs, inputs, opts)
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype, device=outputs[0].device)
        engine.all_to_all_tensor(flat_out, torch.cat([t.reshape(-1) for t in inputs]))
        for t, piece in zip(outputs, flat_out.split([t.numel() for t in outputs]), strict=True):
            t.copy_(piece.view(t.shape))
        return engine.settled(outputs)

    # -- point to point and barrier: gloo (matched XLA programs would need both peers' orders to agree)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        self._engine(tensors, usable=False)
        return self._host.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        self._engine(tensors, usable=False)
        return self._host.recv(tensors, src, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._host.barrier(opts)

    def _last(self, works: list[dist.Work], value: Any) -> dist.Work:
        """One finished Work for several (coalesced calls): each of them waited for."""
        for work in works:
            work.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(value)
        return _create_work_from_future(future)

    # torch 2.13 names for the single-tensor collectives.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced


def _program_mesh(group_name: Any, device_index: int) -> Any:
    group = group_name if isinstance(group_name, dist.ProcessGroup) else (
        dist.distributed_c10d._resolve_process_group(group_name))
    return group.program_mesh(device_index) if isinstance(group, ProcessGroupPjrt) else None


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupPjrt:
    """The creator c10d calls for `init_process_group("pjrt")` and `new_group(backend="pjrt")`."""
    multiprocess.set_collective_timeout(timeout.total_seconds())
    spmd.install_mesh_resolver(_program_mesh)
    from torch_pjrt.distributed import lowerings  # noqa: F401 (compiled functional collectives)

    return ProcessGroupPjrt(store, rank, size, timeout)
