"""Matrix products, torch.linalg and torch.fft on pjrt against CPU."""

from __future__ import annotations

import pytest
import torch
from support import check

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _grads(fn, *inputs):
    """fn's input gradients for a fixed random cotangent (backward through the op)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.real.dtype).reshape(out.shape).to(out.device)
    (out.real * weight).sum().backward()
    return [t.grad for t in leaves]


def _spd(*batch: int, n: int = 4, dtype=torch.float32) -> torch.Tensor:
    a = torch.randn(*batch, n, n, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


# --- products ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_mm_dtypes(dtype):
    a, b = torch.randn(4, 5) * 5, torch.randn(5, 3) * 5
    check(torch.mm, a.to(dtype), b.to(dtype))


def test_mm_bfloat16_accumulates_in_float32():
    check(torch.mm, torch.randn(8, 64).bfloat16(), torch.randn(64, 8).bfloat16(), atol=1e-2, rtol=1e-2)


def test_mm_non_contiguous():
    a, b = torch.randn(5, 4), torch.randn(6, 5)
    check(lambda a, b: torch.mm(a.t(), b[::2].t()), a, b, **TOL)


def test_mm_out():
    a, b = torch.randn(5, 4), torch.randn(6, 5)

    def with_out(a, b):
        out = torch.empty(4, 6, device=a.device)
        torch.mm(a.t(), b.t(), out=out)
        return out

    check(with_out, a, b)


def test_addmm_beta_alpha_and_beta_zero_ignores_nan():
    c, a, b = torch.randn(4, 3), torch.randn(4, 5), torch.randn(5, 3)
    check(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=-2), c, a, b, **TOL)
    check(lambda c, a, b: torch.addmm(c, a, b, beta=0), torch.full((4, 3), float("nan")), a, b, **TOL)
    check(lambda c, a, b: c.clone().addmm_(a, b, alpha=3), c, a, b, **TOL)


def test_batched_products():
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    check(torch.bmm, x, y, **TOL)
    check(lambda c, x, y: torch.baddbmm(c, x, y, beta=0.3, alpha=2), torch.randn(2, 3, 5), x, y, **TOL)
    check(lambda c, x, y: torch.addbmm(c, x, y, beta=0.3, alpha=2), torch.randn(3, 5), x, y, **TOL)


@pytest.mark.parametrize("scales", [{}, {"beta": 0.6, "alpha": 0.2}])
def test_addbmm_float32_within_float32_rounding(scales):
    """OpInfo's addbmm samples (entries in [-9, 9], sums of 25 products up to ~300) end some elements near 0, where
    pjrt and CPU differ by more than assert_close's 1e-5: both are float32 roundings of sums far larger than the
    result. So pjrt is held to float32's error bound (27 roundings of the sum of the terms' magnitudes) against
    the float64 result, which a half-precision or TF32 product would miss by orders of magnitude."""
    args = (torch.empty(5, 10).uniform_(-9, 9), torch.empty(5, 5, 5).uniform_(-9, 9),
            torch.empty(5, 5, 10).uniform_(-9, 9))
    exact = torch.addbmm(*(a.double() for a in args), **scales)
    pjrt = torch.addbmm(*(a.to("pjrt") for a in args), **scales).cpu()
    magnitude = torch.addbmm(*(a.double().abs() for a in args), **{k: abs(v) for k, v in scales.items()})
    assert ((pjrt.double() - exact).abs() <= 27 * torch.finfo(torch.float32).eps * magnitude).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_products_truncate_beta_alpha(dtype):
    """CPU converts beta=0.6, alpha=0.2 to the integer type (0) before scaling."""
    ints = lambda *shape: torch.randint(-9, 9, shape, dtype=dtype)
    scales = {"beta": 0.6, "alpha": 1.7}
    check(lambda c, m, v: torch.addmv(c, m, v, **scales), ints(4), ints(4, 5), ints(5))
    check(lambda c, x, y: torch.baddbmm(c, x, y, **scales), ints(2, 3, 5), ints(2, 3, 4), ints(2, 4, 5))
    check(lambda c, x, y: torch.addbmm(c, x, y, **scales), ints(3, 5), ints(2, 3, 4), ints(2, 4, 5))
    check(lambda c, a, b: torch.addr(c, a, b, beta=2, alpha=-3), ints(4, 5), ints(4), ints(5))
    with pytest.raises(RuntimeError):
        torch.addr(*(t.to("pjrt") for t in (ints(4, 5), ints(4), ints(5))), **scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_round_like_cpu(dtype):
    """addbmm rounds after each batch and scales self in float32; addr rounds each step."""
    x, y = (torch.randn(5, 5, 5) * 3).to(dtype), (torch.randn(5, 5, 10) * 3).to(dtype)
    check(lambda c, x, y: torch.addbmm(c, x, y, beta=0.6, alpha=0.2), torch.randn(1).to(dtype), x, y)
    check(lambda c, x, y: torch.addbmm(c, x, y), torch.randn(5, 10).to(dtype), x, y)
    for _ in range(20):  # one element in a few draws rounds differently where XLA keeps excess precision
        v, w = (torch.randn(5) * 3).to(dtype), (torch.randn(10) * 3).to(dtype)
        check(lambda c, v, w: torch.addr(c, v, w, beta=0.6, alpha=0.2), torch.randn(5, 10).to(dtype), v, w)


def test_vector_products():
    m, v, w = torch.randn(4, 5), torch.randn(5), torch.randn(4)
    check(torch.mv, m, v, **TOL)
    check(lambda c, m, v: torch.addmv(c, m, v, beta=2, alpha=0.5), w, m, v, **TOL)
    check(lambda c, a, b: torch.addr(c, a, b, alpha=2), m, w, v, **TOL)
    check(torch.dot, v, v.flip(0), **TOL)
    z = torch.randn(5, dtype=torch.complex64)
    check(torch.vdot, z, z.flip(0), **TOL)


@pytest.mark.parametrize("shapes", [((3, 4), (4,)), ((4,), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2))])
def test_matmul_broadcasting(shapes):
    check(torch.matmul, *(torch.randn(s) for s in shapes), **TOL)


def test_matmul_and_einsum_backward():
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    check(lambda a, b: _grads(torch.matmul, a, b), a, b, **TOL)
    check(lambda a, b: _grads(lambda x, y: torch.einsum("bij,jk->bik", x, y), a, b), a, b, **TOL)
    check(lambda c, a, b: _grads(lambda c, a, b: torch.baddbmm(c, a, b, alpha=2), c, a, b),
          torch.randn(2, 3, 5), a, b.expand(2, 4, 5).contiguous(), **TOL)


def test_einsum_contractions():
    check(lambda a, b: torch.einsum("ij,ij->i", a, b), torch.randn(3, 4), torch.randn(3, 4), **TOL)
    check(lambda a, b: torch.einsum("bhqd,bhkd->bhqk", a, b), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 5, 4), **TOL)


# --- factorisations and solvers ----------------------------------------------------------------


def test_inv_and_solve():
    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    check(torch.linalg.inv, a, **TOL)
    check(torch.linalg.inv_ex, a.double(), **TOL)
    check(torch.linalg.solve, a, torch.randn(2, 4, 3), **TOL)
    check(torch.linalg.solve, a, torch.randn(2, 4), **TOL)
    check(lambda a, b: torch.linalg.solve(a, b, left=False), a, torch.randn(2, 3, 4), **TOL)


def test_inv_singular_raises_like_cpu():
    a = torch.ones(3, 3).to("pjrt")
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.inv(a)
    info = torch.linalg.inv_ex(a).info
    assert info.item() > 0


def test_cholesky():
    a = _spd(2)
    check(torch.linalg.cholesky, a, **TOL)
    check(lambda a: torch.linalg.cholesky(a, upper=True), a, **TOL)
    check(lambda a: torch.linalg.cholesky_ex(a).info, -a)
    check(lambda b, a: torch.cholesky_solve(b, torch.linalg.cholesky(a)), torch.randn(2, 4, 3), a, **TOL)
    check(lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), a[0], **TOL)


@pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated")
def test_empty_matrices_factorise():
    """0x0 matrices have an empty diagonal: info is 0, as LAPACK says."""
    empty = torch.randn(2, 0, 0)
    check(torch.linalg.inv_ex, empty)
    check(torch.linalg.cholesky_ex, empty)
    check(torch.cholesky, empty)


@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr(mode):
    check(lambda a: torch.linalg.qr(a, mode=mode), torch.randn(2, 5, 3), **TOL)


def test_svd_and_eigh():
    a = torch.randn(2, 5, 3)
    check(torch.linalg.svdvals, a, **TOL)

    def reconstruct(a):
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u @ torch.diag_embed(s) @ vh

    check(reconstruct, a, **TOL)
    s = _spd(2)
    check(torch.linalg.eigvalsh, s, **TOL)
    check(lambda s: torch.linalg.eigh(s, UPLO="U").eigenvalues, s, **TOL)
    check(lambda s: torch.linalg.eigh(s).eigenvectors.abs(), s, atol=1e-3, rtol=1e-3)


def test_det_slogdet_lu():
    a = torch.randn(2, 4, 4)
    check(torch.linalg.det, a, **TOL)
    check(torch.linalg.det, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]) * 2)
    check(torch.linalg.slogdet, a, **TOL)
    check(torch.linalg.lu_factor, a, **TOL)
    check(torch.linalg.lu, torch.randn(5, 3), **TOL)
    b = torch.randn(2, 4, 2)
    check(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), a, b, **TOL)
    check(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b, adjoint=True), a, b, **TOL)
    check(lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT, left=False), a, b, **TOL)


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_triangular_solves():
    a = torch.randn(2, 4, 4).triu() + 3 * torch.eye(4)
    b = torch.randn(2, 4, 3)
    check(lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), a, b, **TOL)
    check(lambda a, b: torch.linalg.solve_triangular(a.mT, b.mT, upper=False, left=False, unitriangular=True),
          a, b, **TOL)
    check(lambda b, a: torch.triangular_solve(b, a, transpose=True), b, a, **TOL)


def test_cross_pinv_matrix_exp():
    check(torch.linalg.cross, torch.randn(4, 3), torch.randn(4, 3), **TOL)
    check(torch.linalg.pinv, torch.randn(5, 3), **TOL)
    check(lambda a: torch.linalg.pinv(a, hermitian=True), _spd(), **TOL)
    check(lambda a: torch.linalg.pinv(a, hermitian=True), torch.randn(2, 4, 4), **TOL)  # reads the lower triangle
    check(lambda a: torch.linalg.eigh(a, UPLO="U").eigenvalues, torch.randn(2, 4, 4), **TOL)
    check(torch.linalg.pinv, torch.randn(5, 5, dtype=torch.complex64), **TOL)
    check(torch.linalg.matrix_exp, torch.randn(2, 3, 3) / 3, **TOL)


def test_matrix_exp_every_degree():
    """One batch mixing 1-norms for each Taylor degree (1 to 18) and for scaling and squaring."""
    scales = torch.tensor([1e-17, 1e-9, 1e-5, 1e-2, 0.1, 0.5, 1.0, 3.0, 30.0], dtype=torch.float64)
    a = torch.randn(9, 4, 4, dtype=torch.float64) * scales[:, None, None] / 4
    check(torch.linalg.matrix_exp, a, rtol=1e-12, atol=1e-12)
    check(lambda a: _grads(torch.linalg.matrix_exp, a), a[5:8], rtol=1e-12, atol=1e-12)
    check(torch.linalg.matrix_exp, a.float(), rtol=1e-4, atol=1e-3)


def test_matrix_exp_half_types_run_in_float32():
    """PyTorch's CPU kernel returns inf/nan for half types; pjrt gives exp rounded to the type."""
    a = torch.randn(2, 3, 3) / 2
    for dtype in (torch.bfloat16, torch.float16):
        expected = torch.linalg.matrix_exp(a.to(dtype).float()).to(dtype)
        torch.testing.assert_close(torch.linalg.matrix_exp(a.to(dtype).to("pjrt")).cpu(), expected)


@pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated")
def test_lu_unpack_legacy_cholesky_eig():
    check(lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a)), torch.randn(2, 5, 3), **TOL)
    check(lambda a: torch.lu_unpack(*torch.linalg.lu_factor(a), unpack_data=False), torch.randn(4, 4), **TOL)
    check(torch.cholesky, _spd(), **TOL)
    a = torch.randn(4, 4, dtype=torch.float64)
    check(torch.linalg.eigvals, a)

    def residual(a):
        w, v = torch.linalg.eig(a)
        return (a.to(v.dtype) @ v - v * w.unsqueeze(-2)).abs()

    check(residual, a, atol=1e-8, rtol=0)


@pytest.mark.parametrize("driver", ["gels", "gelsy", "gelsd", "gelss"])
def test_lstsq_drivers(driver):
    """Tall, wide and broadcast batches; a vector right-hand side; every output's shape per driver."""
    lstsq = lambda a, b: torch.linalg.lstsq(a, b, driver=driver)
    check(lstsq, torch.randn(2, 5, 3, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64))
    check(lstsq, torch.randn(1, 3, 5, dtype=torch.float64), torch.randn(2, 3, 2, dtype=torch.float64))
    check(lstsq, torch.randn(2, 4, 3), torch.randn(2, 4), **TOL)
    check(lambda a, b: _grads(lambda x: lstsq(x, b).solution, a), torch.randn(5, 3, dtype=torch.float64),
          torch.randn(5, 2, dtype=torch.float64))


def test_lstsq_rank_deficient_gives_minimum_norm_solution():
    a = torch.randn(5, 3, dtype=torch.float64)
    a[:, 2] = a[:, 0]
    b = torch.randn(5, 2, dtype=torch.float64)
    check(lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd")[::2], a, b)
    check(lambda a, b: torch.linalg.lstsq(a, b, rcond=0.5, driver="gelss")[::2], a, b)


def test_geqrf():
    check(torch.geqrf, torch.randn(2, 5, 3), **TOL)
    check(torch.geqrf, torch.randn(3, 4, dtype=torch.complex64), **TOL)
    check(torch.geqrf, torch.randn(2, 0, 3))


def test_householder_product_ormqr():
    reflectors, tau = torch.geqrf(torch.randn(2, 5, 3))
    check(torch.linalg.householder_product, reflectors, tau, **TOL)
    check(torch.ormqr, reflectors, tau, torch.randn(2, 5, 2), **TOL)
    right = torch.randn(2, 2, 5)
    check(lambda a, t, c: torch.ormqr(a, t, c, left=False, transpose=True), reflectors, tau, right, **TOL)
    check(lambda a, t: _grads(lambda x: torch.linalg.householder_product(x, t), a), reflectors[0], tau[0], **TOL)


@pytest.mark.parametrize("p", [0.0, 2.0, 3.5, float("inf")])
def test_cdist(p):
    a, b = torch.randn(2, 4, 3), torch.randn(2, 5, 3)
    check(lambda a, b: torch.cdist(a, b, p=p), a, b, **TOL)
    check(lambda a, b: _grads(lambda x: torch.cdist(x, b, p=p), a), a, b, **TOL)


def test_fused_and_integer_matmuls():
    c, a, b = torch.randn(3), torch.randn(4, 5), torch.randn(5, 3)
    check(lambda c, a, b: torch.ops.aten._addmm_activation(c, a, b, use_gelu=True), c, a, b, **TOL)
    check(lambda c, a, b: torch.ops.aten._addmm_activation(c, a, b, beta=2), c, a, b, **TOL)
    i8 = torch.randint(-100, 100, (32, 32), dtype=torch.int8)
    check(torch._int_mm, i8, i8.t().contiguous())


def test_linalg_backward():
    a = torch.randn(2, 4, 4) + 4 * torch.eye(4)
    b = torch.randn(2, 4, 3)
    tol = {"atol": 1e-3, "rtol": 1e-3}
    check(lambda a: _grads(torch.linalg.det, a), a, **tol)
    check(lambda a: _grads(lambda x: torch.linalg.slogdet(x).logabsdet, a), a, **tol)
    check(lambda a: _grads(torch.linalg.inv, a), a, **tol)
    check(lambda a, b: _grads(torch.linalg.solve, a, b), a, b, **tol)
    check(lambda a, b: _grads(lambda x: torch.linalg.lu_solve(*torch.linalg.lu_factor(x), b), a), a, b, **tol)
    check(lambda a: _grads(lambda x: torch.linalg.cholesky(x @ x.mT), a), a, **tol)
    check(lambda a: _grads(torch.linalg.eigvalsh, a + a.mT), a, **tol)
    check(lambda a: _grads(torch.linalg.svdvals, a), a, **tol)


# --- fft ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_fft_normalizations(norm):
    x, z = torch.randn(4, 6), torch.randn(4, 6, dtype=torch.complex64)
    check(lambda x: torch.fft.fft(x, norm=norm), x, **TOL)
    check(lambda z: torch.fft.ifft(z, norm=norm), z, **TOL)
    check(lambda x: torch.fft.rfft(x, norm=norm), x, **TOL)
    check(lambda z: torch.fft.irfft(z, norm=norm), z, **TOL)
    check(lambda z: torch.fft.fft2(z, norm=norm), z, **TOL)
    check(lambda x: torch.fft.rfftn(x, norm=norm), x, **TOL)
    check(lambda z: torch.fft.irfftn(z, s=(4, 9), norm=norm), z, **TOL)


def test_fft_float64_and_backward():
    check(torch.fft.fft, torch.randn(8, dtype=torch.float64))
    check(lambda x: _grads(lambda t: torch.fft.rfft(t).abs(), x), torch.randn(3, 8), **TOL)


@pytest.mark.xfail(reason="core: copy_ ignores the conjugate bit of its source (resolve_conj on pjrt)")
def test_hfft_conjugate_input():
    check(torch.fft.hfft, torch.randn(4, 6, dtype=torch.complex64), **TOL)


@pytest.mark.xfail(reason="core: compiled graphs call with_effects(_linalg_check_errors) on jax values")
def test_compiled_inv():
    check(torch.compile(torch.linalg.inv, backend="pjrt"), torch.randn(3, 3) + 3 * torch.eye(3), **TOL)
