"""LSMR against dense solves and least squares; the submatrix operator against dense slices."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import dense_ggn, dense_hessian, dense_jacobian, problem
from test_algorithms_estimators import Op

from avionics.curvature import (
    GGNOperator,
    HessianOperator,
    IdentityOperator,
    JacobianOperator,
    LSMRInverseOperator,
    SubmatrixOperator,
)
from avionics.curvature.algorithms import lsmr

DT = torch.float64


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def _random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def test_lsmr_on_dense_matrices():
    square = _random(30, 30) + 6 * torch.eye(30, dtype=DT)  # non-symmetric, non-singular
    B = _random(30, 3, seed=1)
    result = lsmr(Op(square), B, atol=1e-12, btol=1e-12)
    torch.testing.assert_close(result.solution, torch.linalg.solve(square, B))
    assert bool(result.converged.all())
    assert result.num_products == 2 * 3 * (result.num_iterations + 1)
    # the columns are independent: one column alone gives its column of the block solve
    single = lsmr(square, B[:, 1], atol=1e-12, btol=1e-12)
    torch.testing.assert_close(single.solution, result.solution[:, 1])
    # tall: least squares; damped: the ridge solution
    tall, b = _random(50, 20, seed=2), _random(50, seed=3)
    torch.testing.assert_close(
        lsmr(tall, b, atol=1e-12, btol=1e-12).solution, torch.linalg.lstsq(tall, b).solution
    )
    ridge = torch.linalg.solve(tall.T @ tall + 0.7**2 * torch.eye(20, dtype=DT), tall.T @ b)
    torch.testing.assert_close(lsmr(tall, b, damping=0.7, atol=1e-12, btol=1e-12).solution,
                               ridge)  # fmt: skip
    # b = 0: x = 0 at once
    zero = lsmr(square, torch.zeros(30, dtype=DT))
    assert zero.num_iterations == 0 and bool(zero.converged)
    assert float(zero.solution.abs().max()) == 0.0


@pytest.mark.parametrize(
    "name", ["mlp", "cnn", pytest.param("transformer", marks=pytest.mark.slow), "tied"]
)
def test_lsmr_solves_damped_curvature_and_jacobian_least_squares(name):
    model, loss_fn, data, _ = problem(name)
    G = GGNOperator(model, loss_fn, None, data)
    damped = G + 0.5 * IdentityOperator(G)
    b = _random(G.shape[0], 2, seed=4)
    expected = torch.linalg.solve(dense_ggn(model, loss_fn, data) + 0.5 * torch.eye(len(b)), b)
    torch.testing.assert_close(lsmr(damped, b, atol=1e-10, btol=1e-10).solution, expected)
    # the ridge regression min ||J x - u||^2 + 1^2 ||x||^2 with the Jacobian
    J = JacobianOperator(model, None, data)
    J_dense = dense_jacobian(model, data)
    u = _random(J.shape[0], seed=5)
    eye = torch.eye(J.shape[1], dtype=DT)
    ridge = torch.linalg.solve(J_dense.T @ J_dense + eye, J_dense.T @ u)
    solution = lsmr(J, u, damping=1.0, atol=1e-10, btol=1e-10).solution
    torch.testing.assert_close(solution, ridge)


@pytest.mark.parametrize(
    "name", ["mlp", "cnn", pytest.param("transformer", marks=pytest.mark.slow), "tied"]
)
def test_lsmr_inverse_operator(name):
    """The inverse of the damped GGN as an operator, in every input format, and the ridge
    solution operator of the Jacobian with its adjoint."""
    model, loss_fn, data, _ = problem(name)
    G = GGNOperator(model, loss_fn, None, data)
    inverse = LSMRInverseOperator(G + 0.5 * IdentityOperator(G), atol=1e-10, btol=1e-10)
    assert inverse.SELF_ADJOINT
    expected = torch.linalg.inv(dense_ggn(model, loss_fn, data) + 0.5 * torch.eye(G.shape[0]))
    torch.testing.assert_close(dense(inverse), expected)
    assert bool(inverse.last_result.converged.all())
    v = _random(G.shape[0], seed=6)
    v_list = [x.view(s) for x, s in zip(v.split([s.numel() for s in G.in_shapes]), G.in_shapes)]
    result = inverse @ v_list
    torch.testing.assert_close(torch.cat([r.flatten() for r in result]), expected @ v)
    J = JacobianOperator(model, None, data)
    J_dense = dense_jacobian(model, data)
    solve = LSMRInverseOperator(J, damping=1.0, atol=1e-10, btol=1e-10)
    assert solve.shape == (J.shape[1], J.shape[0])
    ridge = torch.linalg.solve(J_dense.T @ J_dense + torch.eye(J.shape[1]), J_dense.T)
    torch.testing.assert_close(dense(solve), ridge)
    assert solve.adjoint().shape == J.shape
    with pytest.raises(TypeError, match=r"unknown options \['tol'\]"):
        LSMRInverseOperator(J, tol=1e-3)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_submatrix_is_the_dense_slice(name):
    model, loss_fn, data, _ = problem(name)
    H = HessianOperator(model, loss_fn, None, data)
    full = dense_hessian(model, loss_fn, data)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(H.shape[0], generator=generator)[:7].tolist()
    columns = torch.randperm(H.shape[1], generator=generator)[:5].tolist()
    S = SubmatrixOperator(H, rows, columns)
    assert S.shape == (7, 5)
    torch.testing.assert_close(dense(S), full[rows][:, columns])
    torch.testing.assert_close(dense(S.adjoint()), full[columns][:, rows])
    assert not S.SELF_ADJOINT
    square = SubmatrixOperator(H, rows, rows)
    assert square.SELF_ADJOINT and square.adjoint() is square
    # of a non-square operator: rows of the Jacobian's outputs, columns of its parameters
    J = JacobianOperator(model, None, data)
    sub = SubmatrixOperator(J, [0, 2, 3], columns)
    torch.testing.assert_close(dense(sub), dense_jacobian(model, data)[[0, 2, 3]][:, columns])
    torch.testing.assert_close(dense(sub.adjoint()),
                               dense_jacobian(model, data)[[0, 2, 3]][:, columns].T)  # fmt: skip


def test_submatrix_of_a_parameter_subset():
    """The rows and columns of parameters by name: SubmatrixOperator.of_parameters."""
    model, loss_fn, data, _ = problem("mlp")
    H = HessianOperator(model, loss_fn, None, data)
    S = SubmatrixOperator.of_parameters(H, ["2.weight", "0.bias"], ["0.weight"])
    subset = HessianOperator(model, loss_fn, ["2.weight", "0.bias", "0.weight"], data)
    torch.testing.assert_close(dense(S), dense(subset)[:20, 20:])


def test_bad_indices_are_refused():
    model, loss_fn, data, _ = problem("mlp")
    H = HessianOperator(model, loss_fn, None, data)
    with pytest.raises(ValueError, match=r"rows must be distinct integers in \[0, 43\)"):
        SubmatrixOperator(H, [0, 0], [1])
    with pytest.raises(ValueError, match=r"columns must be distinct integers in \[0, 43\)"):
        SubmatrixOperator(H, [0], [43])
    with pytest.raises(ValueError, match=r"columns must be distinct integers"):
        SubmatrixOperator(H, [0], [1.5])
    with pytest.raises(ValueError, match=r"no parameter 'head.weight'; its parameters are"):
        SubmatrixOperator.of_parameters(H, ["head.weight"], ["0.bias"])
