"""Shared test helpers: run the same function on CPU and on pjrt and compare."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree


def to_device(value: Any, device: str = "pjrt") -> Any:
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def assert_same(actual: Any, expected: Any, **tolerances: Any) -> None:
    """Compare pjrt results with CPU results (values, dtypes, shapes; pjrt moved to CPU)."""
    actual_leaves = pytree.tree_leaves(actual)
    expected_leaves = pytree.tree_leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a)}"
            assert a.device.type == "pjrt", f"result on {a.device}, expected pjrt"
            torch.testing.assert_close(a.cpu(), e, **tolerances)
        else:
            assert a == e or (a != a and e != e), f"{a!r} != {e!r}"


def check(fn: Any, *args: Any, **tolerances: Any) -> Any:
    """Run fn on CPU tensors and on their pjrt copies; assert the results match."""
    expected = fn(*args)
    actual = fn(*to_device(args))
    assert_same(actual, expected, **tolerances)
    return actual


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Any:
    """accelerate keeps one process-wide state; each test builds its own (modules that use accelerate
    import this fixture)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
