"""A fixed fast slice of the bad-input battery (battery/run_errors.py): where CPU raises, pjrt raises.

Every ErrorInput of the entries in ENTRIES and EXAMPLES derandomized hypothesis cases of each property in
PROPERTIES must keep their outcome rules: CPU's exception class or a deferred device-check RuntimeError
where CPU raises, CPU's values where it returns. The whole battery is `make battery-errors`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.opinfo.core import SampleInput

from battery import properties, run_errors, run_opinfo

EXAMPLES = 8
ENTRIES = (
    "diagonal", "gather", "gradient", "index_select", "movedim", "multinomial", "narrow", "reshape", "roll", "scatter",
    "scatter_add", "take", "view",
)
PROPERTIES = (
    "gather", "scatter", "take/put_", "one_hot", "bincount", "repeat_interleave", "multinomial", "binary_cross_entropy",
    "view/reshape", "expand", "narrow/select/slice", "dims",
)


@functools.cache
def entries() -> dict[str, Any]:
    return run_opinfo.load_entries()


def _problems(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{row['outcome']}: {row['what'][:200]}; CPU {row['cpu']}; pjrt {row['pjrt']}"
            for row in rows if run_errors.is_defect(row)]


@pytest.mark.parametrize("key", ENTRIES)
def test_error_inputs(key: str) -> None:
    rows: list[dict[str, Any]] = []
    run_errors.run_key(f"errors:{key}", entries(), EXAMPLES, rows.append)
    assert rows and rows[0]["outcome"] != "skip"
    assert not _problems(rows), "\n".join(_problems(rows))


@pytest.mark.parametrize("name", PROPERTIES)
def test_hypothesis_cases(name: str) -> None:
    rows: list[dict[str, Any]] = []
    run_errors.run_key(f"hypothesis:{name}", entries(), EXAMPLES, rows.append)
    assert len(rows) == EXAMPLES
    assert not _problems(rows), "\n".join(_problems(rows))


def test_the_same_count_draws_the_same_cases() -> None:
    drawn: list[list[str]] = [[], []]
    for found in drawn:
        properties.explore("gather", 4, lambda case, found=found: found.append(case.what))
    assert drawn[0] == drawn[1] and len(set(drawn[0])) > 1


def _outcome(fn: Any, *args: Any) -> dict[str, Any]:
    return run_errors.run_case(run_errors.Case(fn, SampleInput(args[0], args=args[1:]), "test"))


def test_outcomes_tell_a_value_from_an_error() -> None:
    x = torch.randn(5) + 2
    bad, good = torch.tensor([7]), torch.tensor([4, -5])
    assert _outcome(lambda t, i: t[i], x, bad)["outcome"] == "raises-deferred-runtimeerror"
    assert _outcome(lambda t, i: t[i], x, good)["outcome"] == "returns-cpu-value"
    # a call that raises on CPU only: the value pjrt returns is the defect
    cpu_only = lambda t: t.sin() if t.device.type == "pjrt" else t.view(3)
    row = _outcome(cpu_only, x)
    assert row["outcome"] == "returns-value-where-cpu-raises" and run_errors.is_defect(row)
    other_value = lambda t: t.cos() if t.device.type == "pjrt" else t.sin()
    assert _outcome(other_value, x)["outcome"] == "returns-other-value"
    other_class = lambda t: t.view(3) if t.device.type == "pjrt" else t[9]
    assert _outcome(other_class, x)["outcome"] == "raises-other-class"
    assert _outcome(lambda t: t.view(3), x)["outcome"] == "raises-same-class"


def test_moving_a_sample_keeps_its_views_and_aliases() -> None:
    base = torch.randn(6) + 2
    sample = SampleInput(base[1:], args=(base.expand(2, 6),), kwargs={"out": base})
    moved = run_opinfo.on_pjrt(sample, keep_aliases=True)
    assert moved.input.storage_offset() == 1 and moved.args[0].stride() == (0, 1)
    moved.kwargs["out"].add_(1)
    torch.testing.assert_close(moved.input.cpu(), base[1:] + 1)
    torch.testing.assert_close(moved.args[0].cpu(), base.expand(2, 6) + 1)


def _ints(*shape: int) -> torch.Tensor:
    return torch.randint(-5, 5, shape)


def _table(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(shape) + 2).to(dtype)


def _ids(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# CPU raises at the op from shapes, dtypes or static arguments alone (cases the battery found): pjrt raises
# the same class; fresh random values each run
STATIC_ERRORS: dict[str, tuple[Any, Any]] = {
    "index_add_source_shape": (lambda x, i, s: x.index_add(0, i, s), lambda: (_table(3, 2), _ids(0, 1), _table(2))),
    "index_add_0d_self": (lambda x, i, s: x.index_add_(0, i, s), lambda: (_table(), _ids(0), _table(1))),
    "index_copy_int32_index": (lambda x, i, s: x.index_copy(0, i, s),
                               lambda: (_table(3, 2), _ids(0, dtype=torch.int32), _table(1, 2))),
    "index_fill_int32_index": (lambda x, i: x.index_fill(0, i, 1.5), lambda: (_table(3), _ids(0, dtype=torch.int32))),
    "index_select_0d_dim": (lambda x, i: torch.index_select(x, 1, i), lambda: (_table(), _ids(0))),
    "index_put_value_shape": (lambda x, i, v: x.index_put_((i,), v), lambda: (_table(0, 4, 1), _ids(), _table(0, 4))),
    "index_of_an_empty_dim": (lambda x, i: x[i], lambda: (_table(0, 3), _ids(1))),
    "masked_scatter_byte_mask": (lambda x, m, s: x.masked_scatter(m, s),
                                 lambda: (_table(1, 3), torch.ones(1, 3, dtype=torch.uint8), _table(3, 4))),
    "nll_loss_int32_target": (F.nll_loss, lambda: (_table(3, 4), _ids(0, 1, 2, dtype=torch.int32))),
    "nll_loss_weight_size": (lambda x, t, w: F.nll_loss(x, t, weight=w), lambda: (_table(2, 4), _ids(0, 1), _table(5))),
    "one_hot_empty_no_classes": (lambda t: F.one_hot(t, 0), lambda: (_ids(),)),
    "conv3d_negative_padding": (lambda x, w: F.conv3d(x, w, padding=-1), lambda: (_table(1, 1, 4, 4, 4),
                                                                                 _table(1, 1, 2, 2, 2))),
    "conv1d_negative_dilation": (lambda x, w: F.conv1d(x, w, dilation=-1), lambda: (_table(1, 1, 4), _table(1, 1, 2))),
    "as_strided_scatter_storage": (lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (200, 200)),
                                   lambda: (_table(4, 4), _table(2, 2))),
    "complex_int_part": (torch.complex, lambda: (_table(3), _table(3, dtype=torch.int32))),
    "complex_out_dtype": (lambda r, i, o: torch.complex(r, i, out=o),
                          lambda: (_table(3, dtype=torch.float64), _table(3, dtype=torch.float64),
                                   torch.empty(3, dtype=torch.complex64))),
    "aminmax_out_dtype": (lambda x, a, b: torch.aminmax(x, dim=0, out=(a, b)),
                          lambda: (_table(4, 3), torch.empty(3), torch.empty(3, dtype=torch.float64))),
    "kthvalue_out_is_input": (lambda x, i: torch.kthvalue(x, 2, out=(x, i)),
                              lambda: (_table(6), torch.empty((), dtype=torch.int64))),
    "lt_into_a_smaller_self": (lambda x, y: x.lt_(y), lambda: (_table(2), _table(2, 2))),
    "fmod_into_a_smaller_self": (lambda x, y: x.fmod_(y), lambda: (_table(2), _ints(1, 2))),
    "frac_of_ints": (torch.frac, lambda: (_ints(3),)),
    "round_of_bools": (lambda x: x.round_(), lambda: (_ints(3) > 0,)),
    "median_of_bools": (torch.median, lambda: (_ints(3) > 0,)),
    "median_of_an_empty_dim": (lambda x: x.median(0), lambda: (_table(0),)),
    "std_of_ints": (torch.std, lambda: (_ints(2, 3),)),
    "amax_of_an_empty_dim": (lambda x: x.amax(1), lambda: (_table(3, 0),)),
    "argmin_of_nothing": (torch.argmin, lambda: (_table(0),)),
    "bitwise_and_of_floats": (torch.bitwise_and, lambda: (_table(3), _table(3))),
    "cat_of_0d_tensors": (lambda a, b: torch.cat([a, b]), lambda: (_table(), _table())),
    "stack_of_unequal_sizes": (lambda a, b: torch.stack([a, b], 3), lambda: (_table(2, 2, 2), _table(2, 2))),
    "embedding_weight_not_2d": (F.embedding, lambda: (_ids(0), _table(1, 1, 1))),
    "bucketize_boundaries_not_1d": (torch.bucketize, lambda: (_table(3, 3), _table(3, 3))),
    "index_tensors_that_do_not_broadcast": (lambda x, i, j: x[i, j], lambda: (_table(2, 3), _ids(0, 1), _ids(0, 1, 2))),
    "repeat_interleave_float_repeats": (torch.repeat_interleave, lambda: (_table(),)),
    "multinomial_out_dtype": (lambda p, o: torch.multinomial(p, 2, out=o),
                              lambda: (_table(1, 2, dtype=torch.float64).abs(), torch.empty(1, 2).double())),
    "randn_size_overflow": (lambda x: torch.randn(2**62, 3, device=x.device), lambda: (_table(1),)),
    "pow_of_bools_by_a_bool_tensor": (torch.pow, lambda: (_ints(3) > 0, _ints(3) > 0)),
    "pow_of_true_by_bools": (lambda x: torch.pow(True, x), lambda: (_ints(3) > 0,)),
}
# CPU returns (nothing is selected, so no index is checked; or an empty tensor with a huge side)
STATIC_VALUES: dict[str, tuple[Any, Any]] = {
    "index_add_into_empty": (lambda x, i, s: x.index_add_(-1, i, s), lambda: (_table(2, 0), _ids(5)[0], _table(2, 1))),
    "index_copy_with_an_empty_side": (lambda x, i, s: x.index_copy_(1, i, s),
                                      lambda: (_table(4, 2, 0), _ids(0)[0], _table(4, 1, 0))),
    "index_put_selecting_nothing": (lambda x, i, v: x.index_put_((i,), v),
                                    lambda: (_table(1, 0, 4), _ids(0, -7, 1, 1), _table(4, 0, 4))),
    "repeat_interleave_int32_repeats": (torch.repeat_interleave,
                                        lambda: (torch.randint(0, 3, (4,), dtype=torch.int32),)),
    "view_of_an_empty_tensor_with_a_huge_side": (lambda x: x.view(2**62, 0), lambda: (_table(2, 0, 0),)),
    # a bool tensor raised to a bool is a bool (a copy or a fill), in place and into out= too
    "pow_of_bools_by_a_bool": (lambda x, o: (torch.pow(x, False), torch.pow(x, True, out=o), x.pow_(True)),
                               lambda: (_ints(2, 3) > 0, torch.empty(0, dtype=torch.bool))),
}


@pytest.mark.parametrize("name", sorted(STATIC_ERRORS))
def test_static_errors_raise_cpus_class_at_the_op(name: str) -> None:
    fn, make = STATIC_ERRORS[name]
    row = _outcome(fn, *make())
    assert row["outcome"] == "raises-same-class", row


@pytest.mark.parametrize("name", sorted(STATIC_VALUES))
def test_calls_cpu_answers_get_cpus_values(name: str) -> None:
    fn, make = STATIC_VALUES[name]
    row = _outcome(fn, *make())
    assert row["outcome"] == "returns-cpu-value", row
