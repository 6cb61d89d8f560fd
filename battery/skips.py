"""The skip map: OpInfo entries the battery does not compare, and why.

A skip is for a test that cannot say anything about pjrt (the CPU reference itself is not
reproducible, or the entry is outside what a device can be asked); a known pjrt defect is
never a skip: it stays in the report as fail-wrong, fail-error, unsupported or crash.
Keys are entry keys (`name` or `name.variant`); values map a dtype name, or "*" for all, to the reason.
"""

from __future__ import annotations

SKIPS: dict[str, dict[str, str]] = {
    "item": {"*": "returns a Python number; covered by tests/test_device.py"},
    "tolist": {"*": "returns Python lists; covered by tests/test_device.py"},
    "to_sparse": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
    "sparse.sampled_addmm": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
    "sparse.mm.reduce": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
}


def skip_reason(key: str, dtype: str) -> str | None:
    """Why (key, dtype) is skipped, or None."""
    reasons = SKIPS.get(key, {})
    return reasons.get(dtype) or reasons.get("*")
