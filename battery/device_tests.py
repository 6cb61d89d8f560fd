"""OpInfo consistency tests on pjrt through PyTorch's generic device-test machinery.

`instantiate_device_type_tests` with its PrivateUse1 base (the route out-of-tree backends take)
generates, for every OpInfo entry in float32, tests that compare pjrt with itself the way
PyTorch's own consistency tests do: non-contiguous inputs against contiguous ones, the method
and in-place variants against the function, and the out= variant against the function.
(Values against CPU are the battery's job: battery.run_opinfo.)

Known failures are listed in battery/device_skips.py with the reason; such a test still runs,
and one that now passes fails, so the map cannot go stale.
Run: .venv/bin/python -m pytest battery/device_tests.py   (make battery-device-tests writes a report)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, ops
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_utils import TestCase
from torch.utils import _pytree as pytree

from battery.device_skips import known_failure
from battery.run_opinfo import RANDOM_ENTRIES
from battery.skips import skip_reason


def _key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# Entries whose values are random or undefined cannot be compared run against run; the battery's
# whole-entry skips (sparse layouts) hold here too.
COMPARABLE = [op for op in op_db if op.name not in RANDOM_ENTRIES and not op.name.startswith("empty")
              and skip_reason(_key(op), "float32") is None]
SAMPLES = 4


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class TestPjrtOpConsistency(TestCase):
    def _check(self, test: str, op: Any, body: Callable[[], None]) -> None:
        reason = known_failure(test, _key(op))
        if reason is None:
            body()
            return
        try:
            body()
        except Exception:
            self.skipTest(f"known failure: {reason}")
        self.fail(f"{test} now passes for {_key(op)}: remove it from battery/device_skips.py")

    def _samples(self, op: Any, device: str, dtype: torch.dtype) -> list[Any]:
        return list(op.sample_inputs(device, dtype, requires_grad=False))[:SAMPLES]

    @ops(COMPARABLE, allowed_dtypes=(torch.float32,))
    def test_noncontiguous_samples(self, device: str, dtype: torch.dtype, op: Any) -> None:
        def body() -> None:
            for sample in self._samples(op, device, dtype):
                expected = op(sample.input, *sample.args, **sample.kwargs)
                strided = sample.noncontiguous()
                actual = op(strided.input, *strided.args, **strided.kwargs)
                self.assertEqual(actual, expected, atol=1e-5, rtol=1.3e-6, exact_dtype=True)

        self._check("test_noncontiguous_samples", op, body)

    @ops([op for op in COMPARABLE if op.get_method() or op.get_inplace()], allowed_dtypes=(torch.float32,))
    def test_variant_consistency(self, device: str, dtype: torch.dtype, op: Any) -> None:
        method, inplace = op.get_method(), op.get_inplace()

        def body() -> None:
            for sample in self._samples(op, device, dtype):
                expected = op(sample.input, *sample.args, **sample.kwargs)
                if method is not None:
                    self.assertEqual(method(sample.input, *sample.args, **sample.kwargs), expected)
                if inplace is not None and isinstance(expected, torch.Tensor) and expected.dtype == dtype \
                        and sample.input.shape == expected.shape:
                    target = sample.input.clone()
                    result = inplace(target, *sample.args, **sample.kwargs)
                    self.assertIs(result, target)
                    self.assertEqual(target, expected)

        self._check("test_variant_consistency", op, body)

    @ops([op for op in COMPARABLE if op.supports_out], allowed_dtypes=(torch.float32,))
    def test_out(self, device: str, dtype: torch.dtype, op: Any) -> None:
        def body() -> None:
            for sample in self._samples(op, device, dtype):
                expected = op(sample.input, *sample.args, **sample.kwargs)
                leaves = _tensors(expected)
                if not leaves or len(leaves) != len(pytree.tree_leaves(expected)):
                    continue
                out = pytree.tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t,
                                      expected)
                result = op(sample.input, *sample.args, out=out, **sample.kwargs)
                for got, buffer, want in zip(_tensors(result), _tensors(out), leaves):
                    self.assertEqual(got.data_ptr(), buffer.data_ptr())
                    self.assertEqual(buffer, want)

        self._check("test_out", op, body)


instantiate_device_type_tests(TestPjrtOpConsistency, globals(), only_for="pjrt")
