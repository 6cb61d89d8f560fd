"""The skip map: OpInfo entries the battery does not compare, and why.

A skip is for a test that cannot say anything about pjrt (the CPU reference itself is not
reproducible, or the entry is outside what a device can be asked); a known pjrt defect is
never a skip: it stays in the report as fail-wrong, fail-error, unsupported or crash.
Keys are entry keys (`name` or `name.variant`); values map a dtype name, or "*" for all, to the reason.
"""

from __future__ import annotations

TIES = "ties: the order of equal values' indices is unspecified, CPU's is one valid answer"

SKIPS: dict[str, dict[str, str]] = {
    "to_sparse": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
    "sparse.sampled_addmm": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
    "sparse.mm.reduce": {"*": "sparse layouts are not a pjrt feature (strided tensors only)"},
    # Samples with many equal keys (few distinct values in these dtypes) and stable=False / topk: which index of
    # equal values comes first is unspecified, so CPU's indices are one valid answer of several. Values and
    # indices are still compared in float32 and float64.
    "sort": {dtype: TIES for dtype in ("bool", "bfloat16", "float16")},
    "topk": {dtype: TIES for dtype in ("bool", "bfloat16", "float16", "int32", "int64")},
    "argsort": {dtype: TIES for dtype in ("bool", "bfloat16", "float16")},
    "kthvalue": {dtype: TIES for dtype in ("int32", "int64")},
    # Its (3000,) sample holds each value many times in these dtypes, and CPU returns the index of an arbitrary
    # occurrence of the mode (from ~100 elements neither the first nor the last; PyTorch's test_compare_cpu skips
    # float32 on CUDA for this sample). Values and indices are still compared in float32 and float64.
    "mode": {dtype: TIES for dtype in ("bool", "bfloat16", "float16", "int32", "int64")},
    # PyTorch's |x| > 5 branch of J0 and Y1 evaluates Cephes' QQ polynomial without its leading coefficient 1
    # (p1evl), off by up to ~3e-7; pjrt matches the true value (tests/test_ops_pointwise.py checks float64
    # against the exact power series).
    "special.bessel_j0": {"float64": "the CPU reference is off by up to 3e-7 for |x| > 5 (a PyTorch bug)"},
    "special.bessel_y1": {"float64": "the CPU reference is off by up to 3e-7 for x > 5 (a PyTorch bug)"},
    # PyTorch's CPU matrix_exp reads its double coefficient tables as half-type memory for bfloat16 and float16,
    # so it returns inf/nan; pjrt computes in float32 (tests/test_ops_linalg.py checks against that).
    "matrix_exp": {dtype: "the CPU reference returns inf/nan for half types (a PyTorch bug)"
                   for dtype in ("bfloat16", "float16")},
}


def skip_reason(key: str, dtype: str) -> str | None:
    """Why (key, dtype) is skipped, or None."""
    reasons = SKIPS.get(key, {})
    return reasons.get(dtype) or reasons.get("*")
