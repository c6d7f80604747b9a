"""XTrace with Rademacher vectors, XDiag of non-symmetric operators (products with the adjoint),
and the Frobenius norm of non-square operators (Jacobians), against dense float64 values."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import dense_ggn, dense_hessian, dense_jacobian, problem

from avionics.curvature import GGNOperator, HessianOperator, JacobianOperator
from avionics.curvature.algorithms import frobenius_norm_squared, xdiag, xtrace

DT = torch.float64


class WithoutAdjoint:
    """An operator with shape, dtype, device and @, but no adjoint()."""

    def __init__(self, A):
        self._A, self.shape, self.dtype, self.device = A, A.shape, A.dtype, A.device

    def __matmul__(self, X):
        return self._A @ X


class ClaimsSymmetric(WithoutAdjoint):
    """An operator whose adjoint() wrongly returns itself."""

    def adjoint(self):
        return self


def nonsymmetric(D=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(D, 4, generator=g, dtype=DT)
    return (
        10 * U @ torch.randn(4, D, generator=g, dtype=DT) / D
        + torch.randn(D, D, generator=g, dtype=DT) / D**0.5
    )


def _leave_one_out_bases(A, Om):
    """Q_(i): an orthonormal basis of range(A Omega_{-i}), for each i (the definition)."""
    m = Om.shape[1]
    return [torch.linalg.qr(A @ torch.cat([Om[:, :i], Om[:, i + 1 :]], 1))[0] for i in range(m)]


def _rademacher(N, m, seed):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randint(0, 2, (N, m), generator=g).to(DT) - 1


def xdiag_by_definition(A, Om):
    """(1/m) sum_i diag(P_i A) + w_i * ((I - P_i) A w_i), P_i = Q_(i) Q_(i)^T."""
    N = A.shape[0]
    estimates = []
    for i, Qi in enumerate(_leave_one_out_bases(A, Om)):
        P = Qi @ Qi.T
        w = Om[:, i]
        estimates.append(torch.diagonal(P @ A) + w * ((torch.eye(N, dtype=DT) - P) @ A @ w))
    return torch.stack(estimates).mean(0)


def xtrace_estimates_by_definition(A, Om):
    """tr(Q_(i)^T A Q_(i)) + u_i^T A u_i, u_i = (I - Q_(i) Q_(i)^T) omega_i, for each i."""
    estimates = []
    for i, Qi in enumerate(_leave_one_out_bases(A, Om)):
        u = Om[:, i] - Qi @ (Qi.T @ Om[:, i])
        estimates.append(torch.trace(Qi.T @ A @ Qi) + u @ A @ u)
    return torch.stack(estimates)


def test_xtrace_with_rademacher_vectors_matches_its_definition():
    A = nonsymmetric()
    m, seed = 6, 5
    reference = xtrace_estimates_by_definition(A, _rademacher(A.shape[0], m, seed))
    estimate, error = xtrace(A, 2 * m, distribution="rademacher", return_error=True, seed=seed)
    torch.testing.assert_close(estimate, reference.mean())
    torch.testing.assert_close(error, reference.std() / m**0.5)
    # improved (the rescaling for rotation-invariant vectors) is refused with Rademacher ones
    with pytest.raises(ValueError, match=r"unbiased only for Gaussian ones.*improved=False"):
        xtrace(A, 12, distribution="rademacher", improved=True)


def test_xtrace_with_rademacher_vectors_is_unbiased():
    A = nonsymmetric(D=30, seed=1)
    exact = float(torch.trace(A))
    estimates = torch.stack([xtrace(A, 8, distribution="rademacher", seed=s) for s in range(400)])
    standard_error = float(estimates.std()) / 400**0.5
    assert abs(float(estimates.mean()) - exact) < 4 * standard_error


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_xtrace_with_rademacher_vectors_of_the_hessian(name):
    """XTrace of the Hessian operator with Rademacher vectors: its definition on the dense
    float64 Hessian with the same vectors."""
    model, loss_fn, data, _ = problem(name)
    H = HessianOperator(model, loss_fn, None, data)
    dense = dense_hessian(model, loss_fn, data)
    m, seed = 4, 2
    reference = xtrace_estimates_by_definition(dense, _rademacher(H.shape[0], m, seed))
    estimate, error = xtrace(H, 2 * m, distribution="rademacher", return_error=True, seed=seed)
    torch.testing.assert_close(estimate, reference.mean())
    torch.testing.assert_close(error, reference.std() / m**0.5)


def test_xdiag_of_a_nonsymmetric_matrix_matches_its_definition():
    """Issue 28 item 9: XDiag of a non-symmetric A used A Q for A^T Q (rel. error 0.67
    against its own definition); it now multiplies by the adjoint."""
    A = nonsymmetric()
    m, seed = 5, 7
    reference = xdiag_by_definition(A, _rademacher(A.shape[0], m, seed))
    torch.testing.assert_close(xdiag(A, 2 * m, seed=seed), reference)
    # what A Q in place of A^T Q gives (an adjoint that claims A^T = A): far off
    claimed_symmetric = xdiag(ClaimsSymmetric(A), 2 * m, seed=seed)
    assert (claimed_symmetric - reference).norm() / reference.norm() > 0.1
    # without an adjoint the estimate cannot be formed: refused before any product
    with pytest.raises(TypeError, match=r"xdiag needs products with the transpose A\^T"):
        xdiag(WithoutAdjoint(A), 10, seed=seed)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_xdiag_of_a_product_of_curvature_operators(name):
    """H G is not symmetric; its adjoint is the lazy G H."""
    model, loss_fn, data, _ = problem(name)
    H = HessianOperator(model, loss_fn, None, data)
    G = GGNOperator(model, loss_fn, None, data)
    dense_product = dense_hessian(model, loss_fn, data) @ dense_ggn(model, loss_fn, data)
    assert (dense_product - dense_product.T).abs().max() > 1e-3  # not symmetric
    m, seed = 6, 3
    reference = xdiag_by_definition(dense_product, _rademacher(H.shape[0], m, seed))
    torch.testing.assert_close(xdiag(H @ G, 2 * m, seed=seed), reference)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_frobenius_norm_of_the_jacobian(name):
    model, _, data, _ = problem(name)
    J = JacobianOperator(model, None, data)
    expected = dense_jacobian(model, data).square().sum()
    torch.testing.assert_close(frobenius_norm_squared(J), expected)
    estimate = frobenius_norm_squared(J, 400, seed=0)
    assert abs(float(estimate / expected) - 1) < 0.2
    # a tall operator: the transposed Jacobian, through itself
    torch.testing.assert_close(frobenius_norm_squared(J.adjoint()), expected)


def test_frobenius_norm_of_a_wide_matrix_takes_the_smaller_side():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 40, generator=g, dtype=DT)
    torch.testing.assert_close(frobenius_norm_squared(A), A.square().sum())
    torch.testing.assert_close(frobenius_norm_squared(WithoutAdjoint(A)), A.square().sum())
    estimates = torch.stack([frobenius_norm_squared(A, 3, seed=s) for s in range(300)])
    standard_error = float(estimates.std()) / 300**0.5
    assert abs(float(estimates.mean() - A.square().sum())) < 4 * standard_error
