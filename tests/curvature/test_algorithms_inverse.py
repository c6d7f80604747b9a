"""Conjugate gradients and the Neumann series against dense solves."""

from __future__ import annotations

import pytest
import torch

from avionics.curvature.algorithms import conjugate_gradient, neumann_inverse

DT = torch.float64


class Op:
    """Exposes only what an operator must: shape, dtype, device and @ (counts columns, calls)."""

    def __init__(self, A):
        self._A, self.shape, self.dtype, self.device = A, A.shape, A.dtype, A.device
        self.products = self.calls = 0

    def __matmul__(self, X):
        self.products += 1 if X.ndim == 1 else X.shape[1]
        self.calls += 1
        return self._A @ X


def spd(D=80, cond=100.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=DT))
    ev = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), D, dtype=DT)
    return Q @ torch.diag(ev) @ Q.T


def test_cg_batched_matches_dense_solve():
    A = spd()
    B = torch.randn(80, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    B[:, 3] = 0  # a zero right-hand side converges at once
    op = Op(A)
    res = conjugate_gradient(op, B, tol=1e-10)
    assert res.converged.all() and res.converged.shape == (5,)
    torch.testing.assert_close(res.solution, torch.linalg.solve(A, B), rtol=1e-8, atol=1e-8)
    assert (res.residual_norms <= 1e-10 * B.norm(dim=0)).all()
    # One block product per iteration (not one per column), and products == column count.
    assert op.calls == res.num_iterations and op.products == res.num_products
    assert res.num_products < 4 * res.num_iterations + 1


def test_cg_vector_x0_maxiter():
    A = spd(D=50, seed=2)
    b = torch.randn(50, generator=torch.Generator().manual_seed(3), dtype=DT)
    x = torch.linalg.solve(A, b)
    res = conjugate_gradient(A, b, tol=1e-12)
    assert res.solution.shape == (50,) and bool(res.converged)
    torch.testing.assert_close(res.solution, x, rtol=1e-9, atol=1e-9)
    # Starting at the solution: done after the initial residual.
    res = conjugate_gradient(A, b, x0=x, tol=1e-8)
    assert res.num_iterations == 0 and bool(res.converged)
    res = conjugate_gradient(A, b, tol=1e-14, maxiter=3)
    assert res.num_iterations == 3 and not bool(res.converged)


def test_cg_preconditioner():
    """Jacobi preconditioning on a badly scaled matrix: fewer iterations, same solution."""
    g = torch.Generator().manual_seed(4)
    s = torch.logspace(0, 3, 60, dtype=DT)
    A = s[:, None] * spd(D=60, cond=5.0, seed=5) * s[None]
    B = torch.randn(60, 3, generator=g, dtype=DT)
    exact = torch.linalg.solve(A, B)
    plain = conjugate_gradient(A, B, tol=1e-10)
    d = torch.diagonal(A)
    for M in (lambda R: R / d[:, None], torch.diag(1 / d), Op(torch.diag(1 / d))):
        pre = conjugate_gradient(A, B, tol=1e-10, preconditioner=M)
        assert pre.converged.all()
        torch.testing.assert_close(pre.solution, exact, rtol=1e-7, atol=1e-9)
        assert pre.num_iterations < plain.num_iterations / 2


def test_neumann_matches_dense_solve():
    A = spd(D=40, cond=10.0, seed=6)
    B = torch.randn(40, 2, generator=torch.Generator().manual_seed(7), dtype=DT)
    exact = torch.linalg.solve(A, B)
    lam_max = float(torch.linalg.eigvalsh(A)[-1])
    op = Op(A)
    X = neumann_inverse(op, B, scale=1 / lam_max, num_terms=400)
    assert op.calls == 399
    torch.testing.assert_close(X, exact, rtol=1e-9, atol=1e-9)
    # The truncation error is exactly (I - scale A)^K A^{-1} B.
    X10 = neumann_inverse(A, B, scale=0.5 / lam_max, num_terms=10)
    Mk = torch.linalg.matrix_power(torch.eye(40, dtype=DT) - 0.5 / lam_max * A, 10)
    torch.testing.assert_close(exact - X10, Mk @ exact, rtol=1e-9, atol=1e-10)
    # Default scale from Lanczos, early stop by tol; a vector right-hand side.
    x = neumann_inverse(A, B[:, 0], tol=1e-12, num_terms=10_000)
    torch.testing.assert_close(x, exact[:, 0], rtol=1e-8, atol=1e-8)


def test_neumann_rejects_indefinite():
    A = -spd(D=10)
    with pytest.raises(ValueError, match="diverges"):
        neumann_inverse(A, torch.ones(10, dtype=DT))


def test_cg_indefinite_column_is_stopped():
    A = torch.diag(torch.tensor([1.0, 2.0, -3.0, 4.0], dtype=DT))
    B = torch.zeros(4, 2, dtype=DT)
    B[0, 0] = B[1, 0] = 1.0  # lives in the positive definite part: solvable
    B[2, 1] = 1.0  # pure negative curvature
    with pytest.warns(UserWarning, match="not positive definite"):
        res = conjugate_gradient(A, B, tol=1e-12)
    assert res.converged.tolist() == [True, False]
    torch.testing.assert_close(res.solution[:, 0], torch.tensor([1.0, 0.5, 0, 0], dtype=DT))
    assert torch.isfinite(res.solution).all()


def test_neumann_warns_when_diverging():
    A = spd(D=10, cond=10.0)
    with pytest.warns(UserWarning, match="diverges"):
        neumann_inverse(A, torch.ones(10, dtype=DT), scale=3.0 / 10.0, num_terms=30)
