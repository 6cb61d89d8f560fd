"""Lowerings of the functional collectives (`_c10d_functional`) for compiled graphs.

Under `torch.compile(backend="pjrt")` a functional collective is a node of the traced graph.
Where the group's collectives run on the XLA engine, the graph is one SPMD program over the
group's mesh (`runtime/spmd.py`) and the node is the XLA collective inside it, the same body
the eager engine runs (`xla_engine.collective_body`): the program never stops for it. Elsewhere
(the host engine, a graph with collectives of several groups) the lowering is an ordered host
callback that runs the collective through the process group, so compiled ranks meet in program
order, like eager ones. `wait_tensor` is the identity either way. Eager calls never come here
(c10d's own kernels reach the process group directly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torch_pjrt.distributed import xla_engine
from torch_pjrt.ops.registry import register
from torch_pjrt.runtime import metrics, spmd

c10d = torch.ops._c10d_functional
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
}


def _group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return dist.distributed_c10d._resolve_process_group(group_name)


def _reduce_op(name: str) -> dist.ReduceOp:
    if name not in REDUCE_OPS:
        raise NotImplementedError(f"compiled collectives support reduce ops {sorted(REDUCE_OPS)}, not {name!r}")
    return REDUCE_OPS[name]


def _host_collective(collective: Callable[..., torch.Tensor], shape: tuple[int, ...], *arrays: Any) -> Any:
    """`collective` on CPU copies of `arrays`, as an ordered callback returning `shape`."""
    from torch_pjrt import storage
    from torch_pjrt.runtime import client

    jax = client.jax_module()
    from jax.experimental import io_callback

    def host(*values: np.ndarray) -> np.ndarray:
        metrics.bump("collectives_host")
        result = collective(*(storage.host_tensor(np.asarray(v)) for v in values))
        return storage.host_array(result)

    like = jax.ShapeDtypeStruct(shape, arrays[0].dtype)
    return io_callback(host, like, *arrays, ordered=True)


def _all_reduce_host(op: dist.ReduceOp, group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    return run


def _in_program(kind: str, input: Any, group_name: Any, *options: Any) -> Any:
    """The collective inside the SPMD program being traced, or None where there is none."""
    if spmd.axis() is None:
        return None
    return xla_engine.collective_body(kind, _group(group_name).size(), *options)(input)


def _reduction(reduce_op: str, group_name: Any) -> tuple[Any, int, None]:
    op = _reduce_op(reduce_op)
    return xla_engine.reduce_kind(op), _group(group_name).size(), None


@register(c10d.all_reduce.default)
def all_reduce(input: Any, reduce_op: str, group_name: Any) -> Any:
    inside = _in_program("all_reduce", input, group_name, *_reduction(reduce_op, group_name))
    if inside is not None:
        return inside
    run = _all_reduce_host(_reduce_op(reduce_op), _group(group_name))
    return _host_collective(run, tuple(input.shape), input)


@register(c10d.all_reduce_coalesced.default)
def all_reduce_coalesced(inputs: list[Any], reduce_op: str, group_name: Any) -> list[Any]:
    return [all_reduce(t, reduce_op, group_name) for t in inputs]


@register(c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(input: Any, group_size: int, group_name: Any) -> Any:
    inside = _in_program("all_gather", input, group_name)
    if inside is not None:
        return inside
    group = _group(group_name)
    shape = (input.shape[0] * group_size, *input.shape[1:])

    def run(tensor: torch.Tensor) -> torch.Tensor:
        output = tensor.new_empty(shape)
        dist.all_gather_into_tensor(output, tensor, group=group)
        return output

    return _host_collective(run, shape, input)


@register(c10d.all_gather_into_tensor_coalesced.default)
def all_gather_into_tensor_coalesced(inputs: list[Any], group_size: int, group_name: Any) -> list[Any]:
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


@register(c10d.reduce_scatter_tensor.default)
def reduce_scatter_tensor(input: Any, reduce_op: str, group_size: int, group_name: Any) -> Any:
    inside = _in_program("reduce_scatter", input, group_name, *_reduction(reduce_op, group_name))
    if inside is not None:
        return inside
    op, group = _reduce_op(reduce_op), _group(group_name)
    shape = (input.shape[0] // group_size, *input.shape[1:])

    def run(tensor: torch.Tensor) -> torch.Tensor:
        output = tensor.new_empty(shape)
        dist.reduce_scatter_tensor(output, tensor, op=op, group=group)
        return output

    return _host_collective(run, shape, input)


@register(c10d.reduce_scatter_tensor_coalesced.default)
def reduce_scatter_tensor_coalesced(inputs: list[Any], reduce_op: str, group_size: int, group_name: Any) -> list[Any]:
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


@register(c10d.all_to_all_single.default)
def all_to_all_single(input: Any, output_split_sizes: list[int], input_split_sizes: list[int], group_name: Any) -> Any:
    group = _group(group_name)
    outputs = [int(s) for s in output_split_sizes] or None
    inputs = [int(s) for s in input_split_sizes] or None
    even = [input.shape[0] // group.size()] * group.size()
    if spmd.axis() is not None and (outputs or even) == even == (inputs or even):
        return xla_engine.collective_body("all_to_all", group.size())(input)
    rows = sum(outputs) if outputs else input.shape[0]
    shape = (rows, *input.shape[1:])

    def run(tensor: torch.Tensor) -> torch.Tensor:
        output = tensor.new_empty(shape)
        dist.all_to_all_single(output, tensor, outputs, inputs, group=group)
        return output

    return _host_collective(run, shape, input)


@register(c10d.broadcast.default)
def broadcast(input: Any, src: int, group_name: Any) -> Any:
    inside = _in_program("broadcast", input, group_name, src)
    if inside is not None:
        return inside
    group = _group(group_name)

    def run(tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        return tensor

    return _host_collective(run, tuple(input.shape), input)


@register(c10d.wait_tensor.default)
def wait_tensor(tensor: Any) -> Any:
    return tensor


for _overload, _group_argument in (
    (c10d.all_reduce.default, 2), (c10d.all_reduce_coalesced.default, 2), (c10d.all_gather_into_tensor.default, 2),
    (c10d.all_gather_into_tensor_coalesced.default, 2), (c10d.reduce_scatter_tensor.default, 3),
    (c10d.reduce_scatter_tensor_coalesced.default, 3), (c10d.all_to_all_single.default, 3),
    (c10d.broadcast.default, 2),
):
    spmd.register_collective(_overload, _group_argument)
