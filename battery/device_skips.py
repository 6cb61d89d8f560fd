"""Known failures of battery/device_tests.py on pjrt: (test, OpInfo entry key) -> why.

Each entry is a pjrt gap or a documented difference; the test still runs, and fails once the
entry passes, so this list only shrinks with the code.
"""

from __future__ import annotations

NO_LDL = "no lowering for linalg_ldl_factor_ex (LAPACK's Bunch-Kaufman pivoting is not reproduced): NotImplementedError"
NO_COMPLEX32 = "pjrt tensors cannot hold complex32: UnsupportedDtype (a NotImplementedError)"
NO_OUT_META = "PyTorch has no meta kernel for this out= overload (torch_pjrt registers the functional form's)"
OUT_TUPLE = "the test passes out= as one tuple, and this overload takes its outputs as separate arguments"
PYTORCH_IHFFT_OUT = ("a PyTorch bug, on CPU too: with out= the result never reaches `out` (conj_physical.out "
                     "gets `out` as its input), so `out` keeps whatever it held; pjrt does what CPU does")
DATA_DEPENDENT_OUT = "data-dependent out= forms have no lowering (the functional forms run in eager)"

AS_STRIDED = ("as_strided addresses the storage, so a non-contiguous copy selects other elements (PyTorch's own "
              "test_noncontiguous_samples skips it)")

KNOWN_FAILURES: dict[tuple[str, str], str] = {
    ("test_noncontiguous_samples", "as_strided"): AS_STRIDED,
    ("test_noncontiguous_samples", "as_strided.partial_views"): AS_STRIDED,
    ("test_noncontiguous_samples", "chalf"): NO_COMPLEX32,
    ("test_variant_consistency", "chalf"): NO_COMPLEX32,
    ("test_noncontiguous_samples", "view_as_complex"): "view_as_complex needs a last dimension of stride 1; "
    "CPU raises the same error for the non-contiguous sample",
    **{(test, key): NO_LDL for test in ("test_noncontiguous_samples", "test_out")
       for key in ("linalg.ldl_factor", "linalg.ldl_factor_ex", "linalg.ldl_solve")},
    ("test_out", "_native_batch_norm_legit"): NO_OUT_META,
    ("test_out", "geqrf"): NO_OUT_META,
    ("test_out", "histogram"): NO_OUT_META,
    ("test_out", "linalg.lstsq"): NO_OUT_META,
    ("test_out", "_batch_norm_with_update"): OUT_TUPLE,
    ("test_out", "histogramdd"): OUT_TUPLE,
    ("test_out", "masked_select"): DATA_DEPENDENT_OUT,
    ("test_out", "nonzero"): DATA_DEPENDENT_OUT,
    ("test_out", "native_batch_norm"): "native_batch_norm.out updates the running statistics without declaring "
    "it in its schema; pjrt raises instead of writing them silently",
    ("test_out", "fft.ihfft2"): PYTORCH_IHFFT_OUT,
    ("test_out", "fft.ihfftn"): PYTORCH_IHFFT_OUT,
}


def known_failure(test: str, key: str) -> str | None:
    return KNOWN_FAILURES.get((test, key))
