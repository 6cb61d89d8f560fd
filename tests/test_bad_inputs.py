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
from torch.testing._internal.opinfo.core import SampleInput

from battery import properties, run_errors, run_opinfo

EXAMPLES = 8
ENTRIES = (
    "diagonal", "gather", "index_select", "movedim", "multinomial", "narrow", "reshape", "roll", "scatter",
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
