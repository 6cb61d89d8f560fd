"""Lowerings of the functional collectives (`_c10d_functional`) for compiled graphs.

Under `torch.compile(backend="pjrt")` a functional collective is a node of the traced graph.
Its lowering is an ordered host callback inside the jitted program: the callback runs the same
collective on CPU tensors through the process group (gloo), so compiled ranks meet in program
order, like eager ones. `wait_tensor` is the identity: the callback has finished by then.
Eager calls never come here (c10d's own kernels reach the process group directly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torch_pjrt.ops.registry import register

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
        result = collective(*(storage.host_tensor(np.asarray(v)) for v in values))
        return storage.host_array(result)

    like = jax.ShapeDtypeStruct(shape, arrays[0].dtype)
    return io_callback(host, like, *arrays, ordered=True)


def _all_reduce_host(op: dist.ReduceOp, group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor

    return run


@register(c10d.all_reduce.default)
def all_reduce(input: Any, reduce_op: str, group_name: Any) -> Any:
    run = _all_reduce_host(_reduce_op(reduce_op), _group(group_name))
    return _host_collective(run, tuple(input.shape), input)


@register(c10d.all_reduce_coalesced.default)
def all_reduce_coalesced(inputs: list[Any], reduce_op: str, group_name: Any) -> list[Any]:
    return [all_reduce(t, reduce_op, group_name) for t in inputs]


@register(c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(input: Any, group_size: int, group_name: Any) -> Any:
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
    rows = sum(outputs) if outputs else input.shape[0]
    shape = (rows, *input.shape[1:])

    def run(tensor: torch.Tensor) -> torch.Tensor:
        output = tensor.new_empty(shape)
        dist.all_to_all_single(output, tensor, outputs, inputs, group=group)
        return output

    return _host_collective(run, shape, input)


@register(c10d.broadcast.default)
def broadcast(input: Any, src: int, group_name: Any) -> Any:
    group = _group(group_name)

    def run(tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
        return tensor

    return _host_collective(run, tuple(input.shape), input)


@register(c10d.wait_tensor.default)
def wait_tensor(tensor: Any) -> Any:
    return tensor
