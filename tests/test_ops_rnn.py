"""Recurrent modules and cells on pjrt against CPU, forward and backward: every RNN entry of
PyTorch's module_db (with its error inputs), then GRU and GRUCell directly, packed sequences,
double backward, float64/bfloat16 and torch.compile of a cell.

On pjrt PyTorch takes its non-CPU path (the fused `_thnn_fused_{lstm,gru}_cell` kernels), on CPU
its composite one, so these compare two different implementations of each cell.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from support import assert_same
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils import _pytree as pytree

RNN_MODULES = ("nn.RNNCell", "nn.GRUCell", "nn.LSTMCell", "nn.RNN", "nn.GRU", "nn.LSTM")


@functools.cache
def module_infos() -> dict[str, Any]:
    """module_db's RNN entries by name (imported on first use: loading module_db takes seconds)."""
    from torch.testing._internal.common_modules import module_db

    return {info.name: info for info in module_db if info.name in RNN_MODULES}


def leaf_copies(args: Any, device: str) -> Any:
    """Fresh leaves on device; floating-point ones require grad."""
    def copy_leaf(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().to(device).requires_grad_(value.is_floating_point())

    return pytree.tree_map(copy_leaf, args)


# float32 through two implementations of the recurrence (see above): sums in other orders, whose
# differences the backward accumulates over the steps and layers (seen: 1.3e-5 on a gradient of 1.2)
FLOAT32_TOLERANCES = {"rtol": 1e-5, "atol": 2e-5}


def check_run(module: nn.Module, forward: Any, *args: Any, **tolerances: Any) -> None:
    """forward(module, *args) on pjrt matches CPU: every output, then the gradients of every floating
    input and parameter for random cotangents on all outputs."""
    if not tolerances and all(p.dtype == torch.float32 for p in module.parameters()):
        tolerances = FLOAT32_TOLERANCES
    device_module = copy.deepcopy(module).to("pjrt")
    cpu_args, device_args = leaf_copies(args, "cpu"), leaf_copies(args, "pjrt")
    expected = pytree.tree_leaves(forward(module, *cpu_args))
    actual = pytree.tree_leaves(forward(device_module, *device_args))
    assert_same(actual, expected, **tolerances)
    cotangents = [torch.randn_like(e) for e in expected]
    torch.autograd.backward(expected, cotangents)
    torch.autograd.backward(actual, [c.to("pjrt") for c in cotangents])

    def grads(module: nn.Module, args: Any) -> list[torch.Tensor]:
        inputs = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        return [t.grad for t in inputs + list(module.parameters())]

    assert_same(grads(device_module, device_args), grads(module, cpu_args), **tolerances)


def call(module: nn.Module, *args: Any) -> Any:
    return module(*args)


# --- PyTorch's module_db ----------------------------------------------------------------------------


# float32 only: every configuration again in float64 doubled the file's time in CI (5 min); float64 and
# bfloat16 run for GRU in test_gru_dtypes below.
@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("name", RNN_MODULES)
def test_module_db_samples(name: str, dtype: torch.dtype) -> None:
    info = module_infos()[name]
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True)
    for sample in samples:
        module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(dtype)
        try:
            check_run(module, call, *sample.forward_input.args)
        except AssertionError as error:
            raise AssertionError(f"{name}({sample.constructor_input.kwargs}) on "
                                 f"{[getattr(a, 'shape', a) for a in sample.forward_input.args]}: {error}") from error


@pytest.mark.parametrize("name", RNN_MODULES)
def test_module_db_error_inputs(name: str) -> None:
    """Bad forward arguments raise what CPU raises (construction errors never reach the device)."""
    from torch.testing._internal.common_modules import ModuleErrorEnum

    info = module_infos()[name]
    errors = info.module_error_inputs_func(info, device="pjrt", dtype=torch.float32, requires_grad=False,
                                           training=True)
    forward_errors = [e for e in errors if e.error_on == ModuleErrorEnum.FORWARD_ERROR]
    assert forward_errors
    for error in forward_errors:
        sample = error.module_error_input
        module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to("pjrt")
        with pytest.raises(error.error_type, match=error.error_regex):
            module(*sample.forward_input.args, **sample.forward_input.kwargs)


# --- GRU and GRUCell ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_gru_batched_with_initial_state(bias: bool) -> None:
    module = nn.GRU(5, 4, num_layers=2, bias=bias, batch_first=True, bidirectional=True)
    check_run(module, call, torch.randn(3, 6, 5), torch.randn(4, 3, 4))


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell_batched(bias: bool) -> None:
    check_run(nn.GRUCell(5, 4, bias=bias), call, torch.randn(3, 5), torch.randn(3, 4))


def test_gru_cell_unrolled_over_a_sequence() -> None:
    """The state feeds back step after step, so the backward chains fused cell backwards."""
    def unroll(cell: nn.Module, inputs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        for step in inputs:
            state = cell(step, state)
        return state

    check_run(nn.GRUCell(3, 5), unroll, torch.randn(6, 2, 3), torch.randn(2, 5))


def test_lstm_cell_without_bias() -> None:
    check_run(nn.LSTMCell(5, 4, bias=False), call, torch.randn(3, 5), (torch.randn(3, 4), torch.randn(3, 4)))


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_batched(bias: bool) -> None:
    check_run(nn.LSTM(8, 6, num_layers=2, bias=bias, batch_first=True, bidirectional=True), call,
              torch.randn(3, 5, 8))


def test_lstm_with_projection_batched() -> None:
    check_run(nn.LSTM(5, 4, num_layers=2, proj_size=3, bidirectional=True), call, torch.randn(6, 3, 5))


@pytest.mark.parametrize("module_cls", [nn.RNN, nn.GRU, nn.LSTM], ids=lambda c: c.__name__)
def test_packed_sequences(module_cls: type[nn.Module]) -> None:
    lengths = torch.tensor([6, 4, 1])

    def padded(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        output, _ = module(pack_padded_sequence(inputs, lengths))
        return pad_packed_sequence(output)[0]

    check_run(module_cls(4, 3, num_layers=2, bidirectional=True), padded, torch.randn(6, 3, 4))


@pytest.mark.parametrize("module_cls", [nn.GRUCell, nn.LSTMCell], ids=lambda c: c.__name__)
def test_cell_double_backward(module_cls: type[nn.Module]) -> None:
    """With create_graph PyTorch differentiates the cell through its composite backward."""
    def gradient_norm(cell: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        output = pytree.tree_leaves(cell(inputs))[0]
        grads = torch.autograd.grad((output * output).sum(), [inputs, *cell.parameters()], create_graph=True)
        return sum((g * g).sum() for g in grads)

    check_run(module_cls(4, 3), gradient_norm, torch.randn(2, 4))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, None), (torch.bfloat16, 2e-2)], ids=str)
def test_gru_dtypes(dtype: torch.dtype, tolerance: float | None) -> None:
    tolerances = {} if tolerance is None else {"atol": tolerance, "rtol": tolerance}
    check_run(nn.GRU(4, 3, num_layers=2).to(dtype), call, torch.randn(5, 2, 4, dtype=dtype), **tolerances)


def test_gru_cell_compiled() -> None:
    """torch.compile traces the fused cell and its backward with the meta kernels registered here
    (Dynamo refuses the RNN modules themselves unless torch._dynamo.config.allow_rnn is set)."""
    def run(cell: nn.Module, inputs: torch.Tensor, state: torch.Tensor) -> Any:
        if inputs.device.type == "pjrt":
            cell = torch.compile(cell, backend="pjrt", fullgraph=True)
        return cell(inputs, state)

    check_run(nn.GRUCell(4, 3), run, torch.randn(2, 4), torch.randn(2, 3))
