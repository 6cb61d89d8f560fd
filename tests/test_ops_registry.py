"""The lowering table's search for a mutating op's functional counterpart (ops/registry.py)."""

import pytest
import torch

from torch_pjrt.ops import registry

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("mutating", "functional"),
    [
        (aten.add_.Tensor, aten.add.Tensor),  # the in-place op's base packet, same overload name
        (aten.add.Scalar_out, aten.add.Scalar),  # an out= overload: its keyword-only out argument dropped
        (aten.clamp_.Tensor, aten.clamp.Tensor),  # `Tensor? min` is not clamp.default's `Scalar? min`
        (aten.clamp.out, aten.clamp.default),
        (aten.max.dim_max, aten.max.dim),  # several keyword-only outputs
        (aten.bernoulli_.float, aten.bernoulli.p),  # another overload name, same arguments
        (aten.normal_.default, aten.normal_functional.default),  # the `_functional` packet
        (aten._fused_moving_avg_obs_fq_helper.default, aten._fused_moving_avg_obs_fq_helper_functional.default),
    ],
)
def test_the_functional_counterpart_of_an_aten_op(mutating, functional):
    assert registry.functional_counterpart(mutating) is functional


def test_an_op_without_a_functional_form_has_no_counterpart():
    assert registry.functional_counterpart(aten._cummax_helper.default) is None  # writes its two outputs


def test_a_counterpart_defined_after_earlier_searches_is_found():
    """Names tried and found to be no operator are asked again later: a library can define them meanwhile."""
    library = torch.library.Library("torch_pjrt_test_registry", "DEF")
    library.define("shift_.Scalar(Tensor(a!) self, Scalar amount) -> Tensor(a!)")
    library.define("shift_.Tensor(Tensor(a!) self, Tensor amount) -> Tensor(a!)")
    ops = torch.ops.torch_pjrt_test_registry
    assert registry.functional_counterpart(ops.shift_.Scalar) is None
    library.define("shift.Tensor(Tensor self, Tensor amount) -> Tensor")
    assert registry.functional_counterpart(ops.shift_.Tensor) is ops.shift.Tensor


def test_mutated_arguments_are_a_fresh_list_per_call():
    first = registry.mutated_arguments(aten.add.out)
    assert first == [3]
    first.append(0)
    assert registry.mutated_arguments(aten.add.out) == [3]
