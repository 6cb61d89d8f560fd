# ruff: noqa: N802, N803, N806 (parameters keep ATen schema names: A, B, LU, UPLO; math names L, U, P)
"""Matrix products and torch.linalg.

Products run at the precision `torch.set_float32_matmul_precision` asks for (HIGHEST by default,
as PyTorch's CPU kernels compute), with float32 accumulation for half types. Factorisations return
LAPACK-style extras (1-based int32 pivots, `info`) because PyTorch's backward formulas and error
checks read them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_pjrt import storage
from torch_pjrt.ops.graph import decomposed
from torch_pjrt.ops.pointwise import rounded_like
from torch_pjrt.ops.registry import LOWERINGS, Lowering, register

aten = torch.ops.aten

# torch.get_float32_matmul_precision() -> XLA's dot precision. "high": three bf16 passes on TPU, TF32
# on GPU (what cuBLAS does with allow_tf32); "medium": one bf16 pass. XLA's CPU backend computes
# float32 products in full precision whatever it is asked.
DOT_PRECISION = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}
_pinned = threading.local()


def global_float32_matmul_precision() -> str:
    """PyTorch's float32 matmul setting as "highest", "high" or "medium", from whichever API set it:
    torch.set_float32_matmul_precision, allow_tf32, or the per-backend fp32_precision (once that is
    used, PyTorch's legacy getter raises)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        pass
    backends = torch.backends
    requested = backends.cuda.matmul.fp32_precision
    if requested == "none":
        requested = backends.fp32_precision
    if requested != "tf32":
        return "highest"
    return "medium" if backends.mkldnn.matmul.fp32_precision == "bf16" else "high"


def float32_matmul_precision() -> str:
    """The precision products trace with: the one pinned for this trace, else PyTorch's global setting."""
    return getattr(_pinned, "name", None) or global_float32_matmul_precision()


@contextlib.contextmanager
def pinned_float32_matmul_precision(name: str) -> Iterator[None]:
    """Trace products at `name`, the setting a program was keyed by (a fused program traces its ops
    later, when the global setting may have changed since they were issued)."""
    previous = getattr(_pinned, "name", None)
    _pinned.name = name
    try:
        yield
    finally:
        _pinned.name = previous


# --- shared helpers ----------------------------------------------------------------------------


def _accumulator(*arrays: Any) -> Any:
    """float32 accumulation for half types (what PyTorch's CPU and CUDA kernels do)."""
    if any(a.dtype in (jnp.bfloat16, jnp.float16) for a in arrays):
        return jnp.float32
    return None


def _is_float8(a: Any) -> bool:
    return a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating)


def _matmul(a: Any, b: Any) -> Any:
    if a.dtype == jnp.bool_:
        return jnp.matmul(a.astype(jnp.int32), b.astype(jnp.int32)) != 0
    if _is_float8(a):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)  # CPU multiplies float8 in float32
    precision = DOT_PRECISION[float32_matmul_precision()]
    return jnp.matmul(a, b, precision=precision, preferred_element_type=_accumulator(a, b))


def _integral_scalars(dtype: Any, beta: Any, alpha: Any) -> tuple[Any, Any]:
    """PyTorch converts beta and alpha to an integer result's type first: 0.6 scales by 0."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(beta).astype(dtype), jnp.asarray(alpha).astype(dtype)
    return beta, alpha


def _scaled_sum(self: Any, product: Any, beta: Any, alpha: Any) -> Any:
    """beta * self + alpha * product, where beta == 0 ignores self (NaN included), as in BLAS."""
    if self.dtype == jnp.bool_:
        return (jnp.logical_and(self, beta != 0)) | (jnp.logical_and(product, alpha != 0))
    beta, alpha = _integral_scalars(self.dtype, beta, alpha)
    if product.dtype == jnp.float32 and (self.dtype in (jnp.bfloat16, jnp.float16) or _is_float8(self)):
        self = self.astype(jnp.float32)  # a half-type or float8 gemm scales its input in float32 too
    scaled = jnp.where(beta == 0, jnp.zeros((), self.dtype), self * beta)
    return scaled + product * alpha


def _mT(a: Any) -> Any:
    return jnp.swapaxes(a, -1, -2)


def _mH(a: Any) -> Any:
    return jnp.conj(_mT(a)) if jnp.iscomplexobj(a) else _mT(a)


def _broadcast_batch(a: Any, b: Any) -> tuple[Any, Any]:
    """Broadcast the batch dims (all but the last two) of two matrix stacks."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _lu(a: Any) -> tuple[Any, Any, Any]:
    """Partial-pivoting LU: (LU, LAPACK 1-based int32 pivots, 0-based permutation)."""
    lu, pivots, permutation = lax.linalg.lu(a)
    return lu, (pivots + 1).astype(jnp.int32), permutation


def _first_true(mask: Any) -> Any:
    """LAPACK's info convention: 1-based index of the first True along the last axis, else 0
    (0 too for an empty axis, where argmax has nothing to reduce)."""
    if mask.shape[-1] == 0:
        return jnp.zeros(mask.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(mask, axis=-1), jnp.argmax(mask, axis=-1) + 1, 0).astype(jnp.int32)


def _singular_info(lu: Any) -> Any:
    """LAPACK getrf's info: 1-based index of the first zero pivot of U, else 0."""
    return _first_true(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)


def _permutation_from_pivots(pivots: Any, m: int) -> Any:
    """The row permutation that LAPACK's 1-based sequential swaps describe (A[perm] = L U)."""
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _lu_solve(lu: Any, permutation: Any, b: Any, adjoint: bool = False) -> Any:
    """Solve A X = B (or A^H X = B) from A's LU factors; b is a matrix stack."""
    lu, b = _broadcast_batch(lu, b)
    permutation = jnp.broadcast_to(permutation, lu.shape[:-1])
    if not adjoint:
        pb = jnp.take_along_axis(b, permutation[..., None], axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True,
                                    conjugate_a=True)
    y = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, unit_diagonal=True,
                                    transpose_a=True, conjugate_a=True)
    inverse = jnp.argsort(permutation, axis=-1)
    return jnp.take_along_axis(y, inverse[..., None], axis=-2)


def _hermitian(A: Any, lower: bool = True) -> Any:
    """The Hermitian matrix that one triangle of A describes: LAPACK reads only that triangle."""
    if lower:
        return jnp.tril(A) + _mH(jnp.tril(A, -1))
    return jnp.triu(A) + _mH(jnp.triu(A, 1))


def _triangular_solve(a: Any, b: Any, upper: bool, left: bool, unitriangular: bool,
                      transpose: bool = False) -> Any:
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, transpose_a=transpose,
                                       unit_diagonal=unitriangular)


def _float(a: Any) -> Any:
    """Factorisations need a floating type (PyTorch rejects others before we get here)."""
    return a if jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(jnp.float32)


# --- products ----------------------------------------------------------------------------------


@register(aten.mm.default, aten.bmm.default)
def mm(self: Any, mat2: Any) -> Any:
    """Matrix and batched matrix products alike: _matmul contracts the last two dims."""
    return _matmul(self, mat2)


@register(aten.mm.dtype, aten.bmm.dtype)
def mm_dtype(self: Any, mat2: Any, out_dtype: Any) -> Any:
    return _matmul(self, mat2)


@register(aten.addmm.default)
def addmm(self: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)


@register(aten.addmm.dtype)
def addmm_dtype(self: Any, mat1: Any, mat2: Any, out_dtype: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scaled_sum(self.astype(jnp.float32), _matmul(mat1, mat2), beta, alpha)


@register(aten.baddbmm.default)
def baddbmm(self: Any, batch1: Any, batch2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scaled_sum(self, _matmul(batch1, batch2), beta, alpha)


@register(aten.baddbmm.dtype)
def baddbmm_dtype(self: Any, batch1: Any, batch2: Any, out_dtype: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scaled_sum(self.astype(jnp.float32), _matmul(batch1, batch2), beta, alpha)


@register(aten._addmm_activation.default)
def _addmm_activation(self: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1,
                      use_gelu: bool = False) -> Any:
    """The fused Linear+activation: exact GELU, as PyTorch's non-CUDA kernels (CUDA uses tanh)."""
    out = _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)
    return jax.nn.gelu(out, approximate=False) if use_gelu else jnp.maximum(out, 0)


@register(aten._int_mm.default)
def _int_mm(self: Any, mat2: Any) -> Any:
    return jnp.matmul(self, mat2, preferred_element_type=jnp.int32)


@register(aten.addbmm.default)
def addbmm(self: Any, batch1: Any, batch2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """Accumulated one batch at a time in the result's dtype, as PyTorch's loop of addmm_ does, so the
    rounding (of every half-precision partial sum too) is CPU's."""
    products = _matmul(batch1, batch2)
    start = jnp.broadcast_to(self, products.shape[1:])
    if products.shape[0] == 0:
        return _scaled_sum(start, jnp.zeros_like(start), beta, alpha)
    first = _scaled_sum(start, products[0], beta, alpha).astype(self.dtype)

    def accumulate(total: Any, product: Any) -> tuple[Any, None]:
        return _scaled_sum(total, product, 1, alpha).astype(self.dtype), None

    return lax.scan(accumulate, first, products[1:])[0]


@register(aten.addmv.default)
def addmv(self: Any, mat: Any, vec: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    return _scaled_sum(self, _matmul(mat, vec), beta, alpha)


@register(aten.addr.default)
def addr(self: Any, vec1: Any, vec2: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    """beta * self + (alpha * vec1) * vec2 in that order, each step rounded in the dtype as on CPU."""
    if vec1.dtype == jnp.bool_:
        return _scaled_sum(self, jnp.logical_and(vec1[:, None], vec2[None, :]), beta, alpha)
    beta, alpha = _integral_scalars(self.dtype, beta, alpha)
    if jnp.issubdtype(self.dtype, jnp.floating) and jnp.finfo(self.dtype).bits < 32:
        # half precision: each step rounded explicitly (XLA may keep excess precision inside a fusion),
        # the scalars too, as CPU converts them to the dtype first
        def rounded(x: Any) -> Any:
            return rounded_like(x, self.dtype)

        wide = jnp.float32
        beta, alpha = rounded(jnp.asarray(beta, wide)), rounded(jnp.asarray(alpha, wide))
        outer = rounded(rounded(vec1.astype(wide) * alpha)[:, None] * vec2.astype(wide)[None, :])
        scaled = jnp.where(beta == 0, jnp.zeros((), wide), rounded(beta * self.astype(wide)))
        return (scaled + outer).astype(self.dtype)
    outer = (vec1 * alpha)[:, None] * vec2[None, :]
    return jnp.where(beta == 0, jnp.zeros((), outer.dtype), beta * self) + outer


@register(aten.mv.default)
def mv(self: Any, vec: Any) -> Any:
    return _matmul(self, vec)


@register(aten.dot.default)
def dot(self: Any, tensor: Any) -> Any:
    return _matmul(self, tensor)


@register(aten.vdot.default)
def vdot(self: Any, other: Any) -> Any:
    return _matmul(jnp.conj(self), other)


# --- float8 scaled products ------------------------------------------------------------------------

_SCALE_RESULT_OUTPUTS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     bias: torch.Tensor | None, scale_result: torch.Tensor | None) -> None:
    """PyTorch CPU's argument checks of torch._scaled_mm, with its exception types."""
    for name, matrix in (("mat1", a), ("mat2", b)):
        if matrix.dim() != 2:
            raise RuntimeError(f"{name} must be a matrix")
    m, n = a.shape[0], b.shape[1]
    both_float8 = a.dtype in storage.FLOAT8_DTYPES and b.dtype in storage.FLOAT8_DTYPES
    float_scales = scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    tensor_wise = scale_a.numel() == 1 and scale_b.numel() == 1
    row_wise = (tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
                and scale_a.is_contiguous() and scale_b.is_contiguous())
    if not (both_float8 and float_scales and (tensor_wise or row_wise)):
        raise ValueError(
            "Invalid scaling configuration.\n- For TensorWise scaling, a and b should be float8, scales should be "
            "float and singletons.\n- For RowWise scaling, a and b should be float8, scales should be float, "
            f"scale_a should be ({m}, 1) and scale_b should be (1, {n}), and both should be contiguous.\n"
            f"Got mat_a.dtype()={a.dtype}, scale_a.dtype()={scale_a.dtype}, scale_a.size()={list(scale_a.shape)}, "
            f"scale_a.stride()={list(scale_a.stride())}, mat_b.dtype()={b.dtype}, scale_b.dtype()={scale_b.dtype}, "
            f"scale_b.size()={list(scale_b.shape)} and scale_b.stride()={list(scale_b.stride())}"
        )
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(
            f"mat_a and mat_b shapes cannot be multiplied ({m}x{a.shape[1]} and {b.shape[0]}x{n})")
    if scale_result is not None and (scale_result.dtype != torch.float32 or scale_result.numel() != 1):
        raise RuntimeError("scale_result must be a float scalar")
    if bias is not None and bias.numel() != n:
        raise RuntimeError(f"Bias must be size {n} but got {bias.numel()}")


def scaled_mm(self: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """torch._scaled_mm as PyTorch CPU computes it: both operands scaled in float32 (tensor-wise or
    row-wise), multiplied, the bias added, divided by scale_result when out_dtype names e4m3fn or e5m2,
    then cast.

    In tensor ops, so eager runs it as they run and torch.compile lowers the same function; PyTorch's own
    meta kernel (CUDA's layout and multiple-of-16 rules) is never asked in eager mode.
    `use_fast_accum` only picks a CUDA kernel: accumulation is float32 either way."""
    _check_scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result)
    product = (self.float() * scale_a) @ (mat2.float() * scale_b)
    if bias is not None:
        product = product + bias
    if scale_result is not None and out_dtype in _SCALE_RESULT_OUTPUTS:  # only when out_dtype is given
        product = product * scale_result.reciprocal()
    return product.to(self.dtype if out_dtype is None else out_dtype)


LOWERINGS[aten._scaled_mm.default] = Lowering(decomposed(aten._scaled_mm.default, scaled_mm), static_scalars=True)


# --- factorisations and solvers ----------------------------------------------------------------


@register(aten._linalg_check_errors.default)
def _linalg_check_errors(info: Any, api_name: str, *, is_matrix: bool) -> tuple:
    """Inside a compiled graph a data-dependent raise is impossible: failed factorisations show
    as NaN/inf results there. Eager calls never get here: the kernel in
    eager/data_dependent.py reads `info` and raises PyTorch's LinAlgError."""
    return ()


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(A: Any, *, check_errors: bool = False) -> tuple[Any, Any]:
    A = _float(A)
    lu, _, permutation = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, permutation, eye), _singular_info(lu)


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self: Any, *, upper: bool = False, check_errors: bool = False) -> tuple[Any, Any]:
    """Reads the lower triangle only; info is the order of the first non-positive leading minor."""
    L = lax.linalg.cholesky(_hermitian(_float(self)), symmetrize_input=False)
    info = _first_true(jnp.isnan(jnp.diagonal(L, axis1=-2, axis2=-1)))
    L = jnp.tril(jnp.where(jnp.isnan(L), 0, L))
    return (_mH(L) if upper else L), info


@register(aten.cholesky.default)
def cholesky(self: Any, upper: bool = False) -> Any:
    return linalg_cholesky_ex(self, upper=upper)[0]


@register(aten.linalg_qr.default)
def linalg_qr(A: Any, mode: str = "reduced") -> tuple[Any, Any]:
    A = _float(A)
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    q, r = jnp.linalg.qr(A, mode=mode)
    return q, r


@torch.library.register_fake("aten::geqrf")
def _geqrf_meta(self: Any) -> tuple[Any, Any]:
    """PyTorch has no meta kernel for geqrf; shapes are the input's and (*, min(m, n))."""
    return self.new_empty(self.shape), self.new_empty((*self.shape[:-2], min(self.shape[-2:])))


@register(aten.geqrf.default)
def geqrf(self: Any) -> tuple[Any, Any]:
    """LAPACK's compact QR (Householder reflectors below the diagonal, R on and above, and tau);
    numpy's "raw" mode gives it transposed."""
    h, tau = jnp.linalg.qr(_float(self), mode="raw")
    return _mT(h), tau


@register(aten.linalg_householder_product.default)
def linalg_householder_product(input: Any, tau: Any) -> Any:
    return lax.linalg.householder_product(input, tau.astype(input.dtype))


@register(aten.ormqr.default)
def ormqr(self: Any, input2: Any, input3: Any, left: bool = True, transpose: bool = False) -> Any:
    return lax.linalg.ormqr(self, input2.astype(self.dtype), input3.astype(self.dtype), left=left,
                            transpose=transpose)


@register(aten._linalg_svd.default)
def _linalg_svd(A: Any, full_matrices: bool = False, compute_uv: bool = True, *,
                driver: str | None = None) -> tuple[Any, Any, Any]:
    A = _float(A)
    if not compute_uv:
        s = jnp.linalg.svd(A, compute_uv=False)
        return jnp.zeros((0,), A.dtype), s, jnp.zeros((0,), A.dtype)
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@register(aten._linalg_eigh.default)
def _linalg_eigh(A: Any, UPLO: str = "L", compute_v: bool = True) -> tuple[Any, Any]:
    A = _hermitian(_float(A), lower=UPLO == "L")
    w, v = jnp.linalg.eigh(A, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@register(aten.linalg_eig.default)
def linalg_eig(self: Any) -> tuple[Any, Any]:
    """LAPACK geev's conventions on CPU (jax's eig is geev); other platforms may lack it."""
    w, v = jnp.linalg.eig(_float(self))
    return w, v


@register(aten._linalg_eigvals.default)
def _linalg_eigvals(self: Any) -> Any:
    return jnp.linalg.eigvals(_float(self))


def _det_from_lu(lu: Any, swaps: Any) -> tuple[Any, Any]:
    """(sign of the row permutation, diagonal of U); each pivot that moves a row is one swap.

    det and slogdet factor A^T, as PyTorch does: their backward formulas solve with that LU.
    """
    moved = jnp.sum(swaps != jnp.arange(swaps.shape[-1]), axis=-1)
    sign = jnp.where(moved % 2 == 1, -1, 1).astype(lu.dtype)
    return sign, jnp.diagonal(lu, axis1=-2, axis2=-1)


@register(aten._linalg_det.default)
def _linalg_det(A: Any) -> tuple[Any, Any, Any]:
    lu, pivots, _ = _lu(_mT(_float(A)))
    sign, diagonal = _det_from_lu(lu, pivots - 1)
    return sign * jnp.prod(diagonal, axis=-1), lu, pivots


@register(aten._linalg_slogdet.default)
def _linalg_slogdet(A: Any) -> tuple[Any, Any, Any, Any]:
    lu, pivots, _ = _lu(_mT(_float(A)))
    sign, diagonal = _det_from_lu(lu, pivots - 1)
    magnitude = jnp.abs(diagonal)
    phase = jnp.prod(jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude)), axis=-1)
    return sign * phase, jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A: Any, *, pivot: bool = True, check_errors: bool = False) -> tuple[Any, Any, Any]:
    if not pivot:
        raise NotImplementedError("torch_pjrt: LU without pivoting is not supported (nor is it on CPU).")
    lu, pivots, _ = _lu(_float(A))
    return lu, pivots, _singular_info(lu)


def _permutation_matrix(permutation: Any, dtype: Any) -> Any:
    """P with A = P L U, from A[permutation] = L U."""
    return jnp.swapaxes(jax.nn.one_hot(permutation, permutation.shape[-1], dtype=dtype), -1, -2)


def _unpack_lu(lu: Any) -> tuple[Any, Any]:
    """(unit lower L, upper U) from a packed m x n LU."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    return jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype), jnp.triu(lu[..., :k, :])


@register(aten.linalg_lu.default)
def linalg_lu(A: Any, *, pivot: bool = True) -> tuple[Any, Any, Any]:
    if not pivot:
        raise NotImplementedError("torch_pjrt: LU without pivoting is not supported (nor is it on CPU).")
    lu, _, permutation = _lu(_float(A))
    return (_permutation_matrix(permutation, lu.dtype), *_unpack_lu(lu))


@register(aten.lu_unpack.default)
def lu_unpack(LU_data: Any, LU_pivots: Any, unpack_data: bool = True,
              unpack_pivots: bool = True) -> tuple[Any, Any, Any]:
    empty = jnp.zeros((0,), LU_data.dtype)
    P = empty
    if unpack_pivots:
        P = _permutation_matrix(_permutation_from_pivots(LU_pivots, LU_data.shape[-2]), LU_data.dtype)
    return (P, *_unpack_lu(LU_data)) if unpack_data else (P, empty, empty)


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU: Any, pivots: Any, B: Any, *, left: bool = True, adjoint: bool = False) -> Any:
    permutation = _permutation_from_pivots(pivots, LU.shape[-1])
    if left:
        return _lu_solve(LU, permutation, B, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    return _mH(_lu_solve(LU, permutation, _mH(B), not adjoint))


@register(aten._linalg_solve_ex.default)
def _linalg_solve_ex(A: Any, B: Any, *, left: bool = True, check_errors: bool = False) -> tuple[Any, Any, Any, Any]:
    """B is a (batch of) vector(s) when PyTorch's rule says so: 1-D, or A's batch shape plus n."""
    A = _float(A)
    B = B.astype(A.dtype)
    vector = B.ndim == 1 or (left and B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    lu, pivots, permutation = _lu(A)
    matrix = B[..., None] if vector else B
    if left:
        x = _lu_solve(lu, permutation, matrix)
    else:
        x = _mH(_lu_solve(lu, permutation, _mH(matrix), adjoint=True))
    return (x[..., 0] if vector else x), lu, pivots, _singular_info(lu)


_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def _lstsq_driver(driver: str | None) -> str:
    """PyTorch's default driver is gelsy on every device but CUDA."""
    if driver is not None and driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of {_LSTSQ_DRIVERS}")
    return driver or "gelsy"


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


@torch.library.register_fake("aten::linalg_lstsq")
def _linalg_lstsq_meta(self: Any, b: Any, rcond: float | None = None, *,
                       driver: str | None = None) -> tuple[Any, Any, Any, Any]:
    """PyTorch has no meta kernel for lstsq. Residuals exist for m > n except with gelsy, rank except
    with gels, singular values with gelsd and gelss (CPU's shapes)."""
    driver = _lstsq_driver(driver)
    if not (self.dim() >= 2 and self.dim() - b.dim() in (0, 1)):
        raise RuntimeError("torch.linalg.lstsq: input.dim() must be greater or equal to other.dim() and "
                           "(input.dim() - other.dim()) <= 1")
    vector = b.dim() == self.dim() - 1
    k = 1 if vector else b.shape[-1]
    m, n = self.shape[-2:]
    batch = torch.broadcast_shapes(self.shape[:-2], b.shape[:-1 if vector else -2])
    real = _real_dtype(self.dtype)
    solution = self.new_empty((*batch, n) if vector else (*batch, n, k))
    residuals = self.new_empty((*batch, k) if m > n and driver != "gelsy" else (0,), dtype=real)
    rank = self.new_empty(self.shape[:-2] if driver != "gels" else (0,), dtype=torch.int64)
    singular = (*self.shape[:-2], min(m, n)) if driver in ("gelsd", "gelss") else (0,)
    return solution, residuals, rank, self.new_empty(singular, dtype=real)


def _lstsq_qr(A: Any, B: Any) -> tuple[Any, Any]:
    """gels: QR of A (m >= n) or of A^H (m < n), full rank assumed; (solution, the rows of Q^H B
    whose squared sum is the residual)."""
    m, n = A.shape[-2:]
    if m >= n:
        q, r = jnp.linalg.qr(A, mode="complete")
        c = _matmul(_mH(q), B)
        return _triangular_solve(r[..., :n, :], c[..., :n, :], True, True, False), c[..., n:, :]
    q, r = jnp.linalg.qr(_mH(A), mode="reduced")
    r, B = _broadcast_batch(r, B)
    y = lax.linalg.triangular_solve(r, B, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    return _matmul(q, y), B[..., :0, :]


def _lstsq_svd(A: Any, B: Any, rcond: float) -> tuple[Any, Any, Any, Any]:
    """gelsy, gelsd, gelss: the minimum-norm solution, singular values up to rcond * largest dropped;
    (solution, the rows of U^H B whose squared sum is the residual, rank, singular values)."""
    k = min(A.shape[-2:])
    u, s, vh = jnp.linalg.svd(A, full_matrices=True)
    keep = s > rcond * jnp.max(s, axis=-1, keepdims=True, initial=0)
    c = _matmul(_mH(u), B)
    inverse = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(A.dtype)
    solution = _matmul(_mH(vh[..., :k, :]), inverse[..., None] * c[..., :k, :])
    return solution, c[..., k:, :], jnp.sum(keep, axis=-1).astype(jnp.int64), s


@register(aten.linalg_lstsq.default)
def linalg_lstsq(self: Any, b: Any, rcond: float | None = None, *,
                 driver: str | None = None) -> tuple[Any, Any, Any, Any]:
    """Residuals come for m > n with every driver but gelsy. CPU returns an empty tensor instead when
    gelsd/gelss find a matrix rank deficient (a value-dependent shape no compiled program can have):
    there this returns the residual of the minimum-norm solution."""
    driver = _lstsq_driver(driver)
    A = _float(self)
    m, n = A.shape[-2:]
    vector = b.ndim == A.ndim - 1
    B = (b[..., None] if vector else b).astype(A.dtype)
    empty_real = jnp.zeros((0,), jnp.real(A).dtype)
    if driver == "gels":
        (solution, rows), rank, singular = _lstsq_qr(A, B), jnp.zeros((0,), jnp.int64), empty_real
    else:
        default = float(np.finfo(np.dtype(empty_real.dtype)).eps) * max(m, n)
        solution, rows, rank, singular = _lstsq_svd(A, B, default if rcond is None else rcond)
    residuals = jnp.sum(jnp.abs(rows) ** 2, axis=-2) if m > n and driver != "gelsy" else empty_real
    if driver not in ("gelsd", "gelss"):
        singular = empty_real
    return (solution[..., 0] if vector else solution), residuals, rank, singular


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self: Any, B: Any, *, upper: bool, left: bool = True,
                            unitriangular: bool = False) -> Any:
    A = _float(self)
    return _triangular_solve(A, B.astype(A.dtype), upper, left, unitriangular)


@register(aten.triangular_solve.default)
def triangular_solve(self: Any, A: Any, upper: bool = True, transpose: bool = False,
                     unitriangular: bool = False) -> tuple[Any, Any]:
    A = _float(A)
    solution = _triangular_solve(A, self.astype(A.dtype), upper, True, unitriangular, transpose)
    return solution, jnp.broadcast_to(A, solution.shape[:-2] + A.shape[-2:])


@register(aten.cholesky_solve.default)
def cholesky_solve(self: Any, input2: Any, upper: bool = False) -> Any:
    L = _mH(input2) if upper else input2
    y = _triangular_solve(L, self, False, True, False)
    L, y = _broadcast_batch(L, y)
    return lax.linalg.triangular_solve(L, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(self: Any, upper: bool = False) -> Any:
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return cholesky_solve(eye, self, upper)


# Matrix exponential: PyTorch's method (Bader, Blanes and Casas, "Computing the matrix exponential
# with an optimized Taylor polynomial approximation", Mathematics 7(12), 2019): a Taylor polynomial of
# degree 1, 2, 4, 8 or 12 chosen by the 1-norm, else degree 18 with scaling and squaring. Same method,
# same coefficients, same order of operations: values round like CPU's (jax's Pade expm differs by
# far more than float32's tolerance on matrices of norm ~30).

# The largest 1-norm each degree (1, 2, 4, 8, 12, 18) serves, for single and double precision.
_EXPM_THETAS = {
    np.float32: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
                 1.461661507209034e+00, 3.010066362817634e+00),
    np.float64: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04, 4.991228871115323e-02,
                 2.996158913811580e-01, 1.090863719290036e+00),
}
# Degree 12: rows B_i = sum_j b_ij A^j over (I, A, A^2, A^3); T12 = B0 + (B1 + B2 + B3^2) (B2 + B3^2).
_EXPM_T12 = (
    (9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
    (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
    (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
    (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359),
)
# Degree 18: rows over (I, A, A^2, A^3, A^6); with A9 = B0 B4 + B3, T18 = B1 + (B2 + A9) A9.
_EXPM_T18 = (
    (0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0),
    (0.0, 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04),
    (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05),
    (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05),
    (0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05),
)


def _combination(terms: list[Any], coefficients: Any) -> Any:
    """sum_j c_j * terms_j, accumulated left to right (PyTorch's _compute_linear_combination)."""
    total = coefficients[0] * terms[0]
    for c, term in zip(coefficients[1:], terms[1:]):
        total = total + c * term
    return total


def _expm_t8_coefficients(real: type) -> tuple[float, ...]:
    """(x1, x2, x3, x4, x5, x6, x7, y2) of the degree-8 scheme, each rounded to `real` as it is formed."""
    r = lambda v: float(real(v))
    root, x3 = r(np.sqrt(177.0)), r(2 / 3)
    return (r(x3 * ((1 + root) / 88)), r(x3 * ((1 + root) / 352)), x3, r((-271 + 29 * root) / (315 * x3)),
            r((-11 + 11 * root) / (1260 * x3)), r((-99 + 11 * root) / (5040 * x3)),
            r((89 - root) / (5040 * x3)), r((857 - 58 * root) / 630))


def _expm_taylor(a: Any, degree: int, real: type) -> Any:
    """The degree-`degree` Taylor approximation of exp for one matrix."""
    c = lambda *values: [jnp.asarray(v, real) for v in values]
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    if degree == 1:
        return eye + a
    a2 = _matmul(a, a)
    if degree == 2:
        return eye + a + a2 / 2
    if degree == 4:
        tail = _matmul(a2, _combination([eye, a, a2], c(1 / 2, 1 / 6, 1 / 24)))
        return _combination([eye, a, a2, tail], c(1, 1, 0, 1))
    if degree == 8:
        x1, x2, x3, x4, x5, x6, x7, y2 = c(*_expm_t8_coefficients(real))
        a4 = _matmul(a2, _combination([a, a2], [x1, x2]))
        a8 = _matmul(_combination([a2, a4], [x3, c(1)[0]]), _combination([eye, a, a2, a4], [x4, x5, x6, x7]))
        return _combination([eye, a, a2, a4, a8], [*c(1, 1), y2, *c(0, 1)])
    powers = [eye, a, a2, _matmul(a, a2)]
    if degree == 12:
        b = [_combination(powers, c(*row)) for row in _EXPM_T12]
        b2 = b[2] + _matmul(b[3], b[3])
        return b[0] + _matmul(b[1] + b2, b2)
    powers.append(_matmul(powers[3], powers[3]))
    b = [_combination(powers, c(*row)) for row in _EXPM_T18]
    a9 = b[3] + _matmul(b[0], b[4])
    return b[1] + _matmul(b[2] + a9, a9)


def _expm_one(a: Any) -> Any:
    """exp of one matrix: the lowest degree whose theta bounds its 1-norm, else degree 18 on a / 2^s
    squared s times."""
    real = np.float32 if a.dtype in (jnp.float32, jnp.complex64) else np.float64
    thetas = jnp.asarray(_EXPM_THETAS[real], real)
    norm = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1).astype(real)
    branch = jnp.sum(norm > thetas[:-1]) + (norm == thetas[-2])
    squarings = jnp.maximum(jnp.ceil(jnp.log2(norm / thetas[-1])), 0)
    squarings = jnp.where(branch == 5, jnp.nan_to_num(squarings), 0).astype(jnp.int32)

    def scaled_and_squared(a: Any) -> Any:
        power = _expm_taylor(a / (2.0 ** squarings).astype(real), 18, real)
        return lax.fori_loop(0, squarings, lambda _, m: _matmul(m, m), power)

    branches = [lambda a, d=d: _expm_taylor(a, d, real) for d in (1, 2, 4, 8, 12)] + [scaled_and_squared]
    return lax.switch(branch, branches, a)


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self: Any) -> Any:
    """Half types run in float32 (PyTorch's CPU kernel reads its coefficient tables as the wrong type
    there and returns inf/nan)."""
    a = self.astype(jnp.float32) if self.dtype in (jnp.bfloat16, jnp.float16) else _float(self)
    n = a.shape[-1]
    if n <= 1:
        return jnp.exp(a)
    flat = a.reshape((-1, n, n))
    return jax.vmap(_expm_one)(flat).reshape(a.shape)


def _pairwise(x1: Any, x2: Any) -> Any:
    return x1[..., :, None, :] - x2[..., None, :, :]


@register(aten._cdist_forward.default)
def _cdist_forward(x1: Any, x2: Any, p: float, compute_mode: int | None) -> Any:
    """Exact differences (no matmul expansion), so p=2 matches the direct CPU path closely."""
    diff = jnp.abs(_pairwise(x1, x2))
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(x1.dtype)
    if p == float("inf"):
        return jnp.max(diff, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(diff ** p, axis=-1) ** (1 / p)


@register(aten._cdist_backward.default)
def _cdist_backward(grad: Any, x1: Any, x2: Any, p: float, cdist: Any) -> Any:
    """d dist_ij / d x1_i for each p; zero where a distance is zero (PyTorch's convention)."""
    diff = _pairwise(x1, x2)
    dist = cdist[..., None]
    safe = jnp.where(dist == 0, 1, dist)
    if p == 0:
        partial = jnp.zeros_like(diff)
    elif p == 1:
        partial = jnp.sign(diff)
    elif p == 2:
        partial = diff / safe
    elif p == float("inf"):
        partial = jnp.sign(diff) * (jnp.abs(diff) == dist)
    else:
        partial = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
    partial = jnp.where(dist == 0, 0, partial)
    return jnp.sum(grad[..., None] * partial, axis=-2)


@register(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(self: Any, *, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> Any:
    """Singular values below max(atol, rtol * largest) are dropped, PyTorch's rule; hermitian reads
    the lower triangle only, as LAPACK's eigh does."""
    A = _float(self)
    m, n = A.shape[-2:]
    if hermitian:
        w, v = jnp.linalg.eigh(_hermitian(A), symmetrize_input=False)
        s = jnp.abs(w)
        left, right = v * jnp.sign(w)[..., None, :], _mH(v)
    else:
        left, s, right = jnp.linalg.svd(A, full_matrices=False)
    largest = jnp.max(s, axis=-1, keepdims=True) if s.shape[-1] else jnp.zeros(s.shape[:-1] + (1,), s.dtype)
    zero = jnp.zeros((), s.dtype)
    atol_ = zero if atol is None else jnp.asarray(atol, s.dtype)[..., None]
    if rtol is None:
        default = jnp.asarray(np.finfo(np.dtype(s.dtype)).eps * max(m, n), s.dtype)
        rtol_ = default if atol is None else jnp.where(atol_ > 0, zero, default)
    else:
        rtol_ = jnp.asarray(rtol, s.dtype)[..., None]
    cutoff = jnp.maximum(atol_, rtol_ * largest)
    inverse = jnp.where(s > cutoff, 1 / jnp.where(s > cutoff, s, 1), 0).astype(A.dtype)
    return _matmul(_mH(right) * inverse[..., None, :], _mH(left))
