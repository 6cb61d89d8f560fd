"""Programs that every rank of a mesh runs together, so collectives are nodes inside them.

A compiled graph with collectives (DDP's and FSDP2's under torch.compile, functional
collectives) becomes one SPMD program: `shard_map` over the group's mesh (one device per rank),
every argument and result this rank's own (replicated specs, no checks of variance), so the
graph's code is the single-device code and a collective lowers to the XLA collective over the
mesh axis. The distributed layer says which mesh a process group has (`install_mesh_resolver`);
lowerings ask `axis()` whether they are being traced inside such a program.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from torch_pjrt.runtime import client, programs

AXIS = "ranks"
_tracing = threading.local()
_resolvers: list[Callable[[Any, int], Any]] = []
# Collective ops (their overloads) and the position of their process-group argument.
COLLECTIVES: dict[Any, int] = {}


def register_collective(target: Any, group_argument: int) -> None:
    COLLECTIVES[target] = group_argument


def install_mesh_resolver(resolve: Callable[[Any, int], Any]) -> None:
    """`resolve(group_name, device_index)`: the group's mesh for collectives inside programs, or None."""
    _resolvers[:] = [resolve]


def mesh_of(group_name: Any, device_index: int) -> Any:
    return _resolvers[0](group_name, device_index) if _resolvers else None


def axis() -> str | None:
    """The mesh axis of the SPMD program being traced on this thread, or None outside one."""
    return getattr(_tracing, "axis", None)


@contextlib.contextmanager
def _traced_on_mesh() -> Iterator[None]:
    previous = axis()
    _tracing.axis = AXIS
    try:
        yield
    finally:
        _tracing.axis = previous


class MeshProgram:
    """A program run by every rank of `mesh` at once: this rank's arrays in, its results out."""

    def __init__(self, fn: Callable[..., Any], mesh: Any, name: str, counter: str | None = None,
                 donate: tuple[int, ...] = ()) -> None:
        jax = client.jax_module()
        self.mesh = mesh
        self._local_device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def body(*args: Any) -> Any:
            with _traced_on_mesh():
                return fn(*args)

        spec = jax.sharding.PartitionSpec()
        self._program = programs.Program(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False), name, donate=donate,
            counter=counter,
        )

    def _global(self, value: Any) -> Any:
        jax = client.jax_module()
        if isinstance(value, np.ndarray):
            value = jax.device_put(value, self._local_device)
        if isinstance(value, jax.Array):
            return jax.make_array_from_single_device_arrays(value.shape, self._replicated, [value])
        return value

    def call(self, *args: Any) -> Any:
        jax = client.jax_module()
        result = self._program.call(*jax.tree_util.tree_map(self._global, args))
        return jax.tree_util.tree_map(lambda a: a.addressable_data(0) if isinstance(a, jax.Array) else a, result)
